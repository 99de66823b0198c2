"""Translate a project train config to the config-registry era (torchtitan 0.3.x).

Upstream 0.3.x builds a ``Trainer.Config`` from a Python config function
(``--module M --config F``). titan-npu is such a module: ``titan_npu`` below
starts from the upstream function for the model and flavor (``llama3`` +
``debugmodel`` -> ``llama3_debugmodel``) and sets every key of the project's
TOML on it, renamed where 0.3.x moved it. A key with no 0.3.x counterpart is a
``ConfigError`` naming the key and the era.
"""

import dataclasses
import functools
import importlib
from pathlib import Path
from typing import Any

from torchtitan_npu.compat.era import Era
from torchtitan_npu.config import batch_and_data, hf_model
from torchtitan_npu.config.field_table import FieldTable, plain
from torchtitan_npu.config.fields import (
    describe,
    field_type,
    get_path,
    has_path,
    leaf_paths,
    set_path,
)
from torchtitan_npu.config.schema import (
    ConfigError,
    did_you_mean,
    flatten,
)
from torchtitan_npu.models import MODEL_PACKAGES, find_model_module, needs

ERA = Era.CONFIG_REGISTRY
# The optimizer names upstream's OptimizersContainer builds
OPTIMIZERS = ("Adam", "AdamW", "DistMuon")

# project key -> Trainer.Config path
_RENAMES = {
    "job.dump_folder": "dump_folder",
    "job.print_config": "debug.print_config",
    "parallelism.enable_async_tensor_parallel": "compile.enable_async_tensor_parallel",
    "model.hf_assets_path": "hf_assets_path",
    "training.dataset": "dataloader.dataset",
    "training.dataset_path": "dataloader.dataset_path",
    "validation.dataset": "validator.dataloader.dataset",
    "validation.dataset_path": "validator.dataloader.dataset_path",
}
SECTION_RENAMES = {"profiling": "profiler", "validation": "validator"}
_SECTIONS_BACK = {"dataloader": "training"} | {v: k for k, v in SECTION_RENAMES.items()}
# Keys consumed while choosing the base config, or pure descriptions.
_HANDLED = {"model.name", "model.flavor", "job.description"}
# [optimizer] keys that live in every param group's optimizer_kwargs on 0.3.x
_OPTIMIZER_KWARGS = {"lr", "eps", "weight_decay"}
# The keys whose values choose upstream's config classes (the dataloader's,
# activation checkpointing's), and so which other keys exist: a cached field
# table is one per combination of them.
SHAPING_KEYS = (
    "model.name",
    "model.flavor",
    "training.dataset",
    "activation_checkpoint.mode",
    "activation_checkpoint.selective_ac_option",
)
# Keys translate reads before the others (activation checkpointing, converters)
_READ_FIRST = (
    "activation_checkpoint.mode",
    "activation_checkpoint.selective_ac_option",
    "model.converters",
)


def field_table(trainer_config: Any, version: str) -> FieldTable:
    """The train config keys this era takes, spelled as the TOML spells them,
    with their types and the values ``trainer_config`` (a base config) has."""
    back = {v: k for k, v in _RENAMES.items()}
    sections = {v: k for k, v in SECTION_RENAMES.items()}
    taken = {"type": "any", "default": None}  # read before the key loop
    fields: dict[str, dict[str, Any]] = dict.fromkeys([*_HANDLED, *_READ_FIRST], taken)
    for kwarg in _OPTIMIZER_KWARGS:
        group = trainer_config.optimizer.param_groups[0].optimizer_kwargs
        fields[f"optimizer.{kwarg}"] = {"type": "float", "default": group.get(kwarg)}
    name = trainer_config.optimizer.param_groups[0].optimizer_name
    fields["optimizer.name"] = {"type": "str", "default": name}
    grain = _grain_sections(trainer_config)
    hidden = tuple(f"{batch_and_data.LOADERS[s]}.dataset." for s in grain)
    for path in leaf_paths(trainer_config):
        value = get_path(trainer_config, path)
        if isinstance(value, dict) or path.startswith(hidden):
            continue  # upstream's own tables and dataset configs: not TOML keys
        section, _, leaf = path.partition(".")
        key = back.get(path) or f"{sections.get(section, section)}.{leaf}"
        kind = describe(field_type(trainer_config, path))
        fields[key] = {"type": kind, "default": plain(value)}
    if batch_and_data.counts_tokens():
        for key, value in batch_and_data.sequence_batch(trainer_config).items():
            fields[key] = {"type": "int", "default": value}
    for section in grain:
        loader = get_path(trainer_config, batch_and_data.LOADERS[section])
        name = batch_and_data.dataset_name(loader)
        fields[f"{section}.dataset"] = {"type": "str", "default": name}
        fields[f"{section}.dataset_path"] = {"type": "str", "default": None}
    return FieldTable(version, ERA.value, fields, open_sections=("quantize",))


