"""Attention as the planned device runs it.

Planning happens on CPU, where flex attention runs eagerly and keeps the
whole score matrix for backward. NPU and CUDA run it fused (compiled flex,
npu_fusion_attention): forward keeps only its inputs, output and
log-sum-exp; backward makes the three input gradients.
``fused_flex_attention`` puts that memory behaviour in flex attention's place
(``fused_varlen_attention`` in 0.3's varlen attention's, ``device_sdpa`` in
SDPA's) while a plan for such a device is computed (shapes only: it is never
used to train). ``device_sdpa`` also lets context parallelism shard SDPA as
it does on the device: on CPU, SDPA runs a kernel that CP has no rule for.

Context parallelism shards flex attention's block mask per rank with a
compiled ``create_block_mask``, which torch.compile refuses to trace under
the memory tracker: a plan builds a block mask of its shapes instead (fake
tensors have no mask values to compute, and the attention's memory does not
depend on them), and a measurement builds the real one uncompiled
(``cp_block_mask``).

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


def device_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """scaled_dot_product_attention as a device runs it: aten's flash
    attention op (its shapes on fake tensors), which context parallelism
    shards; a mask or dropout takes SDPA's own path."""
    if attn_mask is not None or dropout_p:
        return _SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale)
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeats = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(repeats, dim=-3)
        value = value.repeat_interleave(repeats, dim=-3)
    flash = torch.ops.aten._scaled_dot_product_flash_attention
    return flash(query, key, value, 0.0, is_causal, False, scale=scale)[0]


_SDPA = torch.nn.functional.scaled_dot_product_attention


def document_per_row(create: Any) -> Any:
    """0.3's ``create_varlen_metadata_for_document`` for fake positions of a
    plan's batch: computed on real positions of that shape, one document per
    row (0.3.0's ``[rows, seq]``; main's packed ``[tokens]`` is one row), as
    fake ones have no values to find the documents in (``nonzero``). Varlen
    attention's memory does not depend on where documents start."""
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

    def planned(positions: torch.Tensor, **kwargs: Any) -> Any:
        if not isinstance(positions, FakeTensor):
            return create(positions, **kwargs)
        with unset_fake_temporarily():
            rows = torch.arange(positions.shape[-1]).expand(positions.shape)
            return create(rows, **kwargs)

    return planned


def cp_block_mask(
    mask_mod: Any,
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    device: str = "cpu",
    BLOCK_SIZE: int | tuple[int, int] = 128,
) -> Any:
    """``create_block_mask`` as context parallelism calls it compiled: on
    fake tensors a block mask of its shapes (every block computed), on real
    ones the real mask, uncompiled."""
    import math

    from torch._guards import active_fake_mode
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    if active_fake_mode() is None:
        return create_block_mask(
            mask_mod, B, H, Q_LEN, KV_LEN, device=device, BLOCK_SIZE=BLOCK_SIZE
        )
    q_size, kv_size = BLOCK_SIZE if isinstance(BLOCK_SIZE, tuple) else 2 * (BLOCK_SIZE,)
    rows, columns = math.ceil(Q_LEN / q_size), math.ceil(KV_LEN / kv_size)
    shape = (B or 1, H or 1, rows)
    counts = torch.full(shape, columns, dtype=torch.int32, device=device)
    indices = torch.arange(columns, dtype=torch.int32, device=device)
    return BlockMask.from_kv_blocks(
        counts,
        indices.expand(*shape, columns).contiguous(),
        BLOCK_SIZE=(q_size, kv_size),
        mask_mod=mask_mod,
        seq_lengths=(Q_LEN, KV_LEN),
    )


@contextlib.contextmanager
def attention_for(device_type: str) -> Iterator[None]:
    """Flex and varlen attention as ``device_type`` runs them, for the
    duration of a plan: eager (flex uncompiled: torch.compile refuses to
    trace under the memory tracker) on CPU, fused elsewhere (SDPA too); context
    parallelism's block masks uncompiled (``cp_block_mask``)."""
    from torch.distributed.tensor.experimental._context_parallel import (
        _attention as cp_attention,
    )
    from torch.nn.attention import flex_attention as module

    saved: list[tuple[Any, str, Any]] = [
        (module, name, getattr(module, name)) for name in _NAMES
    ]
    saved.append((cp_attention, _CP_MASK, getattr(cp_attention, _CP_MASK)))
    setattr(module, _UNCOMPILED, True)
    setattr(cp_attention, _CP_MASK, cp_block_mask)
    if device_type != "cpu":
        module.flex_attention = fused_flex_attention
        functional = torch.nn.functional
        saved.append((functional, "scaled_dot_product_attention", _SDPA))
        functional.scaled_dot_product_attention = device_sdpa
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
_CP_MASK = "_compiled_create_block_mask"  # built once, then called as is
