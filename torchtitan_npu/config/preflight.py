"""Checks of a resolved train config before anything is launched.

``check`` runs in the launcher process: the parallel layout against the
number of processes, the paths the run reads, the checkpoint it will load
(whole, and of this era), then the era's own translation (every key, its
type, the model and flavor). Each problem is a ``ConfigError``
that the CLI prints as one line.
"""

import itertools
import json
import os
import re
from pathlib import Path
from typing import Any

from torchtitan_npu.config import field_table
from torchtitan_npu.config.field_table import FieldTable
from torchtitan_npu.config.schema import ConfigError, did_you_mean
from torchtitan_npu.errors import ConversionError

# The mesh degrees a launch's process count must match (-1: "the rest").
_DEGREES = (
    "data_parallel_replicate_degree",
    "data_parallel_shard_degree",
    "context_parallel_degree",
    "tensor_parallel_degree",
    "pipeline_parallel_degree",
)


def _degrees(config: dict[str, Any], table: FieldTable) -> dict[str, Any]:
    """The degrees ``config`` sets, else upstream's defaults."""
    parallelism = config.get("parallelism", {})
    return {
        key: parallelism.get(key, table.default(f"parallelism.{key}"))
        for key in _DEGREES
    }


def _fixed(degrees: dict[str, int]) -> int:
    """The product of the mesh degrees that are set (not -1, "the rest")."""
    product = 1
    for key in _DEGREES:
        product *= 1 if degrees[key] == -1 else degrees[key]
    return product


def check_layout(
    config: dict[str, Any], table: FieldTable, world_size: int | None, launch: str
) -> None:
    """The parallel degrees multiply to the number of processes launched."""
    degrees = _degrees(config, table)
    for key, value in degrees.items():
        wildcard = key == "data_parallel_shard_degree" and value == -1
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"parallelism.{key} = {value!r}: expected an integer")
        if value < 1 and not wildcard:
            raise ConfigError(f"parallelism.{key} = {value}: must be at least 1")
    if world_size is None:
        return
    fixed = _fixed(degrees)
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


# (section, key) -> the least value a run can use
_LEAST = {
    ("training", "steps"): 1,
    ("training", "local_batch_size"): 1,
    ("training", "seq_len"): 1,
    ("optimizer", "lr"): 0,
    ("metrics", "log_freq"): 1,
    ("checkpoint", "interval"): 1,
    ("checkpoint", "keep_latest_k"): 0,
    ("lr_scheduler", "warmup_steps"): 0,
    ("lr_scheduler", "decay_ratio"): 0,
    ("lr_scheduler", "min_lr_factor"): 0,
    ("validation", "freq"): 1,
}


def check_values(config: dict[str, Any]) -> None:
    """Numbers upstream takes without a word (a negative learning rate, no
    steps) or refuses only in the ranks (a batch of 0, a log every 0 steps)."""
    for (section, key), least in _LEAST.items():
        value = config.get(section, {}).get(key)
        if isinstance(value, (int, float)) and value < least:
            raise ConfigError(f"{section}.{key} = {value}: must be at least {least}")
    max_norm = config.get("training", {}).get("max_norm")
    if isinstance(max_norm, (int, float)) and max_norm <= 0:
        raise ConfigError(
            f"training.max_norm = {max_norm}: must be above 0 (upstream always "
            "clips: 0 zeroes every gradient, a negative norm flips them); a large "
            "one (1e9) clips practically never"
        )
    option = config.get("activation_checkpoint", {}).get("selective_ac_option", "op")
    if option != "op" and not str(option).lstrip("-").isdigit():
        raise ConfigError(
            f"activation_checkpoint.selective_ac_option = {option!r}: 'op' (per-op "
            "selective AC) or a number N (every Nth layer checkpointed whole)"
        )
    steps = config.get("validation", {}).get("steps")
    if isinstance(steps, int) and steps != -1 and steps < 1:
        raise ConfigError(
            f"validation.steps = {steps}: must be at least 1, or -1 (the whole "
            "validation set)"
        )
    if config.get("checkpoint", {}).get("keep_latest_k") == 1:
        raise ConfigError(
            "checkpoint.keep_latest_k = 1: upstream keeps 0 (all) or at least 2, "
            "as the newest may still be being written"
        )


