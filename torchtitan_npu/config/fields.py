"""Walk, type-check and set dotted paths on upstream config dataclass instances."""

import dataclasses
import types
import typing
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


def leaf_paths(obj: Any, prefix: str = "") -> list[str]:
    """Every dotted path of ``obj`` that ends at a value (not a dataclass)."""
    out = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out += leaf_paths(value, f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


def set_path(obj: Any, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        obj = getattr(obj, part)
    setattr(obj, leaf, value)


def field_type(obj: Any, dotted: str) -> Any:
    """The annotation of the field at ``a.b.c`` (``Any`` when unknown)."""
    *parents, leaf = dotted.split(".")
    for part in parents:
        obj = getattr(obj, part)
    try:
        hints = typing.get_type_hints(type(obj), include_extras=True)
    except Exception:  # an annotation that does not resolve: do not guess
        return Any
    return hints.get(leaf, Any)


def fitted(annotation: Any, value: Any) -> Any:
    """``value``, or its text where the field takes text and was given a number
    (``--activation_checkpoint.selective_ac_option 2`` for a str field)."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if number and expected(annotation, value) and not expected(annotation, str(value)):
        return str(value)
    return value


def expected(annotation: Any, value: Any) -> str | None:
    """None when ``value`` fits ``annotation``, else what the field expects."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return expected(args[0], value)
    if origin in (typing.Union, types.UnionType):
        wants = [expected(arm, value) for arm in args]
        if None in wants:
            return None
        return " or ".join(dict.fromkeys(w for w in wants if w is not None))
    if origin is typing.Literal:
        return None if value in args else f"one of {list(args)}"
    if annotation is type(None):
        return None if value is None else "none"
    if annotation is bool:
        return None if isinstance(value, bool) else "true or false"
    if annotation is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        return None if ok else "an integer"
    if annotation is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return None if ok else "a number"
    if annotation is str:
        return None if isinstance(value, str) else "a string"
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            return "a list"
        inner = args[0] if args else Any
        wants = [expected(inner, item) for item in value]
        problem = next((w for w in wants if w is not None), None)
        return None if problem is None else f"a list of {problem}"
    if origin is dict or annotation is dict:
        return None if isinstance(value, dict) else "a table"
    return None  # Any, classes, callables: upstream checks those itself