def _grain_sections(trainer_config: Any) -> list[str]:
    """The project sections whose dataloader is main's Grain loader."""
    return [
        section
        for section, path in batch_and_data.LOADERS.items()
        if has_path(trainer_config, path)
        and batch_and_data.grain_loader(get_path(trainer_config, path))
    ]


def upstream_defaults() -> Any:
    """Upstream's own train config as its llama3 debug recipe builds it."""
    return base_config("llama3", "debugmodel")


def base_config(name: str, flavor: str) -> Any:
    """Upstream's (or an injected model's) config function for name + flavor;
    for flavor ``hf``, the debug flavor's with the model derived from
    config.json (``config/hf_model.py``)."""
    from torchtitan_npu.state_dict_adapters import architecture

    derived = architecture.runtime_flavors(name, ERA).get(flavor)
    if derived is not None:
        # the debug flavor's training setup; with MTP layers, its MTP loss
        mtp = bool(getattr(derived, "mtp_layers", None))
        base = base_config(name, "debugmodel_mtp" if mtp else "debugmodel")
        return _with_model(base, derived, flavor)
    try:
        registry = find_model_module(name, ERA.value)  # the era is named after it
    except ModuleNotFoundError as e:  # an optional package the recipes import
        raise ConfigError(f"model {name!r} {needs(e)}") from e
    if registry is None:
        known = known_models()
        raise ConfigError(
            f"unknown model {name!r} in era {ERA}{did_you_mean(name, known)}; "
            f"known models: {known}"
        )
    function = _config_function(registry, name, flavor)
    if function is None:
        available = flavors(name)
        raise ConfigError(
            f"model {name!r} has no flavor {flavor!r} in era {ERA}"
            f"{did_you_mean(flavor, available)}; known flavors: {available}"
        )
    try:
        return function()
    except ImportError as e:  # e.g. a float8 recipe without torchao
        raise ConfigError(f"model {name!r} flavor {flavor!r} {needs(e)}") from e
    except ValueError as e:  # its converters' device checks (float8, MX)
        raise ConfigError(
            f"model {name!r} flavor {flavor!r} cannot run here: {e} (upstream's "
            "recipe); choose another flavor"
        ) from e


def flavors(name: str) -> list[str]:
    """The flavors of a model: its config functions' names without the
    model's prefix (``qwen3_0_6b`` -> ``0_6b``, ``qwen35_debugmodel`` ->
    ``debugmodel``; ``kimi_k2_5`` stays whole), as ``--model.flavor`` takes
    them."""
    registry = find_model_module(name, ERA.value)
    return sorted(_config_functions(registry, name)) if registry else []


def _config_functions(registry, name: str) -> dict[str, Any]:
    """flavor -> config function: the registry's own public functions that
    take no argument (helpers such as ``enable_fused_swiglu`` take some)."""
    import inspect

    prefixes = (f"{name}_", f"{name.replace('_', '')}_")
    functions = {}
    for attr, value in vars(registry).items():
        if (
            attr.startswith("_")
            or not inspect.isfunction(value)
            or value.__module__ != registry.__name__
            or inspect.signature(value).parameters
        ):
            continue
        prefix = next((p for p in prefixes if attr.startswith(p)), "")
        functions[attr.removeprefix(prefix)] = value
    return functions


