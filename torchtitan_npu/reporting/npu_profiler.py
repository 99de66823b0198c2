"""torch_npu's profiler behind upstream's profiling config (npu only).

Upstream builds ``torch.profiler.profile(activities=[CPU, CUDA/XPU],
schedule=torch.profiler.schedule(...), on_trace_ready=...)``; torch's profiler
cannot see NPU activity. On npu the overlay points ``torch.profiler.profile``
and ``torch.profiler.schedule`` at these two, which build torch_npu's
equivalents with NPU activity; upstream's trace handler, folders and
``profiling.*`` settings stay as they are.
"""

import logging
from typing import Any

logger = logging.getLogger(__name__)


def _torch_npu_profiler():
    import torch_npu

    return torch_npu.profiler


def profile(
    *,
    activities: Any = None,
    schedule: Any = None,
    on_trace_ready: Any = None,
    **kwargs,
) -> Any:
    """A torch_npu profiler recording CPU and NPU activity."""
    profiler = _torch_npu_profiler()
    return profiler.profile(
        activities=[profiler.ProfilerActivity.CPU, profiler.ProfilerActivity.NPU],
        schedule=schedule,
        on_trace_ready=on_trace_ready,
        **kwargs,
    )


def schedule(
    *,
    wait: int,
    warmup: int,
    active: int,
    repeat: int = 0,
    skip_first: int = 0,
    skip_first_wait: int = 0,
) -> Any:
    """torch_npu's schedule (2.14.0's takes every argument torch's does)."""
    return _torch_npu_profiler().schedule(
        wait=wait,
        warmup=warmup,
        active=active,
        repeat=repeat,
        skip_first=skip_first,
        skip_first_wait=skip_first_wait,
    )
