"""Peak dense bf16/fp16 FLOPs of Ascend NPUs, so MFU is reported on NPU.

On CPU there is no meaningful peak: MFU reads 0 unless ``TITAN_NPU_PEAK_FLOPS``
is set.

Upstream's ``get_peak_flops`` knows NVIDIA/AMD names and falls back to an
A100's 312 TFLOPs for anything else. Each figure below is per device, which
is per rank: on Atlas A3 (910C) each of a chip's two dies is its own device
(torch_npu names it ``Ascend910_93xx``) and its own rank. The basis is said
per row: "cube" is the matrix (cube) units alone, where the matmuls MFU
counts run; "total" adds the vector units (the commonly published figure,
where no cube-only one is published). None has been measured here.
``TITAN_NPU_PEAK_FLOPS`` (FLOPs per second) overrides them.
"""

import os
from typing import NamedTuple

PEAK_FLOPS_ENV = "TITAN_NPU_PEAK_FLOPS"


class Peak(NamedTuple):
    flops: float
    basis: str  # "cube" or "total"
    source: str


# Longest name first: "Ascend910B1" must not match "Ascend910".
ASCEND_PEAKS = {
    "Ascend910_93": Peak(
        353.9e12, "cube",
        "one A3 die (376 TFLOPs with the vector units); Huawei torchtitan-npu's "
        "per-device figure",
    ),
    "Ascend910B1": Peak(414e12, "total", "Atlas A2 910B1, published"),
    "Ascend910B2": Peak(376e12, "total", "Atlas A2 910B2, published"),
    "Ascend910B3": Peak(313e12, "total", "Atlas A2 910B3, published"),
    "Ascend910B4": Peak(280e12, "total", "Atlas A2 910B4, published"),
    "Ascend910": Peak(256e12, "total", "first-generation Ascend 910, published"),
}  # fmt: skip


def ascend_peak(device_name: str) -> Peak | None:
    """The table's row for a torch_npu device name, or None."""
    name = device_name.replace(" ", "")
    for prefix in sorted(ASCEND_PEAKS, key=len, reverse=True):
        if name.startswith(prefix):
            return ASCEND_PEAKS[prefix]
    return None


def ascend_peak_flops(device_name: str) -> float | None:
    """The figure for a torch_npu device name (the override first), or None."""
    if os.environ.get(PEAK_FLOPS_ENV):
        return float(os.environ[PEAK_FLOPS_ENV])
    peak = ascend_peak(device_name)
    return None if peak is None else peak.flops


def peak_flops(device_type: str, device_name: str) -> float | None:
    """The peak for MFU on ``device_type``; None: ask upstream's table."""
    if os.environ.get(PEAK_FLOPS_ENV):
        return float(os.environ[PEAK_FLOPS_ENV])
    if device_type == "cpu":
        return float("inf")  # MFU 0: no peak to compare with
    return ascend_peak_flops(device_name) if device_type == "npu" else None


def describe(device_type: str, device_name: str | None) -> str:
    """What MFU is computed against on this device (doctor's line)."""
    if os.environ.get(PEAK_FLOPS_ENV):
        return f"{float(os.environ[PEAK_FLOPS_ENV]) / 1e12:g} TFLOPs ({PEAK_FLOPS_ENV})"
    if device_type == "cpu":
        return f"none: MFU reads 0 on cpu (set {PEAK_FLOPS_ENV} to compare)"
    if device_type == "npu" and device_name:
        peak = ascend_peak(device_name)
        if peak is not None:
            return (
                f"{peak.flops / 1e12:g} TFLOPs per device, {peak.basis} "
                f"({device_name}: {peak.source})"
            )
        return f"unknown for {device_name}: set {PEAK_FLOPS_ENV}"
    return f"upstream's table for {device_name or device_type}"
