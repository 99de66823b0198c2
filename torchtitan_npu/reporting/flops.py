"""Peak dense bf16/fp16 FLOPs of Ascend NPUs, so MFU is reported on NPU.

On CPU there is no meaningful peak: MFU reads 0 unless ``TITAN_NPU_PEAK_FLOPS``
is set.

Upstream's ``get_peak_flops`` knows NVIDIA/AMD names and falls back to an
A100's 312 TFLOPs for anything else. The figures below are the commonly
published per-chip peaks (cube units, fp16/bf16, dense); they have not been
measured here. ``TITAN_NPU_PEAK_FLOPS`` (FLOPs per second) overrides them.
"""

import os

PEAK_FLOPS_ENV = "TITAN_NPU_PEAK_FLOPS"

# Longest name first: "Ascend910B1" must not match "Ascend910".
ASCEND_PEAK_FLOPS = {
    "Ascend910_93": 752e12,  # Atlas A3 (910C) die pair
    "Ascend910B1": 414e12,
    "Ascend910B2": 376e12,
    "Ascend910B3": 313e12,
    "Ascend910B4": 280e12,
    "Ascend910": 256e12,  # first-generation Ascend 910
}


def ascend_peak_flops(device_name: str) -> float | None:
    """The table's figure for a torch_npu device name, or None."""
    if os.environ.get(PEAK_FLOPS_ENV):
        return float(os.environ[PEAK_FLOPS_ENV])
    name = device_name.replace(" ", "")
    for prefix in sorted(ASCEND_PEAK_FLOPS, key=len, reverse=True):
        if name.startswith(prefix):
            return ASCEND_PEAK_FLOPS[prefix]
    return None


def peak_flops(device_type: str, device_name: str) -> float | None:
    """The peak for MFU on ``device_type``; None: ask upstream's table."""
    if os.environ.get(PEAK_FLOPS_ENV):
        return float(os.environ[PEAK_FLOPS_ENV])
    if device_type == "cpu":
        return float("inf")  # MFU 0: no peak to compare with
    return ascend_peak_flops(device_name) if device_type == "npu" else None
