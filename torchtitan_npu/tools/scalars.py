"""Read a run's TensorBoard scalars exactly (float32 as stored, not printed)."""

import re
from pathlib import Path

from torchtitan_npu.errors import UsageError

LOSS = "loss_metrics/global_avg_loss"
GRAD_NORM = "grad_norm"


def tensorboard_dirs(run: str | Path) -> list[Path]:
    """Every TensorBoard folder of a run, oldest launch first.

    A dump folder holds one folder per launch under ``tb/`` (a resumed run is
    several launches); a folder with event files is taken as it is. Only
    rank 0's scalars are read when every rank saved its own.
    """
    run = Path(run)
    if not run.exists():
        raise UsageError(f"{run} does not exist")
    if any(run.glob("events.out.tfevents.*")):
        return [run]
    folders = {
        p.parent
        for p in (run / "tb").rglob("events.out.tfevents.*")
        if not re.fullmatch(r"rank_[1-9]\d*", p.parent.name)
    }
    if not folders:
        raise UsageError(f"no TensorBoard events under {run} (or {run}/tb/)")
    return sorted(folders)


def read_scalars(
    run: str | Path, tags: tuple[str, ...] = (LOSS, GRAD_NORM)
) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}`` of a run, over all its launches (a step logged
    again after a resume takes the later launch's value)."""
    from tensorboard.backend.event_processing.event_accumulator import (
        EventAccumulator,
    )

    merged: dict[str, dict[int, float]] = {t: {} for t in tags}
    present: set[str] = set()
    for folder in tensorboard_dirs(run):
        accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})
        accumulator.Reload()
        found: set[str] = set(accumulator.Tags()["scalars"])  # pyrefly: ignore
        present |= found
        for tag in found & set(tags):
            merged[tag].update((e.step, e.value) for e in accumulator.Scalars(tag))
    missing = [t for t in tags if t not in present]
    if missing:
        raise UsageError(f"{run}: no scalars {missing}; present: {sorted(present)}")
    return merged
