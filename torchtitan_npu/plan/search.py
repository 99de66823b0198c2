"""`plan --search`: the layouts a device count allows, each planned, ranked.

Candidates keep the config's model, sequence and everything else. The first
round varies the tensor-parallel degree (within a node), the expert-parallel
degree (MoE models, where the era plans EP: the degrees dividing both the
FSDP degree and the routed experts), activation checkpointing and the local
batch; FSDP shards over the remaining devices. A smaller local batch is
tried only while the larger one does not fit, a heavier checkpointing mode
only while the lighter one needs a smaller batch. Where a layout fits on
several nodes, HSDP replicates it over each divisor of the node count while
it still fits (less traffic between nodes).

Pipeline and context parallelism split the model's work further, at a cost
(a pipeline bubble, attention's exchanges), so they are tried only where
nothing fits without: the smallest split first (pp x cp = 2, then 4, ...),
each PP degree leaving every stage a layer, with the config's schedule and
the other common ones, each CP degree dividing the sequence.

A degree, schedule, checkpointing mode or local batch given on the command
line (``--parallelism.tensor_parallel_degree 8``) is kept: only the rest
varies.
"""

import copy
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from torchtitan_npu.config import preflight
from torchtitan_npu.errors import ConfigError, PlanError
from torchtitan_npu.plan.estimate import Estimate, estimate

AC_MODES = ("none", "selective", "full")  # lightest (fastest) first
SCHEDULES = ("1F1B", "Interleaved1F1B")  # tried beside the config's own
# The command-line overrides a search keeps as given: key -> Candidate field.
KEPT = {
    "parallelism.data_parallel_replicate_degree": "replicate",
    "parallelism.data_parallel_shard_degree": "fsdp",
    "parallelism.tensor_parallel_degree": "tp",
    "parallelism.pipeline_parallel_degree": "pp",
    "parallelism.pipeline_parallel_schedule": "schedule",
    "parallelism.context_parallel_degree": "cp",
    "parallelism.expert_parallel_degree": "ep",
    "activation_checkpoint.mode": "ac",
    "training.local_batch_size": "local_batch",
}


@dataclass
class Candidate:
    fsdp: int
    tp: int
    ac: str
    local_batch: int
    ep: int = 1
    pp: int = 1
    cp: int = 1
    replicate: int = 1
    schedule: str = ""  # the pipeline schedule, where pp > 1
    estimate: Estimate | None = None
    failure: str = ""

    def peak(self) -> int:
        return self.estimate.worst.peak if self.estimate else 0

    def fits(self, memory: int) -> bool:
        return self.estimate is not None and self.peak() <= memory

    def name(self) -> str:
        """E.g. ``replicate 2 x fsdp 4 x tp 2`` or ``fsdp 1 x pp 2 (1F1B)``."""
        degrees = [("replicate", self.replicate), ("fsdp", self.fsdp)]
        degrees += [("pp", self.pp), ("cp", self.cp), ("tp", self.tp), ("ep", self.ep)]
        used = [f"{n} {d}" for n, d in degrees if d > 1 or n == "fsdp"]
        return " x ".join(used) + (f" ({self.schedule})" if self.pp > 1 else "")


def kept(overrides: dict[str, Any]) -> dict[str, Any]:
    """The candidate fields the command line's ``--section.key`` overrides
    fix (an FSDP degree of -1, "the rest", fixes nothing)."""
    fixed = {KEPT[key]: value for key, value in overrides.items() if key in KEPT}
    if fixed.get("fsdp") == -1:
        del fixed["fsdp"]
    return fixed


def layout_config(config: dict[str, Any], c: Candidate) -> dict:
    """``config`` with the candidate's layout."""
    out = copy.deepcopy(config)
    parallelism = out.setdefault("parallelism", {})
    parallelism.update(
        tensor_parallel_degree=c.tp,
        data_parallel_shard_degree=c.fsdp,
        data_parallel_replicate_degree=c.replicate,
        pipeline_parallel_degree=c.pp,
        context_parallel_degree=c.cp,
        expert_parallel_degree=c.ep,
    )
    if c.pp > 1:
        parallelism["pipeline_parallel_schedule"] = c.schedule
    out.setdefault("activation_checkpoint", {})["mode"] = c.ac
    out.setdefault("training", {})["local_batch_size"] = c.local_batch
    return out


