"""Test setup: upstream stays unpatched in this process unless a test applies
the overlay itself (the bootstrap hook is off); e2e runs train in subprocesses."""

import os
import subprocess

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
    """The matrix runs only when asked for by marker (`-m matrix`, nox). On an
    older release of an era, CI's share leaves the whole-model (heavy) tests to
    the newest one, which shares their code path (`nox -s full` runs them)."""
    from support import FULL_SUITE, newest_of_its_era

    if not (FULL_SUITE or newest_of_its_era()):
        older = pytest.mark.skip(reason="heavy: the newest release of the era runs it")
        for item in items:
            if "heavy" in item.keywords:
                item.add_marker(older)
    if "matrix" in (config.getoption("markexpr") or ""):
        return
    kept = [item for item in items if "matrix" not in item.keywords]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept


# What starts a distributed run from a test's own process.
_LAUNCHES = ("torch.distributed.run", "torchrun", "torchtitan_npu.entry")


@pytest.fixture(autouse=True)
def _launches_need_the_e2e_marker(request, monkeypatch):
    """A test that starts torchrun or elastic_launch is marked ``e2e`` (or
    ``matrix``): `nox -s quick` leaves those out and must stay fast."""
    node = request.node
    if node.get_closest_marker("e2e") or node.get_closest_marker("matrix"):
        return
    if "launcher" in request.fixturenames:
        pytest.fail(f"{node.nodeid} starts runs (launcher) without @pytest.mark.e2e")
    start = subprocess.Popen.__init__

    def guarded(self, args, *rest, **kwargs):
        words = [str(a) for a in args] if isinstance(args, list | tuple) else [args]
        if any(launch in word for word in words for launch in _LAUNCHES):
            pytest.fail(f"{node.nodeid} starts torchrun without @pytest.mark.e2e")
        start(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded)


@pytest.fixture(scope="session")
def upstream():
    return resolve_upstream()


@pytest.fixture(scope="session")
def launcher(tmp_path_factory):
    """Runs started from a fork server with upstream imported (tests/launch.py)."""
    from launch import WarmLauncher

    return WarmLauncher(tmp_path_factory.mktemp("launcher"))
