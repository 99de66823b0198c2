"""Patches of the TrainSpec era (torchtitan 0.2.x)."""

from typing import Any

from torchtitan_npu.compat.era import Era
from torchtitan_npu.overlay.common import eager_flex_attention, skip_unless_cpu
from torchtitan_npu.overlay.registry import (
    Change,
    Patch,
    PatchContext,
    Target,
    no_change,
)


def _apply_eager_flex(target: Target, ctx: PatchContext) -> list[Change]:
    def forward(
        self,
        q,
        k,
        v,
        *,
        score_mod=None,
        block_mask=None,
        scale=None,
        return_lse=False,
        enable_gqa=False,
    ):
        # Eager flex_attention differentiates on CPU (see flex_cpu_backward);
        # the compiled CPU kernel cannot.
        return eager_flex_attention(
            q,
            k,
            v,
            score_mod=score_mod,
            block_mask=block_mask,
            scale=scale,
            enable_gqa=enable_gqa,
            return_lse=return_lse,
        )

    return [Change(target.owner, target.attr, forward)]


EAGER_FLEX_ATTENTION = Patch(
    name="eager_flex_attention",
    target="torchtitan.models.attention:FlexAttentionWrapper.forward",
    kind="replace",
    reason=(
        "the compiled FlexAttention kernel has no backward on CPU; flex flavours "
        "and context parallelism need the eager path there."
    ),
    eras=(Era.TRAINSPEC,),
    upstream_ref="pytorch/pytorch#139434 (compiled FlexAttention: no CPU backward)",
    remove_when="0.2.x era dropped, or torch's compiled FlexAttention trains on CPU",
    apply=_apply_eager_flex,
    skip=skip_unless_cpu,
)


def _apply_mask_device(target: Target, ctx: PatchContext) -> list[Change]:
    original = target.obj
    device_position = 5  # create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device)

    def create_attention_mask(*args, **kwargs):
        if len(args) <= device_position:
            kwargs.setdefault("device", ctx.device_type)
        return original(*args, **kwargs)

    return [Change(target.owner, target.attr, create_attention_mask, rebind=True)]


FLEX_MASK_DEVICE = Patch(
    name="flex_mask_device",
    target="torchtitan.models.attention:create_attention_mask",
    kind="wrap",
    reason=(
        "0.2.x builds FlexAttention block masks without a device, and torch's "
        "create_block_mask defaults to 'cuda': flex flavours (and so CP) fail "
        "with a cuda/cpu device mismatch elsewhere. Passes the training device."
    ),
    eras=(Era.TRAINSPEC,),
    upstream_ref="pytorch/pytorch#169224 (create_block_mask defaults to device='cuda')",
    remove_when=(
        "0.2.x era dropped (0.3.x passes the device), or torch's create_block_mask "
        "defaults to the current device"
    ),
    apply=_apply_mask_device,
    skip=lambda ctx: "cuda is the default" if ctx.device_type == "cuda" else None,
)


def _apply_hf_adapters(target: Target, ctx: PatchContext) -> list[Change]:
    from torchtitan_npu.state_dict_adapters import ADAPTERS
    from torchtitan_npu.state_dict_adapters.upstream_adapter import with_adapter

    original = target.obj

    def get_train_spec(name: str):
        spec = original(name)
        return with_adapter(spec, name, ctx.era) if name in ADAPTERS else spec

    return [Change(target.owner, target.attr, get_train_spec, rebind=True)]


HF_ADAPTERS = Patch(
    name="hf_adapters",
    target="torchtitan.protocols.train_spec:get_train_spec",
    kind="wrap",
    reason=(
        "checkpoint.initial_load_in_hf / last_save_in_hf use titan-npu's "
        "declarative, coverage-checked HF mappings (state_dict_adapters)."
    ),
    eras=(Era.TRAINSPEC,),
    upstream_ref=(
        "none upstream: titan-npu's own HF mapping (state_dict_adapters) replaces the "
        "model's adapter; upstream's works but is not coverage-checked"
    ),
    remove_when="0.2.x era dropped",
    apply=_apply_hf_adapters,
)


