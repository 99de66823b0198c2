"""Patches of the config-registry era (torchtitan 0.3.x)."""

from typing import Any

from torchtitan_npu.compat.era import Era
from torchtitan_npu.kernels.varlen_attention import varlen_attention_reference
from torchtitan_npu.overlay.common import eager_flex_attention, skip_unless_cpu
from torchtitan_npu.overlay.registry import (
    Change,
    Patch,
    PatchContext,
    Target,
    no_change,
)


def _apply_eager_flex(target: Target, ctx: PatchContext) -> list[Change]:
    def compiled_flex_attn(
        q,
        k,
        v,
        *,
        score_mod,
        block_mask,
        scale,
        enable_gqa,
        return_aux,
        kernel_options,
    ):
        # Eager flex_attention differentiates on CPU (see flex_cpu_backward);
        # the compiled CPU kernel cannot. kernel_options tune compiled kernels.
        return eager_flex_attention(
            q,
            k,
            v,
            score_mod=score_mod,
            block_mask=block_mask,
            scale=scale,
            enable_gqa=enable_gqa,
            return_aux=return_aux,
        )

    return [Change(target.owner, target.attr, staticmethod(compiled_flex_attn))]


EAGER_FLEX_ATTENTION = Patch(
    name="eager_flex_attention",
    target="torchtitan.models.common.attention:FlexAttention.compiled_flex_attn",
    kind="replace",
    reason=(
        "the compiled FlexAttention kernel has no backward on CPU ('FlexAttention "
        "does not support backward on CPU'); 0.3.x rejects sdpa for LMs, so every "
        "CPU run needs the eager path."
    ),
    eras=(Era.CONFIG_REGISTRY,),
    upstream_ref=(
        "pytorch/pytorch#139434 (compiled FlexAttention: no CPU backward); 0.3.x "
        "rejects sdpa for language models"
    ),
    remove_when=(
        "torch's compiled FlexAttention trains on CPU, or upstream lets CPU runs "
        "choose sdpa"
    ),
    apply=_apply_eager_flex,
    skip=skip_unless_cpu,
)


def _apply_eager_block_mask(target: Target, ctx: PatchContext) -> list[Change]:
    from torch.nn.attention.flex_attention import create_block_mask

    return [Change(target.owner, target.attr, create_block_mask, rebind=True)]


EAGER_VISION_BLOCK_MASK = Patch(
    name="eager_vision_block_mask",
    target="torchtitan.models.common.vision_encoder:compiled_create_block_mask",
    kind="replace",
    reason=(
        "the vision encoders (Kimi K2.5, Qwen3.5) build their block-diagonal "
        "image mask with torch.compile(create_block_mask), whose CPU code does "
        "not compile (inductor: 'operands to ?: have different types VecMask<int> "
        "and VecMask<float>'); the eager builder makes the same mask."
    ),
    eras=(Era.CONFIG_REGISTRY,),
    upstream_ref=(
        "torch 2.14 inductor's CPU vectorization of the mask_mod of "
        "get_vision_block_mask_mod (reproduced on every image batch on CPU)"
    ),
    remove_when="torch's inductor compiles the vision mask on CPU",
    apply=_apply_eager_block_mask,
    skip=skip_unless_cpu,
)


def _apply_hf_adapter(target: Target, ctx: PatchContext) -> list[Change]:
    from torchtitan_npu.state_dict_adapters.upstream_adapter import with_adapter

    original = target.obj
    model = target.owner.__name__.rsplit(".", 1)[-1]

    def model_registry(*args, **kwargs):
        return with_adapter(original(*args, **kwargs), model, ctx.era)

    return [Change(target.owner, target.attr, model_registry, rebind=True)]


