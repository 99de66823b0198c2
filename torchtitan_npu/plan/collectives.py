"""Collectives' memory as the planned device's communication library has it.

A fake process group moves nothing and allocates nothing. NCCL and HCCL
reduce-scatter in place; gloo (CPU) reduces through a copy of the whole input,
made and freed within the call (measured: FSDP's reduce-scatter of a 248,320 x
256 fp32 embedding gradient on 2 ranks holds 242.5 MiB more in a real gloo run
than on the fake group, exactly the input). ``collectives_for("cpu")`` puts
that copy in a plan on the fake group.
"""

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class GlooReduceScatterCopy(TorchDispatchMode):
    """Each reduce-scatter allocates a copy of its input for the call's
    duration, as gloo does."""

    # higher-order ops (flex attention) pass through to the modes below
    supports_higher_order_operators = True

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        if func is torch.ops.c10d._reduce_scatter_base_.default:
            _, whole = args[:2]  # (output, input, group, ...)
            copy = torch.empty_like(whole)
            result = func(*args, **(kwargs or {}))
            del copy
            return result
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def collectives_for(device_type: str) -> Iterator[None]:
    """For the duration of a plan on the fake process group: reduce-scatter's
    memory as ``device_type``'s library has it (gloo's copy on CPU; NCCL and
    HCCL need nothing more). A real group (``--measure``) has its own."""
    import torch.distributed as dist

    if device_type != "cpu" or dist.get_backend() != "fake":
        yield
        return
    with GlooReduceScatterCopy():
        yield
