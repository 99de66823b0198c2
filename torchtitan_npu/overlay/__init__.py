"""The overlay: patch sets per era, and the process-wide overlay instance."""

from torchtitan_npu.overlay import common, config_registry, trainspec
from torchtitan_npu.overlay.registry import (
    Overlay,
    Patch,
    PatchContext,
    PatchStatus,
    PatchTargetError,
    check,
)

ERAS = ("trainspec", "config_registry")

_ERA_PATCHES = {
    "trainspec": trainspec.PATCHES,
    "config_registry": config_registry.PATCHES,
}

OVERLAY = Overlay()


def patches_for(era: str) -> list[Patch]:
    """common + the era's own patches, in application order."""
    if era not in _ERA_PATCHES:
        raise ValueError(f"unknown upstream API era {era!r}; known: {ERAS}")
    patches = common.PATCHES + _ERA_PATCHES[era]
    assert all(era in p.eras for p in patches)
    return patches


__all__ = [
    "ERAS",
    "OVERLAY",
    "Overlay",
    "Patch",
    "PatchContext",
    "PatchStatus",
    "PatchTargetError",
    "check",
    "patches_for",
]
