"""Read a run's TensorBoard scalars exactly (float32 as stored, not printed)."""

from pathlib import Path

LOSS = "loss_metrics/global_avg_loss"
GRAD_NORM = "grad_norm"


def tensorboard_dir(run: str | Path) -> Path:
    """The newest TensorBoard folder of a run's dump folder (or the folder itself)."""
    run = Path(run)
    if any(run.glob("events.out.tfevents.*")):
        return run
    candidates = sorted(p for p in (run / "tb").glob("*") if p.is_dir())
    if not candidates:
        raise FileNotFoundError(f"no TensorBoard events under {run} (or {run}/tb/*)")
    return candidates[-1]


def read_scalars(
    run: str | Path, tags: tuple[str, ...] = (LOSS, GRAD_NORM)
) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}`` for the given tags of a run."""
    from tensorboard.backend.event_processing.event_accumulator import (
        EventAccumulator,
    )

    accumulator = EventAccumulator(
        str(tensorboard_dir(run)), size_guidance={"scalars": 0}
    )
    accumulator.Reload()
    present = set(accumulator.Tags()["scalars"])
    missing = [t for t in tags if t not in present]
    if missing:
        raise KeyError(f"{run}: no scalars {missing}; present: {sorted(present)}")
    return {t: {e.step: e.value for e in accumulator.Scalars(t)} for t in tags}
