"""The overlay: the records of every change titan-npu makes to upstream, per
era, and the process-wide overlay instance."""

from typing import TYPE_CHECKING

from torchtitan_npu.overlay.registry import (
    Overlay,
    Patch,
    PatchContext,
    PatchStatus,
    PatchTargetError,
    check,
)

if TYPE_CHECKING:  # compat costs ~40 ms of `import torchtitan_npu`
    from torchtitan_npu.compat.era import Era

OVERLAY = Overlay()


def patches_for(era: "Era") -> list[Patch]:
    """Every record of ``era`` in application order: ``common``, the era's own
    patches (``overlay/<era>.py``), then the kernel converters' records."""
    from torchtitan_npu.compat.era import era_module
    from torchtitan_npu.converters import records
    from torchtitan_npu.overlay import common

    patches = common.PATCHES + era_module(__name__, era).PATCHES + records(era)
    assert all(era in p.eras for p in patches)
    return patches


__all__ = [
    "OVERLAY",
    "Overlay",
    "Patch",
    "PatchContext",
    "PatchStatus",
    "PatchTargetError",
    "check",
    "patches_for",
]
