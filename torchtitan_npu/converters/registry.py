"""The converter registry: named kernel swaps, each with per-era replacements.

A converter replaces, in a model, the module classes or functions an upstream
era implements an op with (``Replacement``), by versions that call one of the
device kernels in ``kernels``. Module classes are replaced by subclasses that
override the computing method only, so parameters, FQNs and checkpoints are
unchanged. Which models a converter supports is declared per era and checked.

``apply_to_module`` converts a built model (TrainSpec era, on the meta device
before parallelization); ``apply_to_config`` converts a model config tree
(config-registry era, before the model is built).
"""

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torchtitan_npu.config.schema import ConfigError
from torchtitan_npu.converters.kernels import KERNELS, impl_for

logger = logging.getLogger(__name__)


class ConverterError(ConfigError):
    """An unknown converter, or one the model or layout cannot take."""


@dataclass(frozen=True)
class Replacement:
    """What a converter replaces in one era.

    ``target`` is ``"module:qualname"`` of a module class or a function.
    ``build(kernel, original)`` returns, for a class, the attributes its
    subclass overrides; for a function, the replacement function, and then
    ``counted`` names the class (same module) whose instances call it, to
    count what was converted.
    """

    target: str
    models: tuple[str, ...]
    build: Callable[..., Any]
    counted: str | None = None

    @property
    def is_function(self) -> bool:
        return self.counted is not None


@dataclass(frozen=True)
class Converter:
    name: str
    description: str
    kernel: str  # key of kernels.KERNELS
    npu_ops: tuple[str, ...]
    native: str  # what the cuda/cpu implementation is
    replacements: dict[str, tuple[Replacement, ...]]  # era -> replacements
    context_parallel: bool = True  # False: refuses context-parallel layouts
    notes: tuple[str, ...] = field(default=())

    def models(self, era: str) -> tuple[str, ...]:
        return tuple(
            sorted({m for r in self.replacements.get(era, ()) for m in r.models})
        )

    def for_model(self, era: str, model_name: str) -> list[Replacement]:
        return [r for r in self.replacements.get(era, ()) if model_name in r.models]

    def implementation(self, device_type: str) -> Any:
        return KERNELS[self.kernel][impl_for(device_type)]


CONVERTERS: dict[str, Converter] = {}


def register(converter: Converter) -> Converter:
    if converter.name in CONVERTERS:
        raise ValueError(f"converter {converter.name!r} is already registered")
    CONVERTERS[converter.name] = converter
    return converter


def parse_names(value: str | list[str] | None) -> list[str]:
    """``"a,b"`` (a command-line override) or ``["a", "b"]`` (TOML)."""
    if not value:
        return []
    if isinstance(value, str):
        return [n.strip() for n in value.split(",") if n.strip()]
    return list(value)


def all_converters() -> dict[str, Converter]:
    """Every registered converter, the built-in ones included."""
    from torchtitan_npu.converters import builtin  # noqa: F401  (registers)

    return CONVERTERS


def get(name: str) -> Converter:
    if name not in all_converters():
        raise ConverterError(
            f"unknown converter {name!r}; known converters: {sorted(CONVERTERS)}"
        )
    return CONVERTERS[name]


def check(
    names: list[str], *, era: str, model_name: str, context_parallel: bool = False
) -> list[Converter]:
    """The named converters, after checking each supports this model and layout."""
    converters = [get(name) for name in names]
    for converter in converters:
        supported = converter.models(era)
        if not supported:
            raise ConverterError(
                f"converter {converter.name!r} is not available in era {era}; "
                f"it exists for {sorted(converter.replacements)}"
            )
        if model_name not in supported:
            raise ConverterError(
                f"converter {converter.name!r} does not support model "
                f"{model_name!r} in era {era}; it supports {list(supported)}"
            )
        if context_parallel and not converter.context_parallel:
            raise ConverterError(
                f"converter {converter.name!r} does not support context parallelism"
            )
    return converters


