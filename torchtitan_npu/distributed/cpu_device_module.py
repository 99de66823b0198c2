"""A ``torch.cuda``-shaped device module for CPU training.

torchtitan drives its device through ``device_module`` (``torch.cuda``,
``torch.npu``, ...). ``torch.cpu`` lacks part of that API: the memory
statistics ``DeviceMemoryMonitor`` reads, ``get_device_name``/
``get_device_properties``, and an integer ``current_device()`` (it returns the
string "cpu", which ``barrier(device_ids=...)`` rejects). This module forwards
everything else to ``torch.cpu`` and fills those gaps with process-level facts
(peak resident memory stands in for the allocator's peak).
"""

import os
import platform
import resource
from types import SimpleNamespace
from typing import Any

import torch


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _total_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def current_device() -> int:
    return 0


def device_count() -> int:
    return 1


def set_device(device: Any) -> None:
    """CPU has one device; nothing to select."""


def synchronize(device: Any = None) -> None:
    """CPU ops are synchronous."""


def get_device_name(device: Any = None) -> str:
    return platform.processor() or platform.machine() or "cpu"


def get_device_properties(device: Any = None) -> Any:
    return SimpleNamespace(name=get_device_name(), total_memory=_total_memory_bytes())


def memory_stats(device: Any = None) -> dict[str, int]:
    peak = _peak_rss_bytes()
    return {
        "active_bytes.all.peak": peak,
        "reserved_bytes.all.peak": peak,
        "num_alloc_retries": 0,
        "num_ooms": 0,
    }


def reset_peak_memory_stats(device: Any = None) -> None:
    """The process peak RSS cannot be reset; the stats stay cumulative."""


def empty_cache() -> None:
    """No caching allocator on CPU."""


def __getattr__(name: str):
    return getattr(torch.cpu, name)
