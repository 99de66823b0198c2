"""torch's flash-only ``varlen_attn`` as plain tensor math, for devices
without a flash kernel (record ``varlen_attention_reference``)."""

from typing import Any

import torch


def varlen_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    *,
    return_aux: Any = None,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    **unused: Any,
) -> Any:
    """torch's ``varlen_attn`` (flash-only) as plain tensor math: packed
    sequences (T, N, H) whose boundaries are ``cu_seq_q``, each attending
    within itself (``window_size`` = (left, right), -1 unbounded), scores in
    float32; returns (out (T, N, H) in the query's dtype[, lse (N, T)])."""
    shared = cu_seq_k is None or cu_seq_k is cu_seq_q  # upstream passes one tensor
    if not shared and not torch.equal(cu_seq_q, cu_seq_k):
        raise NotImplementedError("varlen reference: queries and keys share lengths")
    if enable_gqa and key.shape[1] != query.shape[1]:
        group = query.shape[1] // key.shape[1]
        key, value = (t.repeat_interleave(group, dim=1) for t in (key, value))
    tokens = query.shape[0]
    position = torch.arange(tokens, device=query.device)
    sequence = torch.bucketize(position, cu_seq_q[1:].to(position), right=True)
    allowed = sequence[:, None] == sequence[None, :]
    left, right = window_size
    offset = position[None, :] - position[:, None]  # key - query
    if left >= 0:
        allowed &= offset >= -left
    if right >= 0:
        allowed &= offset <= right
    q, k, v = (t.float().transpose(0, 1) for t in (query, key, value))  # N, T, H
    scores = q @ k.transpose(1, 2) * (scale or query.shape[-1] ** -0.5)
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # N, T
    out = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).to(query.dtype)
    if return_aux is not None and getattr(return_aux, "lse", False):
        return out, lse
    return out