def _apply_qwen2(target: Target, ctx: PatchContext) -> list[Change]:
    from torchtitan_npu.models.qwen2.trainspec import train_spec

    # What register_train_spec("qwen2", spec) does, on a copy of the registry
    # so that reverting the overlay unregisters it.
    specs = dict(target.owner._extra_train_specs)
    if "qwen2" in specs:
        raise RuntimeError("TrainSpec qwen2 is already registered.")
    specs["qwen2"] = train_spec()
    return [Change(target.owner, "_extra_train_specs", specs)]


QWEN2_MODEL = Patch(
    name="qwen2_model",
    target="torchtitan.protocols.train_spec:register_train_spec",
    kind="inject",
    reason=(
        "registers titan-npu's Qwen2 model (torchtitan_npu.models.qwen2) as "
        "train spec 'qwen2'."
    ),
    eras=(Era.TRAINSPEC,),
    upstream_ref=(
        "none upstream: model injection (Qwen2 is not an upstream model); "
        "register_train_spec is the documented extension point"
    ),
    remove_when="0.2.x era dropped",
    apply=_apply_qwen2,
)


def _apply_converters(target: Target, ctx: PatchContext) -> list[Change]:
    from torchtitan_npu.converters.trainspec import model_converter_classes

    # What register_model_converter(cls, name) does for each converter, on a
    # copy of the registry so that reverting the overlay unregisters them.
    registry = dict(target.owner._registry_model_converter_cls)
    ours = model_converter_classes(ctx.device_type)
    taken = sorted(set(registry) & set(ours))
    if taken:
        raise RuntimeError(f"model converters {taken} are already registered.")
    registry.update(ours)
    return [Change(target.owner, "_registry_model_converter_cls", registry)]


CONVERTERS = Patch(
    name="converters",
    target="torchtitan.protocols.model_converter:register_model_converter",
    kind="inject",
    reason=(
        "registers titan-npu's kernel converters (torchtitan_npu.converters) "
        "as model converters, applied by name from model.converters."
    ),
    eras=(Era.TRAINSPEC,),
    upstream_ref=(
        "none upstream: converter injection; register_model_converter is the "
        "documented extension point"
    ),
    remove_when="0.2.x era dropped",
    apply=_apply_converters,
)


# What reads the registry the converters patch writes: pinned, never changed.
# (get_train_spec, the reader of qwen2_model's registry, is hf_adapters' target.)
CONVERTER_LOOKUP = Patch(
    name="converter_lookup",
    target="torchtitan.protocols.model_converter:ModelConvertersContainer",
    kind="depend",
    reason=(
        "reads _registry_model_converter_cls, where the converters patch registers "
        "titan-npu's converters"
    ),
    eras=(Era.TRAINSPEC,),
    upstream_ref="none upstream: the reader of the registry converters writes",
    remove_when="0.2.x era dropped",
    apply=no_change,
)


def _apply_integer_histc(target: Target, ctx: PatchContext) -> list[Change]:
    import torch

    original = torch.histc

    def histc(input, bins=100, min=0, max=0, *, out=None):
        if out is None and input.device.type == "cpu" and not input.is_floating_point():
            # exact: float64 holds every count and index below 2**53
            return original(input.double(), bins, min, max).to(input.dtype)
        return original(input, bins, min, max, out=out)

    return [Change(torch, "histc", histc)]


_HISTC_REASON = (
    "0.2.x MoE counts tokens per expert with torch.histc on the int64 expert "
    "indices; CPU histc has no integer kernel ('histc_cpu' not implemented for "
    "'Long'), so no MoE model ran forward on CPU: integer inputs on CPU are "
    "counted in float64 (exact) and returned in their dtype, as CUDA's are."
)
MOE_INTEGER_HISTC = Patch(
    name="moe_integer_histc",
    target="torchtitan.models.moe.moe:TokenReorderer.forward",
    kind="polyfill",
    reason=_HISTC_REASON,
    eras=(Era.TRAINSPEC,),
    upstream_ref="torch.histc: integer inputs are CUDA-only",
    remove_when="0.2.x era dropped (0.3.x counts experts without histc)",
    apply=_apply_integer_histc,
    skip=skip_unless_cpu,
)