def _config_function(registry, name: str, flavor: str):
    """The config function of a flavor: by its name (upstream spells flavor
    "0.6B" as function qwen3_0_6b), else the shortest-named one whose model
    is the model registry's flavor of that name (``debugmodel_moe`` ->
    ``qwen3_moe_debug``)."""
    functions = _config_functions(registry, name)
    function = functions.get(flavor) or functions.get(
        flavor.replace(".", "_").replace("-", "_").lower()
    )
    if function is not None:
        return function
    matches = []
    for candidate, function in functions.items():
        try:
            config = function()
        except Exception:  # a recipe needing what this machine lacks
            continue
        if getattr(getattr(config, "model_spec", None), "flavor", None) == flavor:
            matches.append(candidate)
    if not matches:
        return None
    return functions[min(matches, key=len)]


def meta_model(name: str, flavor: str) -> Any:
    """The model a flavor builds, on the meta device."""
    import torch

    model = base_config(name, flavor).model_spec.model
    with torch.device("meta"):
        return model.build()


def parameter_count(name: str, flavor: str) -> int:
    """Parameters of the model a flavor builds (on the meta device)."""
    return sum(p.numel() for p in meta_model(name, flavor).parameters())


def _with_model(trainer_config: Any, model: Any, flavor: str) -> Any:
    """A Trainer.Config whose model spec builds `model` (and whose loss knows
    its vocabulary)."""
    from torchtitan.models.common.config_utils import decoder_vocab_size

    spec = dataclasses.replace(trainer_config.model_spec, flavor=flavor, model=model)
    trainer_config.model_spec = spec
    loss = trainer_config.loss
    loss = getattr(loss, "loss_fn", loss)  # a chunked loss wraps its loss
    loss.global_vocab_size = decoder_vocab_size(spec)
    return trainer_config


def known_models() -> list[str]:
    """Model packages with a config_registry (upstream's and injected ones)."""
    import pkgutil

    names = set()
    for package in MODEL_PACKAGES:
        for folder in importlib.import_module(package).__path__:
            for module in pkgutil.iter_modules([folder]):
                if (Path(folder) / module.name / "config_registry.py").is_file():
                    names.add(module.name)
    return sorted(names)


def _activation_checkpoint(mode: str):
    from torchtitan.distributed.activation_checkpoint import (
        FullAC,
        MemoryBudgetAC,
        SelectiveAC,
    )

    modes = {
        "none": None,
        "full": FullAC.Config,
        "selective": SelectiveAC.Config,
        "memory_budget": MemoryBudgetAC.Config,
    }
    if mode not in modes:
        raise ConfigError(f"activation_checkpoint.mode {mode!r}: one of {list(modes)}")
    factory = modes[mode]
    return factory() if factory is not None else None


def _layer_ac(ac_config: Any, option: Any) -> Any:
    """0.2.x's ``selective_ac_option = N`` (every Nth block checkpointed
    whole) for a selective AC config; other modes ignore it, as on 0.2.x."""
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    from torchtitan_npu.distributed.activation_checkpoint import LayerAC

    if not isinstance(ac_config, SelectiveAC.Config):
        return ac_config
    return LayerAC.Config(every=int(option))  # preflight.check_values: a number


def _text_pipeline(trainer_config: Any, dataset: str | None) -> None:
    """A multimodal recipe (qwen3_5, kimi_k2_7) on a text dataset trains its
    language model: upstream's text dataloader and tokenizer replace the
    multimodal ones (the project's train-config format describes text)."""
    from torchtitan.components.tokenizer import (
        HuggingFaceTokenizer,
        MultiModalTokenizer,
    )

    if dataset in batch_and_data.datasets() and isinstance(
        trainer_config.tokenizer, MultiModalTokenizer.Config
    ):
        trainer_config.tokenizer = HuggingFaceTokenizer.Config()
        trainer_config.dataloader = _text_loader(trainer_config.dataloader)
        spec = trainer_config.model_spec
        trainer_config.model_spec = dataclasses.replace(
            spec, parallelize_fn=functools.partial(_vision_frozen, spec.parallelize_fn)
        )


def _text_loader(loader: Any) -> Any:
    """Upstream's text dataloader config in place of a multimodal recipe's:
    0.3.0's HuggingFaceTextDataLoader; main's Grain loader, its dataset packed
    as upstream's text recipes pack theirs (set by translate)."""
    if not batch_and_data.grain_loader(loader):
        from torchtitan.hf_datasets.text_datasets import (  # pyrefly: ignore
            HuggingFaceTextDataLoader,
        )

        return HuggingFaceTextDataLoader.Config()
    from torchtitan.components.data import (  # pyrefly: ignore
        ConcatThenSplitPackingConfig,
        GrainDataLoader,
    )

    first = next(iter(batch_and_data.datasets().values()))
    return GrainDataLoader.Config(dataset=ConcatThenSplitPackingConfig(dataset=first))