def search(
    config: dict[str, Any],
    world_size: int,
    per_node: int,
    memory: int,
    target: str,
    progress: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
    all_layers: bool = False,
    fixed: dict[str, Any] | None = None,
) -> list[Candidate]:
    """Plan every candidate on ``target`` devices, keeping the ``fixed``
    fields (see ``kept``); fitting ones first (fastest expected first), then
    the misses by how much they exceed ``memory``."""
    fixed = fixed or {}
    batch = config.get("training", {}).get("local_batch_size", 8)
    planned: list[Candidate] = []

    def attempt(c: Candidate, tag: str) -> bool:
        """Plan ``c``; whether it fits."""
        try:
            candidate = layout_config(config, c)
            preflight.check(
                candidate,
                world_size=world_size,
                launch="the search",
                device_type=target,
            )
            c.estimate = estimate(candidate, world_size, target, all_layers)
        except (ConfigError, PlanError) as e:  # a layout the run would refuse
            c.failure = str(e)
        planned.append(c)
        shown = _gib(c.peak()) if c.estimate else c.failure
        progress(f"{tag} {c.name()}, ac {c.ac}, batch {c.local_batch}: {shown}")
        return c.fits(memory)

    nodes = world_size // per_node
    for split in range(1, world_size + 1):
        if world_size % split:
            continue
        shaped = groups(config, world_size, per_node, split)
        layouts = [kept for g in shaped if (kept := keep(g, fixed)) is not None]
        if not layouts:
            continue
        if planned:
            progress(f"no layout fits with pp x cp below {split}: trying {split}")
        modes = 1 if "ac" in fixed else len(AC_MODES)
        halved = "" if "local_batch" in fixed else " (halved while it misses)"
        progress(
            f"{len(layouts)} layout(s) to plan, each with up to {modes} "
            f"checkpointing mode(s) and local batch {batch}{halved}; what the "
            "command line sets is kept (set more to plan fewer)"
        )
        for i, layout in enumerate(layouts, 1):
            tag = f"[{i}/{len(layouts)}]"
            plan_layout(layout, batch, nodes, fixed, partial(attempt, tag=tag))
        if any(c.fits(memory) for c in planned):
            break
    if not planned:
        flags = {field: key for key, field in KEPT.items()}
        given = " ".join(f"--{flags[field]} {v}" for field, v in fixed.items())
        raise PlanError(
            f"no layout of {world_size} devices ({per_node} per node) keeps "
            f"{given}; change or drop these overrides"
        )
    return rank(planned, memory)


