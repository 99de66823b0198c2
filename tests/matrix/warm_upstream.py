"""Preloaded by the matrix's fork server: upstream, imported once, pre-fork.

The fork server is a fresh, single-threaded interpreter; every rank of every
matrix run is forked from it, so ranks start with upstream imported. The job
file path is fixed here, before torchtitan is imported (0.2.x binds its command
line at import); the launcher rewrites that file before each run.
"""

import os

from launch import JOB_FILE_ENV

from torchtitan_npu.entry import prepare_upstream

prepare_upstream(os.environ[JOB_FILE_ENV])
import torchtitan.train  # noqa: E402, F401