def _vision_frozen(parallelize_fn: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
    """Text batches never reach the vision encoder: it is frozen (no gradients,
    no optimizer state, kept in checkpoints as loaded), so a text run's
    checkpoint resumes — an encoder that never stepped has no optimizer state
    to save, which the optimizer's loader would then miss. Frozen after
    parallelizing: frozen before, kimi_k2_7's encoder came out of upstream's
    parallelize trainable again (measured; the cause is not traced)."""
    model = parallelize_fn(model, *args, **kwargs)
    encoder = getattr(model, "vision_encoder", None)
    if encoder is not None:
        encoder.requires_grad_(False)
    return model


def check_runnable(job: Any, *, device_type: str, version: str) -> None:
    """What upstream refuses late, in the ranks, for the translated job: each
    config section's own validation, the sequence its sequence/context
    parallelism cannot split evenly (the Trainer's own rule) and what the
    model config's own ``update_from_config`` refuses (TP not dividing the
    heads, a sequence beyond RoPE's, tying under PP), run here on a copy.
    Every 0.3.x attention backend has a CPU path, so ``device_type`` adds
    nothing."""
    import copy

    from torchtitan_npu.config.preflight import check_dataset_name

    config = copy.deepcopy(job)  # upstream's checks below may change what they read
    _validate_sections(config, version)
    loaders = [("training", job.dataloader)]
    loaders += (
        [("validation", job.validator.dataloader)] if job.validator.enable else []
    )
    for section, loader in loaders:
        known = batch_and_data.datasets(loader)
        check_dataset_name(section, getattr(loader, "dataset", None), known)
    parallelism = job.parallelism
    seq = batch_and_data.sequence_batch(job)["training.seq_len"]
    sp = parallelism.enable_sequence_parallel and parallelism.tensor_parallel_degree
    cp = parallelism.context_parallel_degree
    divisor = (sp or 1) * (2 * cp if cp > 1 else 1)
    if seq % divisor:
        splits = [f"tensor_parallel {sp} (sequence parallel)"] if sp > 1 else []
        splits += [f"context_parallel {cp} (2 chunks a rank)"] if cp > 1 else []
        raise ConfigError(
            f"training.seq_len {seq} cannot be split evenly by "
            f"{' and '.join(splits)}: use a multiple of {divisor}"
        )
    from torchtitan.models.common.decoder import Decoder

    spec = job.model_spec
    vocab = spec.model.vocab_size if isinstance(spec.model, Decoder.Config) else None
    hf_model.check_tokenizer(job.hf_assets_path, vocab, f"{spec.name} {spec.flavor}")
    model = config.model_spec.model
    try:
        model.update_from_config(config=config)
    except (ValueError, NotImplementedError) as e:
        spec = config.model_spec
        raise ConfigError(
            f"{spec.name} {spec.flavor}: {str(e).rstrip('.')} (upstream's own "
            "check); change the parallel degrees, the training settings or the flavor"
        ) from None


def _validate_sections(config: Any, version: str, path: str = "") -> None:
    """Run each config dataclass's ``__post_init__``, innermost first, as
    upstream's command-line parser does when it rebuilds the config in every
    rank (a checkpoint interval of 0, keep_latest_k 1, a microbatch of 0 are
    refused there). Values set after construction skip it; the model's own
    config is left to ``update_from_config``."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name, None)
        if field.name == "model_spec":
            continue
        for item in value if isinstance(value, list) else [value]:
            if dataclasses.is_dataclass(item) and not isinstance(item, type):
                _validate_sections(item, version, f"{path}{field.name}.")
    post_init = getattr(type(config), "__post_init__", None)
    if post_init is None:
        return
    try:
        post_init(config)
    except (ValueError, AssertionError) as e:
        section = path.split(".")[0]
        where = f"[{_SECTIONS_BACK.get(section, section)}]" if section else "config"
        raise ConfigError(
            f"train {where} refused by torchtitan {version}: {str(e).rstrip('.')}"
        ) from None


def _shaped(config: dict[str, Any], device_type: str) -> Any:
    """Upstream's config function's ``Trainer.Config`` for the model and
    flavor, with the config classes the SHAPING_KEYS choose."""
    model = config.get("model", {})
    hf_model.register(config, ERA)
    trainer_config = base_config(model["name"], model["flavor"])
    if device_type != "cuda" and has_path(
        trainer_config, "training.disable_cuda_graphs"
    ):
        # CUDA graphs exist only on CUDA; upstream validates them even elsewhere
        # (PP refuses to start while they are enabled). A config may still set it.
        trainer_config.training.disable_cuda_graphs = True
    _text_pipeline(trainer_config, config.get("training", {}).get("dataset"))
    checkpointing = config.get("activation_checkpoint", {})
    ac_mode = checkpointing.get("mode")
    if ac_mode is not None:
        trainer_config.activation_checkpoint = _activation_checkpoint(ac_mode)
    ac_option = checkpointing.get("selective_ac_option", "op")
    if ac_option != "op":
        trainer_config.activation_checkpoint = _layer_ac(
            trainer_config.activation_checkpoint, ac_option
        )
    return trainer_config


def fields_of(config: dict[str, Any], *, version: str, device_type: str) -> FieldTable:
    """The field table ``translate`` checks ``config``'s keys against."""
    return field_table(_shaped(config, device_type), version)


def translate(config: dict[str, Any], *, version: str, device_type: str) -> Any:
    """The ``Trainer.Config`` of a project config: upstream's config function
    for the model and flavor, every key set on it (renamed, type-checked),
    then the converters. Raises ConfigError naming the key."""
    trainer_config = _shaped(config, device_type)
    table = field_table(trainer_config, version)
    flat = {key: table.checked(key, value) for key, value in flatten(config).items()}
    tokens = batch_and_data.counts_tokens()
    grain = _grain_sections(trainer_config)
    for key, value in flat.items():
        section, _, leaf = key.partition(".")
        if key in _HANDLED or key in _READ_FIRST or section == "quantize":
            continue  # converters after every other key: they check the layout
        if (tokens and key in batch_and_data.TOKEN_FIELDS) or (
            section in grain and leaf in batch_and_data.DATA_KEYS
        ):
            continue  # set below, from several keys at once
        if section == "optimizer" and leaf in _OPTIMIZER_KWARGS:
            for group in trainer_config.optimizer.param_groups:
                group.optimizer_kwargs[leaf] = value
            continue
        if key == "optimizer.name":
            for group in trainer_config.optimizer.param_groups:
                group.optimizer_name = value
            continue
        target = _RENAMES.get(key) or ".".join(
            [SECTION_RENAMES.get(section, section), leaf]
        )
        set_path(trainer_config, target, value)
    if tokens:
        batch_and_data.token_counts(trainer_config, flat)
    for section in grain:
        batch_and_data.grain_dataset(
            get_path(trainer_config, batch_and_data.LOADERS[section]),
            section,
            flat.get(f"{section}.dataset"),
            flat.get(f"{section}.dataset_path"),
        )
    if flat.get("model.converters") or any(k.startswith("quantize.") for k in flat):
        from torchtitan_npu.converters import config_registry as converters

        converters.apply(
            trainer_config,
            flat,
            model_name=config["model"]["name"],
            device_type=device_type,
            version=version,
        )
    return trainer_config


# The Trainer.Config handed over to upstream's ConfigManager in this process.
_handed_over: list[Any] = []


def hand_over(trainer_config: Any, job_file: str) -> None:
    """Give the translated config to ``titan_npu``, which upstream calls next."""
    _handed_over[:] = [trainer_config]


def titan_npu() -> Any:
    """Config function upstream's ConfigManager calls (``--config titan_npu``)."""
    if not _handed_over:
        raise ConfigError(
            "titan_npu is titan-npu's config function for upstream's trainer; "
            "train with `titan-npu train` (it translates the config first)"
        )
    return _handed_over.pop()


def upstream_argv(job_file: str) -> list[str]:
    """Upstream's command line: this module's ``titan_npu`` config function."""
    return ["--module", __name__, "--config", "titan_npu"]
