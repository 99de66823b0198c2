"""The built-in converters: rms_norm, rope, attention, swiglu, grouped_mm,
token_permute.

Each converter lists, per upstream era, the classes or functions it replaces
and the models whose code uses them. The replacements keep upstream's
arithmetic (dtype casts included) and swap only the op for the device kernel.
"""

import sys
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from torchtitan_npu.converters.registry import Converter, Replacement, register

TRAINSPEC, CONFIG_REGISTRY = "trainspec", "config_registry"
MODELS = ("deepseek_v3", "llama3", "qwen3")
MOE_MODELS = ("deepseek_v3", "qwen3")


# rms_norm ------------------------------------------------------------------------


def _rms_norm(kernel, original):
    def forward(self, x):
        return kernel(x, self.normalized_shape, self.weight, self.eps)

    return {"forward": forward}


register(
    Converter(
        name="rms_norm",
        description="RMSNorm layers (attention/ffn/final norms, q/k norms, MLA norms)",
        kernel="rms_norm",
        npu_ops=("npu_rms_norm",),
        native="torch.nn.functional.rms_norm",
        replacements={
            TRAINSPEC: (Replacement("torch.nn:RMSNorm", MODELS, _rms_norm),),
            CONFIG_REGISTRY: (
                Replacement(
                    "torchtitan.models.common.nn_modules:RMSNorm", MODELS, _rms_norm
                ),
            ),
        },
    )
)


# rope ----------------------------------------------------------------------------


