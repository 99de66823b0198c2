"""The train config's batch and dataset keys on upstream's two 0.3-era shapes.

The project's format keeps one spelling for every upstream: a batch is
``training.local_batch_size`` sequences of ``training.seq_len`` tokens per
data-parallel rank (split into pipeline microbatches of
``parallelism.pipeline_parallel_microbatch_size``), up to
``training.global_batch_size`` sequences a step; a dataset is a name of
upstream's ``DATASETS`` and an optional local ``dataset_path``.

torchtitan 0.3.0 has these fields itself. Upstream main (#4121, #4088) counts
tokens instead and builds Grain dataset configs: ``token_counts`` maps the
project's keys onto ``num_tokens_per_microbatch_per_dp_rank``,
``num_tokens_per_train_step``, ``max_context_length`` and
``num_pp_microbatches`` (the same tokens per step), and ``grain_dataset``
puts the named dataset, relocated to ``dataset_path``, inside the recipe's own
packing. Which shape an upstream has is read from its config classes, not
from its version. docs/train_configs.md shows the mapping.
"""

import dataclasses
import functools
import inspect
from typing import Any

from torchtitan_npu.config.schema import ConfigError

# project key -> main's token-count field it becomes
TOKEN_FIELDS = {
    "training.local_batch_size": "training.num_tokens_per_microbatch_per_dp_rank",
    "training.global_batch_size": "training.num_tokens_per_train_step",
    "training.seq_len": "training.max_context_length",
    "parallelism.pipeline_parallel_microbatch_size": "parallelism.num_pp_microbatches",
}
DATA_KEYS = ("dataset", "dataset_path")
# project section -> the Trainer.Config path of its dataloader
LOADERS = {"training": "dataloader", "validation": "validator.dataloader"}


@functools.cache
def counts_tokens() -> bool:
    """Whether upstream's TrainingConfig counts tokens rather than sequences
    (0.3.0); such an upstream (main) feeds its model one row of packed
    documents, ``[tokens]`` with per-document positions, not ``[rows, seq]``."""
    from torchtitan.config import TrainingConfig

    return any(
        f.name == "max_context_length" for f in dataclasses.fields(TrainingConfig)
    )


def grain_loader(loader: Any) -> bool:
    """Whether a dataloader config takes a dataset config (main's Grain
    loader) rather than a dataset name (0.3.0)."""
    return not isinstance(getattr(loader, "dataset", ""), str | None)