def _hf_adapter(model: str) -> Patch:
    return Patch(
        name=f"{model}_hf_adapter",
        target=f"torchtitan.models.{model}:model_registry",
        kind="wrap",
        reason=(
            "checkpoint.initial_load_in_hf / last_save_in_hf use titan-npu's "
            "declarative, coverage-checked HF mapping (state_dict_adapters)."
        ),
        eras=(Era.CONFIG_REGISTRY,),
        upstream_ref=(
            "none upstream: titan-npu's own HF mapping (state_dict_adapters) replaces "
            "the model's adapter; upstream's works but is not coverage-checked"
        ),
        remove_when=(
            "never for titan-npu's own models; for upstream models once their adapters "
            "check coverage and stream (then drop the wrap)"
        ),
        apply=_apply_hf_adapter,
    )


HF_ADAPTERS = [
    _hf_adapter(m)
    for m in ("llama3", "qwen3", "deepseek_v3", "gpt_oss", "qwen3_5", "kimi_k2_7")
]


def _architecture_builder(model: str, name: str) -> Patch:
    return Patch(
        name=f"{model}{name}",
        target=f"torchtitan.models.{model}:{name}",
        kind="depend",
        reason=(
            "a flavor derived from a HF config.json (state_dict_adapters/"
            "architecture.py) is built with upstream's own builder and initializers"
        ),
        eras=(Era.CONFIG_REGISTRY,),
        upstream_ref="none upstream: flavors are Python functions, not config.json",
        remove_when="upstream builds a model config from a HF config.json itself",
        apply=no_change,
    )


# distributed/activation_checkpoint.py's LayerAC (0.2.x's per-layer selective
# AC) subclasses FullAC; ActivationCheckpointing.apply wraps each block in turn.
LAYER_AC = [
    Patch(
        name=f"layer_ac_{name}",
        target=f"torchtitan.distributed.activation_checkpoint:{name}",
        kind="depend",
        reason=(
            "a train config's selective_ac_option N (every Nth layer checkpointed "
            "whole, 0.2.x) is LayerAC: FullAC's wrapper on every Nth block that "
            "ActivationCheckpointing.apply hands to _wrap_block"
        ),
        eras=(Era.CONFIG_REGISTRY,),
        upstream_ref="none upstream: 0.3 checkpoints selectively per op only",
        remove_when="upstream checkpoints every Nth layer again",
        apply=no_change,
    )
    for name in ("ActivationCheckpointing", "FullAC")
]


# What the derived (``hf``) flavors of state_dict_adapters/<model>.py call.
ARCHITECTURE_BUILDERS = [
    _architecture_builder("llama3", "_build_llama3_layers"),
    _architecture_builder("llama3", "_output_linear_init"),
    _architecture_builder("qwen3", "_build_qwen3_layers"),
    _architecture_builder("qwen3", "_build_qwen3_moe_layers"),
    _architecture_builder("deepseek_v3", "_build_dsv3_layers"),
    _architecture_builder("deepseek_v3", "_build_mtp_layers"),
    _architecture_builder("deepseek_v3", "_output_linear_init"),
    _architecture_builder("gpt_oss", "_build_gptoss_layers"),
    _architecture_builder("gpt_oss", "_make_gptoss_attn_config"),
    _architecture_builder("qwen3_5", "_build_qwen35_layers"),
    _architecture_builder("qwen3_5", "_build_qwen35_moe_layers"),
    _architecture_builder("qwen3_5", "_qwen35_vision_encoder_config"),
]


def _apply_experts_in_input_dtype(target: Target, ctx: PatchContext) -> list[Change]:
    original = target.obj

    def forward(self, x_RD, num_tokens_per_expert_E):
        return original(self, x_RD, num_tokens_per_expert_E).to(x_RD.dtype)

    return [Change(target.owner, target.attr, forward)]


