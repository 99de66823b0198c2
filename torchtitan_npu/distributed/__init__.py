"""Device and backend selection: npu (hccl) > cuda (nccl) > cpu (gloo)."""

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
