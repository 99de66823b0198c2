"""Walk and set dotted paths on upstream config dataclass instances."""

import dataclasses
from typing import Any

MISSING = object()


def get_path(obj: Any, dotted: str) -> Any:
    """The value at ``a.b.c``; ``MISSING`` when a step is not a dataclass field."""
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(obj):
            return MISSING
        if part not in {f.name for f in dataclasses.fields(obj)}:
            return MISSING
        obj = getattr(obj, part)
    return obj


def has_path(obj: Any, dotted: str) -> bool:
    return get_path(obj, dotted) is not MISSING


def set_path(obj: Any, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        obj = getattr(obj, part)
    setattr(obj, leaf, value)