def _apply_permute_on_cpu(target: Target, ctx: PatchContext) -> list[Change]:
    original = target.obj

    def generate_permute_indices(tokens_per_expert_group, *args, use_cpu=False):
        use_cpu = use_cpu or tokens_per_expert_group.device.type == "cpu"
        return original(tokens_per_expert_group, *args, use_cpu=use_cpu)

    return [Change(target.owner, target.attr, generate_permute_indices, rebind=True)]


MOE_PERMUTE_ON_CPU = Patch(
    name="moe_permute_on_cpu",
    target="torchtitan.models.moe.kernels:generate_permute_indices",
    kind="wrap",
    reason=(
        "0.2.x's grouped-mm experts pad and permute tokens with a Triton kernel "
        "('0 active drivers' without a GPU) although the function has a CPU "
        "path: tokens on CPU take upstream's own CPU path."
    ),
    eras=(Era.TRAINSPEC,),
    upstream_ref="generate_permute_indices(use_cpu=...): _permute never passes it",
    remove_when="0.2.x era dropped (0.3.x permutes without Triton)",
    apply=_apply_permute_on_cpu,
    skip=skip_unless_cpu,
)


def _apply_even_expert_tokens(target: Target, ctx: PatchContext) -> list[Change]:
    from torchtitan_npu.plan.routing import evenly_routed_experts

    return [Change(target.owner, target.attr, evenly_routed_experts(target.obj))]


def _plan_even_expert_tokens(name: str, target: str, since: str | None) -> Patch:
    return Patch(
        name=name,
        target=target,
        kind="wrap",
        reason=(
            "fake tensors have no token counts for the experts' loop "
            "('aten._local_scalar_dense' at .tolist()): a plan spreads the "
            "routed tokens evenly over the experts"
        ),
        eras=(Era.TRAINSPEC,),
        since=since,
        upstream_ref=(
            "none upstream: a plan on fake tensors has no token counts to read "
            "(plan/routing.py)"
        ),
        remove_when="0.2.x era dropped",
        apply=_apply_even_expert_tokens,
        on_request=True,  # by `titan-npu plan` only, never in training
    )


# 0.2.x's MoE experts off SM90 CUDA in a plan: the shared loop, gpt_oss's own.
PLAN_EVEN_EXPERT_TOKENS = [
    _plan_even_expert_tokens(
        "plan_even_expert_tokens",
        "torchtitan.models.moe.moe:_run_experts_for_loop",
        since=None,
    ),
    _plan_even_expert_tokens(
        "plan_even_gpt_oss_expert_tokens",
        "torchtitan.models.gpt_oss.model.moe:_run_experts_for_loop",
        since="0.2.2",
    ),
]


def _apply_even_ep_splits(target: Target, ctx: PatchContext) -> list[Change]:
    import sys

    from torchtitan_npu.plan.routing import even_expert_parallel_dispatch

    permute = sys.modules[target.owner.__module__]._permute  # as upstream imports it
    return [Change(target.owner, target.attr, even_expert_parallel_dispatch(permute))]


PLAN_EVEN_EP_SPLITS = Patch(
    name="plan_even_ep_splits",
    target="torchtitan.distributed.expert_parallel:ExpertParallel._token_dispatch",
    kind="replace",
    reason=(
        "fake tensors have no token counts for the EP all-to-all's splits "
        "('aten._local_scalar_dense' at .tolist()): a plan routes evenly"
    ),
    eras=(Era.TRAINSPEC,),
    upstream_ref=(
        "none upstream: a plan on fake tensors has no token counts to read "
        "(plan/routing.py)"
    ),
    remove_when="0.2.x era dropped",
    apply=_apply_even_ep_splits,
    on_request=True,  # by `titan-npu plan` only, never in training
)


