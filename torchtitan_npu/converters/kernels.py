"""The kernels behind the converters: torch_npu on npu, PyTorch-native elsewhere.

Every kernel has one signature on every device; ``KERNELS[name][impl]`` holds
the ``"npu"`` and ``"native"`` implementations and ``impl_for(device_type)``
says which one a device uses. The native ones are the references the tests
compare against; the npu ones call torch_npu and run only on Ascend.

Activations that are DTensors (tensor/sequence parallel) take the native path
even on npu: torch_npu's fused ops have no DTensor sharding rules.
"""

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor


def impl_for(device_type: str) -> str:
    return "npu" if device_type == "npu" else "native"


def _torch_npu():
    import torch_npu

    return torch_npu


def _npu(native: Callable) -> Callable:
    """An npu kernel that falls back to ``native`` for DTensor arguments."""

    def decorator(kernel: Callable) -> Callable:
        @functools.wraps(kernel)
        def dispatch(*args, **kwargs):
            if any(isinstance(a, DTensor) for a in (*args, *kwargs.values())):
                return native(*args, **kwargs)
            return kernel(*args, **kwargs)

        return dispatch

    return decorator


# rms_norm(x, normalized_shape, weight, eps) -------------------------------------


def rms_norm_native(x, normalized_shape, weight, eps):
    return F.rms_norm(x, normalized_shape, weight, eps)


@_npu(rms_norm_native)
def rms_norm_npu(x, normalized_shape, weight, eps):
    if weight is None:
        weight = x.new_ones(normalized_shape)
    if eps is None:  # nn.RMSNorm's default: the dtype's machine epsilon
        eps = torch.finfo(x.dtype).eps
    return _torch_npu().npu_rms_norm(x, weight, epsilon=eps)[0]


# rotary(x, cos, sin, interleaved) -> x rotated -----------------------------------
# interleaved: pairs (x0, x1), (x2, x3)... (complex RoPE); else halves
# (x[:d/2], x[d/2:]) (rotate-half RoPE). cos and sin span the full head dim.


def _rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_native(x, cos, sin, interleaved):
    return x * cos + _rotate(x, interleaved) * sin


@_npu(rotary_native)
def rotary_npu(x, cos, sin, interleaved):
    mode = "interleave" if interleaved else "half"
    return _torch_npu().npu_rotary_mul(x, cos, sin, rotary_mode=mode)


# attention(q, k, v, *, mask, scale, enable_gqa) ----------------------------------
# q, k, v: (batch, heads, seq, head_dim). mask None = causal, else a boolean
# (batch or 1, 1, seq_q, seq_kv) tensor, True where a query may attend.


def attention_native(q, k, v, *, mask, scale, enable_gqa):
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


