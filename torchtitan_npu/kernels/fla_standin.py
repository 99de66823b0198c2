"""A stand-in for flash-linear-attention (``fla``) where it is not installed.

Upstream's Qwen3.5 (``torchtitan.models.qwen3_5.model``) imports fla's
Triton kernels at module level: without fla the model does not even import,
and fla's kernels run on CUDA only. While the overlay is active and no real
``fla`` is installed, an import finder placed last on ``sys.meta_path``
answers for exactly the fla names upstream imports, with the PyTorch gated
delta rule of ``kernels/gated_delta.py`` and a reference causal conv behind
them. A real fla, when installed, always wins (the finder is asked last).

The ``depend`` records of ``overlay/config_registry.py`` pin upstream's call
sites, so a change in how upstream calls fla is caught before step 1.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from torchtitan_npu.kernels import gated_delta

logger = logging.getLogger("torchtitan_npu")
STANDIN = "__titan_npu_standin__"


def _recomputed(name: str, fn: Callable[..., tuple[Any, ...]]) -> type:
    """An autograd.Function running ``fn`` without keeping its graph: the
    backward recomputes it from the saved inputs (fla's kernels keep only
    their inputs too). ``fn`` returns a tuple of tensors or Nones."""

    def forward(ctx, *args):
        ctx.args = args
        ctx.save_for_backward(*(a for a in args if isinstance(a, torch.Tensor)))
        return fn(*args)  # autograd records nothing inside a Function's forward

    def backward(ctx, *grads):
        saved = iter(ctx.saved_tensors)
        args = [
            next(saved).detach().requires_grad_(ctx.needs_input_grad[i])
            if isinstance(a, torch.Tensor)
            else a
            for i, a in enumerate(ctx.args)
        ]
        with torch.enable_grad():
            outputs = fn(*args)
        pairs = [
            (o, g)
            for o, g in zip(outputs, grads)
            if o is not None and g is not None and o.requires_grad
        ]
        wanted = [a for i, a in enumerate(args) if ctx.needs_input_grad[i]]
        found = iter(
            torch.autograd.grad(
                [o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True
            )
            if pairs and wanted
            else [None] * len(wanted)
        )
        return tuple(
            next(found) if ctx.needs_input_grad[i] else None for i in range(len(args))
        )

    namespace = {"forward": staticmethod(forward), "backward": staticmethod(backward)}
    return type(name, (torch.autograd.Function,), namespace)


def _once_per_process() -> None:
    if not getattr(_once_per_process, "done", False):
        _once_per_process.done = True  # pyrefly: ignore [missing-attribute]
        logger.info(
            "Qwen3.5 linear attention: titan-npu's PyTorch gated delta rule "
            "(flash-linear-attention is not installed; on CUDA `pip install "
            "flash-linear-attention` gives its Triton kernels)"
        )


def _delta_rule(rule: Callable[..., Any]) -> Callable[..., tuple[Any, ...]]:
    def run(q, k, v, g, beta, scale, initial_state, cu_seqlens, l2norm, final):
        if q.shape[2] != v.shape[2]:  # fla's grouped values: a q/k head per group
            group = v.shape[2] // q.shape[2]
            q, k = (x.repeat_interleave(group, dim=2) for x in (q, k))
        out, state = rule(
            q, k, v, g, beta, scale=scale, initial_state=initial_state,
            cu_seqlens=cu_seqlens, use_qk_l2norm=l2norm,
        )  # fmt: skip
        return out, state if final else None

    return run


ChunkGatedDeltaRuleFunction = _recomputed(
    "ChunkGatedDeltaRuleFunction", _delta_rule(gated_delta.chunked)
)
FusedRecurrentFunction = _recomputed(
    "FusedRecurrentFunction", _delta_rule(gated_delta.recurrent)
)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's chunked gated delta rule: (outputs, final state or None)."""
    _once_per_process()
    bounds = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens
    return ChunkGatedDeltaRuleFunction.apply(
        q, k, v, g, beta, scale, initial_state, bounds,
        use_qk_l2norm_in_kernel, output_final_state,
    )  # fmt: skip


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's token-by-token gated delta rule (beta defaults to ones)."""
    _once_per_process()
    beta = torch.ones_like(g) if beta is None else beta
    return FusedRecurrentFunction.apply(
        q, k, v, g, beta, scale, initial_state, cu_seqlens,
        use_qk_l2norm_in_kernel, output_final_state,
    )  # fmt: skip


def _conv(x, weight, bias, activation, cu_seqlens):
    """Depthwise causal conv of x [B, T, D] with weight [D, W], restarting at
    every document boundary of ``cu_seqlens``."""
    width = weight.shape[-1]
    pieces = []
    for start, end in gated_delta.segments(x.shape[1], cu_seqlens):
        piece = F.pad(x[:, start:end].transpose(1, 2), [width - 1, 0])
        pieces.append(F.conv1d(piece, weight[:, None], bias, groups=weight.shape[0]))
    out = torch.cat(pieces, dim=-1).transpose(1, 2)
    if activation in ("silu", "swish"):
        out = F.silu(out)
    elif activation is not None:
        raise RuntimeError(f"causal_conv1d activation {activation!r}: silu or None")
    return (out,)


CausalConv1dFunction = _recomputed("CausalConv1dFunction", _conv)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    backend: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> tuple[torch.Tensor, None]:
    """fla's causal conv (any backend name: there is one): (output, None)."""
    bounds = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens
    (out,) = CausalConv1dFunction.apply(x, weight, bias, activation, bounds)
    return out, None


# The fla modules upstream imports and what each must hold.
MODULES: dict[str, dict[str, Any]] = {
    "fla": {},
    "fla.ops": {},
    "fla.ops.gated_delta_rule": {
        "chunk_gated_delta_rule": chunk_gated_delta_rule,
        "fused_recurrent_gated_delta_rule": fused_recurrent_gated_delta_rule,
    },
    "fla.ops.gated_delta_rule.chunk": {
        "ChunkGatedDeltaRuleFunction": ChunkGatedDeltaRuleFunction,
        "chunk_gated_delta_rule": chunk_gated_delta_rule,
    },
    "fla.ops.gated_delta_rule.fused_recurrent": {
        "FusedRecurrentFunction": FusedRecurrentFunction,
        "fused_recurrent_gated_delta_rule": fused_recurrent_gated_delta_rule,
    },
    "fla.modules": {},
    "fla.modules.conv": {},
    "fla.modules.conv.causal_conv1d": {"causal_conv1d": causal_conv1d},
    "fla.modules.conv.triton": {},
    "fla.modules.conv.triton.ops": {"CausalConv1dFunction": CausalConv1dFunction},
}


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname not in MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module: types.ModuleType) -> None:
        module.__dict__.update(MODULES[module.__name__])
        module.__path__ = []
        setattr(module, STANDIN, True)


_FINDER = _Finder()


def install() -> bool:
    """Answer for fla's names while no real fla is installed; True if it does."""
    if _FINDER in sys.meta_path:
        return True
    if importlib.machinery.PathFinder.find_spec("fla") is not None:
        return False  # a real fla: upstream gets its kernels
    sys.meta_path.append(_FINDER)
    return True


def uninstall() -> None:
    """Remove the finder and any stand-in modules already imported."""
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    for name in [n for n, m in sys.modules.items() if getattr(m, STANDIN, False)]:
        del sys.modules[name]
