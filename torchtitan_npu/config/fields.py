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
    return fitted_to(describe(annotation), value)


def expected(annotation: Any, value: Any) -> str | None:
    """None when ``value`` fits ``annotation``, else what the field expects."""
    return fits(describe(annotation), value)


# A field's type as JSON (cached in field tables): "any", "bool", "int",
# "float", "str", "none", "table", {"literal": [...]}, {"union": [...]},
# {"list": type}. Classes, callables and enums are "any": upstream checks them.
_SCALARS = {bool: "bool", int: "int", float: "float", str: "str", type(None): "none"}


def describe(annotation: Any) -> Any:
    """``annotation`` as the JSON type description ``fits`` reads."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return describe(args[0])
    if origin in (typing.Union, types.UnionType):
        arms = [describe(arm) for arm in args]
        return "any" if "any" in arms else {"union": arms}
    if origin is typing.Literal:
        plain = all(a is None or isinstance(a, bool | int | float | str) for a in args)
        return {"literal": list(args)} if plain else "any"
    if annotation in _SCALARS:
        return _SCALARS[annotation]
    if origin in (list, tuple):
        return {"list": describe(args[0]) if args else "any"}
    if origin is dict or annotation is dict:
        return "table"
    return "any"


def fitted_to(kind: Any, value: Any) -> Any:
    """``fitted`` on a type description."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if number and fits(kind, value) and not fits(kind, str(value)):
        return str(value)
    return value


def fits(kind: Any, value: Any) -> str | None:
    """None when ``value`` fits the type description, else what it expects."""
    if isinstance(kind, dict) and "union" in kind:
        wants = [fits(arm, value) for arm in kind["union"]]
        if None in wants:
            return None
        return " or ".join(dict.fromkeys(w for w in wants if w is not None))
    if isinstance(kind, dict) and "literal" in kind:
        choices = kind["literal"]
        return None if value in choices else f"one of {choices}"
    if isinstance(kind, dict) and "list" in kind:
        if not isinstance(value, list | tuple):
            return "a list"
        problem = next((w for item in value if (w := fits(kind["list"], item))), None)
        return None if problem is None else f"a list of {problem}"
    if kind == "none":
        return None if value is None else "none"
    if kind == "bool":
        return None if isinstance(value, bool) else "true or false"
    if kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
        return None if ok else "an integer"
    if kind == "float":
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return None if ok else "a number"
    if kind == "str":
        return None if isinstance(value, str) else "a string"
    if kind == "table":
        return None if isinstance(value, dict) else "a table"
    return None  # "any"
