"""``titan-npu models``: the models and flavors the installed upstream trains
(upstream's names, as ``--model.name`` / ``--model.flavor`` take them), their
parameter counts (built on the meta device), what this project tests, and
what a flavor needs that this machine lacks."""

from __future__ import annotations

import contextlib
import io
import logging
import sys

from torchtitan_npu.compat import resolve_upstream
from torchtitan_npu.config import era_config
from torchtitan_npu.models import needs
from torchtitan_npu.reporting.table import format_table

# (model, flavor) -> what checks it in this project, on every era it exists in.
TESTED = {
    ("llama3", "debugmodel"): "matrix",
    ("qwen2", "debugmodel"): "matrix",
    ("qwen3", "debugmodel"): "converters, HF",
    ("qwen3", "moe_debug"): "HF, matrix (nox)",
    ("qwen3", "debugmodel_moe"): "HF, matrix (nox)",  # 0.2.x's name of it
    ("llama4", "debugmodel"): "matrix (nox)",
    ("deepseek_v3", "debugmodel"): "converters, HF",
    ("gpt_oss", "debugmodel"): "matrix (nox), CPU train",
    ("gpt_oss", "debugmodel_flex"): "CPU train step",
    ("gpt_oss", "20b"): "HF config.json",
    ("gpt_oss", "120b"): "HF config.json",
    ("qwen3_5", "debugmodel"): "matrix (nox), CPU train (no fla), HF",
    ("qwen3_5", "debugmodel_moe"): "HF",
    ("kimi_k2_7", "kimi_k2_5_debugmodel"): "matrix (nox), CPU train (text), HF",
}


def rows(progress: bool = True) -> list[list[str]]:
    """[model, flavor, parameters, tested, needs] for every model and flavor."""
    era = resolve_upstream().era
    config = era_config(era)
    table = []
    models = config.known_models()
    for i, model in enumerate(models, 1):
        if progress:
            sys.stderr.write(f"\rmodels: {model} ({i}/{len(models)})\033[K")
        try:
            flavors = config.flavors(model)
        except Exception as e:  # the model's package itself does not import
            table.append([model, "", "", "", needs(e)])
            continue
        for flavor in flavors:
            try:
                with _quiet():
                    count = _human(config.parameter_count(model, flavor))
                missing = ""
            except Exception as e:  # a recipe needing what this machine lacks
                count, missing = "", needs(e)
            tested = TESTED.get((model, flavor), "")
            table.append([model, flavor, count, tested, missing])
    if progress:
        sys.stderr.write("\r\033[K")
    return table


def main() -> int:
    from torchtitan_npu.bootstrap import activate

    activate()  # titan-npu's injected models (qwen2) register with the overlay
    upstream = resolve_upstream()
    body = rows(progress=sys.stderr.isatty())
    print(
        f"torchtitan {upstream.installed.version} (era {upstream.era}): "
        "titan-npu train --model.name MODEL --model.flavor FLAVOR\n"
    )
    print(format_table(["model", "flavor", "parameters", "tested", "needs"], body))
    print(
        "\nAny HF checkpoint of llama3, qwen2, qwen3 or deepseek_v3 architecture: "
        "--model.flavor hf --model.hf_assets_path DIR (docs/hf_checkpoints.md)."
    )
    return 0


def _human(count: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.1f}{unit}"
    return str(count)


@contextlib.contextmanager
def _quiet():
    """Upstream's config functions log and print as they build."""
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logging.disable(logging.NOTSET)
