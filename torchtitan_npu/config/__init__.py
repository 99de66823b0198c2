"""The project's train-config format and its translation to each upstream era."""

from types import ModuleType

from torchtitan_npu.config.schema import (
    DEFAULT_CONFIG,
    ConfigError,
    parse_overrides,
    resolve,
)

__all__ = [
    "DEFAULT_CONFIG",
    "ConfigError",
    "era_translator",
    "parse_overrides",
    "resolve",
]


def era_translator(era: str) -> ModuleType:
    """The module translating project configs to ``era``'s upstream config.

    Each provides ``upstream_argv(job_file)`` (upstream's command line, which
    must be set before torchtitan is imported: 0.2.x binds ``sys.argv`` as a
    default argument at import) and ``write_upstream_config(config, version=,
    path=)``.
    """
    if era == "trainspec":
        from torchtitan_npu.config import trainspec as translator
    else:
        from torchtitan_npu.config import config_registry as translator
    return translator
