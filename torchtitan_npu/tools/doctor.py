"""``titan-npu doctor``: what is installed, what will train, which patches apply."""

import importlib.metadata
import os
import platform
import sys
from pathlib import Path

from torchtitan_npu.compat.era import Era
from torchtitan_npu.overlay.registry import PatchStatus

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


def upstream_line() -> str:
    """The installed torchtitan and what upstream.lock says of it (no import)."""
    from torchtitan_npu.compat import (
        UpstreamNotInstalled,
        find_entry,
        installed_upstream,
        read_lock,
    )

    try:
        installed = installed_upstream()
    except UpstreamNotInstalled:
        return "not installed"
    entries = read_lock()
    entry = find_entry(installed, entries)
    if entry is None:
        tested = ", ".join(e.version for e in entries)
        return f"{installed.version} (NOT in upstream.lock; tested: {tested})"
    default = ", default" if entry.default else ""
    return (
        f"{installed.version} (upstream.lock: {entry.status}{default}, era "
        f"{entry.era}, commit {entry.commit}, wheel sha256 {entry.wheel_sha256[:12]})"
    )


def device_line() -> str:
    """The device titan-npu would train on here, and its collective backend."""
    from torchtitan_npu.distributed import (
        backend_for,
        load_torch_npu,
        select_device_type,
    )
    from torchtitan_npu.errors import DeviceError, TorchNpuLoadError

    try:
        load_torch_npu()
        device = select_device_type()
    except (TorchNpuLoadError, DeviceError) as e:
        return f"unavailable: {str(e).splitlines()[0]}"
    return f"{device} ({backend_for(device)})"


def peak_flops_line(device_type: str) -> str:
    """The peak MFU is computed against on this machine's device."""
    import torch

    from torchtitan_npu.reporting.flops import describe

    module = getattr(torch, device_type, None)
    name = module.get_device_name(0) if device_type != "cpu" and module else None
    return describe(device_type, name)


def determinism_line(device_type: str) -> str:
    """What --debug.deterministic adds to upstream's torch settings here."""
    from torchtitan_npu.distributed.hccl import DETERMINISTIC_ENV

    if device_type != "npu":
        return "upstream's debug.deterministic (torch's deterministic algorithms)"
    shown = ", ".join(
        f"{k}={os.environ[k]} (yours)" if k in os.environ else f"{k}={v}"
        for k, v in DETERMINISTIC_ENV.items()
    )
    return f"debug.deterministic also sets {shown} before the ranks start"


def version_report() -> str:
    """``titan-npu --version``: titan-npu, upstream, torch, torch_npu, device."""
    from torchtitan_npu import __version__

    rows = [
        ("titan-npu", __version__),
        ("torchtitan", upstream_line()),
        ("torch", _version("torch")),
        ("torch_npu", _version("torch-npu")),
        ("device", device_line()),
    ]
    return "\n".join(f"{name:<11} {value}" for name, value in rows)


def run() -> int:
    print(f"python      {sys.version.split()[0]} ({platform.platform()})")
    for dist in ("titan-npu", "torch", "torch-npu", "torchtitan"):
        print(f"{dist:<11} {_version(dist)}")
    print(f"CANN        {cann_version()}")

    from torchtitan_npu.bootstrap import activate
    from torchtitan_npu.compat import LockError
    from torchtitan_npu.tools.compat_tool import status_table

    try:
        activation = activate()
    except LockError:
        raise  # one line from the CLI: the install itself is broken
    except Exception as e:  # report any refusal plainly, then the raw check
        print(f"\noverlay     NOT ACTIVE: {type(e).__name__}: {e}")
        if "torch_npu" not in str(e):
            from torchtitan_npu.tools.compat_tool import check_installed

            print()
            try:
                check_installed()
            except Exception as check_error:  # upstream itself does not import
                name = type(check_error).__name__
                print(f"patch check impossible: {name}: {check_error}")
        return 1
    upstream, ctx = activation.upstream, activation.context
    entry = upstream.entry
    lock = f"in upstream.lock, {entry.status}" if entry else "UNTESTED (opted in)"
    print(f"upstream    torchtitan {upstream.installed.version}: {lock}, era {ctx.era}")
    print(f"device      {ctx.device_type} (backend {ctx.backend})")
    print(f"peak flops  {peak_flops_line(ctx.device_type)}")
    print(f"determinism {determinism_line(ctx.device_type)}")
    print("\npatches")
    print(status_table(activation.status))
    print("\npatch manifest (docs/patches.md)")
    print(manifest_table(activation.status))
    print("\nconverters (train config: [model] converters = [...])")
    print(converter_table(ctx.era, ctx.device_type))
    from torchtitan_npu.converters.quantization import availability_table

    print("\nupstream's low-precision training (model.converters; settings: [name])")
    print(availability_table(ctx.device_type))
    return 0


def manifest_table(rows: list[PatchStatus]) -> str:
    """Each patch of the running era: its upstream reference and removal condition."""
    return "\n".join(
        f"{r.patch.name}\n  upstream:    {r.patch.upstream_ref}\n"
        f"  remove when: {r.patch.remove_when}"
        for r in rows
    )


def converter_table(era: Era, device_type: str) -> str:
    from torchtitan_npu.converters import CONVERTERS
    from torchtitan_npu.converters.kernels import impl_for
    from torchtitan_npu.reporting.table import format_table

    rows = []
    for name, converter in sorted(CONVERTERS.items()):
        kernel = (
            ", ".join(f"torch_npu.{op}" for op in converter.npu_ops)
            if impl_for(device_type) == "npu"
            else converter.native
        )
        models = ", ".join(converter.models(era)) or f"(none: not in era {era})"
        rows.append([name, models, kernel])
    return format_table(["name", "models", f"kernel on {device_type}"], rows)
