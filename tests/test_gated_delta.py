"""The PyTorch-native gated delta rule (kernels/gated_delta.py): the chunked
form equals the token-by-token recurrence, values and gradients, with and
without packed documents."""

import pytest
import torch
import torch.nn.functional as F

from torchtitan_npu.kernels import gated_delta

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


# The fla stand-in (kernels/fla_standin.py): what upstream's Qwen3.5 imports
# when flash-linear-attention is not installed.


def test_standin_kernels_recompute_what_autograd_would_keep():
    """The stand-in's autograd Functions keep only their inputs and recompute
    in backward: same outputs and gradients as autograd through the rule."""
    from torchtitan_npu.kernels import fla_standin

    xs = inputs()
    want, _ = gated_delta.chunked(*xs, **NORM)
    got, state = fla_standin.chunk_gated_delta_rule(*xs, use_qk_l2norm_in_kernel=True)
    assert state is None and torch.equal(got, want)
    grads = torch.autograd.grad(want.square().sum(), xs)
    standin_grads = torch.autograd.grad(got.square().sum(), xs)
    for name, a, b in zip("q k v g beta".split(), grads, standin_grads):
        assert torch.equal(a, b), name


def test_standin_serves_grouped_value_heads_as_fla_does():
    """fla (and transformers 5's Qwen3.5, which calls it so) takes fewer q/k
    heads than value heads: each q/k head serves consecutive value heads."""
    from torchtitan_npu.kernels import fla_standin

    q, k, v, g, beta = inputs()
    wide = [torch.cat([x, x.flip(-1)], dim=2).detach() for x in (v, g, beta)]
    got, _ = fla_standin.chunk_gated_delta_rule(q, k, *wide)
    repeated = (x.repeat_interleave(2, dim=2) for x in (q, k))
    want, _ = fla_standin.chunk_gated_delta_rule(*repeated, *wide)
    assert got.shape[2] == 2 * H and torch.equal(got, want)


def test_standin_causal_conv_restarts_at_each_document():
    """fla's varlen causal conv: upstream's own fixed-length depthwise conv
    (pad left, conv1d, silu) run on each packed document alone."""
    from torchtitan_npu.kernels import fla_standin

    torch.manual_seed(0)
    x, weight = torch.randn(1, 30, 6), torch.randn(6, 4)
    bounds = [0, 11, 12, 30]
    out, _ = fla_standin.causal_conv1d(
        x, weight, activation="silu", backend="triton", cu_seqlens=torch.tensor(bounds)
    )
    for start, end in zip(bounds[:-1], bounds[1:]):
        piece = F.pad(x[:, start:end].transpose(1, 2), [3, 0])
        want = F.silu(F.conv1d(piece, weight[:, None], groups=6)).transpose(1, 2)
        torch.testing.assert_close(out[:, start:end], want, rtol=0, atol=1e-6)


def test_standin_answers_only_while_no_real_fla_is_installed(tmp_path, monkeypatch):
    import importlib
    import sys

    from torchtitan_npu.kernels import fla_standin

    if importlib.machinery.PathFinder.find_spec("fla") is not None:
        pytest.skip("a real fla is installed here")
    active = fla_standin._FINDER in sys.meta_path  # an earlier test's overlay
    assert fla_standin.install()
    try:
        module = importlib.import_module("fla.ops.gated_delta_rule")
        assert module.chunk_gated_delta_rule is fla_standin.chunk_gated_delta_rule
        fla_standin.uninstall()
        assert "fla.ops.gated_delta_rule" not in sys.modules
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("fla")
        (tmp_path / "fla").mkdir()
        (tmp_path / "fla" / "__init__.py").write_text("")
        monkeypatch.syspath_prepend(str(tmp_path))
        assert not fla_standin.install()  # a real fla: upstream gets its kernels
    finally:
        monkeypatch.undo()
        sys.modules.pop("fla", None)
        fla_standin.install() if active else fla_standin.uninstall()
