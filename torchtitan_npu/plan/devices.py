"""Device memory: the table of known accelerators and memory strings.

Capacities are the vendors' per-device (per-die) HBM figures; a process
never gets all of it (the runtime, the allocator's fragmentation, the
communication library's buffers), so the plan reports headroom, not a
yes/no at the last byte.
"""

import re

from torchtitan_npu.errors import PlanError

GIB = 1024**3

# Per-device memory, GiB, by the names `npu-smi` / `nvidia-smi` report.
DEVICE_MEMORY = {
    "Ascend910B1": 64,
    "Ascend910B2": 64,
    "Ascend910B3": 64,
    "Ascend910B4": 32,
    "Ascend910_93": 64,  # Atlas A3 (910C): per die, two dies per module
    "Ascend950PR": 128,
    "Ascend950DT": 144,
    "A100-40GB": 40,
    "A100-80GB": 80,
    "H100": 80,
    "H200": 141,
}

_UNITS = {
    "": 1, "b": 1,
    "kib": 1024, "mib": 1024**2, "gib": GIB, "tib": 1024**4,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 1024, "m": 1024**2, "g": GIB, "t": 1024**4,
}  # fmt: skip


def parse_memory(text: str) -> int:
    """Bytes of "64GiB", "80 GB", "65536MiB", "12g" (binary) or a byte count."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS:
        raise PlanError(
            f"--device-memory {text!r} is not a memory size; write e.g. 64GiB, "
            "80GB or 65536MiB"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def device_memory(name: str) -> int:
    """Bytes of a known device, by name (case and '-' insensitive)."""
    key = {_normal(k): k for k in DEVICE_MEMORY}.get(_normal(name))
    if key is None:
        raise PlanError(
            f"unknown --device-name {name!r}; known: {', '.join(DEVICE_MEMORY)} "
            "(or give --device-memory SIZE)"
        )
    return DEVICE_MEMORY[key] * GIB


def local_device_memory(device_type: str) -> int | None:
    """Total memory of this machine's first device of ``device_type`` (None
    on CPU)."""
    import torch

    module = getattr(torch, device_type, None) if device_type != "cpu" else None
    if module is None or not module.is_available():
        return None
    return module.get_device_properties(0).total_memory


def device_type_of(name: str) -> str:
    """npu for Ascend devices, cuda for the others in the table."""
    return "npu" if _normal(name).startswith("ascend") else "cuda"


def _normal(name: str) -> str:
    return re.sub(r"[\s_-]", "", name).lower()
