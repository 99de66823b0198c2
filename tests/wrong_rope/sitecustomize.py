"""Test-only (tests/test_numerics.py): with this folder on PYTHONPATH, every
process's rope converter computes RoPE with the sine's sign flipped, the kind
of wrong kernel `numerics locate` must name."""

from torchtitan_npu.converters.kernels import Kernel
from torchtitan_npu.converters.ops import rope
from torchtitan_npu.converters.registry import CONVERTERS


def flipped(x, cos, sin, interleaved):
    return rope.native(x, cos, -sin, interleaved)


object.__setattr__(CONVERTERS["rope"], "kernel", Kernel(flipped, flipped))
