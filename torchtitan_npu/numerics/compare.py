"""Compare two setups' captures (``hooks.Capture``) record by record.

Forward records are compared in setup A's execution order (a module's output
when it completes, so the innermost module comes first); gradients in the
order backward makes them (the reverse of their modules' forward order). One
pair at a time is read from disk: memory stays at the two largest records.

What a capture holds is each rank's own view; before comparing, a record is
put in the other setup's shape where that is unambiguous:
- a tensor-parallel local shard (a plain tensor, not a DTensor): the ranks'
  shards concatenated along the one dimension whose size they split;
- microbatches (pipeline schedules, gradient accumulation): one setup's
  calls concatenated along the batch dimension, when the other has one call.
"""

import json
import math
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Relative error (norm of the difference over the norm of B's value) above
# which a record departs. fp32: summation order (TP partial sums, FSDP's
# reduce-scatter) moves records by ~1e-7 and it grows over depth to ~1e-6;
# a real bug moves them by 1e-3 or more. bf16 rounds at ~4e-3 per op.
DEFAULT_RTOL = {"torch.float32": 1e-5, "torch.float64": 1e-9}
LOW_PRECISION_RTOL = 2e-2


def default_rtol(dtype: str) -> float:
    return DEFAULT_RTOL.get(dtype, LOW_PRECISION_RTOL)


@dataclass(frozen=True)
class Record:
    kind: str  # "forward" or "grad"
    name: str
    call: int
    leaf: int
    seq: int
    pp: int
    rank: int
    file: str | None
    shape: tuple[int, ...] | None
    dtype: str | None
    cls: str = ""  # the module's class (forward records)


class Capture:
    """One setup's capture folder: its records across ranks."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        records: dict[tuple[str, str, int, int], list[Record]] = defaultdict(list)
        for index in sorted(folder.glob("rank-*/index.jsonl")):
            rank = int(index.parent.name.removeprefix("rank-"))
            for line in index.read_text().splitlines():
                r = json.loads(line)
                shape = tuple(r["shape"]) if "shape" in r else None
                record = Record(
                    r["kind"], r["name"], r["call"], r["leaf"], r["seq"], r["pp"],
                    rank, r.get("file"), shape, r.get("dtype"), r.get("class", ""),
                )  # fmt: skip
                records[record.kind, record.name, record.call, record.leaf].append(
                    record
                )
        for ranks in records.values():
            ranks.sort(key=lambda r: r.rank)
        self.records = dict(records)
        self._calls: Counter[tuple[str, str, int]] = Counter()
        self._leaves: dict[tuple[str, str], set[int]] = defaultdict(set)
        for kind, name, _, leaf in self.records:
            self._calls[kind, name, leaf] += 1
            self._leaves[kind, name].add(leaf)

    def __bool__(self) -> bool:
        return bool(self.records)

    def keys(self, kind: str) -> list[tuple[str, str, int, int]]:
        """``kind``'s records in execution order (pipeline stage, then time)."""
        found = [k for k in self.records if k[0] == kind]
        return sorted(
            found, key=lambda k: (self.records[k][0].pp, self.records[k][0].seq)
        )

    def calls(self, kind: str, name: str, leaf: int) -> int:
        return self._calls[kind, name, leaf]

    def leaves(self, kind: str, name: str) -> int:
        return len(self._leaves.get((kind, name), ()))

    def load(self, record: Record) -> torch.Tensor:
        assert record.file is not None
        path = self.folder / f"rank-{record.rank}" / record.file
        return torch.load(path, map_location="cpu", weights_only=True)


@dataclass(frozen=True)
class Difference:
    kind: str
    label: str
    dtype: str | None
    error: float | None  # relative (norm) error; None: not comparable
    max_abs: float | None
    bitwise: bool
    note: str = ""

    def departs(self, rtol: float | None) -> bool:
        if self.error is None:
            return False
        limit = default_rtol(self.dtype or "") if rtol is None else rtol
        return self.error > limit

    def describe(self, rtol: float | None) -> str:
        if self.error is None:
            return f"{self.label}: not compared ({self.note})"
        limit = default_rtol(self.dtype or "") if rtol is None else rtol
        verdict = "bitwise equal" if self.bitwise else (
            f"relative error {self.error:.2e} {'>' if self.error > limit else '<='} "
            f"{limit:g}, max abs {self.max_abs:.2e}"
        )  # fmt: skip
        return f"{self.label}: {verdict}"


def _concat_dim(shards: list[tuple[int, ...]], target: tuple[int, ...]) -> int | None:
    """The dimension along which ``shards`` (same shape) concatenate to
    ``target``, when exactly one does."""
    shape = shards[0]
    if len(shape) != len(target) or any(s != shape for s in shards):
        return None
    dims = [
        d for d in range(len(shape))
        if shape[d] * len(shards) == target[d]
        and all(shape[e] == target[e] for e in range(len(shape)) if e != d)
    ]  # fmt: skip
    return dims[0] if len(dims) == 1 else None


def _stage(ranks: list[Record]) -> list[Record]:
    """The records of the lowest rank's pipeline stage (one per rank)."""
    return [r for r in ranks if r.pp == ranks[0].pp]


class _Side:
    """One record of one setup, in the shape the other setup has."""

    def __init__(self, capture: Capture, key: tuple[str, str, int, int]) -> None:
        self.capture, self.ranks = capture, _stage(capture.records[key])

    @property
    def shape(self) -> tuple[int, ...] | None:
        return self.ranks[0].shape

    def shaped_as(self, target: tuple[int, ...] | None) -> torch.Tensor | None:
        first = self.ranks[0]
        if first.shape is None:
            return None
        if first.shape == target or target is None:
            return self.capture.load(first)
        shapes = [r.shape for r in self.ranks if r.shape is not None]
        dim = _concat_dim(shapes, target) if len(shapes) > 1 else None
        if dim is None:
            return None
        return torch.cat([self.capture.load(r) for r in self.ranks], dim=dim)


def _error(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, bool]:
    bitwise = a.dtype == b.dtype and torch.equal(a, b)
    a64, b64 = a.double(), b.double()
    same_nonfinite = torch.equal(torch.isnan(a64), torch.isnan(b64)) and torch.equal(
        a64.masked_fill(torch.isfinite(a64), 0).nan_to_num(0.0),
        b64.masked_fill(torch.isfinite(b64), 0).nan_to_num(0.0),
    )
    if not same_nonfinite:
        return math.inf, math.inf, False
    finite = torch.isfinite(a64)
    diff = torch.where(finite, a64 - b64, 0.0)
    scale = float(torch.where(finite, b64, 0.0).norm())
    distance = float(diff.norm())
    relative = distance / scale if scale else (0.0 if distance == 0 else math.inf)
    max_abs = float(diff.abs().max()) if diff.numel() else 0.0
    return relative, max_abs, bitwise


def _label(capture: Capture, kind: str, name: str, call: int, leaf: int) -> str:
    label = name
    if capture.leaves(kind, name) > 1:
        label += f"[{leaf}]"
    if kind == "forward" and capture.calls(kind, name, leaf) > 1:
        label += f" (call {call})"
    return label


def _pair(a: Capture, b: Capture, key: tuple[str, str, int, int]) -> Difference | None:
    """The difference of one record; None when B lacks it and it is a call
    B folded into one (microbatches)."""
    kind, name, call, leaf = key
    label = _label(a, kind, name, call, leaf)
    calls_a, calls_b = a.calls(kind, name, leaf), b.calls(kind, name, leaf)
    dtype = a.records[key][0].dtype
    if calls_b == 0:
        note = "B has no such record (a masked partial sum is not captured)"
        return Difference(kind, label, dtype, None, None, False, note)
    if calls_a == calls_b:
        if key not in b.records:
            return Difference(
                kind, label, dtype, None, None, False, "B has no such record"
            )
        tensors = _shaped_pair(_Side(a, key), _Side(b, key))
    elif 1 in (calls_a, calls_b):
        if call > 0:
            return None  # compared with call 0, all calls together
        tensors = _microbatched(a, b, kind, name, leaf, calls_a, calls_b)
        label = name if a.leaves(kind, name) == 1 else f"{name}[{leaf}]"
    else:
        note = f"A calls it {calls_a} times in the step, B {calls_b}"
        return Difference(kind, label, dtype, None, None, False, note)
    if isinstance(tensors, str):
        return Difference(kind, label, dtype, None, None, False, tensors)
    relative, max_abs, bitwise = _error(*tensors)
    return Difference(kind, label, dtype, relative, max_abs, bitwise)


def _shaped_pair(a: _Side, b: _Side) -> tuple[torch.Tensor, torch.Tensor] | str:
    if a.shape is None and b.shape is None:
        return "no gradient in either setup"
    if a.shape is None or b.shape is None:
        return f"a gradient in {'B' if a.shape is None else 'A'} only"
    if a.shape == b.shape:
        return a.shaped_as(a.shape), b.shaped_as(b.shape)  # type: ignore[return-value]
    ta, tb = a.shaped_as(b.shape), b.shaped_as(a.shape)
    if ta is not None:
        return ta, b.shaped_as(b.shape)  # type: ignore[return-value]
    if tb is not None:
        return a.shaped_as(a.shape), tb  # type: ignore[return-value]
    return f"shapes {list(a.shape)} (A) and {list(b.shape)} (B) do not line up"


def _microbatched(a, b, kind, name, leaf, calls_a, calls_b):
    many, one = (a, b) if calls_a > 1 else (b, a)
    whole = one.records[kind, name, 0, leaf][0]
    parts = []
    for call in range(max(calls_a, calls_b)):
        side = _Side(many, (kind, name, call, leaf))
        part_shape = None if whole.shape is None else side.shape
        parts.append(side.shaped_as(part_shape))
    if any(p is None for p in parts) or whole.shape is None:
        return "a microbatch's shards do not line up"
    # The calls that make the batch are the last ones: a pipeline schedule's
    # shape inference may run the stage once before them.
    rows, kept = 0, len(parts)
    while kept > 0 and rows < whole.shape[0]:
        kept -= 1
        rows += parts[kept].shape[0]  # type: ignore[union-attr]
    joined = torch.cat(parts[kept:], dim=0)  # type: ignore[arg-type]
    if tuple(joined.shape) != whole.shape:
        return f"{len(parts)} calls of the module do not make the other's batch"
    other = one.load(whole)
    return (joined, other) if many is a else (other, joined)


def _backward_order(a: Capture) -> list[tuple[str, str, int, int]]:
    """Gradients in the order backward makes them: the reverse of their
    modules' forward completion."""
    done: dict[str, int] = {}
    for position, key in enumerate(a.keys("forward")):
        done.setdefault(key[1], position)
    grads = a.keys("grad")
    return sorted(grads, key=lambda k: -done.get(k[1].rpartition(".")[0], -1))


def compare(a: Capture, b: Capture) -> tuple[list[Difference], list[Difference]]:
    """(forward differences in execution order, gradient differences in
    backward order)."""
    forward = [d for k in a.keys("forward") if (d := _pair(a, b, k)) is not None]
    backward = [d for k in _backward_order(a) if (d := _pair(a, b, k)) is not None]
    return forward, backward


def first_departure(diffs: list[Difference], rtol: float | None) -> Difference | None:
    return next((d for d in diffs if d.departs(rtol)), None)


def worst(diffs: list[Difference], k: int) -> list[Difference]:
    compared = [d for d in diffs if d.error is not None and d.error > 0]
    return sorted(compared, key=lambda d: -(d.error or 0.0))[:k]


def summary(
    forward: list[Difference], backward: list[Difference], rtol: float | None, k: int
) -> str:
    lines = []
    forward_first = first_departure(forward, rtol)
    for phase, diffs in (("forward", forward), ("backward", backward)):
        compared = [d for d in diffs if d.error is not None]
        equal = sum(d.bitwise for d in compared)
        skipped = [d for d in diffs if d.error is None]
        first = first_departure(diffs, rtol)
        head = f"{phase}: {len(compared)} records compared, {equal} bitwise equal"
        if skipped:
            head += f", {len(skipped)} not comparable"
        lines.append(head)
        if first is None:
            lines.append(f"  no record departs ({_limit(rtol)})")
        elif phase == "backward" and forward_first is not None:
            # Every gradient is computed from forward outputs that already
            # differ: the order says nothing, the size does.
            lines.append(f"  largest departure: {worst(diffs, 1)[0].describe(rtol)}")
            lines.append(
                f"  (every gradient follows the forward departure at "
                f"{forward_first.label}: ranked by error, not by order)"
            )
        else:
            before = compared[: compared.index(first)]
            agree = max((d.error or 0.0 for d in before), default=0.0)
            lines.append(f"  first departure: {first.describe(rtol)}")
            lines.append(
                f"  ({len(before)} records before it agree; worst {agree:.1e})"
            )
        for d in worst(diffs, k):
            lines.append(f"  worst: {d.describe(rtol)}")
        lines += [f"  {d.describe(rtol)}" for d in skipped[:3]]
    return "\n".join(lines)


def _limit(rtol: float | None) -> str:
    if rtol is not None:
        return f"relative error <= {rtol:g}"
    return f"relative error <= {DEFAULT_RTOL['torch.float32']:g} in fp32"


def as_json(
    forward: list[Difference], backward: list[Difference]
) -> list[dict[str, Any]]:
    return [
        {"phase": phase, "label": d.label, "dtype": d.dtype, "error": d.error,
         "max_abs": d.max_abs, "bitwise": d.bitwise, "note": d.note}
        for phase, diffs in (("forward", forward), ("backward", backward))
        for d in diffs
    ]  # fmt: skip


def plot(
    forward: list[Difference], backward: list[Difference], rtol: float | None, out: Path
) -> Path | None:
    """Relative error per record along depth, forward and backward; None
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, axes = plt.subplots(2, 1, figsize=(12, 7))
    for axis, phase, diffs in (
        (axes[0], "forward", forward),
        (axes[1], "backward", backward),
    ):
        errors = [
            max(d.error, 1e-16) if d.error is not None else math.nan for d in diffs
        ]
        axis.semilogy(range(len(diffs)), errors, marker=".", linewidth=0.8)
        limits = [default_rtol(d.dtype or "") if rtol is None else rtol for d in diffs]
        axis.plot(range(len(diffs)), limits, "--", color="grey", linewidth=0.8)
        first = first_departure(diffs, rtol)
        if first is not None:
            axis.axvline(diffs.index(first), color="red", linewidth=0.8)
            axis.set_title(f"{phase}: first departure {first.label}", fontsize=9)
        else:
            axis.set_title(f"{phase}: no departure", fontsize=9)
        axis.set_ylabel("relative error")
        axis.grid(alpha=0.3)
    axes[0].set_xlabel("module outputs in execution order")
    axes[1].set_xlabel("parameter gradients in backward order")
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out
