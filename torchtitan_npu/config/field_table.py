"""Upstream's config fields as the train config spells them: each key's type
and upstream's default, read from the installed upstream's own config objects
(``<era>.fields_of``) and cached per installed upstream.

One table serves both checks of a key: the era's ``translate`` (upstream
imported) and ``preflight.check_early``, which reads the cache and imports
neither torch nor upstream, so a misspelt key, a wrong type or a layout the
process count cannot hold is one line at once. Without a cache (a first
launch, another model) the early check does nothing and the full check,
which writes the cache, decides.
"""

import dataclasses
import hashlib
import importlib.metadata
import json
import os
from pathlib import Path
from typing import Any

from torchtitan_npu.config.fields import fits, fitted_to
from torchtitan_npu.config.schema import ConfigError, did_you_mean, flatten, wrong_type


@dataclasses.dataclass(frozen=True)
class FieldTable:
    """``fields``: key -> {"type": a ``fields.describe`` description,
    "default": upstream's default (None where it is not plain data)};
    ``open_sections``: sections whose keys another check reads (converters')."""

    version: str
    era: str
    fields: dict[str, dict[str, Any]]
    open_sections: tuple[str, ...] = ()

    def default(self, key: str) -> Any:
        return self.fields[key]["default"]

    def check_all(self, config: dict[str, Any]) -> None:
        for key, value in flatten(config).items():
            self.checked(key, value)

    def checked(self, key: str, value: Any) -> Any:
        """``value`` fitted to the key's type; a ConfigError for a key upstream
        does not have or a value of another type."""
        if key.partition(".")[0] in self.open_sections:
            return value
        field = self.fields.get(key)
        if field is None:
            raise ConfigError(
                f"train config key {key!r} has no counterpart in torchtitan "
                f"{self.version} (era {self.era}){did_you_mean(key, list(self.fields))}"
            )
        value = fitted_to(field["type"], value)
        if want := fits(field["type"], value):
            raise wrong_type(key, value, want, self.version)
        return value


def plain(value: Any) -> Any:
    """``value`` where JSON holds it as it is, else None."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple) and all(plain(v) == v for v in value):
        return list(value)
    return None


# The modules whose code decides a table's content: a new titan-npu (or an
# edit of them) gets new tables, as a new upstream does.
_BUILDERS = ("field_table.py", "fields.py", "trainspec.py", "config_registry.py")


def _upstream_key() -> str | None:
    """The installed upstream's version and a hash of its RECORD (every
    file's content hash) and of the table's builders: a rebuilt or edited
    upstream, or another titan-npu, gets new tables."""
    try:
        dist = importlib.metadata.distribution("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        return None
    record = dist.read_text("RECORD")
    if not record:
        return None
    digest = hashlib.sha256(record.encode())
    for builder in _BUILDERS:  # titan-npu's code that makes a table, too
        digest.update((Path(__file__).parent / builder).read_bytes())
    return f"{dist.version}-{digest.hexdigest()[:16]}"


def cache_path(config: dict[str, Any], shaping: tuple[str, ...]) -> Path | None:
    """The table of ``config``'s upstream and of its ``shaping`` keys' values
    (those that choose upstream's config classes, the era's SHAPING_KEYS)."""
    from torchtitan_npu.assets.builder import cache_base

    key = _upstream_key()
    if key is None:
        return None
    flat = flatten(config)
    chosen = json.dumps([flat.get(k) for k in shaping], sort_keys=True, default=str)
    name = hashlib.sha256(chosen.encode()).hexdigest()[:16]
    return cache_base() / "field-tables" / key / f"{name}.json"


def save(table: FieldTable, config: dict[str, Any], shaping: tuple[str, ...]) -> None:
    path = cache_path(config, shaping)
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(f".{os.getpid()}.tmp")
    staging.write_text(json.dumps(dataclasses.asdict(table)))
    staging.replace(path)  # a concurrent reader sees a whole table or none


def load(config: dict[str, Any], shaping: tuple[str, ...]) -> FieldTable | None:
    path = cache_path(config, shaping)
    if path is None:
        return None
    try:
        data = json.loads(path.read_text())
        return FieldTable(
            data["version"],
            data["era"],
            data["fields"],
            tuple(data["open_sections"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None  # no table yet, or an unreadable one: the full check decides