def keep(layout: Candidate, fixed: dict[str, Any]) -> Candidate | None:
    """``layout`` with the ``fixed`` replicate degree taken from its FSDP
    degree, or None where it differs from a ``fixed`` field."""
    replicate = fixed.get("replicate", 1)
    if layout.fsdp % replicate:
        return None
    layout = replace(layout, fsdp=layout.fsdp // replicate, replicate=replicate)
    fields = {"fsdp", "tp", "ep", "pp", "cp"} | (
        {"schedule"} if layout.pp > 1 else set()
    )
    if any(getattr(layout, f) != fixed[f] for f in fields & fixed.keys()):
        return None
    return layout


def plan_layout(
    layout: Candidate,
    batch: int,
    nodes: int,
    fixed: dict[str, Any],
    attempt: Callable[[Candidate], bool],
) -> None:
    """``layout`` under each checkpointing mode, lightest first, while the
    lighter one needs a smaller batch than ``batch``: its local batch halved
    while it does not fit (unless ``fixed``), then the fitting one replicated
    over more nodes (HSDP) while it still fits, unless the replicate degree
    is ``fixed``."""
    for ac in [fixed["ac"]] if "ac" in fixed else AC_MODES:
        size = batch
        while not attempt(c := replace(layout, ac=ac, local_batch=size)):
            if c.failure:  # refused: no other mode or batch makes it run
                return
            if size == 1 or "local_batch" in fixed:
                break
            size //= 2
        else:
            if "replicate" not in fixed:
                for r in hsdp_degrees(c.fsdp, nodes, c.ep):
                    hsdp = replace(c, fsdp=c.fsdp // r, replicate=r, estimate=None)
                    if not attempt(hsdp):
                        break
            if size == batch:  # a heavier mode would only be slower
                return


def groups(
    config: dict[str, Any], world_size: int, per_node: int, split: int
) -> list[Candidate]:
    """The layouts whose pipeline x context degrees make ``split``: every
    TP degree within a node, PP schedule and EP degree; FSDP over the rest
    (checkpointing and local batch still to choose)."""
    experts, layers = routed_experts(config), layer_count(config)
    seq = config.get("training", {}).get("seq_len", 0)
    own = config.get("parallelism", {}).get("pipeline_parallel_schedule")
    schedules = list(dict.fromkeys(s for s in (own, *SCHEDULES) if s))
    out = []
    for tp in range(1, min(per_node, world_size) + 1):
        if world_size % (tp * split):
            continue
        for pp, cp in model_splits(split, layers, seq):
            fsdp = world_size // (tp * split)
            for schedule in schedules if pp > 1 else [""]:
                out += [
                    Candidate(fsdp, tp, AC_MODES[0], 0, ep, pp, cp, schedule=schedule)
                    for ep in expert_degrees(config, fsdp, experts)
                ]
    return out


def model_splits(split: int, layers: int, seq: int) -> list[tuple[int, int]]:
    """(pp, cp) with pp x cp == ``split``: each stage keeps a layer, each CP
    rank two equal chunks of the sequence (upstream's load balancing)."""
    return [
        (pp, split // pp)
        for pp in range(1, split + 1)
        if split % pp == 0
        and (pp == 1 or pp <= layers)
        and (pp == split or seq % (2 * (split // pp)) == 0)
    ]


def hsdp_degrees(fsdp: int, nodes: int, ep: int) -> list[int]:
    """The replicate degrees above 1 that divide the nodes and the FSDP
    degree, leaving shards EP can split."""
    return [
        r
        for r in range(2, nodes + 1)
        if nodes % r == 0 and fsdp % r == 0 and (fsdp // r) % ep == 0
    ]


def layer_count(config: dict[str, Any]) -> int:
    """The decoder layers of the config's model (0 where it cannot be built
    before launch)."""
    meta = meta_model(config)
    return len(meta.layers) if meta is not None and hasattr(meta, "layers") else 0


def routed_experts(config: dict[str, Any]) -> int:
    """The routed experts of the config's model (0: dense, or a flavor built
    only at launch, such as one derived from an HF config.json)."""
    meta = meta_model(config)
    if meta is None:
        return 0
    return max((getattr(m, "num_experts", 0) for m in meta.modules()), default=0)


def meta_model(config: dict[str, Any]) -> Any:
    """The config's model on the meta device, or None where it is built only
    at launch (a flavor derived from an HF config.json)."""
    from torchtitan_npu.compat import resolve_upstream
    from torchtitan_npu.config import era_config

    model = config.get("model", {})
    try:
        return era_config(resolve_upstream().era).meta_model(
            model["name"], model["flavor"]
        )
    except Exception:  # noqa: BLE001 - the estimate reports what it cannot build
        return None


def expert_degrees(config: dict[str, Any], shard: int, experts: int) -> list[int]:
    """The EP degrees a search plans: with routed experts, each degree
    dividing both the FSDP degree and the experts; otherwise the config's
    own."""
    own = config.get("parallelism", {}).get("expert_parallel_degree", 1)
    if not experts:
        return [own]
    return [d for d in range(1, shard + 1) if shard % d == 0 and experts % d == 0]


def rank(planned: list[Candidate], memory: int) -> list[Candidate]:
    """Fits (larger batch, lighter checkpointing, smaller TP, PP and CP, more
    replication first), then misses by excess, then refusals."""
    fits = [c for c in planned if c.fits(memory)]
    fits.sort(
        key=lambda c: (
            -c.local_batch,
            AC_MODES.index(c.ac),
            c.tp,
            c.pp,
            c.cp,
            -c.replicate,
        )
    )
    misses = [c for c in planned if c.estimate and c.peak() > memory]
    misses.sort(key=lambda c: c.peak())
    failed = [c for c in planned if not c.estimate]
    return fits + misses + failed


def _gib(value: int) -> str:
    return f"{value / 1024**3:.2f} GiB"
