"""rotary(x, cos, sin, interleaved) -> x rotated: RoPE of queries and keys.

interleaved: pairs (x0, x1), (x2, x3)... (complex RoPE); else halves
(x[:d/2], x[d/2:]) (rotate-half RoPE). cos and sin span the full head dim.
"""

import sys

import torch

from torchtitan_npu.compat.era import Era
from torchtitan_npu.converters.kernels import Kernel, npu_kernel, torch_npu
from torchtitan_npu.converters.ops.common import DECODERS_03, MODELS
from torchtitan_npu.converters.registry import Converter, Replacement, register


def _rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def native(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    return x * cos + _rotate(x, interleaved) * sin


@npu_kernel(native)
def npu(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    mode = "interleave" if interleaved else "half"
    return torch_npu().npu_rotary_mul(x, cos, sin, rotary_mode=mode)


def _complex_cos_sin(freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin over the full head dim, pairs interleaved, from complex cis values."""
    cos_sin = torch.view_as_real(freqs_cis).repeat_interleave(2, dim=-2)
    return cos_sin[..., 0], cos_sin[..., 1]


def _rope_args(positions) -> tuple:
    return () if positions is None else (positions,)  # 0.2.0 takes no positions


def _llama3_rope(kernel, original):
    """0.2.x llama3: complex RoPE on q and k (computed in fp32)."""
    model = sys.modules[original.__module__]

    def apply_rotary_emb(xq, xk, freqs_cis, positions=None):
        # reshape_for_broadcast reads only the complex view's shape: xq[..., ::2]
        freqs = model.reshape_for_broadcast(
            freqs_cis, xq[..., ::2], *_rope_args(positions)
        )
        cos, sin = _complex_cos_sin(freqs)
        return (
            kernel(xq.float(), cos, sin, True).type_as(xq),
            kernel(xk.float(), cos, sin, True).type_as(xk),
        )

    return apply_rotary_emb


def _deepseek_v3_rope(kernel, original):
    """0.2.x deepseek_v3: complex RoPE on one tensor (computed in fp32)."""
    model = sys.modules[original.__module__]

    def apply_rotary_emb(x, freqs_cis, positions=None):
        freqs = model.reshape_for_broadcast(
            freqs_cis, x[..., ::2], *_rope_args(positions)
        )
        cos, sin = _complex_cos_sin(freqs)
        return kernel(x.float(), cos, sin, True).to(x.dtype)

    return apply_rotary_emb


def _qwen3_rope(kernel, original):
    """0.2.x qwen3: rotate-half RoPE from a [cos | sin] cache, in the input dtype."""
    model = sys.modules[original.__module__]

    def apply_rotary_emb(xq, xk, rope_cache, positions=None):
        head_dim = xq.shape[-1]
        cache = model.reshape_for_broadcast(rope_cache, xq, *_rope_args(positions))
        cos = cache[..., :head_dim].to(dtype=xq.dtype, device=xq.device)
        sin = cache[..., head_dim:].to(dtype=xq.dtype, device=xq.device)
        return (
            kernel(xq, cos, sin, False).type_as(xq),
            kernel(xk, cos, sin, False).type_as(xk),
        )

    return apply_rotary_emb


def _complex_rope(kernel, original):
    """0.3.x ComplexRoPE.apply_rotary_emb (computed in fp32)."""

    def apply_rotary_emb(query, key, rope_cache):
        cos, sin = _complex_cos_sin(rope_cache)
        return (
            kernel(query.float(), cos, sin, True).type_as(query),
            kernel(key.float(), cos, sin, True).type_as(key),
        )

    return {"apply_rotary_emb": staticmethod(apply_rotary_emb)}


def _cos_sin_rope(kernel, original):
    """0.3.x CosSinRoPE.apply_rotary_emb (computed in fp32)."""

    def apply_rotary_emb(query, key, rope_cache):
        head_dim = query.shape[-1]
        cos, sin = rope_cache[..., :head_dim], rope_cache[..., head_dim:]
        return (
            kernel(query.float(), cos, sin, False).type_as(query),
            kernel(key.float(), cos, sin, False).type_as(key),
        )

    return {"apply_rotary_emb": staticmethod(apply_rotary_emb)}


def _model_function(model: str, build, since: str | None = None) -> Replacement:
    """0.2.x: the model module's apply_rotary_emb, called by Attention by name."""
    module = f"torchtitan.models.{model}.model.model"
    return Replacement(
        f"{module}:apply_rotary_emb",
        (model,),
        build,
        counted="Attention",
        depends=(f"{module}:reshape_for_broadcast",),
        since=since,
    )


_ROPE_03 = "torchtitan.models.common.rope"
CONVERTER = register(
    Converter(
        name="rope",
        description="rotary position embedding of queries and keys",
        kernel=Kernel(native, npu),
        npu_ops=("npu_rotary_mul",),
        native="real-arithmetic rotation (x*cos + rotate(x)*sin)",
        replacements={
            Era.TRAINSPEC: (
                _model_function("llama3", _llama3_rope),
                _model_function("qwen3", _qwen3_rope),
                # 0.2.0's deepseek_v3 has no reshape_for_broadcast (nor positions)
                _model_function("deepseek_v3", _deepseek_v3_rope, since="0.2.1"),
            ),
            Era.CONFIG_REGISTRY: (
                Replacement(f"{_ROPE_03}:ComplexRoPE", MODELS, _complex_rope),
                Replacement(f"{_ROPE_03}:CosSinRoPE", DECODERS_03, _cos_sin_rope),
            ),
        },
        notes=(
            "TrainSpec era: the model module's apply_rotary_emb function is "
            "replaced process-wide (upstream calls it by name) by an overlay "
            "record, reverted with the overlay.",
        ),
    )
)