def check_batch(
    translated: Any, table: FieldTable, world_size: int | None, launch: str
) -> None:
    """Upstream's trainer splits the global batch into local batches x
    data-parallel ranks x gradient-accumulation steps, and asserts it can."""
    total = _setting(translated, table, "training", "global_batch_size")
    if world_size is None or total < 0:
        return
    local = _setting(translated, table, "training", "local_batch_size")
    dp = dp_degree(_parallelism(translated, table), world_size)
    if total == 0 or total % (local * dp):
        raise ConfigError(
            f"training.global_batch_size {total} must be a positive multiple of "
            f"local_batch_size {local} x data-parallel degree {dp} ({launch}) = "
            f"{local * dp}: upstream accumulates gradients over global / (local x "
            f"dp) steps; use a multiple of {local * dp}, or -1 for one step"
        )


def check_optimizer(
    translated: Any, table: FieldTable, known: tuple[str, ...], version: str
) -> None:
    """Upstream builds its optimizers by name, after the model (a few names)."""
    if isinstance(translated, dict):
        names = [_setting(translated, table, "optimizer", "name")]
    else:
        names = [group.optimizer_name for group in translated.optimizer.param_groups]
    for name in names:
        if name not in known:
            raise ConfigError(
                f"optimizer.name {name!r} is not one torchtitan {version} builds"
                f"{did_you_mean(name, known)}; it builds "
                f"{', '.join(known)}"
            )


def check_profiling(translated: Any, table: FieldTable, device_type: str) -> None:
    """The profiler's cycle fits its period, and memory snapshots have a
    device allocator to record (upstream fails at the first step)."""
    if _setting(translated, table, "profiling", "enable_profiling"):
        freq = _setting(translated, table, "profiling", "profile_freq")
        warmup = _setting(translated, table, "profiling", "profiler_warmup")
        active = _setting(translated, table, "profiling", "profiler_active")
        if freq < warmup + active:
            raise ConfigError(
                f"profiling.profile_freq {freq} is shorter than profiler_warmup "
                f"{warmup} + profiler_active {active}; set --profiling.profile_freq "
                f"{warmup + active} or more"
            )
    if device_type == "cpu" and _setting(
        translated, table, "profiling", "enable_memory_snapshot"
    ):
        raise ConfigError(
            "profiling.enable_memory_snapshot records a cuda or npu allocator's "
            "history; this run is on cpu: set it false or train on a device"
        )


