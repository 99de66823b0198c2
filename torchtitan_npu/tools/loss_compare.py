"""Compare two runs' loss and grad_norm exactly, from their TensorBoard scalars.

``titan-npu loss-compare RUN_A RUN_B [--rtol R --atol A] [--plot out.png]``
reports, per tag, the first differing step and the largest absolute and
relative difference, and exits non-zero on a mismatch: bitwise by default, or
within the given tolerances. stdout's 5 printed digits are not enough to tell
two runs apart; the event files hold the exact float32 values.

``--mode computational`` judges a change that is allowed to move the numbers
(a fused kernel, another device) by the accuracy-debug thresholds instead
(``COMPUTATIONAL``): the first step's loss, the per-step loss error on
average, and the per-step grad_norm relative error on average. Run B is the
baseline the relative errors are taken against.
"""

import argparse
from dataclasses import dataclass
from pathlib import Path

from torchtitan_npu.errors import UsageError
from torchtitan_npu.tools.scalars import GRAD_NORM, LOSS, read_scalars

TAGS = (LOSS, GRAD_NORM)


@dataclass(frozen=True)
class Threshold:
    """One accuracy criterion: a statistic below ``abs_limit`` and ``rel_limit``
    (None: not judged). ``strict`` is ``<``; otherwise ``<=``."""

    name: str
    abs_limit: float | None
    rel_limit: float | None
    strict: bool = True


# The accuracy-debug skill's limits for a computational change.
COMPUTATIONAL = (
    Threshold("first-step loss", 0.005, 0.005),
    Threshold("mean loss error", 0.01, 0.01),
    Threshold("mean grad_norm error", None, 0.10, strict=False),
)


@dataclass(frozen=True)
class TagComparison:
    tag: str
    steps: list[int]  # steps present in both runs
    first_difference: int | None  # first step outside tolerance, if any
    max_abs: float
    max_rel: float
    missing_steps: list[int]  # steps present in only one run

    @property
    def ok(self) -> bool:
        return self.first_difference is None and not self.missing_steps


def compare_series(
    tag: str,
    a: dict[int, float],
    b: dict[int, float],
    *,
    rtol: float = 0.0,
    atol: float = 0.0,
    steps: list[int] | None = None,
) -> TagComparison:
    """Compare two ``{step: value}`` series (on ``steps`` when given)."""
    wanted = set(steps) if steps is not None else set(a) | set(b)
    common = sorted(wanted & set(a) & set(b))
    missing = sorted(wanted - (set(a) & set(b)))
    first, max_abs, max_rel = None, 0.0, 0.0
    for step in common:
        diff = abs(a[step] - b[step])
        rel = diff / abs(b[step]) if b[step] else (0.0 if diff == 0 else float("inf"))
        max_abs, max_rel = max(max_abs, diff), max(max_rel, rel)
        if first is None and diff > atol + rtol * abs(b[step]):
            first = step
    return TagComparison(tag, common, first, max_abs, max_rel, missing)


def compare_runs(
    run_a: str | Path,
    run_b: str | Path,
    *,
    rtol: float = 0.0,
    atol: float = 0.0,
    steps: list[int] | None = None,
) -> list[TagComparison]:
    a, b = read_scalars(run_a, TAGS), read_scalars(run_b, TAGS)
    return [
        compare_series(t, a[t], b[t], rtol=rtol, atol=atol, steps=steps) for t in TAGS
    ]


@dataclass(frozen=True)
class Judgement:
    threshold: Threshold
    steps: list[int]
    abs_error: float
    rel_error: float

    @property
    def ok(self) -> bool:
        t = self.threshold

        def within(value: float, limit: float | None) -> bool:
            return limit is None or (value < limit if t.strict else value <= limit)

        return within(self.abs_error, t.abs_limit) and within(
            self.rel_error, t.rel_limit
        )

    def line(self) -> str:
        t = self.threshold
        limits = [
            f"{kind} {'<' if t.strict else '<='} {limit:g}"
            for kind, limit in (("abs", t.abs_limit), ("rel", t.rel_limit))
            if limit is not None
        ]
        span = (
            f"step {self.steps[0]}"
            if len(self.steps) == 1
            else (f"{len(self.steps)} steps")
        )
        return (
            f"{t.name:<22} {'pass' if self.ok else 'FAIL':<5} {span:<10} "
            f"abs={self.abs_error:.3e} rel={self.rel_error:.3e} "
            f"(limits: {', '.join(limits)})"
        )


def _errors(a: dict[int, float], b: dict[int, float], steps: list[int]):
    """Mean absolute and mean relative error of A against baseline B."""
    absolute = [abs(a[s] - b[s]) for s in steps]
    relative = [
        d / abs(b[s]) if b[s] else (float("inf") if d else 0.0)
        for d, s in zip(absolute, steps)
    ]
    return sum(absolute) / len(steps), sum(relative) / len(steps)


