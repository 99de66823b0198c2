"""swiglu(gate, up) = silu(gate) * up: the SwiGLU feed-forward activation."""

import torch
import torch.nn.functional as F

from torchtitan_npu.compat.era import Era
from torchtitan_npu.converters.kernels import Kernel, npu_kernel, torch_npu
from torchtitan_npu.converters.ops.common import DECODERS_03, MOE_MODELS
from torchtitan_npu.converters.registry import Converter, Replacement, register


def native(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@npu_kernel(native)
def npu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch_npu().npu_swiglu(torch.cat((gate, up), dim=-1), dim=-1)


def _swiglu(kernel, original):
    def forward(self, x):
        return self.w2(kernel(self.w1(x), self.w3(x)))

    return {"forward": forward}


CONVERTER = register(
    Converter(
        name="swiglu",
        description="SwiGLU feed-forward activation silu(w1 x) * w3 x",
        kernel=Kernel(native, npu),
        npu_ops=("npu_swiglu",),
        native="silu(gate) * up",
        replacements={
            Era.TRAINSPEC: (
                Replacement(
                    "torchtitan.models.llama3.model.model:FeedForward",
                    ("llama3",),
                    _swiglu,
                ),
                Replacement(
                    "torchtitan.models.qwen3.model.model:FeedForward",
                    ("qwen3",),
                    _swiglu,
                ),
                Replacement(
                    "torchtitan.models.moe.moe:FeedForward", MOE_MODELS, _swiglu
                ),
            ),
            Era.CONFIG_REGISTRY: (
                Replacement(
                    "torchtitan.models.common.feed_forward:FeedForward",
                    DECODERS_03,
                    _swiglu,
                ),
            ),
        },
    )
)