GPT_OSS_EXPERTS_DTYPE = Patch(
    name="gpt_oss_experts_dtype",
    target="torchtitan.models.gpt_oss.moe:GptOssGroupedExperts.forward",
    kind="wrap",
    reason=(
        "gpt_oss's experts compute in bf16 and return bf16; outside FSDP's bf16 "
        "mixed precision (one device, fp32 params) the token combine scatters them "
        "into fp32 and fails ('scatter(): Expected self.dtype to be equal to "
        "src.dtype'): the output is returned in the input's dtype."
    ),
    eras=(Era.CONFIG_REGISTRY,),
    upstream_ref=(
        "none filed: upstream trains gpt_oss under FSDP's bf16 mixed precision, "
        "where input and output are both bf16"
    ),
    remove_when="GptOssGroupedExperts.forward returns its input's dtype",
    apply=_apply_experts_in_input_dtype,
)


def _apply_tp_expert_bias(target: Target, ctx: PatchContext) -> list[Change]:
    upstream_function = target.obj

    class ScaleBiasForward:
        """Upstream's Function, except where the experts' forward cannot see
        the TP degree: under the spmd_types backend they run in a local
        region whose parameters are plain local shards, so
        GptOssGroupedExperts.forward finds no DTensor mesh and passes 1."""

        @staticmethod
        def apply(bias: Any, tp_degree: int, dtype: Any) -> Any:
            from torchtitan.distributed.spmd_types import spmd_mesh_size
            from torchtitan.distributed.utils import get_spmd_backend

            # TP shards the routed experts only without expert parallelism
            # (upstream's moe_sharding), as its own typecheck_forward reads it.
            if (
                tp_degree == 1
                and get_spmd_backend() == "spmd_types"
                and spmd_mesh_size("ep") == 1
                and spmd_mesh_size("tp") > 1
            ):
                # The region sums the ranks' partial outputs, and the ranks'
                # gradients of this replicated bias as well: each rank's
                # share is 1/tp both ways.
                return (bias / spmd_mesh_size("tp")).to(dtype)
            return upstream_function.apply(bias, tp_degree, dtype)

    return [Change(target.owner, target.attr, ScaleBiasForward)]


GPT_OSS_TP_EXPERT_BIAS = Patch(
    name="gpt_oss_tp_expert_bias",
    target="torchtitan.models.gpt_oss.moe:ScaleBiasForward",
    kind="wrap",
    reason=(
        "under TP the experts' output bias must be divided by the TP degree "
        "before the partial sums are reduced; upstream reads the degree from the "
        "parameters' DTensor mesh, which the spmd_types local region has "
        "removed, so every TP rank added the whole bias (measured: the experts' "
        "output 11% off one device, the TP run's step-1 loss 0.34% off); the "
        "ranks' bias gradients are summed too, so they are divided as well "
        "(upstream passes them unscaled: the bias gradient was tp times too large)."
    ),
    eras=(Era.CONFIG_REGISTRY,),
    upstream_ref=(
        "none filed (found by the matrix's gpt_oss_tp cell): "
        "GptOssGroupedExperts.forward's isinstance(self.mlp1_weight_EGD, DTensor)"
    ),
    remove_when="GptOssGroupedExperts.forward scales the bias by the mesh's TP size",
    apply=_apply_tp_expert_bias,
)


def _apply_gloo_token_exchange(target: Target, ctx: PatchContext) -> list[Change]:
    from torch.distributed import get_backend
    from torch.distributed._functional_collectives import all_to_all_single

    original = target.obj

    def exchange(self, tokens, pg, output_splits, input_splits):
        if get_backend(pg) != "gloo":
            return original(self, tokens, pg, output_splits, input_splits)
        # Upstream's own path outside the spmd_types backend: one
        # all_to_all_single with split sizes (gloo's alltoallv), differentiable.
        return all_to_all_single(tokens, output_splits, input_splits, self.ep_mesh)

    return [Change(target.owner, target.attr, exchange)]


