"""Converters in the config-registry era (torchtitan 0.3.x).

Each converter runs as an upstream ``ModelConfigConverter`` on the model
config tree of the ``Trainer.Config`` (what ``model_registry(converters=...)``
does), swapping the config classes of the modules it replaces.
"""

from dataclasses import dataclass

from torchtitan.protocols.model import ModelConfigConverter

from torchtitan_npu.converters.registry import apply_to_config, check, get, parse_names

ERA = "config_registry"


class KernelConverter(ModelConfigConverter):
    """One titan-npu converter, by name, for one model and device."""

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        name: str
        model_name: str
        device_type: str

    def __init__(self, config: Config):
        self.config = config

    def convert(self, model_config):
        cfg = self.config
        model_config, _ = apply_to_config(
            model_config,
            get(cfg.name),
            era=ERA,
            model_name=cfg.model_name,
            device_type=cfg.device_type,
        )
        return model_config


def apply(trainer_config, value, *, model_name: str, device_type: str) -> None:
    """Convert ``trainer_config``'s model with the named converters, in order."""
    names = parse_names(value)
    context_parallel = trainer_config.parallelism.context_parallel_degree > 1
    check(names, era=ERA, model_name=model_name, context_parallel=context_parallel)
    spec = trainer_config.model_spec
    for name in names:
        config = KernelConverter.Config(
            name=name, model_name=model_name, device_type=device_type
        )
        spec.model = config.build().convert(spec.model)
