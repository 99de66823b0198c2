"""What ``import torchtitan_npu`` sets in motion.

Importing the package is cheap (no torch): it installs a one-shot import hook
so that the moment upstream ``torchtitan`` is imported — or at once, if it
already was — the overlay activates:

1. torch_npu is imported first when installed (it registers the ``npu``
   backend that upstream's device detection reads at import);
2. compat identifies the installed upstream and its upstream.lock entry
   (refusing an untested one unless opted in) and so its API era;
3. the overlay verifies every patch target of ``common`` + that era, then
   applies the patches in declared order.
"""

import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torchtitan_npu.overlay import OVERLAY, PatchContext, PatchStatus

if TYPE_CHECKING:  # importing compat here would cost every `titan-npu` call
    from torchtitan_npu.compat import Upstream


@dataclass(frozen=True)
class Activation:
    """The overlay as activated in this process."""

    upstream: "Upstream"
    context: PatchContext
    status: list[PatchStatus]


_activation: Activation | None = None

# Comma-separated patch names to leave off, for A/B runs and for showing what a
# patch fixes (the matrix turns red without it). Never needed in production.
DISABLE_ENV = "TITAN_NPU_DISABLE_PATCHES"


def activate(device_type: str | None = None) -> Activation:
    """Activate the overlay once for this process; later calls return it."""
    global _activation
    if _activation is not None:
        return _activation
    from torchtitan_npu.compat import resolve_upstream
    from torchtitan_npu.distributed import (
        backend_for,
        load_torch_npu,
        select_device_type,
    )
    from torchtitan_npu.overlay import PatchTargetError, patches_for

    remove_hook()
    load_torch_npu()
    upstream = resolve_upstream()
    device = select_device_type(device_type)
    patches = patches_for(upstream.era)
    disabled = frozenset(filter(None, os.environ.get(DISABLE_ENV, "").split(",")))
    unknown = disabled - {p.name for p in patches}
    if unknown:
        raise PatchTargetError(
            f"{DISABLE_ENV} names unknown patches {sorted(unknown)}; "
            f"known: {[p.name for p in patches]}"
        )
    ctx = PatchContext(
        upstream_version=upstream.installed.version,
        era=upstream.era,
        device_type=device,
        backend=backend_for(device),
        tested=upstream.tested,
        disabled=disabled,
    )
    status = OVERLAY.apply(patches, ctx, upstream.fingerprints)
    _activation = Activation(upstream, ctx, status)
    return _activation


def deactivate() -> None:
    """Revert every patch (tests, A/B runs); ``activate`` may run again."""
    global _activation
    OVERLAY.revert()
    _activation = None


class _ActivateOnUpstreamImport:
    """A meta-path finder: activates the overlay right after ``torchtitan``."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torchtitan":
            return None
        import importlib.util

        remove_hook()
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_activate(module):
            exec_module(module)
            activate()

        spec.loader.exec_module = exec_then_activate
        return spec


_HOOK = _ActivateOnUpstreamImport()


def remove_hook() -> None:
    if _HOOK in sys.meta_path:
        sys.meta_path.remove(_HOOK)


def install() -> None:
    """Activate now if upstream is loaded, else when it gets imported."""
    if "torchtitan" in sys.modules:
        activate()
    elif _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)
