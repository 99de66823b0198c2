"""Attention as the planned device runs it.

Planning happens on CPU, where flex attention runs eagerly and keeps the
whole score matrix for backward. NPU and CUDA run it fused (compiled flex,
npu_fusion_attention): forward keeps only its inputs, output and
log-sum-exp; backward makes the three input gradients. ``fused_flex`` puts
that memory behaviour in flex attention's place while a plan for such a
device is computed (shapes only: it is never used to train).
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


@contextlib.contextmanager
def attention_for(device_type: str) -> Iterator[None]:
    """Flex attention as ``device_type`` runs it, for the duration of a plan:
    eager (uncompiled: torch.compile refuses to trace under the memory
    tracker) on CPU, fused elsewhere."""
    from torch.nn.attention import flex_attention as module

    saved = {name: getattr(module, name) for name in _NAMES}
    setattr(module, _UNCOMPILED, True)
    if device_type != "cpu":
        module.flex_attention = fused_flex_attention
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


_UNCOMPILED = "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG"  # torch calls the op as is
_NAMES = (_UNCOMPILED, "flex_attention")
