"""What `titan-npu plan` prints: one layout's breakdown, a search's ranking,
and a stacked bar per layout (PNG)."""

from pathlib import Path

from torchtitan_npu.plan.estimate import PARTS, Estimate, RankMemory, layout_name
from torchtitan_npu.plan.search import Candidate
from torchtitan_npu.reporting.table import format_table

GIB = 1024**3


def size(value: int) -> str:
    return f"{value / GIB:.2f} GiB" if value >= GIB / 10 else f"{value / 2**20:.1f} MiB"


def verdict(peak: int, memory: int | None) -> str:
    if memory is None:
        return "no device memory given (--device-memory / --device-name)"
    headroom = memory - peak
    if headroom >= 0:
        share = f"{headroom / memory:.0%}"
        return f"fits in {size(memory)}: headroom {size(headroom)} ({share})"
    return f"does NOT fit in {size(memory)}: {size(-headroom)} over"


def describe(estimate: Estimate, memory: int | None) -> str:
    """The per-rank peak, its parts, and the model state each rank holds."""
    lines = [f"layout: {layout_name(estimate.degrees)}"]
    for r in estimate.ranks:
        stage = (
            f" (first rank of stage {estimate.ranks.index(r)})"
            if len(estimate.ranks) > 1
            else ""
        )
        lines.append(
            f"rank {r.rank}{stage}: peak {size(r.peak)}, {verdict(r.peak, memory)}"
        )
        rows = [[part, size(r.parts[part])] for part in PARTS]
        lines += [
            "  " + line
            for line in format_table(["at the peak", "bytes"], rows).splitlines()
        ]
        held = ", ".join(f"{k} {size(v)}" for k, v in r.model_state.items())
        lines.append(f"  model state held throughout: {held}")
        if r.sampled:
            lines.append(f"  layers: {r.sampled}")
    lines.append(f"(simulated on fake tensors in {estimate.seconds:.1f} s)")
    return "\n".join(lines)


def measured(ranks: list[dict], estimate: Estimate) -> str:
    """The real steps' tracker figures beside the estimate, per rank."""
    predicted = {r.rank: r for r in estimate.ranks}
    rows = []
    for r in ranks:
        guess = predicted.get(r["rank"])
        error = f"{guess.peak / r['peak'] - 1:+.1%}" if guess else "-"
        state = "equal" if guess and guess.model_state == r["model_state"] else "-"
        shown = size(guess.peak) if guess else "(not simulated)"
        rows.append([r["rank"], shown, size(r["peak"]), error, state])
    headers = ["rank", "estimated peak", "measured peak", "error", "model state"]
    return "measured on this machine:\n" + format_table(headers, rows)


def ranking(candidates: list[Candidate], memory: int) -> str:
    """Fitting layouts with headroom, then the nearest misses and what they
    lack, then those upstream refused."""
    rows = []
    for c in candidates:
        if c.estimate is None:
            rows.append(
                [c.name(), c.ac, c.local_batch, "-", f"cannot run: {c.failure}"]
            )
            continue
        peak = c.peak()
        status = (
            f"fits, headroom {size(memory - peak)}"
            if peak <= memory
            else f"misses: needs {size(peak - memory)} more"
        )
        rows.append([c.name(), c.ac, c.local_batch, size(peak), status])
    headers = ["layout", "activation ckpt", "local batch", "peak/rank", ""]
    return format_table(headers, rows)


def bars(candidates: list[Candidate]) -> list[tuple[str, RankMemory]]:
    """(label, worst rank) of each planned candidate, for ``plot``."""
    return [
        (f"{c.name()}\n{c.ac}, batch {c.local_batch}", c.estimate.worst)
        for c in candidates
        if c.estimate
    ]


def plot(planned: list[tuple[str, RankMemory]], memory: int | None, path: Path) -> None:
    """A stacked bar per layout: its parts at the peak."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [label for label, _ in planned]
    fig, ax = plt.subplots(figsize=(max(6, len(planned) * 0.9), 4.5))
    bottom = [0.0] * len(planned)
    for part in PARTS:
        heights = [rank.parts[part] / GIB for _, rank in planned]
        ax.bar(labels, heights, bottom=bottom, label=part)
        bottom = [b + h for b, h in zip(bottom, heights)]
    if memory is not None:
        ax.axhline(memory / GIB, color="black", linestyle="--", label="device memory")
    ax.set_ylabel("GiB per rank at its peak")
    ax.legend(fontsize="small")
    ax.tick_params(axis="x", labelsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