def _apply_ddp_buckets(target: Target, ctx: PatchContext) -> list[Change]:
    from torchtitan_npu.plan.collectives import ddp_buckets

    return [Change(target.owner, target.attr, ddp_buckets, rebind=True)]


PLAN_DDP_BUCKETS = Patch(
    name="plan_ddp_buckets",
    target="torchtitan.models.llama3.infra.parallelize:apply_ddp",
    kind="replace",
    reason=(
        "DDP's reducer reads its parameters' data, which fake tensors have none "
        "of: a plan leaves the model unwrapped and allocates DDP's gradient "
        "buckets beside it"
    ),
    eras=(Era.TRAINSPEC,),
    upstream_ref=(
        "none upstream: a plan on fake tensors has no data for DDP's reducer "
        "(plan/collectives.py)"
    ),
    remove_when="0.2.x era dropped",
    apply=_apply_ddp_buckets,
    on_request=True,  # by `titan-npu plan` only, never in training
)


def _apply_unfilled_permute_indices(target: Target, ctx: PatchContext) -> list[Change]:
    from torchtitan_npu.plan.routing import unfilled_permute_indices

    return [Change(target.owner, target.attr, unfilled_permute_indices)]


PLAN_PERMUTE_INDICES = Patch(
    name="plan_permute_indices",
    target="torchtitan.models.moe.kernels:fill_indices_cpu",
    kind="replace",
    reason=(
        "fake tensors have no token counts for the grouped experts' padded "
        "token order ('aten._local_scalar_dense' at .item()): a plan allocates "
        "the index vector unfilled"
    ),
    eras=(Era.TRAINSPEC,),
    upstream_ref=(
        "none upstream: a plan on fake tensors has no token counts to read "
        "(plan/routing.py)"
    ),
    remove_when="0.2.x era dropped",
    apply=_apply_unfilled_permute_indices,
    on_request=True,  # by `titan-npu plan` only, never in training
)


# The other 0.2.x call of torch.histc on expert indices.
MOE_ROUTER_HISTC = Patch(
    name="moe_router_histc",
    target="torchtitan.models.moe.moe:TokenChoiceTopKRouter.forward",
    kind="depend",
    reason="calls torch.histc on int64 expert indices: see moe_integer_histc",
    eras=(Era.TRAINSPEC,),
    upstream_ref="torch.histc: integer inputs are CUDA-only",
    remove_when="0.2.x era dropped",
    apply=no_change,
)


def _apply_layers_in_default_dtype(target: Target, ctx: PatchContext) -> list[Change]:
    import torch

    original = target.obj

    def __init__(self, model_args):
        original(self, model_args)
        self.layers.to(torch.get_default_dtype())

    return [Change(target.owner, target.attr, __init__)]


GPT_OSS_LAYERS_DTYPE = Patch(
    name="gpt_oss_layers_dtype",
    target="torchtitan.models.gpt_oss.model.model:GptOssModel.__init__",
    kind="wrap",
    reason=(
        "0.2.2's gpt_oss casts its layers to bf16 at build while its embedding and "
        "head keep the default dtype; outside FSDP's mixed precision (one CPU "
        "process, fp32 params) the first layer fails ('mat1 and mat2 must have the "
        "same dtype'): on CPU the layers keep the default dtype, as 0.3.0's "
        "gpt_oss builds them."
    ),
    eras=(Era.TRAINSPEC,),
    since="0.2.2",
    upstream_ref="none filed: fixed upstream in 0.3.0 (layers in the default dtype)",
    remove_when="0.2.x era dropped",
    apply=_apply_layers_in_default_dtype,
    skip=skip_unless_cpu,
)


def _apply_gate_bias_init(target: Target, ctx: PatchContext) -> list[Change]:
    import torch

    original = target.obj

    def init_weights(self, init_std: float):
        original(self, init_std)
        if self.gate.bias is not None:
            torch.nn.init.zeros_(self.gate.bias)

    return [Change(target.owner, target.attr, init_weights)]


