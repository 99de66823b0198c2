"""Test setup: upstream stays unpatched in this process unless a test applies
the overlay itself (the bootstrap hook is off); e2e runs train in subprocesses."""

import os

os.environ["TITAN_NPU_NO_BOOTSTRAP"] = "1"

import pytest  # noqa: E402

from torchtitan_npu.compat import resolve_upstream  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--layout", default="all", help="matrix: comma-separated layouts")
    parser.addoption("--matrix-results", help="matrix: write cell results (JSON) here")


@pytest.fixture(scope="session")
def upstream():
    return resolve_upstream()
