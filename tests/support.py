"""Test helpers: end-to-end runs of `titan-npu train` in subprocesses, era marks."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchtitan_npu.compat import resolve_upstream
from torchtitan_npu.tools.scalars import GRAD_NORM, LOSS, read_scalars

# Small enough for a 2-core CPU, large enough for the loss to move.
SMALL_RUN = [
    "--training.local_batch_size", "2",
    "--training.seq_len", "128",
    "--metrics.enable_tensorboard", "true",
]  # fmt: skip


def train(
    dump_folder: Path,
    *args: str,
    nproc: int = 1,
    steps: int = 4,
    python: str = sys.executable,
) -> dict:
    """Run `titan-npu train` (of `python`'s environment); return ``{tag:
    {step: value}}`` from TensorBoard."""
    env = {k: v for k, v in os.environ.items() if k != "TITAN_NPU_NO_BOOTSTRAP"}
    env.setdefault("TITAN_NPU_DEVICE", "cpu")  # gloo on CPU unless a device is asked
    command = [
        python, "-m", "torchtitan_npu.cli", "train",
        "--nproc-per-node", str(nproc),
        "--job.dump_folder", str(dump_folder),
        "--training.steps", str(steps),
        *SMALL_RUN, *args,
    ]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    log = dump_folder.parent / f"{dump_folder.name}.log"
    log.write_text(result.stdout + result.stderr)
    assert result.returncode == 0, (
        f"training failed, see {log}:\n{result.stderr[-3000:]}"
    )
    return read_scalars(dump_folder)


def warm_train(
    launcher, dump_folder: Path, *args: str, nproc: int = 1, steps: int = 4
) -> dict:
    """`train`'s run through the warm launcher (tests/launch.py: no import cost
    per launch); rank 0's output goes to ``<dump_folder>.log`` as `train`'s."""
    from launch import rank_log

    try:
        return launcher.train(
            dump_folder,
            [*SMALL_RUN, "--training.steps", str(steps), *args],
            nproc=nproc,
        )
    finally:
        log = dump_folder.parent / f"{dump_folder.name}.log"
        log.write_text(rank_log(dump_folder))


def assert_bit_identical(a: dict, b: dict) -> None:
    for tag in (LOSS, GRAD_NORM):
        assert a[tag] == b[tag], f"{tag} differs: {a[tag]} vs {b[tag]}"


def assert_loss_falls(scalars: dict) -> None:
    loss = scalars[LOSS]
    steps = sorted(loss)
    assert loss[steps[-1]] < loss[steps[0]], f"loss did not fall: {loss}"


def copy_checkpoint(source_dump: Path, step: int, target_dump: Path) -> None:
    """Give a fresh dump folder only step ``step`` of another run's checkpoints."""
    target = target_dump / "checkpoint" / f"step-{step}"
    shutil.copytree(source_dump / "checkpoint" / f"step-{step}", target)


def drop_checkpoints(dump_folder: Path, keep: tuple[int, ...] = ()) -> None:
    """Free a passed run's disk: remove its checkpoints but steps ``keep``
    (a later cell resumes from them); its scalars and logs stay."""
    folder = dump_folder / "checkpoint"
    for step in folder.glob("step-*") if folder.is_dir() else ():
        if int(step.name.removeprefix("step-")) not in keep:
            shutil.rmtree(step)


def heavy_except(values: list, light) -> list:
    """``values`` as pytest params, all but ``light`` marked heavy: `nox -s
    quick` runs the light one, `nox -s tests` all of them."""
    return [
        v if v == light else pytest.param(v, marks=pytest.mark.heavy) for v in values
    ]


def requires_era(era: str):
    """Skip unless the installed upstream is of ``era`` (nox runs every era)."""
    return pytest.mark.skipif(
        resolve_upstream().era != era,
        reason=f"installed upstream is not of era {era}; `nox -s upstream` runs it",
    )


def newest_of_its_era() -> bool:
    """Is the installed upstream the newest tested entry of its era? (A
    tracked upstream main snapshot runs CI's share only.)"""
    from torchtitan_npu.compat.lock import read_lock
    from torchtitan_npu.overlay.registry import release

    installed = resolve_upstream()
    same_era = [
        e for e in read_lock() if e.era == installed.era and e.status == "tested"
    ]
    newest = max(same_era, key=lambda e: release(e.version))
    return installed.installed.version == newest.version


# CI (`uv run nox`) runs a share of the slow tests; `nox -s full` sets this and
# runs every test on every locked upstream.
FULL_SUITE = os.environ.get("TITAN_NPU_FULL_SUITE") == "1"


def requires_newest_of_era(why: str):
    """Run a slow test once per era (CI time); older entries share its code path."""
    return pytest.mark.skipif(not (FULL_SUITE or newest_of_its_era()), reason=why)


def requires_default_upstream(why: str):
    """Run a slow, era-independent test only on the default upstream (CI time)."""
    from torchtitan_npu.compat.lock import default_entry, read_lock

    default = default_entry(read_lock()).version
    installed = resolve_upstream().installed.version
    return pytest.mark.skipif(not (FULL_SUITE or installed == default), reason=why)


def full_suite_only(why: str):
    """A slow test whose behaviour CI's share already sees elsewhere (`why`
    says where); `nox -s full` runs it."""
    return pytest.mark.skipif(not FULL_SUITE, reason=why)


def rows_forward(module, tokens, **kwargs):
    """A 0.3-era model's logits ``[rows, seq, vocab]`` for ``tokens`` of shape
    ``[rows, seq]``, one document a row, fed as the installed upstream's
    trainer feeds it: rows with masks (0.3.0), or one row of packed documents
    with their positions (upstream main)."""
    from torchtitan_npu.config.batch_and_data import counts_tokens

    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    if not counts_tokens():
        masks = module.get_attention_masks(positions)
        return module(tokens, attention_masks=masks, positions=positions, **kwargs)
    rows, packed = tokens.shape, positions.reshape(-1)
    masks = module.get_attention_masks(packed)
    logits = module(
        tokens.reshape(-1), attention_masks=masks, positions=packed, **kwargs
    )
    return logits.reshape(*rows, -1)
