"""`plan --search`: the layouts a device count allows, each planned, ranked.

Candidates keep the config's model, sequence and everything else; they vary
the tensor-parallel degree (within a node), the expert-parallel degree (MoE
models, where the era plans EP: the degrees dividing both the FSDP degree and
the routed experts), activation checkpointing and the local batch; FSDP
shards over the remaining devices. A smaller local batch is tried only while
the larger one does not fit.
"""

import copy
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchtitan_npu.errors import PlanError
from torchtitan_npu.plan.estimate import Estimate, estimate_apart

AC_MODES = ("none", "selective", "full")  # lightest (fastest) first


@dataclass
class Candidate:
    tp: int
    ac: str
    local_batch: int
    ep: int = 1
    estimate: Estimate | None = None
    failure: str = ""

    def peak(self) -> int:
        return self.estimate.worst.peak if self.estimate else 0


def layout_config(config: dict[str, Any], world_size: int, c: Candidate) -> dict:
    """``config`` with the candidate's layout (pp and cp off)."""
    out = copy.deepcopy(config)
    parallelism = out.setdefault("parallelism", {})
    parallelism.update(
        tensor_parallel_degree=c.tp,
        data_parallel_shard_degree=world_size // c.tp,
        data_parallel_replicate_degree=1,
        pipeline_parallel_degree=1,
        context_parallel_degree=1,
        expert_parallel_degree=c.ep,
    )
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
) -> list[Candidate]:
    """Plan every candidate on ``target`` devices; fitting ones first
    (fastest expected first), then the misses by how much they exceed
    ``memory``."""
    batch = config.get("training", {}).get("local_batch_size", 8)
    tps = [t for t in range(1, min(per_node, world_size) + 1) if world_size % t == 0]
    experts = routed_experts(config)
    planned: list[Candidate] = []
    groups = [
        (tp, ep, ac)
        for tp in tps
        for ep in expert_degrees(config, world_size // tp, experts)
        for ac in AC_MODES
    ]
    for i, (tp, ep, ac) in enumerate(groups, 1):
        size = batch
        while size >= 1:
            c = Candidate(tp, ac, size, ep)
            try:
                candidate_config = layout_config(config, world_size, c)
                c.estimate = estimate_apart(
                    candidate_config, world_size, target, all_layers
                )
            except PlanError as e:  # upstream refuses the layout, or pp/cp
                c.failure = str(e)
            planned.append(c)
            shown = _gib(c.peak()) if c.estimate else c.failure
            layout = f"tp {tp}" + (f", ep {ep}" if ep > 1 else "")
            progress(f"[{i}/{len(groups)}] {layout}, ac {ac}, batch {size}: {shown}")
            if c.failure or c.peak() <= memory:
                break
            size //= 2
    return rank(planned, memory)


def routed_experts(config: dict[str, Any]) -> int:
    """The routed experts of the config's model (0: dense, or a flavor built
    only at launch, such as one derived from an HF config.json)."""
    from torchtitan_npu.compat import resolve_upstream
    from torchtitan_npu.config import era_config

    model = config.get("model", {})
    try:
        meta = era_config(resolve_upstream().era).meta_model(
            model["name"], model["flavor"]
        )
    except Exception:  # noqa: BLE001 - the estimate reports what it cannot build
        return 0
    return max((getattr(m, "num_experts", 0) for m in meta.modules()), default=0)


def expert_degrees(config: dict[str, Any], shard: int, experts: int) -> list[int]:
    """The EP degrees a search plans: with routed experts (and an era that
    plans EP), each degree dividing both the FSDP degree and the experts;
    otherwise the config's own."""
    from torchtitan_npu.plan.estimate import era_plan

    own = config.get("parallelism", {}).get("expert_parallel_degree", 1)
    if not experts or "ep" in era_plan().UNPLANNABLE:
        return [own]
    return [d for d in range(1, shard + 1) if shard % d == 0 and experts % d == 0]


def rank(planned: list[Candidate], memory: int) -> list[Candidate]:
    fits = [c for c in planned if c.estimate and c.peak() <= memory]
    fits.sort(key=lambda c: (-c.local_batch, AC_MODES.index(c.ac), c.tp))
    misses = [c for c in planned if c.estimate and c.peak() > memory]
    misses.sort(key=lambda c: c.peak())
    failed = [c for c in planned if not c.estimate]
    return fits + misses + failed


def _gib(value: int) -> str:
    return f"{value / 1024**3:.2f} GiB"
