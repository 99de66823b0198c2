"""The project's train-config format and its translation to each upstream era.

Translation is one step per process, in one direction, in the era's module
(``config/<era>.py``, from ``era_config``):

- ``upstream_argv(job_file)``: upstream's command line. It must be set before
  torchtitan is imported (0.2.x binds ``sys.argv`` as a default argument).
- ``translate(config, *, version, device_type)``: the upstream config (0.2.x:
  the JobConfig TOML's content; 0.3.x: a ``Trainer.Config``). Every key, its
  type, the model, flavor and converters are checked here: the launcher's
  preflight and every rank call it.
- ``hand_over(upstream_config, job_file)``: give it to upstream's config
  manager (0.2.x: the TOML file it reads; 0.3.x: the config function it calls,
  in the same process).
"""

from types import ModuleType

from torchtitan_npu.compat.era import Era, era_module
from torchtitan_npu.config.schema import (
    DEFAULT_CONFIG,
    ConfigError,
    parse_overrides,
    resolve,
)

__all__ = [
    "DEFAULT_CONFIG",
    "ConfigError",
    "era_config",
    "parse_overrides",
    "resolve",
]


def era_config(era: Era) -> ModuleType:
    """``config/<era>.py``: the era's upstream_argv, translate and hand_over."""
    return era_module(__name__, era)
