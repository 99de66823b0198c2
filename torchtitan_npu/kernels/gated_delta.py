"""PyTorch-native gated delta rule: the linear-attention layers of Qwen3.5
(upstream's ``GatedDeltaKernel``) without flash-linear-attention (``fla``,
Triton kernels: CUDA only).

Shapes follow fla: ``q, k: [B, T, H, K]``, ``v: [B, T, H, V]``, the log
decay ``g`` and the write strength ``beta``: ``[B, T, H]``; the state of a
head is ``S: [K, V]``. Each step decays the state, corrects what it holds
for the key by ``beta`` towards the value (the delta rule), and reads it
with the query:

    S_t = exp(g_t) S_{t-1} + k_t u_t^T,  u_t = beta_t (v_t - (exp(g_t) S_{t-1})^T k_t)
    o_t = S_t^T q_t

``recurrent`` runs that loop token by token (the reference the chunked form
is checked against; fla's ``fused_recurrent`` semantics). ``chunked`` gives
the same outputs a chunk of C tokens at a time: inside a chunk the updates
are a unit lower-triangular system (solved once per chunk), so the
sequential part is T / C state updates instead of T.

With ``cu_seqlens`` (packed documents, B = 1) the state restarts at every
document boundary. Computation is in float32; outputs take v's dtype.
"""

import torch
import torch.nn.functional as F

CHUNK = 64


def _prepare(q, k, v, g, beta, scale, l2norm):
    if l2norm:
        q, k = F.normalize(q.float(), dim=-1), F.normalize(k.float(), dim=-1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    # [B, T, H, X] -> [B, H, T, X]: one (batch, head) pair per leading index
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))
    g, beta = (x.float().transpose(1, 2) for x in (g, beta))
    return q * scale, k, v, g, beta


def segments(length: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int]]:
    """Each document's (start, end) in a packed sequence of ``length``. Fake
    offsets (a memory plan's: no values) are the plan's batch: documents of
    equal length, one per row."""
    from torch._subclasses.fake_tensor import FakeTensor

    if cu_seqlens is None:
        return [(0, length)]
    if isinstance(cu_seqlens, FakeTensor):
        documents = cu_seqlens.numel() - 1
        bounds = [length * i // documents for i in range(documents + 1)]
    else:
        bounds = [int(b) for b in cu_seqlens.tolist()]
    return list(zip(bounds[:-1], bounds[1:]))


def _initial(q, v, initial_state):
    B, H, _, K = q.shape
    if initial_state is None:
        return q.new_zeros(B, H, K, v.shape[-1])
    return initial_state.float()


def _recurrent_segment(q, k, v, g, beta, state):
    outputs = []
    for t in range(q.shape[2]):
        state = state * g[:, :, t, None, None].exp()
        read = (state * k[:, :, t, :, None]).sum(-2)  # S^T k: [B, H, V]
        u = beta[:, :, t, None] * (v[:, :, t] - read)
        state = state + k[:, :, t, :, None] * u[:, :, None, :]
        outputs.append((state * q[:, :, t, :, None]).sum(-2))
    return torch.stack(outputs, dim=2), state


def _chunked_segment(q, k, v, g, beta, state, chunk):
    length = q.shape[2]
    pad = -length % chunk
    if pad:  # padded tokens: no decay (g 0), no write (beta 0), no read (q 0)
        q, k, v, g, beta = (
            F.pad(x, (0, 0, 0, pad) if x.dim() == 4 else (0, pad))
            for x in (q, k, v, g, beta)
        )
    B, H, T, K = q.shape
    n = T // chunk
    q, k, v = (x.reshape(B, H, n, chunk, -1) for x in (q, k, v))
    g, beta = (x.reshape(B, H, n, chunk) for x in (g, beta))
    G = g.cumsum(-1)  # decay from the chunk's start through each token
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # exp(G_i - G_j) for j <= i (<= 1: g is a log decay), 0 above the diagonal
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf"))
    decay = decay.exp()
    k_beta = k * beta[..., None]
    # (I + L) u = beta v - beta exp(G) K S0,
    # L[i, j] = beta_i exp(G_i - G_j) k_i.k_j for j < i
    system = (k_beta @ k.transpose(-1, -2)) * decay
    system = system.masked_fill(~lower.tril(-1), 0) + torch.eye(chunk, device=q.device)
    solve = torch.linalg.solve_triangular
    U = solve(system, v * beta[..., None], upper=False, unitriangular=True)
    W = solve(system, k_beta * G[..., None].exp(), upper=False, unitriangular=True)
    inner = (q @ k.transpose(-1, -2)) * decay  # q_i.k_j e^{G_i-G_j}, j <= i
    outputs = []
    for c in range(n):
        u = U[:, :, c] - W[:, :, c] @ state
        outputs.append(
            (q[:, :, c] * G[:, :, c, :, None].exp()) @ state + inner[:, :, c] @ u
        )
        last = G[:, :, c, -1, None, None]
        keys = k[:, :, c] * (last - G[:, :, c, :, None]).exp()
        state = state * last.exp() + keys.transpose(-1, -2) @ u
    out = torch.stack(outputs, dim=2).reshape(B, H, T, -1)
    return out[:, :, :length], state


def _run(segment_fn, q, k, v, g, beta, scale, initial_state, cu_seqlens, l2norm):
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, l2norm)
    outputs, states = [], []
    for index, (start, end) in enumerate(segments(q.shape[2], cu_seqlens)):
        state = _initial(q, v, initial_state)
        if cu_seqlens is not None and initial_state is not None:
            state = state[index : index + 1]
        piece = slice(start, end)
        out, state = segment_fn(
            q[:, :, piece], k[:, :, piece], v[:, :, piece],
            g[:, :, piece], beta[:, :, piece], state,
        )  # fmt: skip
        outputs.append(out)
        states.append(state)
    out = torch.cat(outputs, dim=2).transpose(1, 2).to(dtype)
    return out, torch.cat(states, dim=0)


def recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(outputs [B, T, H, V], final states [N, H, K, V]), token by token."""
    return _run(
        _recurrent_segment, q, k, v, g, beta, scale, initial_state, cu_seqlens,
        use_qk_l2norm,
    )  # fmt: skip


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``recurrent``'s result, ``chunk`` tokens at a time."""

    def segment(q, k, v, g, beta, state):
        return _chunked_segment(q, k, v, g, beta, state, chunk)

    return _run(
        segment, q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm
    )
