"""Preloaded by the fork server of tests/launch.py: upstream, imported once.

The fork server is a fresh, single-threaded interpreter; every rank of every
warm launch is forked from it, so ranks start with upstream imported. The job
file path is fixed here, before torchtitan is imported (0.2.x binds its command
line at import); the launcher rewrites that file before each run.
"""

import os
import sys

from launch import JOB_FILE_ENV

from torchtitan_npu.entry import prepare_upstream

prepare_upstream(os.environ[JOB_FILE_ENV])
# multiprocessing gives every forked child the launcher's sys.argv; the ranks
# put this one back (0.3.x reads it when parsing).
UPSTREAM_ARGV = list(sys.argv)
import torchtitan.train  # noqa: E402, F401
