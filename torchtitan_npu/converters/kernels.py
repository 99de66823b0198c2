"""What every converter kernel shares: the npu/native pair and its dispatch.

Every kernel has one signature on every device: ``Kernel.npu`` calls torch_npu
and runs only on Ascend; ``Kernel.native`` is the PyTorch reference the tests
compare against, used on cuda and cpu. Each op's pair lives in its module
under ``converters/ops``.

Activations that are DTensors (tensor/sequence parallel) take the native path
even on npu: torch_npu's fused ops have no DTensor sharding rules.
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

from torch.distributed.tensor import DTensor


class Kernel(NamedTuple):
    """One op's two implementations (functions, or a tuple of functions)."""

    native: Any
    npu: Any

    def for_device(self, device_type: str) -> Any:
        return self.npu if device_type == "npu" else self.native


def impl_for(device_type: str) -> str:
    """Which implementation a device uses: ``"npu"`` or ``"native"``."""
    return "npu" if device_type == "npu" else "native"


def torch_npu() -> Any:
    import torch_npu

    return torch_npu


def npu_kernel(native: Callable) -> Callable[[Callable], Callable]:
    """An npu kernel that falls back to ``native`` for DTensor arguments."""

    def decorator(kernel: Callable) -> Callable:
        @functools.wraps(kernel)
        def dispatch(*args, **kwargs):
            if any(isinstance(a, DTensor) for a in (*args, *kwargs.values())):
                return native(*args, **kwargs)
            return kernel(*args, **kwargs)

        return dispatch

    return decorator
