"""grouped_mm(a, b_t, offs): rows offs[e-1]:offs[e] of a times b_t[e].

a: (tokens, in), b_t: (experts, in, out), offs: int32 cumulative token counts.
Rows after offs[-1] (alignment padding) come out zero.
"""

import functools

import torch
from torch.distributed.tensor import DTensor

from torchtitan_npu.compat.era import Era
from torchtitan_npu.converters.kernels import Kernel, npu_kernel, torch_npu
from torchtitan_npu.converters.ops.common import MOE_MODELS
from torchtitan_npu.converters.registry import Converter, Replacement, register


@functools.cache
def _has_grouped_mm(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs for this device and dtype (probed once)."""
    try:
        a = torch.zeros(2, 8, device=device_type, dtype=dtype)
        b_t = torch.zeros(1, 8, 8, device=device_type, dtype=dtype)
        offs = torch.tensor([2], device=device_type, dtype=torch.int32)
        torch._grouped_mm(a, b_t, offs=offs)
    except RuntimeError:  # NotImplementedError included
        return False
    return True


def loop(a: torch.Tensor, b_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The reference: one matmul per expert."""
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    parts = [a[s:e] @ b_t[i] for i, (s, e) in enumerate(zip(starts, ends))]
    parts.append(a.new_zeros(a.shape[0] - ends[-1], b_t.shape[-1]))
    return torch.cat(parts)


def native(a: torch.Tensor, b_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if _has_grouped_mm(a.device.type, a.dtype):
        return torch._grouped_mm(a, b_t, offs=offs)
    return loop(a, b_t, offs)


@npu_kernel(native)
def npu(a: torch.Tensor, b_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch_npu().npu_grouped_matmul(
        [a],
        [b_t],
        group_list=offs.to(torch.int64),
        split_item=2,  # one output tensor for all groups
        group_type=0,  # groups split the rows of a
        group_list_type=0,  # group_list holds cumulative counts
    )[0]


def _grouped_experts_02(kernel, original):
    """0.2.x GroupedExperts.forward, in the parameters' dtype."""

    def forward(self, x, num_tokens_per_expert):
        w1, w2, w3 = (
            w.to_local() if isinstance(w, DTensor) else w
            for w in (self.w1, self.w2, self.w3)
        )
        offs = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
        h = torch.nn.functional.silu(kernel(x, w1.transpose(-2, -1), offs))
        h = h * kernel(x, w3.transpose(-2, -1), offs)
        return kernel(h, w2.transpose(-2, -1), offs)

    return {"forward": forward}


def _grouped_experts_03(kernel, original):
    """0.3.x GroupedExperts._grouped_mm: upstream's own seam for the GEMM."""

    def _grouped_mm(self, *, A, B_t, offs):
        return kernel(A, B_t, offs)

    return {"_grouped_mm": _grouped_mm}


CONVERTER = register(
    Converter(
        name="grouped_mm",
        description="MoE routed experts' grouped GEMMs",
        kernel=Kernel(native, npu),
        npu_ops=("npu_grouped_matmul",),
        native="torch._grouped_mm where the device has it, else a per-expert loop",
        replacements={
            Era.TRAINSPEC: (
                Replacement(
                    "torchtitan.models.moe.moe:GroupedExperts",
                    MOE_MODELS,
                    _grouped_experts_02,
                ),
            ),
            Era.CONFIG_REGISTRY: (
                Replacement(
                    "torchtitan.models.common.moe:GroupedExperts",
                    MOE_MODELS,
                    _grouped_experts_03,
                ),
            ),
        },
        notes=(
            "TrainSpec era: experts compute in the parameters' dtype (upstream's "
            "grouped path casts to bf16); 0.3.x keeps upstream's bf16 casts.",
        ),
    )
)
