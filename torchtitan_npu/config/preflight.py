"""Checks of a resolved train config before anything is launched.

``check`` runs in the launcher process: the parallel layout against the
number of processes, the paths the run reads, then the era's own translation
(every key, its type, the model and flavor). Each problem is a ``ConfigError``
that the CLI prints as one line.
"""

from pathlib import Path
from typing import Any

from torchtitan_npu.config import hf_model
from torchtitan_npu.config.schema import ConfigError

# [parallelism] key -> upstream's default (-1: "the rest of the processes")
_DEGREES = {
    "data_parallel_replicate_degree": 1,
    "data_parallel_shard_degree": -1,
    "context_parallel_degree": 1,
    "tensor_parallel_degree": 1,
    "pipeline_parallel_degree": 1,
}


def check_layout(config: dict[str, Any], world_size: int | None, launch: str) -> None:
    """The parallel degrees multiply to the number of processes launched."""
    parallelism = config.get("parallelism", {})
    degrees = {key: parallelism.get(key, default) for key, default in _DEGREES.items()}
    for key, value in degrees.items():
        wildcard = key == "data_parallel_shard_degree" and value == -1
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"parallelism.{key} = {value!r}: expected an integer")
        if value < 1 and not wildcard:
            raise ConfigError(f"parallelism.{key} = {value}: must be at least 1")
    if world_size is None:
        return
    fixed = 1
    for value in degrees.values():
        fixed *= 1 if value == -1 else value
    product = " x ".join(f"{k.removesuffix('_degree')} {v}" for k, v in degrees.items())
    shard_is_rest = degrees["data_parallel_shard_degree"] == -1
    if (shard_is_rest and world_size % fixed) or (
        not shard_is_rest and fixed != world_size
    ):
        need = f"a multiple of {fixed}" if shard_is_rest else str(fixed)
        raise ConfigError(
            f"parallelism ({product}) needs {need} processes, but this launch has "
            f"{world_size} ({launch}); change the degrees or the process count"
        )


def absolute_paths(config: dict[str, Any]) -> None:
    """Paths the ranks read, checked to exist and made absolute (upstream
    0.3.x requires an absolute initial_load_path)."""
    for section, key, what in [
        ("model", "hf_assets_path", "tokenizer/HF assets folder"),
        ("training", "dataset_path", "dataset path"),
        ("checkpoint", "initial_load_path", "checkpoint to start from"),
    ]:
        value = config.get(section, {}).get(key)
        if not value:
            continue
        if not isinstance(value, str):
            raise ConfigError(f"{section}.{key} = {value!r}: expected a path")
        if "://" in value:
            continue  # remote storage: upstream reads it
        path = Path(value).expanduser()
        if not path.exists():
            raise ConfigError(
                f"{section}.{key}: {what} {value} does not exist "
                f"(set --{section}.{key} PATH)"
            )
        config[section][key] = str(path.resolve())


def check_checkpoint(config: dict[str, Any]) -> None:
    """A checkpoint to start from is loaded only with checkpointing on."""
    checkpoint = config.get("checkpoint", {})
    if checkpoint.get("initial_load_path") and not checkpoint.get("enable"):
        raise ConfigError(
            "checkpoint.initial_load_path is set but checkpoint.enable is false, "
            "so nothing would be loaded; add --checkpoint.enable true"
        )


def check(config: dict[str, Any], *, world_size: int | None, launch: str) -> None:
    """Every check that needs no rank: layout, paths, then the era translation."""
    check_layout(config, world_size, launch)
    absolute_paths(config)
    hf_model.prepare(config)
    check_checkpoint(config)
    from torchtitan_npu.bootstrap import activate
    from torchtitan_npu.config import era_config
    from torchtitan_npu.tools.log_noise import quiet_upstream_noise

    quiet_upstream_noise()
    activation = activate()
    version = activation.upstream.installed.version
    try:
        era_config(activation.context.era).translate(
            config, version=version, device_type=activation.context.device_type
        )
    except ConfigError:
        raise
    except Exception as e:
        if activation.upstream.tested:
            raise
        # An untested upstream (opt-in) whose config API is not its era's.
        raise ConfigError(
            f"torchtitan {version} is untested and its config API differs from "
            f"era {activation.context.era}'s ({type(e).__name__}: {e}); install "
            "a tested upstream (titan-npu --version lists the lock)"
        ) from e
