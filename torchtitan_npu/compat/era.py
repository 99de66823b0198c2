"""The upstream API eras: the one module that spells them.

An era is a span of upstream releases sharing one config system and one model
protocol. Code that differs by era is either a module named after the era
(``<package>/<era>.py``, reached with ``era_module``) or a table keyed by
``Era`` members; docs/architecture.md lists every such site.
"""

import importlib
from enum import StrEnum
from types import ModuleType

from torchtitan_npu.errors import LockError


class Era(StrEnum):
    TRAINSPEC = "trainspec"  # torchtitan 0.2.x
    CONFIG_REGISTRY = "config_registry"  # torchtitan 0.3.x

    @property
    def description(self) -> str:
        return _DESCRIPTIONS[self]


_DESCRIPTIONS = {
    Era.TRAINSPEC: "TOML JobConfig + TrainSpec + ModelConverter registry",
    Era.CONFIG_REGISTRY: "Python config registry + ModelSpec + config overrides",
}


def parse_era(value: str) -> Era:
    """``value`` as an Era; a LockError naming the known ones."""
    try:
        return Era(value)
    except ValueError:
        known = [e.value for e in Era]
        raise LockError(f"unknown upstream API era {value!r}; known: {known}") from None


def era_module(package: str, era: Era) -> ModuleType:
    """``<package>.<era>``: the era's implementation of a subsystem."""
    return importlib.import_module(f"{package}.{Era(era).value}")
