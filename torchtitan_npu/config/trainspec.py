"""Translate a project train config to the TrainSpec era (torchtitan 0.2.x).

The project's format is 0.2.x's own TOML layout, so translation is a check of
every key against upstream ``JobConfig`` plus the renames older releases need.
"""

import os
import tempfile
from typing import Any

from torchtitan_npu.compat.era import Era
from torchtitan_npu.config import hf_model
from torchtitan_npu.config.field_table import FieldTable, plain
from torchtitan_npu.config.fields import (
    describe,
    field_type,
    get_path,
    has_path,
    leaf_paths,
)
from torchtitan_npu.config.schema import (
    ConfigError,
    did_you_mean,
    flatten,
)

ERA = Era.TRAINSPEC
# JobConfig is one class on every 0.2.x: one field table per upstream.
SHAPING_KEYS: tuple[str, ...] = ()
# The optimizer names upstream's build_optimizers builds (every 0.2.x)
OPTIMIZERS = ("Adam", "AdamW")

# Before 0.2.2 the seed and determinism switches lived under [training].
_LEGACY_DEBUG_KEYS = {
    "debug.seed": "training.seed",
    "debug.deterministic": "training.deterministic",
}


def check_model(name: str, flavor: str, *, version: str) -> None:
    """The model is a registered TrainSpec and has the flavor."""
    from torchtitan.protocols.train_spec import get_train_spec

    try:
        spec = get_train_spec(name)
    except ValueError:
        known = known_models()
        raise ConfigError(
            f"unknown model {name!r} in torchtitan {version} (era {ERA})"
            f"{did_you_mean(name, known)}; known models: {known}"
        ) from None
    if flavor not in spec.model_args:
        known = sorted(spec.model_args)
        raise ConfigError(
            f"model {name!r} has no flavor {flavor!r} in torchtitan {version} "
            f"(era {ERA}){did_you_mean(flavor, known)}; known flavors: {known}"
        )


def flavors(name: str) -> list[str]:
    """The flavors of a registered model (its TrainSpec's model_args)."""
    from torchtitan.protocols.train_spec import get_train_spec

    return sorted(get_train_spec(name).model_args)


def meta_model(name: str, flavor: str) -> Any:
    """The model a flavor builds, on the meta device."""
    from torchtitan_npu.state_dict_adapters import upstream_models as um

    return um.build_meta(name, um.model_args(name, flavor, ERA), ERA)


def parameter_count(name: str, flavor: str) -> int:
    """Parameters of the model a flavor builds (on the meta device)."""
    return sum(p.numel() for p in meta_model(name, flavor).parameters())


def known_models() -> list[str]:
    """Every name get_train_spec accepts (upstream's models and experiments
    and those registered, titan-npu's among them)."""
    from torchtitan.experiments import _supported_experiments
    from torchtitan.models import _supported_models
    from torchtitan.protocols import train_spec

    return sorted(
        {*_supported_models, *_supported_experiments, *train_spec._extra_train_specs}
    )


def upstream_defaults() -> Any:
    """Upstream's own train config: ``JobConfig`` with its defaults."""
    # pyrefly: ignore[missing-module-attribute]  # 0.2.x only
    from torchtitan.config import JobConfig

    return JobConfig()


def field_table(defaults: Any, version: str) -> FieldTable:
    """The train config keys of ``JobConfig`` (``defaults``: an instance),
    with their types and upstream's defaults; the legacy [debug] keys where
    the release keeps them under [training]."""
    fields = {
        path: {
            "type": describe(field_type(defaults, path)),
            "default": plain(get_path(defaults, path)),
        }
        for path in leaf_paths(defaults)
    }
    for key, target in _LEGACY_DEBUG_KEYS.items():
        if key not in fields and target in fields:
            fields[key] = fields[target]
    # Text or a list: translate's checked_names reads it and checks each name.
    fields["model.converters"] = {**fields["model.converters"], "type": "any"}
    return FieldTable(version, ERA.value, fields)


def fields_of(
    config: dict[str, Any], *, version: str, device_type: str | None = None
) -> FieldTable:
    """The field table ``translate`` checks ``config``'s keys against."""
    return field_table(upstream_defaults(), version)


def translate(
    config: dict[str, Any], *, version: str, device_type: str | None = None
) -> dict[str, Any]:
    """The nested dict upstream's ``--job.config_file`` TOML should contain:
    every key checked against ``JobConfig`` (renamed, type-checked), the model,
    flavor and converters. Raises ConfigError naming the key."""
    # pyrefly: ignore[missing-module-attribute]  # 0.2.x only
    from torchtitan.config import JobConfig

    hf_model.register(config, ERA)
    defaults = JobConfig()
    out: dict[str, Any] = {}
    flat = flatten(config)
    check_model(
        flat.get("model.name", defaults.model.name),
        flat.get("model.flavor", defaults.model.flavor),
        version=version,
    )
    if flat.get("model.converters"):
        from torchtitan_npu.converters.trainspec import checked_names

        flat["model.converters"] = checked_names(
            flat,
            model_name=flat.get("model.name", defaults.model.name),
            context_parallel=flat.get("parallelism.context_parallel_degree", 1) > 1,
            version=version,
            device_type=device_type,
        )
    table = field_table(defaults, version)
    for key, value in flat.items():
        value = table.checked(key, value)
        target = key if has_path(defaults, key) else _LEGACY_DEBUG_KEYS[key]
        *sections, leaf = target.split(".")
        node = out
        for section in sections:
            node = node.setdefault(section, {})
        node[leaf] = value
    validation = out.get("validation", {})
    if validation.get("enable"):
        # As on 0.3.x, validation batches are training's unless set (0.2.x's
        # own 2048 outruns a shorter training.seq_len, the model's RoPE table).
        training = out.get("training", {})
        for key in ("seq_len", "local_batch_size"):
            validation.setdefault(
                key, training.get(key, getattr(defaults.training, key))
            )
    return out


