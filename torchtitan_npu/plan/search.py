"""`plan --search`: the layouts a device count allows, each planned, ranked.

Candidates keep the config's model, sequence and everything else; they vary
the tensor-parallel degree (within a node), the expert-parallel degree (MoE
models, where the era plans EP: the degrees dividing both the FSDP degree and
the routed experts), activation checkpointing and the local batch; FSDP
shards over the remaining devices. A smaller local batch is tried only while
the larger one does not fit. Pipeline parallelism costs a pipeline bubble, so
it is tried only where no layout without it fits: each degree dividing the
devices left by TP, up to the model's layers, with the config's schedule.
"""

import copy
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchtitan_npu.errors import PlanError
from torchtitan_npu.plan.estimate import Estimate, estimate

AC_MODES = ("none", "selective", "full")  # lightest (fastest) first


@dataclass
class Candidate:
    tp: int
    ac: str
    local_batch: int
    ep: int = 1
    pp: int = 1
    estimate: Estimate | None = None
    failure: str = ""

    def peak(self) -> int:
        return self.estimate.worst.peak if self.estimate else 0


def layout_config(config: dict[str, Any], world_size: int, c: Candidate) -> dict:
    """``config`` with the candidate's layout (cp off)."""
    out = copy.deepcopy(config)
    parallelism = out.setdefault("parallelism", {})
    parallelism.update(
        tensor_parallel_degree=c.tp,
        data_parallel_shard_degree=world_size // (c.tp * c.pp),
        data_parallel_replicate_degree=1,
        pipeline_parallel_degree=c.pp,
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
    experts, layers = routed_experts(config), layer_count(config)
    planned: list[Candidate] = []

    def plan_all(groups: list[tuple[int, int, int, str]]) -> None:
        for i, (tp, pp, ep, ac) in enumerate(groups, 1):
            size = batch
            while size >= 1:
                c = Candidate(tp, ac, size, ep, pp)
                try:
                    candidate_config = layout_config(config, world_size, c)
                    c.estimate = estimate(
                        candidate_config, world_size, target, all_layers
                    )
                except PlanError as e:  # upstream refuses the layout
                    c.failure = str(e)
                planned.append(c)
                shown = _gib(c.peak()) if c.estimate else c.failure
                layout = f"tp {tp}" + "".join(
                    f", {name} {d}" for name, d in (("pp", pp), ("ep", ep)) if d > 1
                )
                progress(
                    f"[{i}/{len(groups)}] {layout}, ac {ac}, batch {size}: {shown}"
                )
                if c.failure or c.peak() <= memory:
                    break
                size //= 2

    def groups(pipelined: bool) -> list[tuple[int, int, int, str]]:
        return [
            (tp, pp, ep, ac)
            for tp in tps
            for pp in pipeline_degrees(world_size // tp, layers, pipelined)
            for ep in expert_degrees(config, world_size // (tp * pp), experts)
            for ac in AC_MODES
        ]

    plan_all(groups(pipelined=False))
    if not any(c.estimate and c.peak() <= memory for c in planned):
        progress("no layout without pipeline parallelism fits: trying pp")
        plan_all(groups(pipelined=True))
    return rank(planned, memory)


def pipeline_degrees(devices: int, layers: int, pipelined: bool) -> list[int]:
    """1, or the PP degrees above 1 that divide ``devices`` and leave each
    stage a layer."""
    if not pipelined:
        return [1]
    return [d for d in range(2, min(devices, layers) + 1) if devices % d == 0]


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
    fits.sort(key=lambda c: (-c.local_batch, AC_MODES.index(c.ac), c.tp, c.pp))
    misses = [c for c in planned if c.estimate and c.peak() > memory]
    misses.sort(key=lambda c: c.peak())
    failed = [c for c in planned if not c.estimate]
    return fits + misses + failed


def _gib(value: int) -> str:
    return f"{value / 1024**3:.2f} GiB"
