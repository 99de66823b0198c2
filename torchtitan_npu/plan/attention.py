"""Attention as the planned device runs it.

Planning happens on CPU, where flex attention runs eagerly and keeps the
whole score matrix for backward. NPU and CUDA run it fused (compiled flex,
npu_fusion_attention): forward keeps only its inputs, output and
log-sum-exp; backward makes the three input gradients.
``fused_flex_attention`` puts that memory behaviour in flex attention's place
(and ``fused_varlen_attention`` in 0.3's varlen attention's) while a plan for
such a device is computed (shapes only: it is never used to train).

Varlen attention's document boundaries are read from the batch's positions
as values; a plan's batch is one document per row, so they are computed from
the positions' shape (``document_per_row``, record ``plan_varlen_metadata``).
"""

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class FusedAttentionMemory(torch.autograd.Function):
    """A fused attention kernel's tensors, without its arithmetic."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def fused_flex_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *args: Any,
    return_lse: bool = False,
    return_aux: Any = None,
    **kwargs: Any,
) -> Any:
    """flex_attention's signature and results, FusedAttentionMemory's memory."""
    from torch.nn.attention.flex_attention import AuxOutput

    out, lse = FusedAttentionMemory.apply(query, key, value)
    if return_aux is not None:
        return out, AuxOutput(lse=lse if return_aux.lse else None)
    return (out, lse) if return_lse else out


def fused_varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *args: Any,
    return_aux: Any = None,
    **kwargs: Any,
) -> Any:
    """varlen_attn's signature and results, FusedAttentionMemory's memory."""
    out, lse = FusedAttentionMemory.apply(query, key, value)
    return (out, lse) if getattr(return_aux, "lse", False) else out


def document_per_row(create: Any) -> Any:
    """0.3's ``create_varlen_metadata_for_document`` for fake positions of a
    plan's batch (one document per row, which the plan makes): computed on
    real positions of that shape, as fake ones have no values to find the
    documents in (``nonzero``)."""
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

    def planned(positions: torch.Tensor, **kwargs: Any) -> Any:
        if not isinstance(positions, FakeTensor):
            return create(positions, **kwargs)
        rows, length = positions.shape
        with unset_fake_temporarily():
            return create(torch.arange(length).expand(rows, length), **kwargs)

    return planned


@contextlib.contextmanager
def attention_for(device_type: str) -> Iterator[None]:
    """Flex and varlen attention as ``device_type`` runs them, for the
    duration of a plan: eager (flex uncompiled: torch.compile refuses to
    trace under the memory tracker) on CPU, fused elsewhere."""
    from torch.nn.attention import flex_attention as module

    saved = [(module, name, getattr(module, name)) for name in _NAMES]
    setattr(module, _UNCOMPILED, True)
    if device_type != "cpu":
        module.flex_attention = fused_flex_attention
        varlen = _varlen_module()
        if varlen is not None:
            saved.append((varlen, "varlen_attn", varlen.varlen_attn))
            varlen.varlen_attn = fused_varlen_attention
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def _varlen_module() -> Any:
    """The module whose ``varlen_attn`` upstream's varlen attention calls
    (0.3.x; None before)."""
    try:
        from torchtitan.models.common import attention
    except ImportError:
        return None
    return attention if hasattr(attention, "varlen_attn") else None


_UNCOMPILED = "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG"  # torch calls the op as is
_NAMES = (_UNCOMPILED, "flex_attention")
