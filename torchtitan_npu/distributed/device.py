"""Which device trains, which collective backend it uses, and torch_npu loading.

Nothing here imports torch at module import time, so the CLI can describe the
machine without paying for torch.
"""

import importlib.util
import os
from collections.abc import Mapping, MutableMapping
from types import ModuleType

from torchtitan_npu.errors import DeviceError, TorchNpuLoadError

DEVICE_ENV = "TITAN_NPU_DEVICE"  # force "npu", "cuda" or "cpu"
DEVICE_TYPES = ("npu", "cuda", "cpu")
_BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}


def torch_npu_installed() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


AUTOLOAD_ENV = "TORCH_DEVICE_BACKEND_AUTOLOAD"  # torch's: "0" = no torch_npu


def torch_npu_wanted(env: Mapping[str, str] | None = None) -> bool:
    """Is torch_npu to be loaded? Not when absent, when another device is
    forced, or when torch's device-backend autoload is off."""
    env = os.environ if env is None else env
    forced = env.get(DEVICE_ENV)
    return (
        torch_npu_installed()
        and forced in (None, "", "npu")
        and env.get(AUTOLOAD_ENV) != "0"
    )


def keep_torch_npu_out(env: MutableMapping[str, str]) -> None:
    """With a forced non-NPU device, keep torch from autoloading torch_npu
    (which fails outright on a host without CANN)."""
    if torch_npu_installed() and env.get(DEVICE_ENV) not in (None, "", "npu"):
        env.setdefault(AUTOLOAD_ENV, "0")


def _load_failure(error: BaseException) -> TorchNpuLoadError:
    reason = str(error).strip().splitlines()[-1] if str(error).strip() else ""
    return TorchNpuLoadError(
        f"torch_npu is installed but cannot load ({type(error).__name__}: "
        f"{reason[:200]}); without Ascend CANN it breaks `import torch`: source "
        "CANN's set_env.sh, train on another device (titan-npu train --device "
        f"cpu, or {DEVICE_ENV}=cpu), or uninstall torch-npu"
    )


def check_torch_loads() -> None:
    """Import torch here and now, turning a torch_npu autoload crash into one
    line (call before anything else imports torch)."""
    keep_torch_npu_out(os.environ)
    try:
        import torch  # noqa: F401
    except Exception as e:
        if torch_npu_installed():
            raise _load_failure(e) from None
        raise


def load_torch_npu() -> ModuleType | None:
    """Import torch_npu when wanted, before torchtitan reads the device type.

    torch_npu registers the ``npu`` privateuse1 backend; upstream detects the
    device once, at import. Returns the module, or None when not loaded (not
    installed, another device forced, or ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``).
    """
    if not torch_npu_wanted():
        return None
    try:
        import torch_npu  # noqa: F401
    except Exception as e:  # any failure in the CANN runtime surfaces here
        raise _load_failure(e) from e
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
            raise DeviceError(
                f"unknown device type {requested!r}; choose one of {DEVICE_TYPES}"
            )
        if not available[requested]:
            found = next(d for d in DEVICE_TYPES if available[d])
            raise DeviceError(
                f"device type {requested!r} was requested but is absent "
                f"(from --device or {DEVICE_ENV}); this machine has {found!r}: "
                f"pass --device {found} or leave the choice to titan-npu"
            )
        return requested
    return next(d for d in DEVICE_TYPES if available[d])


def backend_for(device_type: str) -> str:
    """The collective backend of a device type."""
    return _BACKENDS[device_type]