def _resolve(spec: str) -> tuple[Any, str, Any]:
    import importlib

    module_name, _, qualname = spec.partition(":")
    owner: Any = importlib.import_module(module_name)
    *path, attr = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, attr, getattr(owner, attr)


@functools.cache
def converted_class(
    cls: type, replacement: Replacement, converter_name: str, device_type: str, era: str
):
    """``cls``'s subclass that computes with the converter's device kernel."""
    converter = CONVERTERS[converter_name]
    name = f"{cls.__name__}_{converter_name}"
    attrs = dict(replacement.build(converter.implementation(device_type), cls))
    attrs.update(__module__=__name__, __qualname__=name, converter=converter_name)
    if era == "config_registry":  # a Configurable: its Config must build it
        from dataclasses import dataclass as _dataclass

        config = type("Config", (cls.Config,), {"__qualname__": f"{name}.Config"})
        attrs["Config"] = _dataclass(kw_only=True, slots=True)(config)
    return type(name, (cls,), attrs)


# Functions replaced process-wide (TrainSpec-era RoPE): owner, attr -> original.
_REPLACED_FUNCTIONS: dict[tuple[Any, str], Any] = {}


def restore_functions() -> None:
    """Undo every function replacement (tests, A/B runs in one process)."""
    for (owner, attr), original in _REPLACED_FUNCTIONS.items():
        setattr(owner, attr, original)
    _REPLACED_FUNCTIONS.clear()


def apply_to_module(
    model, converter: Converter, *, era: str, model_name: str, device_type: str
) -> int:
    """Convert a built model in place; returns how many modules now use it."""
    count = 0
    for replacement in converter.for_model(era, model_name):
        owner, attr, obj = _resolve(replacement.target)
        if replacement.is_function:
            users = getattr(owner, replacement.counted)
            used = sum(type(m) is users for m in model.modules())
            if used:
                original = _REPLACED_FUNCTIONS.get((owner, attr), obj)
                _REPLACED_FUNCTIONS[(owner, attr)] = original
                kernel = converter.implementation(device_type)
                setattr(owner, attr, replacement.build(kernel, original))
            count += used
            continue
        converted = converted_class(obj, replacement, converter.name, device_type, era)
        for module in model.modules():
            if type(module) is obj:
                module.__class__ = converted
                count += 1
    _report(converter, model_name, count)
    return count


def apply_to_config(
    model_config, converter: Converter, *, era: str, model_name: str, device_type: str
):
    """A converted copy of the config tree's matching nodes; returns (config, count)."""
    from torchtitan.config import derive

    count = 0
    for replacement in converter.for_model(era, model_name):
        cls = _resolve(replacement.target)[2]
        converted = converted_class(cls, replacement, converter.name, device_type, era)
        for _, node, parent, attr in list(model_config.traverse(cls.Config)):
            if type(node) is not cls.Config:
                continue
            new = derive(node, converted.Config)
            if parent is None:
                model_config = new
            elif isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
            count += 1
    _report(converter, model_name, count)
    return model_config, count


def apply_named(
    target, names: list[str], *, era: str, model_name: str, device_type: str
):
    """Apply converters by name, in order, the era's way: to a built model
    (TrainSpec) or a model config (config registry). Returns (target, counts)."""
    counts = []
    for converter in check(names, era=era, model_name=model_name):
        if era == "trainspec":
            count = apply_to_module(
                target,
                converter,
                era=era,
                model_name=model_name,
                device_type=device_type,
            )
        else:
            target, count = apply_to_config(
                target,
                converter,
                era=era,
                model_name=model_name,
                device_type=device_type,
            )
        counts.append(count)
    return target, counts


def _report(converter: Converter, model_name: str, count: int) -> None:
    if count:
        logger.info(
            "converter %s: %d module(s) of %s", converter.name, count, model_name
        )
    else:
        logger.warning(
            "converter %s replaced nothing in model %s", converter.name, model_name
        )
