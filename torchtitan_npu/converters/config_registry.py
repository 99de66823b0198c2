"""Converters in the config-registry era (torchtitan 0.3.x).

Each converter runs as an upstream ``ModelConfigConverter`` on the model
config tree of the ``Trainer.Config`` (what ``model_registry(converters=...)``
does), swapping the config classes of the modules it replaces for configs
that build converted subclasses.
"""

import functools
from dataclasses import dataclass
from typing import Any

from torchtitan.config import derive
from torchtitan.protocols.model import ModelConfigConverter

from torchtitan_npu.compat.era import Era
from torchtitan_npu.converters.registry import (
    Converter,
    Replacement,
    check,
    get,
    parse_names,
    report,
    request,
    running_version,
    subclass,
)
from torchtitan_npu.overlay.registry import resolve_target

ERA = Era.CONFIG_REGISTRY


@functools.cache
def converted_class(
    cls: type, replacement: Replacement, converter_name: str, device_type: str
) -> type:
    """``cls``'s subclass that computes with the converter's device kernel; a
    Configurable, so its own ``Config`` builds it."""
    name, attrs = subclass(cls, replacement, converter_name, device_type)
    config = type("Config", (cls.Config,), {"__qualname__": f"{name}.Config"})
    attrs["Config"] = dataclass(kw_only=True, slots=True)(config)
    return type(name, (cls,), attrs)


def apply_to_config(
    model_config: Any, converter: Converter, *, model_name: str, device_type: str
) -> tuple[Any, int]:
    """A converted copy of the config tree's matching nodes; returns (config, count)."""
    count = 0
    for replacement in converter.for_model(ERA, model_name, running_version()):
        cls = resolve_target(replacement.target).obj
        converted = converted_class(cls, replacement, converter.name, device_type)
        nodes = [
            (node, parent, attr)
            for _, node, parent, attr in model_config.traverse(cls.Config)
            if type(node) is cls.Config
        ]
        if nodes:
            request(converter, replacement, device_type)
        for node, parent, attr in nodes:
            new = derive(node, converted.Config)
            if parent is None:
                model_config = new
            elif isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
            count += 1
    report(converter, model_name, count)
    return model_config, count


def apply_named(
    model_config: Any, names: list[str], *, model_name: str, device_type: str
) -> tuple[Any, list[int]]:
    """Apply converters by name, in order; returns (model_config, counts)."""
    counts = []
    version = running_version()
    for converter in check(names, era=ERA, model_name=model_name, version=version):
        model_config, count = apply_to_config(
            model_config, converter, model_name=model_name, device_type=device_type
        )
        counts.append(count)
    return model_config, counts


class KernelConverter(ModelConfigConverter):
    """One titan-npu converter, by name, for one model and device."""

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        name: str
        model_name: str
        device_type: str

    def __init__(self, config: Config):
        self.config = config

    def convert(self, model_config: Any) -> Any:
        cfg = self.config
        model_config, _ = apply_to_config(
            model_config,
            get(cfg.name),
            model_name=cfg.model_name,
            device_type=cfg.device_type,
        )
        return model_config


def apply(
    trainer_config: Any, value: Any, *, model_name: str, device_type: str, version: str
) -> None:
    """Convert ``trainer_config``'s model with the named converters, in order."""
    names = parse_names(value)
    context_parallel = trainer_config.parallelism.context_parallel_degree > 1
    check(
        names,
        era=ERA,
        model_name=model_name,
        context_parallel=context_parallel,
        version=version,
    )
    spec = trainer_config.model_spec
    for name in names:
        config = KernelConverter.Config(
            name=name, model_name=model_name, device_type=device_type
        )
        spec.model = config.build().convert(spec.model)
