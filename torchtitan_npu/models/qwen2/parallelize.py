"""Parallelize Qwen2 with torch's own APIs, in upstream torchtitan's order:
TP -> activation checkpointing -> compile -> FSDP2.

Era-neutral: the era glue (trainspec.py / config_registry.py) reads its
upstream's config and parallel dims into a `Plan`.
"""

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import (
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)

from torchtitan_npu.errors import ConfigError
from torchtitan_npu.models.qwen2.model import Qwen2Model


@dataclass
class Plan:
    tp_mesh: DeviceMesh | None = None
    loss_parallel: bool = False  # head output stays sharded on the vocab
    ac_mode: str = "none"  # none | full | selective (op-level)
    compile: bool = False
    dp_mesh: DeviceMesh | None = None  # FSDP2 (HSDP when 2-D)
    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    reshard_after_forward: bool = True
    # 1.0 where the trainer normalizes the loss by the global token count
    # (0.2.2+): gradients are then summed over dp ranks, not averaged.
    gradient_divide_factor: float | None = None


def _mesh(parallel_dims, names: list[str]):
    """0.2.1+ name meshes by role ("fsdp"); 0.2.0 by their flattened dims."""
    if hasattr(parallel_dims, "get_mesh"):
        return parallel_dims.get_mesh(names)
    legacy = {"fsdp": "dp_shard_cp"}
    names = [legacy.get(n, n) for n in names]
    return parallel_dims.world_mesh[tuple(names) if len(names) > 1 else names[0]]


def plan_for(
    parallel_dims: Any,
    *,
    loss_parallel: bool,
    ac_mode: str,
    compile: bool,
    training: Any,
    parallelism: Any,
    sum_gradients: bool,
) -> Plan:
    """A `Plan` from either era's parallel dims and config sections."""
    from torchtitan.config import TORCH_DTYPE_MAP

    if parallel_dims.cp_enabled:
        raise ConfigError("qwen2: context parallelism is not supported")
    if parallel_dims.dp_replicate_enabled and not parallel_dims.fsdp_enabled:
        raise ConfigError("qwen2: use FSDP2 / HSDP (data_parallel_shard_degree > 1)")
    plan = Plan(
        ac_mode=ac_mode,
        compile=compile,
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        reshard_after_forward=parallelism.fsdp_reshard_after_forward != "never",
        gradient_divide_factor=1.0 if sum_gradients else None,
    )
    if parallel_dims.tp_enabled:
        plan.tp_mesh = _mesh(parallel_dims, ["tp"])
        plan.loss_parallel = loss_parallel
    if parallel_dims.fsdp_enabled:
        hsdp = parallel_dims.dp_replicate_enabled
        plan.dp_mesh = _mesh(
            parallel_dims, ["dp_replicate", "fsdp"] if hsdp else ["fsdp"]
        )
    return plan


def parallelize_qwen2(model: Qwen2Model, plan: Plan) -> Qwen2Model:
    if plan.tp_mesh is not None:
        apply_tp(model, plan.tp_mesh, plan.loss_parallel)
    if plan.ac_mode != "none":
        apply_ac(model, plan.ac_mode)
    if plan.compile:
        for name, block in model.layers.named_children():
            # pyrefly: ignore[bad-argument-type]  # compile returns the module
            model.layers.register_module(name, torch.compile(block, fullgraph=True))
    if plan.dp_mesh is not None:
        apply_fsdp(model, plan)
    return model


def apply_tp(model: Qwen2Model, mesh: DeviceMesh, loss_parallel: bool) -> None:
    """Megatron-style TP with sequence parallel norms; heads split by rank."""
    head = model.HEAD
    top = {
        "tok_embeddings": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1)
        ),
        "norm": SequenceParallel(),
        head: ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    parallelize_module(
        model, mesh, {k: v for k, v in top.items() if getattr(model, k) is not None}
    )
    for block in model.layers.values():
        parallelize_module(
            block,
            mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(  # rope cache: left as is
                    input_layouts=(Shard(1), None),
                    desired_input_layouts=(Replicate(), None),
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            },
        )


# Selective AC keeps these outputs and recomputes the rest.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _save_matmuls(ctx, op, *args, **kwargs):
    if op in _SAVE_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: Qwen2Model, mode: str) -> None:
    if mode not in ("full", "selective"):
        raise ConfigError(
            f"qwen2: activation checkpoint mode {mode!r} is not supported"
        )
    kwargs: dict[str, Any] = {"preserve_rng_state": False}
    if mode == "selective":
        kwargs["context_fn"] = partial(
            create_selective_checkpoint_contexts, _save_matmuls
        )
    for name, block in model.layers.named_children():
        model.layers.register_module(name, checkpoint_wrapper(block, **kwargs))


def apply_fsdp(model: Qwen2Model, plan: Plan) -> None:
    """One FSDP2 unit per block, the root holds embeddings, norm and head
    (so tied embeddings stay in one unit)."""
    mp = MixedPrecisionPolicy(
        param_dtype=plan.param_dtype, reduce_dtype=plan.reduce_dtype
    )
    shard = partial(fully_shard, mesh=plan.dp_mesh, mp_policy=mp)
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        last = i == len(blocks) - 1
        shard(block, reshard_after_forward=plan.reshard_after_forward and not last)
    shard(model)
    if plan.gradient_divide_factor is not None:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(plan.gradient_divide_factor)
