"""Device and backend selection: npu (hccl) > cuda (nccl) > cpu (gloo); and
(activation_checkpoint.py, 0.3.x only) 0.2.x's per-layer selective AC."""

from torchtitan_npu.distributed.device import (
    DEVICE_ENV,
    TorchNpuLoadError,
    backend_for,
    check_torch_loads,
    keep_torch_npu_out,
    load_torch_npu,
    select_device_type,
)

__all__ = [
    "DEVICE_ENV",
    "TorchNpuLoadError",
    "backend_for",
    "check_torch_loads",
    "keep_torch_npu_out",
    "load_torch_npu",
    "select_device_type",
]
