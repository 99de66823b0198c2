"""Converters in the config-registry era (torchtitan 0.3.x).

Each converter runs as an upstream ``ModelConfigConverter`` on the model
config tree of the ``Trainer.Config`` (what ``model_registry(converters=...)``
does), swapping the config classes of the modules it replaces for configs
that build converted subclasses.
"""

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from torchtitan.config import derive
from torchtitan.protocols.model import ModelConfigConverter

from torchtitan_npu.compat.era import Era
from torchtitan_npu.config.fields import expected, field_type
from torchtitan_npu.config.schema import did_you_mean, wrong_type
from torchtitan_npu.converters.quantization import (
    QUANTIZATIONS,
    QUANTIZE,
    check_runnable,
    model_compiled,
    settings,
)
from torchtitan_npu.converters.registry import (
    CONVERTERS,
    Converter,
    Replacement,
    check,
    get,
    parse_names,
    report,
    request,
    running_version,
    subclass,
    unknown,
)
from torchtitan_npu.errors import ConfigError, ConverterError
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


def quantization_configs(
    flat: dict[str, Any], names: list[str], *, version: str
) -> dict[str, Any]:
    """Upstream's converter configs of the quantizations ``names`` lists,
    built from the config's ``[quantize.*]`` keys (upstream 0.2.x's names);
    every such key is checked by name and type against this release's
    fields. ``model_compile_enabled`` follows ``[compile]`` as in upstream's
    recipes."""
    from torchtitan.components import quantization as upstream

    used = set()  # the [quantize.*] sections the config sets
    for key in (k for k in flat if k.startswith(QUANTIZE)):
        section = key.rpartition(".")[0]
        if section not in QUANTIZATIONS:
            raise ConfigError(
                f"train config key {key!r} has no counterpart in torchtitan "
                f"{version}{did_you_mean(section, QUANTIZATIONS)}; its quantize "
                f"sections: {sorted(QUANTIZATIONS)}"
            )
        used.add(section)
    configs = {}
    for name, quantization in QUANTIZATIONS.items():
        if name not in used and name not in names:
            continue
        config_class = getattr(upstream, quantization.config_class).Config
        defaults = config_class()
        fields = [f.name for f in dataclasses.fields(defaults)]
        fields.remove("model_compile_enabled")  # from [compile]
        values = settings(flat, name)
        for field, value in values.items():
            key = f"{name}.{field}"
            if field not in fields:
                raise ConfigError(
                    f"train config key {key!r} has no counterpart in torchtitan "
                    f"{version}{did_you_mean(field, fields)}; [{name}] takes {fields}"
                )
            if want := expected(field_type(defaults, field), value):
                raise wrong_type(key, value, want, version)
        if name in names:
            configs[name] = config_class(
                **values, model_compile_enabled=model_compiled(flat)
            )
    return configs


def apply(
    trainer_config: Any,
    flat: dict[str, Any],
    *,
    model_name: str,
    device_type: str,
    version: str,
) -> None:
    """Convert ``trainer_config``'s model with the converters ``model.converters``
    names, in order: titan-npu's kernel converters and upstream's quantization."""
    names = parse_names(flat.get("model.converters"))
    for name in names:
        if name not in CONVERTERS and name not in QUANTIZATIONS:
            raise unknown(name, [*CONVERTERS, *QUANTIZATIONS])
    quantizations = quantization_configs(flat, names, version=version)
    context_parallel = trainer_config.parallelism.context_parallel_degree > 1
    check(
        [n for n in names if n not in QUANTIZATIONS],
        era=ERA,
        model_name=model_name,
        context_parallel=context_parallel,
        version=version,
    )
    check_runnable(names, flat, device_type)
    spec = trainer_config.model_spec
    for name in names:
        config = quantizations.get(name) or KernelConverter.Config(
            name=name, model_name=model_name, device_type=device_type
        )
        try:
            spec.model = config.build().convert(spec.model)
        except ConfigError:
            raise
        except (ImportError, ValueError) as e:  # upstream's own checks
            raise ConverterError(f"converter {name!r}: {e}") from e