def check_chunked_loss(
    translated: Any,
    table: FieldTable,
) -> None:
    """0.3's chunked loss splits each rank's sequence into equal chunks; upstream
    refuses another length at the first step."""
    chunks = getattr(getattr(translated, "loss", None), "num_chunks", None)
    if not chunks:
        return
    seq = _setting(translated, table, "training", "seq_len")
    cp = _setting(translated, table, "parallelism", "context_parallel_degree")
    if (seq // cp) % chunks:
        raise ConfigError(
            f"training.seq_len {seq} over context_parallel {cp} leaves each rank "
            f"{seq // cp} tokens, which upstream's chunked loss cannot split into "
            f"its {chunks} chunks; use a multiple of {chunks * cp}"
        )


# Upstream's text datasets (both eras): HF datasets' load_dataset(path) of a
# local folder, training on each record's "text".
_TEXT_DATASETS = ("c4", "c4_test", "c4_validation")
_C4_TEST = "tests/assets/c4_test"  # c4_test's path in upstream's repository


def check_dataset(config: dict[str, Any]) -> None:
    """A local dataset_path of a text dataset (training's, validation's) is a
    folder holding data files whose records have "text" (else a rank fails on
    load or first sample)."""
    for section in ("training", "validation"):
        data = config.get(section, {})
        if section == "validation" and not data.get("enable"):
            continue  # not read
        name, value = data.get("dataset"), data.get("dataset_path")
        if name == "c4_test" and not value and not Path(_C4_TEST).is_dir():
            raise ConfigError(
                f"{section}.dataset c4_test without a dataset_path reads upstream's "
                f"{_C4_TEST} from the current directory, and there is none "
                f"({Path.cwd()}): set --{section}.dataset_path to a folder of "
                f".jsonl files, or --{section}.dataset embedded"
            )
        if name in _TEXT_DATASETS and value and "://" not in value:
            _check_text_folder(Path(value), name, f"{section}.dataset_path {value}")


def check_dataset_name(section: str, name: Any, known: Any) -> None:
    """`name` is a dataset of upstream's loader registry `known` (the
    ``DATASETS`` of the loader's module; None when it has none)."""
    if isinstance(known, dict) and isinstance(name, str) and name not in known:
        text = "c4_test" in known
        embedded = " (the embedded text corpus)" if name == "c4_test" else ""
        raise ConfigError(
            f"{section}.dataset {name!r}{embedded} is not a dataset upstream's "
            f"loader for this model knows{did_you_mean(name, known)}; it knows "
            f"{', '.join(known)}" + (", and titan-npu 'embedded'" if text else "")
        )


def _check_text_folder(path: Path, name: str, what: str) -> None:
    reads = f"upstream's {name} loader reads a folder (HF datasets' load_dataset)"
    if path.is_file():
        raise ConfigError(
            f"{what} is a file; {reads}: put the file in a folder and pass the folder"
        )
    files = (Path(root) / f for root, _, names in os.walk(path) for f in sorted(names))
    first = next(files, None)
    if first is None:
        raise ConfigError(
            f"{what} holds no files; {reads} of .jsonl, .json, .parquet, .csv or "
            ".txt files"
        )
    candidates = itertools.chain([first], itertools.islice(files, 1000))
    sample = next((f for f in candidates if f.suffix == ".jsonl"), None)
    record = _first_record(sample) if sample else None
    if isinstance(record, dict) and "text" not in record:
        raise ConfigError(
            f"{sample}: its records have no 'text' field (they have "
            f"{sorted(record)[:5]}); upstream's {name} trains on each record's "
            "'text': rename the field"
        )


def _first_record(path: Path) -> Any:
    """The first JSON line of a .jsonl file; None when unreadable."""
    try:
        with open(path) as f:
            line = next((x for x in f if x.strip()), "")
        return json.loads(line)
    except (OSError, ValueError):  # UnicodeDecodeError is a ValueError
        return None


def check_checkpoint(config: dict[str, Any]) -> None:
    """A checkpoint to start from is loaded only with checkpointing on."""
    checkpoint = config.get("checkpoint", {})
    initial = checkpoint.get("initial_load_path")
    if initial and not checkpoint.get("enable"):
        raise ConfigError(
            "checkpoint.initial_load_path is set but checkpoint.enable is false, "
            "so nothing would be loaded; add --checkpoint.enable true"
        )
    hf = checkpoint.get("initial_load_in_hf")
    if hf and initial and "://" not in initial:
        if not any(Path(initial).glob("*.safetensors")):
            dcp = (Path(initial) / ".metadata").is_file()
            raise ConfigError(
                f"checkpoint.initial_load_in_hf reads HF safetensors, and "
                f"{initial} has none"
                + (
                    ": it is a DCP checkpoint; load it without "
                    "--checkpoint.initial_load_in_hf"
                    if dcp
                    else "; point --checkpoint.initial_load_path at an HF model folder"
                )
            )


def checkpoint_to_load(config: dict[str, Any]) -> tuple[Path, bool] | None:
    """(the DCP checkpoint the run will load, whether it resumes), as upstream
    picks it: ``load_step``'s or else the newest ``step-N`` of the run's own
    checkpoint folder with a .metadata (a resume), else ``initial_load_path``
    (unless it is HF)."""
    checkpoint = config.get("checkpoint", {})
    if not checkpoint.get("enable"):
        return None
    dump = Path(config.get("job", {}).get("dump_folder", "./outputs"))
    folder = dump / checkpoint.get("folder", "checkpoint")
    load_step = checkpoint.get("load_step", -1)
    if load_step != -1:
        if not folder.is_dir():
            raise ConfigError(
                f"checkpoint.load_step {load_step}: there is no checkpoint folder "
                f"{folder} to load it from"
            )
        return folder / f"step-{load_step}", True
    steps = [
        (int(m.group(1)), p)
        for p in (folder.iterdir() if folder.is_dir() else ())
        if (m := re.fullmatch(r"step-(\d+)", p.name)) and (p / ".metadata").is_file()
    ]
    if steps:
        return max(steps)[1], True
    initial = checkpoint.get("initial_load_path")
    if initial and not checkpoint.get("initial_load_in_hf") and "://" not in initial:
        return Path(initial), False
    return None


def already_trained(config: dict[str, Any]) -> str | None:
    """Why a launch would train nothing: the checkpoint it resumes is at its
    training.steps already (upstream starts up, then stops); else None."""
    found = checkpoint_to_load(config)
    steps = config.get("training", {}).get("steps")
    if found is None or not found[1] or not isinstance(steps, int):
        return None
    step = int(found[0].name.removeprefix("step-"))
    if step < steps:
        return None
    return (
        f"nothing to train: {found[0]} is at step {step} and training.steps is "
        f"{steps}; raise --training.steps to train on, or train afresh in "
        "another --job.dump_folder"
    )


def dp_degree(degrees: dict[str, Any], world_size: int) -> int:
    """Data-parallel degree (replicate x shard) of a launch of `world_size`
    with these parallel degrees."""
    shard = degrees["data_parallel_shard_degree"]
    if shard == -1:
        shard = world_size // _fixed(degrees)
    return degrees["data_parallel_replicate_degree"] * shard


def mesh_degrees(config: dict[str, Any], world_size: int) -> dict[str, int]:
    """The sizes of the run's device mesh, by upstream's dimension names
    (pp, dp_replicate, dp_shard, cp, tp), upstream's defaults where unset."""
    from torchtitan_npu.bootstrap import activate
    from torchtitan_npu.config import era_config

    activation = activate()
    table = era_config(activation.context.era).fields_of(
        config,
        version=activation.upstream.installed.version,
        device_type=activation.context.device_type,
    )
    degrees = _degrees(config, table)
    replicate = degrees["data_parallel_replicate_degree"]
    return {
        "pp": degrees["pipeline_parallel_degree"],
        "dp_replicate": replicate,
        "dp_shard": dp_degree(degrees, world_size) // replicate,
        "cp": degrees["context_parallel_degree"],
        "tp": degrees["tensor_parallel_degree"],
    }


def check_loadable(
    config: dict[str, Any],
    table: FieldTable,
    world_size: int | None,
    era: str,
    version: str,
) -> None:
    """The checkpoint the run will load: a whole DCP checkpoint, of this era's
    parameter names, and (unless its data position is left out) saved with
    this data-parallel degree -- upstream's dataloader cannot reshard."""
    found = checkpoint_to_load(config)
    if found is None:
        return
    path, resume = found
    from torchtitan_npu.compat.lock import read_lock
    from torchtitan_npu.state_dict_adapters import native_era
    from torchtitan_npu.state_dict_adapters.native_io import NativeCheckpoint

    try:
        checkpoint = NativeCheckpoint(path)
    except ConversionError as e:  # not a whole DCP checkpoint: one line
        hf = (
            ""
            if resume or not any(path.glob("*.safetensors"))
            else (
                ", or train from it as it is with --checkpoint.initial_load_in_hf true"
            )
        )
        raise ConfigError(f"checkpoint to load: {e}{hf}") from None
    saved = native_era(checkpoint.model_layout)
    if saved is None or saved == era:
        _check_training_state(config, checkpoint, resume)
        _check_data_position(config, table, checkpoint, world_size)
        return
    versions = ", ".join(e.version for e in read_lock() if e.era == saved)
    fresh = " or train in another --job.dump_folder" if resume else ""
    raise ConfigError(
        f"checkpoint {path} has the parameter names of torchtitan {versions} "
        f"(era {saved}); this install runs {version} (era {era}), which names "
        f"them differently; migrate it (optimizer and data position included): "
        f"titan-npu checkpoint migrate {path} OUT --to {version}, then load OUT "
        f"with --checkpoint.initial_load_path OUT "
        f"--checkpoint.initial_load_model_only false{fresh}"
    )


def check_model_fits(config: dict[str, Any], era: Any) -> None:
    """The checkpoint the run will load has every tensor of the configured
    model, in its shape (else every rank fails in DCP's load: another model,
    flavor or size trained into this dump folder, or a wrong
    initial_load_path). Tensors the model lacks (LoRA, say) are ignored, as
    upstream's load ignores them."""
    found = checkpoint_to_load(config)
    excluded = config.get("checkpoint", {}).get("exclude_from_loading") or []
    if found is None or "model" in excluded:
        return
    from torchtitan_npu.state_dict_adapters.native_io import NativeCheckpoint

    path, resume = found
    saved = NativeCheckpoint(path).model_layout
    model = config.get("model", {})
    name, flavor = model.get("name", "llama3"), model.get("flavor", "debugmodel")
    wanted = era.meta_model(name, flavor).state_dict()
    missing = [k for k in wanted if k not in saved]
    reshaped = [
        f"{k}: {list(saved[k].shape)}, the model's {list(wanted[k].shape)}"
        for k in wanted
        if k in saved and tuple(saved[k].shape) != tuple(wanted[k].shape)
    ]
    if not missing and not reshaped:
        return
    problems = []
    if missing:
        problems.append(
            f"lacks {len(missing)} of the model's {len(wanted)} tensors "
            f"({missing[0]}, ...)"
        )
    if reshaped:
        problems.append(f"has {len(reshaped)} in another shape ({reshaped[0]}, ...)")
    fix = (
        "train that checkpoint's model here, or this one in another --job.dump_folder"
        if resume
        else "pass a checkpoint of this model (titan-npu checkpoint inspect says "
        "what one holds)"
    )
    raise ConfigError(
        f"checkpoint {path} does not fit {name} {flavor}: it {' and '.join(problems)}; "
        f"{fix}"
    )


_TRAINING_STATE = ("optimizer", "lr_scheduler", "dataloader", "train_state")


def _check_training_state(config, checkpoint, resume: bool) -> None:
    """A resume (or a load with initial_load_model_only false) loads the
    training state too, which a model-only save lacks; upstream loads a
    step-0 (a seed checkpoint) model-only."""
    settings = config.get("checkpoint", {})
    if resume and checkpoint.path.name == "step-0":
        return
    if not resume and settings.get("initial_load_model_only", True):
        return
    excluded = settings.get("exclude_from_loading") or []
    saved = {key.split(".")[0] for key in checkpoint.metadata.state_dict_metadata}
    lacking = [s for s in _TRAINING_STATE if s not in saved and s not in excluded]
    if not lacking:
        return
    path = checkpoint.path
    raise ConfigError(
        f"checkpoint {path} holds the model only (no {', '.join(lacking)}: a last "
        "step saved with checkpoint.last_save_model_only, upstream's default), "
        "and this run loads its training state too; train on from its weights "
        f"with a fresh optimizer and schedule: --checkpoint.initial_load_path {path} "
        "in another --job.dump_folder (--checkpoint.last_save_model_only false "
        "makes a last step resumable)"
    )


def _check_data_position(
    config, table: FieldTable, checkpoint, world_size: int | None
) -> None:
    excluded = config.get("checkpoint", {}).get("exclude_from_loading") or []
    saved = checkpoint.read_number("dataloader.world_size")
    if world_size is None or "dataloader" in excluded or saved is None:
        return
    now = dp_degree(_degrees(config, table), world_size)
    if saved != now:
        raise ConfigError(
            f"checkpoint {checkpoint.path} holds the data position of "
            f"{saved} data-parallel rank(s) and this launch has {now}; upstream's "
            "dataloader cannot reshard it: launch with the same dp degree, or "
            "start the data from its beginning (samples seen again) with "
            """--checkpoint.exclude_from_loading '["dataloader"]'"""
        )


def check_early(config: dict[str, Any], *, world_size: int | None, launch: str) -> None:
    """At once, before torch and upstream are imported: every key and type,
    and the layout against the process count, from the field table an
    earlier check cached for this upstream (none yet: ``check`` decides, and
    caches it)."""
    from torchtitan_npu.compat import resolve_upstream
    from torchtitan_npu.config import era_config

    shaping = era_config(resolve_upstream().era).SHAPING_KEYS
    table = field_table.load(config, shaping)
    if table is not None:
        table.check_all(config)
        check_layout(config, table, world_size, launch)


def check(
    config: dict[str, Any],
    *,
    world_size: int | None,
    launch: str,
    device_type: str | None = None,
    layout: bool = True,
) -> None:
    """Every check that needs no rank: layout, paths, the era translation,
    then what the run's ``device_type`` (this machine's unless given: a
    plan's target) cannot run with its parallel degrees (not with
    ``layout=False``: a search checks each layout it makes)."""
    check_values(config)
    check_dataset(config)
    check_checkpoint(config)
    from torchtitan_npu.bootstrap import activate
    from torchtitan_npu.config import era_config
    from torchtitan_npu.reporting.log_noise import quiet_upstream_noise

    quiet_upstream_noise()
    activation = activate()
    version = activation.upstream.installed.version
    era = era_config(activation.context.era)
    here = activation.context.device_type
    try:
        table = era.fields_of(config, version=version, device_type=here)
        field_table.save(table, config, era.SHAPING_KEYS)  # for the next launch
        translated = era.translate(config, version=version, device_type=here)
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
    check_layout(config, table, world_size, launch)
    check_loadable(config, table, world_size, activation.context.era, version)
    check_model_fits(config, era)
    if not layout:
        return
    check_expert_parallel(_parallelism(translated, table), world_size, launch)
    check_pipeline(translated, table)
    check_batch(translated, table, world_size, launch)
    check_optimizer(translated, table, era.OPTIMIZERS, version)
    check_profiling(translated, table, device_type or here)
    era.check_runnable(translated, device_type=device_type or here, version=version)
    check_chunked_loss(translated, table)


_EXPERT_DEGREES = ("expert_parallel_degree", "expert_tensor_parallel_degree")


def _parallelism(translated: Any, table: FieldTable) -> dict[str, int]:
    """The degrees of a translated config: 0.3.x's Trainer.Config (the recipe's
    values included), 0.2.x's TOML dict (the keys set; upstream's defaults)."""
    return {
        key: _setting(translated, table, "parallelism", key)
        if f"parallelism.{key}" in table.fields
        else 1  # a parallelism this upstream does not have (0.3.0: no ETP)
        for key in (*_DEGREES, *_EXPERT_DEGREES)
    }


def _setting(translated: Any, table: FieldTable, section: str, key: str) -> Any:
    """One value of a translated config (0.2.x: the keys set, else upstream's
    default; 0.3.x: the section under its own name)."""
    if isinstance(translated, dict):
        default = table.default(f"{section}.{key}")
        return translated.get(section, {}).get(key, default)
    from torchtitan_npu.config.batch_and_data import TOKEN_FIELDS, sequence_batch
    from torchtitan_npu.config.config_registry import SECTION_RENAMES

    if f"{section}.{key}" in TOKEN_FIELDS:  # main counts tokens instead
        return sequence_batch(translated)[f"{section}.{key}"]
    return getattr(getattr(translated, SECTION_RENAMES.get(section, section)), key)


def check_pipeline(
    translated: Any,
    table: FieldTable,
) -> None:
    """Microbatches split the local batch evenly, and torch's 1F1B schedule
    has one per stage at least (it refuses fewer at the first step)."""
    pp = _setting(translated, table, "parallelism", "pipeline_parallel_degree")
    if pp == 1:
        return
    schedule = _setting(translated, table, "parallelism", "pipeline_parallel_schedule")
    size = _setting(
        translated, table, "parallelism", "pipeline_parallel_microbatch_size"
    )
    batch = _setting(translated, table, "training", "local_batch_size")
    if batch % size:
        raise ConfigError(
            f"training.local_batch_size {batch} is not a multiple of "
            f"parallelism.pipeline_parallel_microbatch_size {size}; change one of them"
        )
    if schedule == "1F1B" and batch // size < pp:
        raise ConfigError(
            f"the 1F1B pipeline schedule needs a microbatch per stage ({pp}), but "
            f"local batch {batch} / microbatch size {size} makes {batch // size}; "
            f"set --training.local_batch_size {pp * size} or another "
            "--parallelism.pipeline_parallel_schedule"
        )


def check_expert_parallel(
    degrees: dict[str, int], world_size: int | None, launch: str
) -> None:
    """Expert parallelism (which a flavor's recipe may set: qwen3_5's
    ``debugmodel_moe`` has 4) borrows its ranks from dp_shard x cp x tp."""
    ep, etp = (
        degrees["expert_parallel_degree"],
        degrees["expert_tensor_parallel_degree"],
    )
    if world_size is None or ep == 1:
        return
    cp_tp = degrees["context_parallel_degree"] * degrees["tensor_parallel_degree"]
    shard = degrees["data_parallel_shard_degree"]
    if shard == -1:
        shard = world_size // _fixed(degrees)
    borrowed = shard * cp_tp
    if borrowed % (ep * etp):
        raise ConfigError(
            f"parallelism.expert_parallel_degree = {ep} (set by the flavor's recipe "
            f"unless you set it) needs dp_shard x cp x tp ({borrowed} in this launch: "
            f"{launch}) to be a multiple of {ep * etp}; pass "
            "--parallelism.expert_parallel_degree 1 or launch more processes"
        )