def check_runnable(job: dict[str, Any], *, device_type: str, version: str) -> None:
    """What upstream refuses late (under torchrun) for the translated job on
    ``device_type``: a sequence or heads its parallelism cannot split (every
    model's parallelize asserts the sequence; attention fails on the heads
    with a shape error), context parallelism with FlexAttention before 0.2.2,
    and with SDPA on CPU (torch's CP has no rule for SDPA's CPU kernel)."""
    import inspect

    # pyrefly: ignore[missing-import]  # 0.2.x only
    from torchtitan.protocols.train_spec import get_train_spec

    from torchtitan_npu.config.preflight import check_dataset_name
    from torchtitan_npu.overlay.registry import release

    parallelism = job.get("parallelism", {})
    tp = parallelism.get("tensor_parallel_degree", 1)
    cp = parallelism.get("context_parallel_degree", 1)
    model = job.get("model", {})
    name, flavor = model.get("name", "llama3"), model.get("flavor", "debugmodel")
    spec = get_train_spec(name)
    flavors = spec.model_args
    known = getattr(inspect.getmodule(spec.build_dataloader_fn), "DATASETS", None)
    check_dataset_name("training", job.get("training", {}).get("dataset"), known)
    seq = job.get("training", {}).get("seq_len", 2048)
    validation = job.get("validation", {})
    if validation.get("enable"):
        dataset = validation.get("dataset", "c4_validation")  # upstream's default
        check_dataset_name("validation", dataset, known)
        if validation.get("seq_len", 2048) > seq:
            raise ConfigError(
                f"validation.seq_len {validation.get('seq_len', 2048)} is longer "
                f"than training.seq_len {seq}, the longest sequence torchtitan "
                f"{version}'s model is built for; set --validation.seq_len to at "
                "most that"
            )
    if seq % (tp * 2 * cp):
        raise ConfigError(
            f"training.seq_len {seq} is not a multiple of tensor_parallel {tp} x 2 x "
            f"context_parallel {cp} = {tp * 2 * cp}, which torchtitan {version} "
            "asserts for every model; change the sequence length or the degrees"
        )
    args = flavors.get(flavor)
    hf_model.check_tokenizer(
        model.get("hf_assets_path"),
        getattr(args, "vocab_size", None),
        f"{name} {flavor}",
    )
    for heads in ("n_heads", "n_kv_heads"):
        count = getattr(args, heads, None) or getattr(args, "n_heads", None)
        if tp > 1 and isinstance(count, int) and count % tp:
            raise ConfigError(
                f"parallelism.tensor_parallel_degree {tp} does not divide {name} "
                f"{flavor}'s {heads} ({count}); pick a degree that does"
            )
    if cp == 1:
        return
    flex_cp = release(version) >= (0, 2, 2)  # before: "still in progress"
    problem = f"parallelism.context_parallel_degree {cp} with {name} {flavor}: "
    attention = _attention(flavors[flavor])
    if attention == "flex" and not flex_cp:
        raise ConfigError(
            f"{problem}torchtitan {version} has no context parallelism for "
            "FlexAttention; pick an SDPA flavor (CP then runs on npu or cuda), "
            "or set cp 1"
        )
    if attention != "sdpa" or device_type != "cpu":
        return
    flex = sorted(f for f, args in flavors.items() if _attention(args) == "flex")
    fix = (
        f"pick a FlexAttention --model.flavor ({', '.join(flex)})"
        if flex and flex_cp
        else "run it on npu or cuda"
    )
    raise ConfigError(
        f"{problem}torch's context parallelism has no rule for SDPA's CPU "
        f"kernel (torchtitan {version}); {fix}, or set cp 1"
    )


def _attention(model_args: Any) -> str:
    """A flavor's attention: 0.2.2's ``attn_type``, or before it ``use_flex_attn``."""
    if hasattr(model_args, "attn_type"):
        return model_args.attn_type
    return "flex" if getattr(model_args, "use_flex_attn", False) else "sdpa"


def upstream_argv(job_file: str) -> list[str]:
    """Upstream's command line: its TOML JobConfig loader reads ``job_file``."""
    return ["--job.config_file", job_file]


def hand_over(job: dict[str, Any], job_file: str) -> None:
    """Write the job TOML upstream will read; atomically, as every rank of a
    run writes the same file (the matrix's warm launcher)."""
    import tomli_w

    directory, name = os.path.split(job_file)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=directory or ".")
    with os.fdopen(fd, "w") as f:
        f.write(tomli_w.dumps(job))
    os.replace(tmp, job_file)
