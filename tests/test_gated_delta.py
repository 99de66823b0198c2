"""The PyTorch-native gated delta rule (overlay/gated_delta.py): the chunked
form equals the token-by-token recurrence, values and gradients, with and
without packed documents."""

import pytest
import torch
import torch.nn.functional as F

from torchtitan_npu.overlay import gated_delta

B, T, H, K, V = 2, 150, 3, 16, 8  # T: two full chunks of 64 and a partial one


def inputs(batch: int = B) -> list[torch.Tensor]:
    torch.manual_seed(0)
    q, k = torch.randn(batch, T, H, K), torch.randn(batch, T, H, K)
    v = torch.randn(batch, T, H, V)
    g = -F.softplus(torch.randn(batch, T, H))  # a log decay: <= 0
    beta = torch.rand(batch, T, H)
    return [x.double().requires_grad_() for x in (q, k, v, g, beta)]


def scale_of(x: torch.Tensor) -> float:
    return float(x.abs().max())


# float32 inside (q, k l2-normalized, as upstream calls it): agreement to a
# few float32 roundings of each tensor's scale
RTOL = 1e-5
NORM = {"use_qk_l2norm": True}


@pytest.mark.parametrize("chunk", [64, 32])
def test_chunked_is_the_recurrence(chunk):
    xs = inputs()
    want, want_state = gated_delta.recurrent(*xs, **NORM)
    got, state = gated_delta.chunked(*xs, **NORM, chunk=chunk)
    assert got.shape == (B, T, H, V) and state.shape == (B, H, K, V)
    assert (got - want).abs().max() <= RTOL * scale_of(want)
    assert (state - want_state).abs().max() <= RTOL * scale_of(want_state)
    grads = torch.autograd.grad((want.sum(), want_state.sum()), xs)
    chunk_grads = torch.autograd.grad((got.sum(), state.sum()), xs)
    for name, a, b in zip("q k v g beta".split(), grads, chunk_grads):
        assert (a - b).abs().max() <= RTOL * scale_of(a), name


def test_packed_documents_restart_the_state():
    xs = [x.detach()[:1].requires_grad_() for x in inputs()]
    bounds = [0, 40, 41, T]
    cu_seqlens = torch.tensor(bounds)
    packed, states = gated_delta.chunked(*xs, **NORM, cu_seqlens=cu_seqlens, chunk=16)
    assert states.shape == (3, H, K, V)
    for index, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        alone = [x[:, start:end] for x in xs]
        want, want_state = gated_delta.recurrent(*alone, **NORM)
        piece = packed[:, start:end]
        assert (piece - want).abs().max() <= RTOL * scale_of(want), (start, end)
        error = (states[index] - want_state[0]).abs().max()
        assert error <= RTOL * scale_of(want_state), (start, end)


def test_initial_state_carries_on():
    """Two halves, the second from the first's final state, are the whole."""
    xs = [x.detach() for x in inputs()]
    whole, _ = gated_delta.chunked(*xs, **NORM)
    first, state = gated_delta.chunked(*(x[:, :70] for x in xs), **NORM)
    rest = (x[:, 70:] for x in xs)
    second, _ = gated_delta.chunked(*rest, **NORM, initial_state=state)
    error = (torch.cat([first, second], 1) - whole).abs().max()
    assert error <= RTOL * scale_of(whole)


def test_outputs_take_the_values_dtype():
    xs = [x.detach().to(torch.bfloat16) for x in inputs()]
    out, state = gated_delta.chunked(*xs, **NORM)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
