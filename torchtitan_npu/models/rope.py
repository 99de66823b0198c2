"""RoPE configs of the 0.3-era model protocol, whichever way the installed
upstream spells their cache length: ``max_seq_len`` (0.3.0) or
``max_context_length`` (main, #4121)."""

import dataclasses
from typing import Any

_LENGTH_FIELDS = ("max_context_length", "max_seq_len")


def rope_config(cls: type, length: int, **kwargs: Any) -> Any:
    """``cls(...)`` (a RoPE ``Config`` class) caching ``length`` positions."""
    names = {f.name for f in dataclasses.fields(cls)}
    field = next(name for name in _LENGTH_FIELDS if name in names)
    return cls(**{field: length}, **kwargs)


def rope_length(rope: Any) -> int:
    """The number of positions a RoPE config caches."""
    return next(getattr(rope, n) for n in _LENGTH_FIELDS if hasattr(rope, n))
