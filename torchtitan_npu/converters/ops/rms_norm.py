"""rms_norm(x, normalized_shape, weight, eps): RMSNorm layers."""

from typing import Any

import torch
import torch.nn.functional as F

from torchtitan_npu.compat.era import Era
from torchtitan_npu.converters.kernels import Kernel, npu_kernel, torch_npu
from torchtitan_npu.converters.ops.common import DECODERS_03, MODELS
from torchtitan_npu.converters.registry import Converter, Replacement, register


def native(
    x: torch.Tensor,
    normalized_shape: Any,
    weight: torch.Tensor | None,
    eps: float | None,
) -> torch.Tensor:
    return F.rms_norm(x, normalized_shape, weight, eps)


@npu_kernel(native)
def npu(
    x: torch.Tensor,
    normalized_shape: Any,
    weight: torch.Tensor | None,
    eps: float | None,
) -> torch.Tensor:
    if weight is None:
        weight = x.new_ones(normalized_shape)
    if eps is None:  # nn.RMSNorm's default: the dtype's machine epsilon
        eps = torch.finfo(x.dtype).eps
    return torch_npu().npu_rms_norm(x, weight, epsilon=eps)[0]


def _rms_norm(kernel, original):
    def forward(self, x):
        return kernel(x, self.normalized_shape, self.weight, self.eps)

    return {"forward": forward}


CONVERTER = register(
    Converter(
        name="rms_norm",
        description="RMSNorm layers (attention/ffn/final norms, q/k norms, MLA norms)",
        kernel=Kernel(native, npu),
        npu_ops=("npu_rms_norm",),
        native="torch.nn.functional.rms_norm",
        replacements={
            Era.TRAINSPEC: (Replacement("torch.nn:RMSNorm", MODELS, _rms_norm),),
            Era.CONFIG_REGISTRY: (
                Replacement(
                    "torchtitan.models.common.nn_modules:RMSNorm",
                    DECODERS_03,
                    _rms_norm,
                ),
            ),
        },
    )
)
