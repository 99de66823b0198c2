"""``titan-npu doctor``: what is installed, what will train, which patches apply."""

import importlib.metadata
import os
import platform
import sys
from pathlib import Path

CANN_HOME_ENVS = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def cann_version() -> str:
    """The Ascend CANN toolkit version, from its install info, if any."""
    for env in CANN_HOME_ENVS:
        home = os.environ.get(env)
        if not home:
            continue
        for info in ("version.cfg", "ascend_toolkit_install.info"):
            path = Path(home) / info
            if path.is_file():
                for line in path.read_text().splitlines():
                    if "version=" in line.lower():
                        return f"{line.split('=', 1)[1].strip()} ({home})"
        return f"unknown version ({home})"
    return "not found (no ASCEND_TOOLKIT_HOME / ASCEND_HOME_PATH)"


def run() -> int:
    print(f"python      {sys.version.split()[0]} ({platform.platform()})")
    for dist in ("titan-npu", "torch", "torch-npu", "torchtitan"):
        print(f"{dist:<11} {_version(dist)}")
    print(f"CANN        {cann_version()}")

    from torchtitan_npu.bootstrap import activate
    from torchtitan_npu.tools.compat_tool import status_table

    try:
        activation = activate()
    except Exception as e:  # report any refusal plainly, then the raw check
        print(f"\noverlay     NOT ACTIVE: {type(e).__name__}: {e}")
        if "torch_npu" not in str(e):
            from torchtitan_npu.tools.compat_tool import check_installed

            print()
            check_installed()
        return 1
    upstream, ctx = activation.upstream, activation.context
    entry = upstream.entry
    lock = f"in upstream.lock, {entry.status}" if entry else "UNTESTED (opted in)"
    print(f"upstream    torchtitan {upstream.installed.version}: {lock}, era {ctx.era}")
    print(f"device      {ctx.device_type} (backend {ctx.backend})")
    print("\npatches")
    print(status_table(activation.status))
    return 0
