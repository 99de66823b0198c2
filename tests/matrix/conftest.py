"""Matrix fixtures: shared data, the seed checkpoint, the single-device
reference run, and the results file the report is built from."""

import json
from pathlib import Path

import pytest
from layouts import BY_NAME, RESUME_BY_NAME

from torchtitan_npu.assets import ensure_default_assets

# Every data-parallel degree of the matrix (1, 2, 4) divides this: each
# dp rank's contiguous shard of the corpus then starts with the same records,
# so every layout sees the single-device run's data (see test_matrix.py).
CORPUS_COPIES = 4


def pytest_generate_tests(metafunc):
    """--layout picks cells by name: layouts, resume_X_to_Y pairs and
    ``upgrade`` (all: every one)."""
    chosen = metafunc.config.getoption("--layout")
    every = [*BY_NAME, *RESUME_BY_NAME, "upgrade"]
    names = every if chosen == "all" else chosen.split(",")
    unknown = [n for n in names if n not in every]
    if unknown:
        raise pytest.UsageError(f"unknown layouts {unknown}; known: {every}")
    for param, table in (("layout", BY_NAME), ("resume", RESUME_BY_NAME)):
        if param in metafunc.fixturenames:
            picked = [n for n in names if n in table]
            metafunc.parametrize(param, [table[n] for n in picked], ids=picked)
    if "upgrade" in metafunc.fixturenames:
        metafunc.parametrize("upgrade", ["upgrade"] if "upgrade" in names else [])


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("matrix")


@pytest.fixture(scope="session")
def matrix_data(workdir) -> Path:
    source = ensure_default_assets().dataset_path / "data.jsonl"
    target = workdir / "data"
    target.mkdir()
    (target / "data.jsonl").write_text(source.read_text() * CORPUS_COPIES)
    return target


@pytest.fixture(scope="session")
def hf_checkpoint(workdir) -> tuple[Path, Path]:
    """(HF directory, its conversion): a llama of no registered size written
    by transformers, with the embedded tokenizer, converted by from-hf."""
    import shutil

    import torch
    import transformers

    from torchtitan_npu.state_dict_adapters import convert

    hf_dir = workdir / "hf-llama"
    config = transformers.LlamaConfig(
        vocab_size=2048, hidden_size=192, intermediate_size=512,
        num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
        rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=2048,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    )  # fmt: skip
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(hf_dir)
    for file in ensure_default_assets().tokenizer_path.iterdir():
        shutil.copy2(file, hf_dir / file.name)
    converted = workdir / "hf-llama-dcp"
    convert.from_hf(hf_dir, converted, "llama3", progress=False)
    return hf_dir, converted


@pytest.fixture(scope="session")
def results(request):
    cells: list[dict] = []
    yield cells
    path = request.config.getoption("--matrix-results")
    if path:
        # Merge: the file keeps each layout's latest result (subset reruns).
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            earlier = json.loads(path.read_text()) if path.exists() else []
        except json.JSONDecodeError:  # left by a run killed mid-write (before
            earlier = []  # writes were atomic): this run's cells still land
        rerun = {c["layout"] for c in cells}
        kept = [c for c in earlier if c["layout"] not in rerun]
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text(json.dumps(kept + cells, indent=2))
        partial.replace(path)  # atomic: a killed run leaves the old file