def judge_computational(
    a: dict[str, dict[int, float]],
    b: dict[str, dict[int, float]],
    steps: list[int],
) -> list[Judgement]:
    """The ``COMPUTATIONAL`` criteria on the steps both runs logged."""
    first, mean_loss, mean_norm = COMPUTATIONAL
    loss_a, loss_b = a[LOSS], b[LOSS]
    return [
        Judgement(first, steps[:1], *_errors(loss_a, loss_b, steps[:1])),
        Judgement(mean_loss, steps, *_errors(loss_a, loss_b, steps)),
        Judgement(mean_norm, steps, *_errors(a[GRAD_NORM], b[GRAD_NORM], steps)),
    ]


def describe(comparisons: list[TagComparison]) -> str:
    lines = []
    for c in comparisons:
        problems = []
        if c.first_difference is not None:
            problems.append(f"DIFFER from step {c.first_difference}")
        if c.missing_steps:
            problems.append(f"MISSING steps {c.missing_steps}")
        verdict = "; ".join(problems) or "match"
        lines.append(
            f"{c.tag:<30} {verdict:<36} steps={len(c.steps)} "
            f"max_abs={c.max_abs:.3e} max_rel={c.max_rel:.3e}"
        )
    return "\n".join(lines)


def plot_runs(runs: dict[str, str | Path], out: str | Path, *, title: str = "") -> Path:
    """A PNG of loss and grad_norm per step for each named run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise UsageError("plotting needs matplotlib: uv pip install matplotlib") from e
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, run in runs.items():
        scalars = read_scalars(run, TAGS)
        for axis, tag in zip(axes, TAGS):
            series = scalars[tag]
            axis.plot(sorted(series), [series[s] for s in sorted(series)], label=name)
    for axis, tag in zip(axes, TAGS):
        axis.set_xlabel("step")
        axis.set_title(tag)
        axis.grid(alpha=0.3)
    axes[1].set_yscale("log")  # scale bugs (2x, 256x) stay readable
    axes[0].legend(fontsize=8)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out


def parse_steps(text: str | None) -> list[int] | None:
    """``"5-8"`` -> [5, 6, 7, 8]; ``"3"`` -> [3]; None -> every step."""
    if text is None:
        return None
    first, _, last = text.partition("-")
    try:
        low, high = int(first), int(last or first)
    except ValueError:
        low, high = 0, -1
    if not 1 <= low <= high:
        raise UsageError(
            f"--steps {text!r}: expected A-B with 1 <= A <= B, or one step"
        )
    return list(range(low, high + 1))


def main(args: argparse.Namespace) -> int:
    steps = parse_steps(args.steps)
    if getattr(args, "mode", "bitwise") == "computational":
        return _main_computational(args, steps)
    comparisons = compare_runs(
        args.run_a, args.run_b, rtol=args.rtol, atol=args.atol, steps=steps
    )
    mode = "bitwise" if args.rtol == 0 and args.atol == 0 else "tolerance"
    span = f", steps {args.steps}" if steps else ""
    print(
        f"{args.run_a} vs {args.run_b} ({mode}, rtol={args.rtol}, atol={args.atol}"
        f"{span})"
    )
    print(describe(comparisons))
    if args.plot:
        print(f"plot: {plot_runs({'A': args.run_a, 'B': args.run_b}, args.plot)}")
    return 0 if all(c.ok for c in comparisons) else 1


def _main_computational(args: argparse.Namespace, steps: list[int] | None) -> int:
    if args.rtol or args.atol:
        raise UsageError(
            "--mode computational has its own thresholds; drop --rtol/--atol "
            "(they belong to the default bitwise mode)"
        )
    a, b = read_scalars(args.run_a, TAGS), read_scalars(args.run_b, TAGS)
    logged = [set(run[tag]) for run in (a, b) for tag in TAGS]
    wanted = set(steps) if steps is not None else set.union(*logged)
    common = sorted(wanted.intersection(*logged))
    missing = sorted(wanted - set(common))
    span = f", steps {args.steps}" if steps else ""
    print(f"{args.run_a} vs {args.run_b} (computational, B is the baseline{span})")
    if not common:
        print(f"no step is logged by both runs (missing: {missing})")
        return 1
    judgements = judge_computational(a, b, common)
    for judgement in judgements:
        print(judgement.line())
    if missing:
        print(f"MISSING steps {missing} (logged by one run only)")
    if args.plot:
        print(f"plot: {plot_runs({'A': args.run_a, 'B': args.run_b}, args.plot)}")
    return 0 if all(j.ok for j in judgements) and not missing else 1