def _complex_cos_sin(freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin over the full head dim, pairs interleaved, from complex cis values."""
    cos_sin = torch.view_as_real(freqs_cis).repeat_interleave(2, dim=-2)
    return cos_sin[..., 0], cos_sin[..., 1]


def _rope_args(positions) -> tuple:
    return () if positions is None else (positions,)  # 0.2.0 takes no positions


def _llama3_rope(kernel, original):
    """0.2.x llama3: complex RoPE on q and k (computed in fp32)."""
    model = sys.modules[original.__module__]

    def apply_rotary_emb(xq, xk, freqs_cis, positions=None):
        # reshape_for_broadcast reads only the complex view's shape: xq[..., ::2]
        freqs = model.reshape_for_broadcast(
            freqs_cis, xq[..., ::2], *_rope_args(positions)
        )
        cos, sin = _complex_cos_sin(freqs)
        return (
            kernel(xq.float(), cos, sin, True).type_as(xq),
            kernel(xk.float(), cos, sin, True).type_as(xk),
        )

    return apply_rotary_emb


def _deepseek_v3_rope(kernel, original):
    """0.2.x deepseek_v3: complex RoPE on one tensor (computed in fp32)."""
    model = sys.modules[original.__module__]

    def apply_rotary_emb(x, freqs_cis, positions=None):
        freqs = model.reshape_for_broadcast(
            freqs_cis, x[..., ::2], *_rope_args(positions)
        )
        cos, sin = _complex_cos_sin(freqs)
        return kernel(x.float(), cos, sin, True).to(x.dtype)

    return apply_rotary_emb


def _qwen3_rope(kernel, original):
    """0.2.x qwen3: rotate-half RoPE from a [cos | sin] cache, in the input dtype."""
    model = sys.modules[original.__module__]

    def apply_rotary_emb(xq, xk, rope_cache, positions=None):
        head_dim = xq.shape[-1]
        cache = model.reshape_for_broadcast(rope_cache, xq, *_rope_args(positions))
        cos = cache[..., :head_dim].to(dtype=xq.dtype, device=xq.device)
        sin = cache[..., head_dim:].to(dtype=xq.dtype, device=xq.device)
        return (
            kernel(xq, cos, sin, False).type_as(xq),
            kernel(xk, cos, sin, False).type_as(xk),
        )

    return apply_rotary_emb


def _complex_rope(kernel, original):
    """0.3.x ComplexRoPE.apply_rotary_emb (computed in fp32)."""

    def apply_rotary_emb(query, key, rope_cache):
        cos, sin = _complex_cos_sin(rope_cache)
        return (
            kernel(query.float(), cos, sin, True).type_as(query),
            kernel(key.float(), cos, sin, True).type_as(key),
        )

    return {"apply_rotary_emb": staticmethod(apply_rotary_emb)}


def _cos_sin_rope(kernel, original):
    """0.3.x CosSinRoPE.apply_rotary_emb (computed in fp32)."""

    def apply_rotary_emb(query, key, rope_cache):
        head_dim = query.shape[-1]
        cos, sin = rope_cache[..., :head_dim], rope_cache[..., head_dim:]
        return (
            kernel(query.float(), cos, sin, False).type_as(query),
            kernel(key.float(), cos, sin, False).type_as(key),
        )

    return {"apply_rotary_emb": staticmethod(apply_rotary_emb)}


def _model_function(model: str, build) -> Replacement:
    module = f"torchtitan.models.{model}.model.model"
    return Replacement(f"{module}:apply_rotary_emb", (model,), build, "Attention")


_ROPE_03 = "torchtitan.models.common.rope"
register(
    Converter(
        name="rope",
        description="rotary position embedding of queries and keys",
        kernel="rotary",
        npu_ops=("npu_rotary_mul",),
        native="real-arithmetic rotation (x*cos + rotate(x)*sin)",
        replacements={
            TRAINSPEC: (
                _model_function("llama3", _llama3_rope),
                _model_function("qwen3", _qwen3_rope),
                _model_function("deepseek_v3", _deepseek_v3_rope),
            ),
            CONFIG_REGISTRY: (
                Replacement(f"{_ROPE_03}:ComplexRoPE", MODELS, _complex_rope),
                Replacement(f"{_ROPE_03}:CosSinRoPE", MODELS, _cos_sin_rope),
            ),
        },
        notes=(
            "TrainSpec era: the model module's apply_rotary_emb function is "
            "replaced process-wide (upstream calls it by name).",
        ),
    )
)


# attention -----------------------------------------------------------------------

# The dense form of the last BlockMask seen: every layer of a step shares one.
_dense: tuple = (None, None)


def dense_mask(block_mask) -> torch.Tensor:
    """A BlockMask as a boolean (batch, heads, q, kv) tensor, True = attend."""
    global _dense
    if _dense[0] is not block_mask:
        from torch.nn.attention.flex_attention import create_mask

        batch, heads = block_mask.kv_num_blocks.shape[:2]
        q_len, kv_len = block_mask.seq_lengths
        mask = create_mask(
            block_mask.mask_mod,
            batch,
            heads,
            q_len,
            kv_len,
            device=block_mask.kv_num_blocks.device,
        )
        _dense = (block_mask, mask)
    return _dense[1]


_SUPPORTED_KWARGS = {
    "block_mask",
    "attention_masks",
    "scale",
    "enable_gqa",
    "is_causal",
}


def _unsupported(kwargs) -> bool:
    """score_mod, lse outputs, non-causal SDPA: left to the upstream module."""
    extra = {k for k, v in kwargs.items() if v and k not in _SUPPORTED_KWARGS}
    return bool(extra) or kwargs.get("is_causal", True) is False


def _attention_bnsd(kernel, original):
    """0.2.x wrappers: (batch, heads, seq, head_dim) in and out."""

    def forward(self, q, k, v, **kwargs):
        if _unsupported(kwargs):
            return original.forward(self, q, k, v, **kwargs)
        block_mask = kwargs.get("block_mask")
        mask = None if block_mask is None else dense_mask(block_mask)
        scale, enable_gqa = kwargs.get("scale"), kwargs.get("enable_gqa", False)
        return kernel(q, k, v, mask=mask, scale=scale, enable_gqa=enable_gqa)

    return {"forward": forward}


def _attention_blnh(kernel, original):
    """0.3.x FlexAttention: (batch, seq, heads, head_dim) in and out."""

    def forward(self, q_BLNH, k_BLNH, v_BLNH, **kwargs):
        if _unsupported(kwargs):
            return original.forward(self, q_BLNH, k_BLNH, v_BLNH, **kwargs)
        mask = dense_mask(kwargs["attention_masks"])
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        out = kernel(
            q,
            k,
            v,
            mask=mask,
            scale=kwargs.get("scale"),
            enable_gqa=kwargs.get("enable_gqa", False),
        )
        return out.transpose(1, 2)

    return {"forward": forward}


_ATTENTION_02 = "torchtitan.models.attention"
register(
    Converter(
        name="attention",
        description="the inner attention (SDPA or FlexAttention with its mask)",
        kernel="attention",
        npu_ops=("npu_fusion_attention",),
        native="torch.nn.functional.scaled_dot_product_attention",
        replacements={
            TRAINSPEC: (
                Replacement(
                    f"{_ATTENTION_02}:ScaledDotProductAttentionWrapper",
                    MODELS,
                    _attention_bnsd,
                ),
                Replacement(
                    f"{_ATTENTION_02}:FlexAttentionWrapper", MODELS, _attention_bnsd
                ),
            ),
            CONFIG_REGISTRY: (
                Replacement(
                    "torchtitan.models.common.attention:FlexAttention",
                    MODELS,
                    _attention_blnh,
                ),
            ),
        },
        context_parallel=False,
        notes=(
            "A FlexAttention mask is materialized once per step as a dense "
            "boolean mask (batch x seq x seq); score_mod and lse outputs stay "
            "on upstream's path.",
        ),
    )
)


# swiglu --------------------------------------------------------------------------


def _swiglu(kernel, original):
    def forward(self, x):
        return self.w2(kernel(self.w1(x), self.w3(x)))

    return {"forward": forward}


register(
    Converter(
        name="swiglu",
        description="SwiGLU feed-forward activation silu(w1 x) * w3 x",
        kernel="swiglu",
        npu_ops=("npu_swiglu",),
        native="silu(gate) * up",
        replacements={
            TRAINSPEC: (
                Replacement(
                    "torchtitan.models.llama3.model.model:FeedForward",
                    ("llama3",),
                    _swiglu,
                ),
                Replacement(
                    "torchtitan.models.qwen3.model.model:FeedForward",
                    ("qwen3",),
                    _swiglu,
                ),
                Replacement(
                    "torchtitan.models.moe.moe:FeedForward", MOE_MODELS, _swiglu
                ),
            ),
            CONFIG_REGISTRY: (
                Replacement(
                    "torchtitan.models.common.feed_forward:FeedForward",
                    MODELS,
                    _swiglu,
                ),
            ),
        },
    )
)


# grouped_mm ----------------------------------------------------------------------


def _grouped_experts_02(kernel, original):
    """0.2.x GroupedExperts.forward, in the parameters' dtype."""

    def forward(self, x, num_tokens_per_expert):
        w1, w2, w3 = (
            w.to_local() if isinstance(w, DTensor) else w
            for w in (self.w1, self.w2, self.w3)
        )
        offs = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
        h = torch.nn.functional.silu(kernel(x, w1.transpose(-2, -1), offs))
        h = h * kernel(x, w3.transpose(-2, -1), offs)
        return kernel(h, w2.transpose(-2, -1), offs)

    return {"forward": forward}


def _grouped_experts_03(kernel, original):
    """0.3.x GroupedExperts._grouped_mm: upstream's own seam for the GEMM."""

    def _grouped_mm(self, *, A, B_t, offs):
        return kernel(A, B_t, offs)

    return {"_grouped_mm": _grouped_mm}


register(
    Converter(
        name="grouped_mm",
        description="MoE routed experts' grouped GEMMs",
        kernel="grouped_mm",
        npu_ops=("npu_grouped_matmul",),
        native="torch._grouped_mm where the device has it, else a per-expert loop",
        replacements={
            TRAINSPEC: (
                Replacement(
                    "torchtitan.models.moe.moe:GroupedExperts",
                    MOE_MODELS,
                    _grouped_experts_02,
                ),
            ),
            CONFIG_REGISTRY: (
                Replacement(
                    "torchtitan.models.common.moe:GroupedExperts",
                    MOE_MODELS,
                    _grouped_experts_03,
                ),
            ),
        },
        notes=(
            "TrainSpec era: experts compute in the parameters' dtype (upstream's "
            "grouped path casts to bf16); 0.3.x keeps upstream's bf16 casts.",
        ),
    )
)


# token_permute ------------------------------------------------------------------


@dataclass(frozen=True)
class PermuteMetadata:
    """What ``combine`` needs from ``dispatch``: each route's row, its score."""

    rows_N: torch.Tensor  # noqa: N815
    topk_scores_TK: torch.Tensor  # noqa: N815


def _token_dispatcher_03(kernel, original):
    """0.3.x token dispatchers without expert parallelism (``ep_mesh`` unset):
    dispatch and combine. With an EP mesh, upstream's all-to-all path runs."""

    def dispatch(
        self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E
    ):
        if getattr(self, "ep_mesh", None) is not None:
            return original.dispatch(
                self,
                x_TD,
                topk_scores_TK,
                topk_expert_ids_TK,
                num_local_tokens_per_expert_E,
            )
        routed_input_RD, rows_N = kernel.permute(x_TD, topk_expert_ids_TK)
        metadata = PermuteMetadata(rows_N=rows_N, topk_scores_TK=topk_scores_TK)
        return routed_input_RD, num_local_tokens_per_expert_E, metadata

    def combine(self, routed_output_RD, metadata, x_TD):
        if not isinstance(metadata, PermuteMetadata):
            return original.combine(self, routed_output_RD, metadata, x_TD)
        return kernel.unpermute(
            routed_output_RD, metadata.rows_N, metadata.topk_scores_TK
        )

    return {"dispatch": dispatch, "combine": combine}


def _dispatcher(name: str) -> Replacement:
    module = "torchtitan.models.common.token_dispatcher"
    return Replacement(f"{module}:{name}", MOE_MODELS, _token_dispatcher_03)


register(
    Converter(
        name="token_permute",
        description="MoE token dispatch/combine: grouping by expert and back",
        kernel="token_permute",
        npu_ops=("npu_moe_token_permute", "npu_moe_token_unpermute"),
        native="stable argsort + indexing; gather + weighted sum",
        replacements={
            CONFIG_REGISTRY: (
                _dispatcher("LocalTokenDispatcher"),
                _dispatcher("AllToAllTokenDispatcher"),  # the default; EP=1 is local
            ),
        },
        notes=(
            "0.3.x only: 0.2.x permutes inside MoE.forward, with no seam to swap.",
            "With expert parallelism, upstream's all-to-all dispatch runs unchanged.",
        ),
    )
)
