"""Collectives' memory as the planned device's communication library has it.

A fake process group moves nothing and allocates nothing. NCCL and HCCL
reduce-scatter in place; gloo (CPU) reduces through a copy of the whole input,
made and freed within the call (measured: FSDP's reduce-scatter of a 248,320 x
256 fp32 embedding gradient on 2 ranks holds 242.5 MiB more in a real gloo run
than on the fake group, exactly the input). ``collectives_for("cpu")`` puts
that copy in a plan on the fake group.

0.2.x replicates with DDP, whose reducer (C++) keeps every gradient a second
time in flat buckets, allocated as the first forward starts and held from
then on (measured: a DDP run's peak is a single device's plus exactly the
gradients' bytes). The reducer reads its tensors' data, which fake tensors
have none of: ``ddp_buckets`` leaves a plan's model unwrapped and allocates
the buckets beside it (record ``plan_ddp_buckets``). All-reduce is in place.
"""

import contextlib
from collections import Counter
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


BUCKETS = "_titan_npu_planned_ddp_buckets"  # the model attribute holding them


def ddp_buckets(model: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
    """0.2.x's ``apply_ddp`` as its memory on fake tensors: the model left
    unwrapped, DDP's gradient buckets (one per dtype, every trainable
    parameter's size) allocated at its first forward."""

    def allocate(module: torch.nn.Module, inputs: Any) -> None:
        handle.remove()
        sizes: Counter[torch.dtype] = Counter()
        trainable = [p for p in module.parameters() if p.requires_grad]
        for p in trainable:
            sizes[p.dtype] += p.numel()
        device = trainable[0].device if trainable else None
        buckets = [torch.empty(n, dtype=d, device=device) for d, n in sizes.items()]
        setattr(module, BUCKETS, buckets)

    handle = model.register_forward_pre_hook(allocate)