def sequence_batch(trainer_config: Any) -> dict[str, int]:
    """The project's batch keys as upstream's config holds them (0.3.0: its
    own fields; main: derived from the token counts)."""
    training, parallelism = trainer_config.training, trainer_config.parallelism
    if not counts_tokens():
        return {
            "training.local_batch_size": training.local_batch_size,
            "training.global_batch_size": training.global_batch_size,
            "training.seq_len": training.seq_len,
            "parallelism.pipeline_parallel_microbatch_size": (
                parallelism.pipeline_parallel_microbatch_size
            ),
        }
    seq, count = training.max_context_length, parallelism.num_pp_microbatches
    per_forward = training.num_tokens_per_microbatch_per_dp_rank // seq
    if parallelism.pipeline_parallel_degree > 1:
        local, size = per_forward * count, per_forward
    else:  # one forward takes it all; with PP it would split into `count`
        local, size = per_forward, max(1, per_forward // count)
    total = training.num_tokens_per_train_step
    return {
        "training.local_batch_size": local,
        "training.global_batch_size": total // seq if total > 0 else total,
        "training.seq_len": seq,
        "parallelism.pipeline_parallel_microbatch_size": size,
    }


def set_token_counts(trainer_config: Any, batch: dict[str, int]) -> None:
    """Main's token fields for a project batch: one model forward per DP rank
    takes a microbatch (with PP) or the local batch (without) of ``seq_len``
    tokens; a step takes ``global_batch_size`` sequences."""
    training, parallelism = trainer_config.training, trainer_config.parallelism
    for key, value in batch.items():  # main's own checks would name its fields
        if value <= 0 and not (key == "training.global_batch_size" and value == -1):
            either = "-1 or " if key == "training.global_batch_size" else ""
            raise ConfigError(f"{key} must be {either}greater than 0 (it is {value})")
    seq, local = batch["training.seq_len"], batch["training.local_batch_size"]
    size = batch["parallelism.pipeline_parallel_microbatch_size"]
    if parallelism.pipeline_parallel_degree > 1:
        if local % size:
            raise ConfigError(
                f"training.local_batch_size {local} is not a multiple of "
                f"parallelism.pipeline_parallel_microbatch_size {size}; change one "
                "of them"
            )
        parallelism.num_pp_microbatches = local // size
        local = size
    training.max_context_length = seq
    training.num_tokens_per_microbatch_per_dp_rank = local * seq
    total = batch["training.global_batch_size"]
    training.num_tokens_per_train_step = total * seq if total > 0 else total


def token_counts(trainer_config: Any, flat: dict[str, Any]) -> None:
    """Set main's token fields from the project's batch keys in ``flat``
    (the recipe's values for those it leaves out). A config that sets main's
    own token fields instead keeps them; setting both is refused."""
    own = [key for key in TOKEN_FIELDS.values() if key in flat]
    project = [key for key in TOKEN_FIELDS if key in flat]
    if own and project:
        raise ConfigError(
            f"{project[0]} and {own[0]} both set the batch; use the project's "
            f"keys ({', '.join(TOKEN_FIELDS)}) or upstream's token counts, not both"
        )
    if own:
        return
    given = {key: flat[key] for key in project}
    batch = sequence_batch(trainer_config) | given
    size = "parallelism.pipeline_parallel_microbatch_size"
    if "training.local_batch_size" in given and size not in given:
        # main's default is a count of microbatches (num_pp_microbatches), not
        # a size: a new local batch splits into as many as the recipe's
        count = trainer_config.parallelism.num_pp_microbatches
        batch[size] = max(1, given["training.local_batch_size"] // count)
    set_token_counts(trainer_config, batch)


def datasets(loader: Any = None) -> dict[str, Any]:
    """Upstream's datasets by name that a dataloader config reads: the
    ``DATASETS`` beside its class (0.3.0) or its collator's (main: flux's
    images), else the text datasets (both shapes keep them in one place)."""
    for part in (loader, getattr(loader, "collator", None)):
        known = getattr(inspect.getmodule(type(part)), "DATASETS", None)
        if part is not None and isinstance(known, dict):
            return known
    from torchtitan.hf_datasets.text_datasets import DATASETS

    return DATASETS


def inner_dataset(dataset: Any) -> Any:
    """The dataset a recipe's packing config wraps (itself when unpacked)."""
    inner = getattr(dataset, "dataset", None)
    return dataset if inner is None else inner_dataset(inner)


def dataset_name(loader: Any) -> str | None:
    """The ``DATASETS`` name of a Grain loader's (packed) dataset config."""
    inner = inner_dataset(loader.dataset)
    return next((name for name, d in datasets(loader).items() if d is inner), None)


def relocated(dataset: Any, path: str | None) -> Any:
    """``dataset`` read from the local folder ``path``, as 0.3.0's text loader
    reads it (``load_dataset(path, ...)``: the folder's files, the split and
    name the dataset names); unchanged without a path."""
    if not path:
        return dataset
    source = dataset.source
    kwargs = {k: v for k, v in source.load_dataset_kwargs.items() if k != "data_files"}
    source = dataclasses.replace(source, path=path, load_dataset_kwargs=kwargs)
    return dataclasses.replace(dataset, source=source)


def repacked(dataset: Any, inner: Any) -> Any:
    """The recipe's packing around ``inner`` instead of its own dataset."""
    wrapped = getattr(dataset, "dataset", None)
    if wrapped is None:
        return inner
    return dataclasses.replace(dataset, dataset=repacked(wrapped, inner))


def grain_dataset(loader: Any, section: str, name: Any, path: Any) -> None:
    """Point a Grain dataloader config at ``DATASETS[name]`` (the recipe's
    own when None) in ``path``, inside the recipe's packing."""
    known = datasets(loader)
    if name is None:
        name = dataset_name(loader)
        if name is None:  # a recipe's own dataset (multimodal): left as it is
            if path:
                raise ConfigError(
                    f"{section}.dataset_path is set but this recipe's dataset is "
                    f"none of upstream's named ones; also set --{section}.dataset "
                    f"({', '.join(known)})"
                )
            return
    if name not in known:
        from torchtitan_npu.config.preflight import check_dataset_name

        check_dataset_name(section, name, known)
    loader.dataset = repacked(loader.dataset, relocated(known[name], path))
