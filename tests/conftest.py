"""Test setup: upstream stays unpatched in this process unless a test applies
the overlay itself (the bootstrap hook is off); e2e runs train in subprocesses."""

import os

os.environ["TITAN_NPU_NO_BOOTSTRAP"] = "1"

import pytest  # noqa: E402

from torchtitan_npu.compat import resolve_upstream  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--layout", default="all", help="matrix: comma-separated layouts")
    parser.addoption("--matrix-results", help="matrix: write cell results (JSON) here")
    parser.addoption(
        "--upgrade-from", help="matrix upgrade cell: the older upstream's python"
    )


def pytest_collection_modifyitems(config, items):
    """The matrix runs only when asked for by marker (`-m matrix`, nox)."""
    if "matrix" in (config.getoption("markexpr") or ""):
        return
    kept = [item for item in items if "matrix" not in item.keywords]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept


@pytest.fixture(scope="session")
def upstream():
    return resolve_upstream()