MOE_GATE_BIAS_INIT = Patch(
    name="moe_gate_bias_init",
    target="torchtitan.models.moe.moe:TokenChoiceTopKRouter.init_weights",
    kind="wrap",
    reason=(
        "0.2.x's router initialises its gate's weight but not the bias gpt_oss's "
        "router has (gate_bias=True): after the meta-device build it is whatever "
        "memory held, NaN losses from step 1 on CPU. The bias starts at zero, as "
        "0.3.0's gpt_oss initialises it."
    ),
    eras=(Era.TRAINSPEC,),
    upstream_ref="none filed: 0.3.0's per-module param_init covers the bias",
    remove_when="0.2.x era dropped",
    apply=_apply_gate_bias_init,
)


def _apply_tp_score_gradient(target: Target, ctx: PatchContext) -> list[Change]:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    original = target.obj

    class SumGradientOverTP(torch.autograd.Function):
        """Identity forward; backward sums the ranks' partial gradients."""

        @staticmethod
        def forward(ctx: Any, scores: Any, group: Any) -> Any:
            ctx.group = group
            return scores.view_as(scores)

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            grad = grads[0].contiguous().clone()
            dist.all_reduce(grad, group=ctx.group)
            return grad, None

    def partial_experts_group(moe):
        """The TP group whose ranks each hold a partial sum of the routed
        experts' output, where the scores multiply that output (None
        otherwise: one device, expert parallelism, scores on the input)."""
        weight = next(moe.experts.parameters())
        if moe.score_before_experts or not isinstance(weight, DTensor):
            return None
        names = weight.device_mesh.mesh_dim_names or ()
        if "tp" not in names or "ep" in names:
            return None
        return weight.device_mesh.get_group("tp")

    def forward(self, x):
        group = partial_experts_group(self)
        if group is None:
            return original(self, x)

        def reduced(module, inputs, outputs):
            scores, *rest = outputs
            return (SumGradientOverTP.apply(scores, group), *rest)

        hook = self.router.register_forward_hook(reduced)
        try:
            return original(self, x)
        finally:
            hook.remove()

    return [Change(target.owner, target.attr, forward)]


MOE_TP_SCORE_GRADIENT = Patch(
    name="moe_tp_score_gradient",
    target="torchtitan.models.moe.moe:MoE.forward",
    kind="wrap",
    reason=(
        "under TP (no EP) 0.2.x's experts leave each rank a partial sum of their "
        "output, and where the routing scores multiply that output "
        "(score_before_experts=False: gpt_oss, deepseek_v3, qwen3) each rank's "
        "gradient of the scores is partial too and is never summed: the router's "
        "replicated weights took a different gradient on each TP rank and drifted "
        "apart (measured: gpt_oss TP 2 on 0.2.2, the ranks' router weights 2.4e-3 "
        "apart after 2 steps; the checkpoint keeps one rank's copy, so a resume "
        "was not bitwise). The scores' gradient is summed over the TP group."
    ),
    eras=(Era.TRAINSPEC,),
    upstream_ref=(
        "none filed (found by the matrix's gpt_oss_tp resume): MoE.forward's "
        "bmm(top_scores, routed_output) on local partial outputs"
    ),
    remove_when="0.2.x era dropped (0.3.x keeps the scores DTensors: Partial)",
    apply=_apply_tp_score_gradient,
)

PATCHES = [
    EAGER_FLEX_ATTENTION,
    FLEX_MASK_DEVICE,
    MOE_INTEGER_HISTC,
    MOE_ROUTER_HISTC,
    MOE_PERMUTE_ON_CPU,
    *PLAN_EVEN_EXPERT_TOKENS,
    PLAN_PERMUTE_INDICES,
    PLAN_EVEN_EP_SPLITS,
    PLAN_DDP_BUCKETS,
    GPT_OSS_LAYERS_DTYPE,
    MOE_GATE_BIAS_INIT,
    MOE_TP_SCORE_GRADIENT,
    HF_ADAPTERS,
    QWEN2_MODEL,
    CONVERTERS,
    CONVERTER_LOOKUP,
]