@_npu(attention_native)
def attention_npu(q, k, v, *, mask, scale, enable_gqa):
    if mask is None:
        atten_mask, sparse_mode = _npu_causal_mask(q.device), 3
    else:  # torch_npu masks out where True
        atten_mask, sparse_mode = ~mask, 0
    return _torch_npu().npu_fusion_attention(
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


# swiglu(gate, up) = silu(gate) * up -----------------------------------------------


def swiglu_native(gate, up):
    return F.silu(gate) * up


@_npu(swiglu_native)
def swiglu_npu(gate, up):
    return _torch_npu().npu_swiglu(torch.cat((gate, up), dim=-1), dim=-1)


# grouped_mm(a, b_t, offs): rows offs[e-1]:offs[e] of a times b_t[e] -------------
# a: (tokens, in), b_t: (experts, in, out), offs: int32 cumulative token counts.
# Rows after offs[-1] (alignment padding) come out zero.


@functools.cache
def _has_grouped_mm(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs for this device and dtype (probed once)."""
    try:
        a = torch.zeros(2, 8, device=device_type, dtype=dtype)
        b_t = torch.zeros(1, 8, 8, device=device_type, dtype=dtype)
        offs = torch.tensor([2], device=device_type, dtype=torch.int32)
        torch._grouped_mm(a, b_t, offs=offs)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def grouped_mm_loop(a, b_t, offs):
    """The reference: one matmul per expert."""
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    parts = [a[s:e] @ b_t[i] for i, (s, e) in enumerate(zip(starts, ends))]
    parts.append(a.new_zeros(a.shape[0] - ends[-1], b_t.shape[-1]))
    return torch.cat(parts)


def grouped_mm_native(a, b_t, offs):
    if _has_grouped_mm(a.device.type, a.dtype):
        return torch._grouped_mm(a, b_t, offs=offs)
    return grouped_mm_loop(a, b_t, offs)


@_npu(grouped_mm_native)
def grouped_mm_npu(a, b_t, offs):
    return _torch_npu().npu_grouped_matmul(
        [a],
        [b_t],
        group_list=offs.to(torch.int64),
        split_item=2,  # one output tensor for all groups
        group_type=0,  # groups split the rows of a
        group_list_type=0,  # group_list holds cumulative counts
    )[0]


# token_permute: MoE tokens grouped by expert, and back ----------------------------
# permute(tokens_TD, expert_ids_TK) -> (routed_ND, rows_N): the (token, k) routes
# grouped by expert (stable), and for each route (flattened T*K order) its row in
# routed_ND (int32). unpermute(routed_ND, rows_N, probs_TK) -> out_TD: each token's
# routed rows weighted by its routing probabilities and summed. The native pair
# reproduces upstream's dispatch/combine bit for bit (fp32 and bf16, CPU).


class TokenPermute(NamedTuple):
    permute: Callable
    unpermute: Callable


def permute_native(tokens, expert_ids):
    top_k = expert_ids.shape[-1] if expert_ids.dim() == 2 else 1
    order = torch.argsort(expert_ids.reshape(-1), stable=True)
    rows = torch.empty_like(order)
    rows[order] = torch.arange(order.numel(), device=order.device)
    # indexing, as upstream: its backward accumulates x's gradient the same way
    return tokens[order // top_k], rows.to(torch.int32)


def unpermute_native(routed, rows, probs):
    num_tokens, top_k = probs.shape
    # each token's routes in row (= expert) order: upstream's summation order
    token_rows, order = rows.view(num_tokens, top_k).sort(dim=1)
    per_token = routed.index_select(0, token_rows.reshape(-1))
    per_token = per_token.view(num_tokens, top_k, -1)
    # upstream's arithmetic: weights applied in fp32, then back to the dtype
    weights = probs.gather(1, order).unsqueeze(-1)
    weighted = (per_token.float() * weights).to(routed.dtype).float()
    out = weighted[:, 0]
    for k in range(1, top_k):  # fp32 accumulation, as upstream's scatter_add
        out = out + weighted[:, k]
    return out.to(routed.dtype)


@_npu(permute_native)
def permute_npu(tokens, expert_ids):
    return _torch_npu().npu_moe_token_permute(tokens, expert_ids)


@_npu(unpermute_native)
def unpermute_npu(routed, rows, probs):
    # the kernel weights in the tokens' dtype (bf16 on some CANN releases)
    return _torch_npu().npu_moe_token_unpermute(routed, rows, probs.to(routed.dtype))


KERNELS: dict[str, dict[str, Callable | TokenPermute]] = {
    "rms_norm": {"native": rms_norm_native, "npu": rms_norm_npu},
    "rotary": {"native": rotary_native, "npu": rotary_npu},
    "attention": {"native": attention_native, "npu": attention_npu},
    "swiglu": {"native": swiglu_native, "npu": swiglu_npu},
    "grouped_mm": {"native": grouped_mm_native, "npu": grouped_mm_npu},
    "token_permute": {
        "native": TokenPermute(permute_native, unpermute_native),
        "npu": TokenPermute(permute_npu, unpermute_npu),
    },
}
