"""Patches every era needs: device choice, SUM-only reductions, NPU wiring."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass

from torchtitan_npu.compat.era import Era
from torchtitan_npu.overlay.registry import (
    Change,
    Patch,
    PatchContext,
    Target,
    no_change,
)

ALL_ERAS = tuple(Era)


def _device_module(device_type: str):
    import torch

    if device_type == "cpu":
        from torchtitan_npu.distributed import cpu_device_module

        return cpu_device_module
    return getattr(torch, device_type)


def _upstream_detected_device() -> str:
    from torch._utils import _get_available_device_type

    # Upstream's own rule: whatever torch reports, else "cuda".
    return _get_available_device_type() or "cuda"


def _apply_device(target: Target, ctx: PatchContext) -> list[Change]:
    device_type, device_module = ctx.device_type, _device_module(ctx.device_type)

    def get_device_info():
        return device_type, device_module

    module = target.owner
    return [
        Change(module, "get_device_info", get_device_info),
        Change(module, "device_type", device_type, rebind=True),
        Change(module, "device_module", device_module, rebind=True),
    ]


def _skip_device(ctx: PatchContext) -> str | None:
    detected = _upstream_detected_device()
    if detected == ctx.device_type:
        return f"upstream detects {detected} itself"
    return None


DEVICE = Patch(
    name="device",
    target="torchtitan.tools.utils:get_device_info",
    kind="replace",
    reason=(
        "upstream picks `_get_available_device_type() or 'cuda'` once at import "
        "and ~10 modules copy it by value; on a CPU host it says 'cuda'. Sets the "
        "selected device and a torch.cuda-shaped CPU module (memory stats, integer "
        "current_device for barrier(device_ids=...)) and rebinds every copy."
    ),
    eras=ALL_ERAS,
    upstream_ref=(
        "none upstream: torchtitan's device choice is CUDA-first by design "
        '(`_get_available_device_type() or "cuda"` in torchtitan/tools/utils.py); no'
        " CPU/NPU selection hook exists"
    ),
    remove_when=(
        "upstream selects the device through an overridable hook (or falls back to "
        "cpu) in every locked release"
    ),
    apply=_apply_device,
    skip=_skip_device,
)


def _apply_sum_reduction(target: Target, ctx: PatchContext) -> list[Change]:
    original = target.obj

    def get_gradient_divide_factors(
        reduce_scatter_group,
        all_reduce_group,
        reduce_dtype,
        device_type="",
        factor=None,
        force_sum_reduction_for_comms=False,
    ):
        pre, post, reduce_scatter_op, all_reduce_op = original(
            reduce_scatter_group,
            all_reduce_group,
            reduce_dtype,
            device_type,
            factor,
            True,
        )
        if factor is not None and _one_rank(reduce_scatter_group):
            # foreach_reduce skips a one-rank reduce-scatter and divides by the
            # factor itself; a pre/post divide on top would divide twice.
            return None, None, reduce_scatter_op, all_reduce_op
        return pre, post, reduce_scatter_op, all_reduce_op

    return [Change(target.owner, target.attr, get_gradient_divide_factors)]


def _one_rank(group) -> bool:
    return group is None or group.size() == 1


def _skip_sum_reduction(ctx: PatchContext) -> str | None:
    if ctx.backend in ("gloo", "hccl"):
        return None
    return f"{ctx.backend} supports AVG and PREMUL_SUM"


FSDP_SUM_REDUCTION = Patch(
    name="fsdp_sum_reduction",
    target=(
        "torch.distributed.fsdp._fully_shard._fsdp_collectives"
        ":_get_gradient_divide_factors"
    ),
    kind="wrap",
    reason=(
        "FSDP2 reduce-scatters gradients with ReduceOp.AVG or PREMUL_SUM when "
        "torchtitan sets a divide factor; gloo has neither and HCCL lacks "
        "PREMUL_SUM. Forces SUM collectives with a separate divide (FSDP2's own "
        "force_sum_reduction_for_comms path), except on a one-rank shard group, "
        "which foreach_reduce divides itself (torch divides twice there: "
        "0.2.0/0.2.1's experts under EP = FSDP degree got half their gradient)."
    ),
    eras=ALL_ERAS,
    upstream_ref=(
        "pytorch/pytorch#155915 (FSDP2 force_sum_reduction_for_comms); torchtitan does"
        " not expose the flag"
    ),
    remove_when=(
        "torchtitan sets force_sum_reduction_for_comms for gloo/hccl meshes, or gloo "
        "and HCCL implement AVG and PREMUL_SUM"
    ),
    apply=_apply_sum_reduction,
    skip=_skip_sum_reduction,
)


# What fsdp_sum_reduction leaves to torch on a one-rank shard group.
FSDP_ONE_RANK_DIVIDE = Patch(
    name="fsdp_one_rank_divide",
    target="torch.distributed.fsdp._fully_shard._fsdp_collectives:foreach_reduce",
    kind="depend",
    reason=(
        "fsdp_sum_reduction leaves a one-rank shard group's divide to "
        "foreach_reduce, which skips the reduce-scatter there and divides by the "
        "gradient divide factor itself"
    ),
    eras=ALL_ERAS,
    upstream_ref=(
        "none upstream: torch divides twice only on the SUM path torchtitan never "
        "forces (0.2.0/0.2.1 set a divide factor on EP's expert FSDP group)"
    ),
    remove_when="the fsdp_sum_reduction record goes",
    apply=no_change,
    skip=_skip_sum_reduction,
)


def eager_flex_attention(*args, **kwargs) -> Any:
    """torch's eager flex_attention, without its "called without torch.compile"
    notice: on CPU eager is the point (the compiled kernel has no backward)."""
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", "flex_attention called without torch.compile", UserWarning
        )
        return flex_attention(*args, **kwargs)


def skip_unless_cpu(ctx: PatchContext) -> str | None:
    return None if ctx.device_type == "cpu" else f"not on cpu ({ctx.device_type})"


def _apply_flex_cpu_backward(target: Target, ctx: PatchContext) -> list[Change]:
    original = target.obj

    def validate_device(query, key, value):
        if query.device.type == "cpu":
            return  # the eager path differentiates through its math reference
        original(query, key, value)

    return [Change(target.owner, target.attr, validate_device)]


FLEX_CPU_BACKWARD = Patch(
    name="flex_cpu_backward",
    target="torch.nn.attention.flex_attention:_validate_device",
    kind="wrap",
    reason=(
        "torch refuses FlexAttention inputs that require grad on CPU because its "
        "compiled CPU kernel has no backward; the eager path (used on CPU through "
        "the eager_flex_attention patch) has a math backward and trains."
    ),
    eras=ALL_ERAS,
    upstream_ref=(
        "pytorch/pytorch#139434 (CPU support for FlexAttention), "
        "pytorch/pytorch#169646 (the CPU backward refusal)"
    ),
    remove_when=(
        "torch ships a FlexAttention backward on CPU (compiled or eager) in the paired"
        " torch of every locked release"
    ),
    apply=_apply_flex_cpu_backward,
    skip=skip_unless_cpu,
)


def skip_unless_npu(ctx: PatchContext) -> str | None:
    return None if ctx.device_type == "npu" else f"not on npu ({ctx.device_type})"


def _apply_hccl_sum_only(target: Target, ctx: PatchContext) -> list[Change]:
    from torchtitan_npu.distributed.hccl import mean_by_sum

    return [Change(target.owner, target.attr, mean_by_sum(target.owner.dist_sum))]


HCCL_SUM_ONLY = Patch(
    name="hccl_sum_only",
    target="torchtitan.distributed.utils:dist_mean",
    kind="replace",
    reason=(
        "torchtitan averages the logged loss with ReduceOp.AVG, which HCCL does "
        "not implement; reduces with SUM and divides by the group size instead."
    ),
    eras=ALL_ERAS,
    upstream_ref=(
        "none upstream: HCCL has no ReduceOp.AVG (Ascend CANN collective docs); "
        "torchtitan's dist_mean assumes NCCL"
    ),
    remove_when=(
        "torch_npu's HCCL process group implements ReduceOp.AVG, or torchtitan's "
        "dist_mean reduces with SUM"
    ),
    apply=_apply_hccl_sum_only,
    skip=lambda ctx: None if ctx.backend == "hccl" else f"not hccl ({ctx.backend})",
)


def _apply_hccl_env(target: Target, ctx: PatchContext) -> list[Change]:
    from torchtitan_npu.distributed.hccl import translate_nccl_env

    original = target.obj

    def init_process_group(*args, **kwargs):
        translate_nccl_env()
        return original(*args, **kwargs)

    return [Change(target.owner, target.attr, init_process_group)]


HCCL_ENV = Patch(
    name="hccl_env",
    target="torch.distributed:init_process_group",
    kind="wrap",
    reason=(
        "torchtitan sets the flight recorder's TORCH_NCCL_* / TORCH_FR_* "
        "variables just before creating the process group; torch_npu reads "
        "TORCH_HCCL_* / HCCL_* names. Copies each across at that moment."
    ),
    eras=ALL_ERAS,
    upstream_ref=(
        "none upstream: torch_npu names its flight-recorder variables TORCH_HCCL_* "
        "(torch_npu docs); torchtitan sets TORCH_NCCL_*"
    ),
    remove_when=(
        "torch_npu reads the TORCH_NCCL_* / TORCH_FR_* flight-recorder variables"
    ),
    apply=_apply_hccl_env,
    skip=skip_unless_npu,
)


def _apply_peak_flops(target: Target, ctx: PatchContext) -> list[Change]:
    from torchtitan_npu.reporting.flops import peak_flops

    original = target.obj

    def get_peak_flops(device_name: str) -> float:
        peak = peak_flops(ctx.device_type, device_name)
        return original(device_name) if peak is None else peak

    return [Change(target.owner, target.attr, get_peak_flops)]


PEAK_FLOPS = Patch(
    name="peak_flops",
    target="torchtitan.tools.utils:get_peak_flops",
    kind="wrap",
    reason=(
        "upstream's peak-FLOPs lookup knows NVIDIA/AMD names only: elsewhere it "
        "runs lspci and reports MFU against an A100, with two warnings. Adds the "
        "Ascend table on npu; on cpu MFU has no meaningful peak and reads 0 "
        "(reporting/flops.py; TITAN_NPU_PEAK_FLOPS overrides both)."
    ),
    eras=ALL_ERAS,
    upstream_ref=(
        "pytorch/torchtitan#1203 (the peak-FLOPs table; Ascend devices not in it)"
    ),
    remove_when=(
        "torchtitan's get_peak_flops knows the Ascend 910B/910_93/950 devices and "
        "stays quiet on cpu"
    ),
    apply=_apply_peak_flops,
    skip=lambda ctx: "upstream's table" if ctx.device_type == "cuda" else None,
)


def _apply_npu_profiler(target: Target, ctx: PatchContext) -> list[Change]:
    from torchtitan_npu.reporting import npu_profiler

    return [Change(target.owner, target.attr, getattr(npu_profiler, target.attr))]


NPU_PROFILER = Patch(
    name="npu_profiler",
    target="torch.profiler:profile",
    kind="replace",
    reason=(
        "upstream profiles with torch.profiler, which records no NPU activity; "
        "builds torch_npu.profiler.profile with CPU + NPU activities instead "
        "(reporting/npu_profiler.py), under upstream's profiling config."
    ),
    eras=ALL_ERAS,
    upstream_ref=(
        "none upstream: torch.profiler records no privateuse1 (NPU) kernels; torch_npu"
        " ships its own profiler (torch_npu docs)"
    ),
    remove_when=(
        "torch.profiler records NPU activities through the privateuse1 profiler hooks"
    ),
    apply=_apply_npu_profiler,
    skip=skip_unless_npu,
)

NPU_PROFILER_SCHEDULE = Patch(
    name="npu_profiler_schedule",
    target="torch.profiler:schedule",
    kind="replace",
    reason="the schedule torch_npu's profiler understands (see npu_profiler).",
    eras=ALL_ERAS,
    upstream_ref="none upstream: pairs with npu_profiler",
    remove_when="npu_profiler is removed",
    apply=_apply_npu_profiler,
    skip=skip_unless_npu,
)

# Pipeline parallelism in a plan: its stages' first-step messages kept in
# the planning process (plan/pipeline.py).
_PIPELINING = "torch.distributed.pipelining"
_PLAN_PIPELINE = dict(
    eras=ALL_ERAS,
    upstream_ref=(
        "none upstream: a fake process group carries no messages; torch >= 2.14 "
        "plans pipelines on one only from complete static stage metadata"
    ),
    remove_when=(
        "never while plans run under a fake process group (the untracked "
        "inference: once torch's memory tracker follows autograd.grad)"
    ),
    on_request=True,  # by `titan-npu plan` only, never in training
)


def _plan_pipeline(make: str) -> Callable[[Target, PatchContext], list[Change]]:
    def apply(target: Target, ctx: PatchContext) -> list[Change]:
        from torchtitan_npu.plan import pipeline

        wrapped = getattr(pipeline, make)(target.obj)
        return [Change(target.owner, target.attr, wrapped)]

    return apply


PLAN_PIPELINE = [
    Patch(
        name="plan_pipeline_inference",
        target=f"{_PIPELINING}.schedules:_PipelineSchedule._warmup_p2p",
        reason=(
            "pipeline stages vote over the process group whether their shapes "
            "must be inferred: over a fake group a plan's stages infer them"
        ),
        kind="wrap",
        apply=_plan_pipeline("inference_without_vote"),
        **_PLAN_PIPELINE,
    ),
    Patch(
        name="plan_pipeline_untracked_inference",
        target=f"{_PIPELINING}.schedules:_PipelineSchedule._initialize_pp_stages",
        reason=(
            "the memory tracker's module hooks cannot follow the gradient a "
            "stage infers its shapes by: a plan's (or its measurement's) first "
            "step infers them untracked"
        ),
        kind="wrap",
        apply=_plan_pipeline("untracked"),
        **_PLAN_PIPELINE,
    ),
    Patch(
        name="plan_pipeline_send",
        target=f"{_PIPELINING}.stage:PipelineStage._send_meta",
        reason="a plan keeps the shapes a stage sends for the stage it sends them to",
        kind="wrap",
        apply=_plan_pipeline("keeping_sent"),
        **_PLAN_PIPELINE,
    ),
    Patch(
        name="plan_pipeline_receive",
        target=f"{_PIPELINING}.stage:PipelineStage._recv_meta",
        reason=(
            "a fake group delivers nothing: a plan's stage receives the shapes "
            "kept for it"
        ),
        kind="wrap",
        apply=_plan_pipeline("receiving_kept"),
        **_PLAN_PIPELINE,
    ),
    Patch(
        name="plan_pipeline_p2p_held",
        target=f"{_PIPELINING}.schedules:_batch_p2p",
        reason=(
            "a real group's work holds the activations a stage sends until the "
            "schedule drops it, a fake group's nothing: a plan's works hold them"
        ),
        kind="wrap",
        apply=_plan_pipeline("holding_p2p"),
        **_PLAN_PIPELINE,
    ),
]

PATCHES = [
    DEVICE,
    FSDP_SUM_REDUCTION,
    FSDP_ONE_RANK_DIVIDE,
    FLEX_CPU_BACKWARD,
    HCCL_SUM_ONLY,
    HCCL_ENV,
    PEAK_FLOPS,
    NPU_PROFILER,
    NPU_PROFILER_SCHEDULE,
    *PLAN_PIPELINE,
]
