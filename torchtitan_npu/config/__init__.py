"""The project's train-config format and its translation to each upstream era."""

from torchtitan_npu.config.schema import (
    DEFAULT_CONFIG,
    ConfigError,
    parse_overrides,
    resolve,
)

__all__ = ["DEFAULT_CONFIG", "ConfigError", "launch", "parse_overrides", "resolve"]


def launch(config: dict, *, era: str, version: str) -> None:
    """Hand a resolved config to the running era's upstream entry point."""
    if era == "trainspec":
        from torchtitan_npu.config.trainspec import launch as era_launch
    else:
        from torchtitan_npu.config.config_registry import launch as era_launch
    era_launch(config, version=version)
