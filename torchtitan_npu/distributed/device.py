"""Which device trains, which collective backend it uses, and torch_npu loading.

Nothing here imports torch at module import time, so the CLI can describe the
machine without paying for torch.
"""

import importlib.util
import os

DEVICE_ENV = "TITAN_NPU_DEVICE"  # force "npu", "cuda" or "cpu"
DEVICE_TYPES = ("npu", "cuda", "cpu")
_BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}


class TorchNpuLoadError(ImportError):
    """torch_npu is installed but cannot be loaded (usually: no Ascend CANN)."""


def torch_npu_installed() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


def load_torch_npu():
    """Import torch_npu when installed, before torchtitan reads the device type.

    torch_npu registers the ``npu`` privateuse1 backend; upstream detects the
    device once, at import. Returns the module, or None when not installed.
    """
    if not torch_npu_installed():
        return None
    try:
        import torch_npu  # noqa: F401
    except Exception as e:  # any failure in the CANN runtime surfaces here
        raise TorchNpuLoadError(
            f"torch_npu is installed but failed to load: {e}\n"
            "On a machine without Ascend CANN, torch_npu breaks even `import torch` "
            "(device-backend autoload). Either source CANN's set_env.sh, uninstall "
            "torch-npu, or set TORCH_DEVICE_BACKEND_AUTOLOAD=0 and "
            f"{DEVICE_ENV}=cpu to train without it."
        ) from e
    return torch_npu


def select_device_type(requested: str | None = None) -> str:
    """npu > cuda > cpu, or the requested/forced type (validated)."""
    import torch

    requested = requested or os.environ.get(DEVICE_ENV) or None
    available = {
        "npu": hasattr(torch, "npu") and torch.npu.is_available(),
        "cuda": torch.cuda.is_available(),
        "cpu": True,
    }
    if requested is not None:
        if requested not in DEVICE_TYPES:
            raise ValueError(
                f"unknown device type {requested!r}; choose one of {DEVICE_TYPES}"
            )
        if not available[requested]:
            raise ValueError(f"device type {requested!r} was requested but is absent")
        return requested
    return next(d for d in DEVICE_TYPES if available[d])


def backend_for(device_type: str) -> str:
    """The collective backend of a device type."""
    return _BACKENDS[device_type]