def _gloo_token_exchange(method: str) -> Patch:
    return Patch(
        name=f"gloo{method}",  # gloo_dispatch_token_exchange, gloo_combine_...
        target=f"torchtitan.models.common.token_dispatcher:AllToAllTokenDispatcher.{method}",
        kind="wrap",
        reason=(
            "expert parallelism sends each rank an uneven share of the tokens; "
            "under the spmd_types backend the exchange is a list all_to_all, "
            "which gloo refuses for uneven tensors ('ProcessGroupGloo::alltoall: "
            "invalid tensor size'): on gloo it goes through all_to_all_single "
            "with split sizes, upstream's own path for the DTensor backends."
        ),
        eras=(Era.CONFIG_REGISTRY,),
        upstream_ref="spmd_types' _AllToAllUneven calls dist.all_to_all (tensor lists)",
        remove_when="spmd_types' uneven all_to_all runs on gloo",
        apply=_apply_gloo_token_exchange,
        skip=skip_unless_cpu,
    )


GLOO_TOKEN_EXCHANGE = [
    _gloo_token_exchange("_dispatch_token_exchange"),
    _gloo_token_exchange("_combine_token_exchange"),
]

VARLEN_ATTENTION_REFERENCE = Patch(
    name="varlen_attention_reference",
    target="torchtitan.models.common.attention:varlen_attn",
    kind="replace",
    reason=(
        "the varlen attention backend (gpt_oss's default, llama3's "
        "debugmodel_varlen_attn) calls torch's flash-only varlen_attn "
        "('Could not run aten::_flash_attention_forward ... CPU'): on CPU the "
        "same packed-sequence attention runs as plain tensor math."
    ),
    eras=(Era.CONFIG_REGISTRY,),
    upstream_ref="torch.nn.attention.varlen.varlen_attn has only a flash kernel",
    remove_when="torch's varlen_attn runs on CPU",
    apply=lambda target, ctx: [
        Change(target.owner, target.attr, varlen_attention_reference)
    ],
    skip=skip_unless_cpu,
)


def _apply_text_only_batches(target: Target, ctx: PatchContext) -> list[Change]:
    original = target.obj

    def prepare_multimodal_embeds(self, tokens, *, special_tokens=None, **vision):
        if special_tokens is None and not any(v is not None for v in vision.values()):
            # ids no token has: the text-only batch has no placeholders to fill
            special_tokens = {"image_id": -1, "video_id": -1}
        return original(self, tokens, special_tokens=special_tokens, **vision)

    return [Change(target.owner, target.attr, prepare_multimodal_embeds)]


QWEN3_5_TEXT_ONLY_BATCHES = Patch(
    name="qwen3_5_text_only_batches",
    target="torchtitan.models.qwen3_5.model:Qwen35Model._prepare_multimodal_embeds",
    kind="wrap",
    reason=(
        "Qwen3.5 reads the image/video placeholder ids from every batch "
        "(KeyError/TypeError on None), but a text dataloader's batches have "
        "none: text-only batches get ids no token has, as kimi_k2_7 allows "
        "(special_tokens None for text-only)."
    ),
    eras=(Era.CONFIG_REGISTRY,),
    upstream_ref="none filed: upstream trains Qwen3.5 on multimodal batches only",
    remove_when="Qwen35Model accepts special_tokens=None for text-only batches",
    apply=_apply_text_only_batches,
)


def _fla_call_site(
    qualname: str, module: str, since: str | None = None, before: str | None = None
) -> Patch:
    suffix = "" if module == "model" else f"_{module}"
    return Patch(
        name=f"qwen3_5_fla_{qualname.rsplit('.', 1)[-1].strip('_')}{suffix}",
        target=f"torchtitan.models.qwen3_5.{module}:{qualname}",
        kind="depend",
        reason=(
            "without flash-linear-attention, kernels/fla_standin.py answers for "
            "the fla functions this upstream code calls, with the arguments it "
            "passes (the PyTorch gated delta rule, a reference causal conv)"
        ),
        eras=(Era.CONFIG_REGISTRY,),
        upstream_ref="fla's kernels are Triton (CUDA); upstream has no other path",
        remove_when="upstream's Qwen3.5 has a kernel path that runs on CPU and NPU",
        apply=no_change,
        since=since,
        before=before,
    )


