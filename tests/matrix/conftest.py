"""Matrix fixtures: shared data, the seed checkpoint, the single-device
reference run, and the results file the report is built from."""

import json
from pathlib import Path

import pytest
from layouts import BY_NAME, LAYOUTS

from torchtitan_npu.assets import ensure_default_assets

# Every data-parallel degree of the matrix (1, 2, 4) divides this: each
# dp rank's contiguous shard of the corpus then starts with the same records,
# so every layout sees the single-device run's data (see test_matrix.py).
CORPUS_COPIES = 4


def pytest_generate_tests(metafunc):
    if "layout" in metafunc.fixturenames:
        chosen = metafunc.config.getoption("--layout")
        names = [lay.name for lay in LAYOUTS] if chosen == "all" else chosen.split(",")
        unknown = [n for n in names if n not in BY_NAME]
        if unknown:
            raise pytest.UsageError(
                f"unknown layouts {unknown}; known: {list(BY_NAME)}"
            )
        metafunc.parametrize("layout", [BY_NAME[n] for n in names], ids=names)


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("matrix")


@pytest.fixture(scope="session")
def launcher(workdir):
    from launch import WarmLauncher

    return WarmLauncher(workdir)


@pytest.fixture(scope="session")
def matrix_data(workdir) -> Path:
    source = ensure_default_assets().dataset_path / "data.jsonl"
    target = workdir / "data"
    target.mkdir()
    (target / "data.jsonl").write_text(source.read_text() * CORPUS_COPIES)
    return target


@pytest.fixture(scope="session")
def results(request):
    cells: list[dict] = []
    yield cells
    path = request.config.getoption("--matrix-results")
    if path:
        # Merge: the file keeps each layout's latest result (subset reruns).
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        earlier = json.loads(path.read_text()) if path.exists() else []
        rerun = {c["layout"] for c in cells}
        kept = [c for c in earlier if c["layout"] not in rerun]
        path.write_text(json.dumps(kept + cells, indent=2))
