"""attention(q, k, v, *, mask, scale, enable_gqa): the inner attention.

q, k, v: (batch, heads, seq, head_dim). mask None = causal, else a boolean
(batch or 1, 1, seq_q, seq_kv) tensor, True where a query may attend.
"""

import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F

from torchtitan_npu.compat.era import Era
from torchtitan_npu.converters.kernels import Kernel, npu_kernel, torch_npu
from torchtitan_npu.converters.ops.common import DECODERS_03, MODELS
from torchtitan_npu.converters.registry import Converter, Replacement, register


def native(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    scale: float | None,
    enable_gqa: bool,
) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=enable_gqa,
    )


# npu_fusion_attention's causal mode (sparse_mode 3) takes this fixed
# 2048 x 2048 upper-triangular mask whatever the sequence length.
_NPU_CAUSAL_MASK_SIZE = 2048


@functools.cache
def _npu_causal_mask(device: torch.device) -> torch.Tensor:
    ones = torch.ones(_NPU_CAUSAL_MASK_SIZE, _NPU_CAUSAL_MASK_SIZE, device=device)
    return torch.triu(ones, diagonal=1).bool()


@npu_kernel(native)
def npu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    scale: float | None,
    enable_gqa: bool,
) -> torch.Tensor:
    if mask is None:
        atten_mask, sparse_mode = _npu_causal_mask(q.device), 3
    else:  # torch_npu masks out where True
        atten_mask, sparse_mode = ~mask, 0
    return torch_npu().npu_fusion_attention(
        q,
        k,
        v,
        q.shape[1],
        "BNSD",
        atten_mask=atten_mask,
        scale=q.shape[-1] ** -0.5 if scale is None else scale,
        keep_prob=1.0,
        sparse_mode=sparse_mode,
    )[0]


# The dense form of the last BlockMask seen: every layer of a step shares one.
_dense: tuple = (None, None)


def dense_mask(block_mask: Any) -> torch.Tensor:
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
    """0.3-era FlexAttention: (batch, seq, heads, head_dim) in and out (0.3.0),
    or one packed row, (tokens, heads, head_dim) (upstream main). The
    replacement keeps upstream's argument names: its local_map reads them."""

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

    def forward_packed(self, q_TNH, k_TNH, v_TNH, **kwargs):
        if _unsupported(kwargs):
            return original.forward(self, q_TNH, k_TNH, v_TNH, **kwargs)
        q, k, v = (t.unsqueeze(0) for t in (q_TNH, k_TNH, v_TNH))
        return forward(self, q, k, v, **kwargs).squeeze(0)

    packed = "q_TNH" in inspect.signature(original.forward).parameters
    return {"forward": forward_packed if packed else forward}


_ATTENTION_02 = "torchtitan.models.attention"
CONVERTER = register(
    Converter(
        name="attention",
        description="the inner attention (SDPA or FlexAttention with its mask)",
        kernel=Kernel(native, npu),
        npu_ops=("npu_fusion_attention",),
        native="torch.nn.functional.scaled_dot_product_attention",
        replacements={
            Era.TRAINSPEC: (
                Replacement(
                    f"{_ATTENTION_02}:ScaledDotProductAttentionWrapper",
                    MODELS,
                    _attention_bnsd,
                ),
                Replacement(
                    f"{_ATTENTION_02}:FlexAttentionWrapper", MODELS, _attention_bnsd
                ),
            ),
            Era.CONFIG_REGISTRY: (
                Replacement(
                    "torchtitan.models.common.attention:FlexAttention",
                    DECODERS_03,
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