# Upstream's calls into fla, which the stand-in implements; main moved the
# gated delta net out of model.py into gdn.py (its inputs now [T, N, K]).
FLA_CALL_SITES = [
    *(
        _fla_call_site(qualname, "model", before="0.3.1")
        for qualname in ("GatedDeltaKernel.forward", "_causal_conv1d_varlen")
    ),
    *(
        _fla_call_site(qualname, "gdn", since="0.3.1")
        for qualname in ("GatedDeltaKernel.forward", "_causal_conv1d_varlen")
    ),
]

_DISPATCHER = "torchtitan.models.common.token_dispatcher:AllToAllTokenDispatcher"
_PLAN_ROUTING = dict(
    eras=(Era.CONFIG_REGISTRY,),
    upstream_ref=(
        "none upstream: a plan on fake tensors has no token counts to read "
        "(plan/routing.py)"
    ),
    remove_when="upstream's EP dispatch sizes its all-to-all without .tolist()",
    on_request=True,  # by `titan-npu plan` only, never in training
)


def _apply_routed_tokens(target: Target, ctx: PatchContext) -> list[Change]:
    from torchtitan_npu.plan.routing import counting_routed_tokens

    return [Change(target.owner, target.attr, counting_routed_tokens(target.obj))]


def _apply_even_splits(target: Target, ctx: PatchContext) -> list[Change]:
    from torchtitan_npu.plan.routing import even_token_count_exchange

    return [Change(target.owner, target.attr, even_token_count_exchange)]


def _apply_document_per_row(target: Target, ctx: PatchContext) -> list[Change]:
    from torchtitan_npu.plan.attention import document_per_row

    planned = document_per_row(target.obj)
    return [Change(target.owner, target.attr, planned, rebind=True)]


PLAN_VARLEN_METADATA = Patch(
    name="plan_varlen_metadata",
    target="torchtitan.models.common.attention:create_varlen_metadata_for_document",
    kind="wrap",
    reason=(
        "varlen attention (gpt_oss, qwen3_5) finds document starts in the "
        "positions ('aten.nonzero' has no fake output shape): a plan's batch "
        "is one document per row, so its metadata comes from the shape"
    ),
    eras=(Era.CONFIG_REGISTRY,),
    upstream_ref=(
        "none upstream: a plan on fake tensors has no positions to read "
        "(plan/attention.py)"
    ),
    remove_when="never while plans run on fake tensors",
    apply=_apply_document_per_row,
    on_request=True,  # by `titan-npu plan` only, never in training
)


# Expert parallelism in a plan: the routed-token count, then even splits.
PLAN_ROUTING = [
    Patch(
        name="plan_routed_tokens",
        target=f"{_DISPATCHER}.dispatch",
        kind="wrap",
        reason="a plan's even EP splits need the tokens x top-k each rank routes",
        apply=_apply_routed_tokens,
        **_PLAN_ROUTING,
    ),
    Patch(
        name="plan_even_splits",
        target=f"{_DISPATCHER}._sync_token_count_exchange",
        kind="replace",
        reason=(
            "fake tensors have no token counts for the EP all-to-all's splits "
            "('aten._local_scalar_dense' at .tolist()): a plan routes evenly"
        ),
        apply=_apply_even_splits,
        **_PLAN_ROUTING,
    ),
]

PATCHES = [
    EAGER_FLEX_ATTENTION,
    EAGER_VISION_BLOCK_MASK,
    VARLEN_ATTENTION_REFERENCE,
    GPT_OSS_EXPERTS_DTYPE,
    GPT_OSS_TP_EXPERT_BIAS,
    *GLOO_TOKEN_EXCHANGE,
    QWEN3_5_TEXT_ONLY_BATCHES,
    *FLA_CALL_SITES,
    *HF_ADAPTERS,
    *ARCHITECTURE_BUILDERS,
    *LAYER_AC,
    *PLAN_ROUTING,
    PLAN_VARLEN_METADATA,
]
