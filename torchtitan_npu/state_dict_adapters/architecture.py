"""A model's architecture from a HF config.json, on either era.

Every config.json field either matches the native model (compared with the
config.json the native model exports), maps into its arguments (the flavor
is derived from config.json), changes nothing (``INERT``, or a family's
neutral value), or is refused by name. So an import is never silently another
model: a checkpoint with another ``rms_norm_eps``, RoPE scaling or tying than
a registered flavor derives its own flavor, ``hf``, at run time.

``register`` makes the derived flavor trainable: ``titan-npu train
--model.flavor hf --model.hf_assets_path DIR`` (see ``config/hf_model.py``).
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torchtitan_npu.compat.era import Era
from torchtitan_npu.errors import ConversionError
from torchtitan_npu.models import HF_FLAVOR
from torchtitan_npu.state_dict_adapters import get_adapter
from torchtitan_npu.state_dict_adapters import upstream_models as um

# config.json fields that never change what the model computes in training:
# token ids, bookkeeping, the inference cache, HF-side training knobs, and
# the position limit (the rope tables are rebuilt for the training seq_len).
INERT = frozenset(
    {
        "_name_or_path",
        "architectures",
        "auto_map",
        "aux_loss_alpha",
        "bos_token_id",
        "dtype",
        "eos_token_id",
        "image_token_id",
        "ep_size",
        "initializer_range",
        "max_position_embeddings",
        "model_type",
        "output_router_logits",
        "pad_token_id",
        "router_aux_loss_coef",
        "seq_aux",
        "tokenizer_class",
        "torch_dtype",
        "transformers_version",
        "use_cache",
        "video_token_id",
        "vision_end_token_id",
        "vision_start_token_id",
    }
)


def with_defaults(model: str, hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """config.json with the HF class defaults of the fields it omits (and
    ``rope_scaling`` of type "default", which scales nothing, as none)."""
    adapter = get_adapter(model)
    defaults = adapter.defaults_of(hf_config.get("model_type"))
    if "rope_parameters" not in defaults:
        hf_config = _rope_as_scaling(hf_config)
    filled = _filled(defaults, hf_config)
    scaling = filled.get("rope_scaling")
    if isinstance(scaling, Mapping) and _normalized(scaling).get("rope_type") in (
        "default",
        None,
    ):
        filled["rope_scaling"] = None
    if filled.get("num_key_value_heads") is None and "num_attention_heads" in filled:
        filled["num_key_value_heads"] = filled["num_attention_heads"]
    if "head_dim" in filled and filled["head_dim"] is None and "hidden_size" in filled:
        filled["head_dim"] = filled["hidden_size"] // filled["num_attention_heads"]
    return filled


def _rope_as_scaling(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """transformers 5 writes ``rope_parameters`` (the theta with the scaling)
    where 4.x wrote ``rope_theta`` and ``rope_scaling``: the 4.x fields, for
    a family whose native config.json uses them (5.x also writes its
    parameters, theta included, as ``rope_scaling``)."""
    name = "rope_parameters" if "rope_parameters" in config else "rope_scaling"
    parameters = config.get(name)
    if not isinstance(parameters, Mapping) or "rope_theta" not in parameters:
        return config
    out = {k: v for k, v in config.items() if k != name}
    scaling = {k: v for k, v in parameters.items() if k != "rope_theta"}
    out["rope_theta"] = parameters["rope_theta"]
    out["rope_scaling"] = scaling or None
    return out


def _filled(defaults: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """`config` with `defaults` where it has no value (a callable default: a
    function of `config`); a sub-config (``text_config``) filled alike."""
    filled = {k: v(config) if callable(v) else v for k, v in defaults.items()}
    filled.update(config)
    for key, sub in defaults.items():
        if _is_sub_config(key, sub) and isinstance(config.get(key), Mapping):
            filled[key] = _filled(sub, config[key])
    return filled


def _is_sub_config(key: str, value: Any) -> bool:
    return key.endswith("_config") and isinstance(value, Mapping)


def problems(
    model: str, source: Mapping[str, Any], native: Mapping[str, Any]
) -> list[str]:
    """What keeps config.json `source` from describing the native model whose
    exported config.json is `native` (both with defaults filled)."""
    wrong_type = _model_type_problem(model, source)
    if wrong_type:
        return [wrong_type]
    return _field_problems(model, source, native, "")


def _field_problems(
    model: str, source: Mapping[str, Any], native: Mapping[str, Any], prefix: str
) -> list[str]:
    adapter = get_adapter(model)
    found = [
        f"config.json has no {prefix + key!r} (the native model has {native[key]!r} "
        "and titan-npu does not know transformers' default): add it"
        for key in sorted(native.keys() - source.keys() - INERT)
    ]
    for key in sorted(source):
        value, name = source[key], prefix + key
        if key in INERT or key == "quantization_config":  # see quantization.py
            continue
        if _is_sub_config(key, value) and _is_sub_config(key, native.get(key)):
            found += _field_problems(model, value, native[key], f"{name}.")
            continue
        if key in native:
            if key == "tie_word_embeddings" and value and not native[key]:
                if not adapter.unties:
                    found.append(
                        "config.json tie_word_embeddings=True: this torchtitan's "
                        f"{model} builds no tied weights"
                    )
            elif not _same(value, native[key]):
                found.append(
                    f"config.json {name}={value!r}, the native model has "
                    f"{native[key]!r}"
                )
            continue
        neutral = adapter.neutral.get(name)
        if neutral is not None and neutral(value, source):
            continue
        found.append(
            f"config.json {name}={value!r} is not supported for {model} "
            "(it changes the model and titan-npu cannot map it)"
        )
    return found


def _model_type_problem(model: str, source: Mapping[str, Any]) -> str | None:
    model_type = source.get("model_type")
    readable = get_adapter(model).model_types
    if model_type in readable:
        return None
    hint = f"; convert it with --model {found}" if (found := model_for(source)) else ""
    return (
        f"config.json model_type {model_type!r} is not a {model} checkpoint "
        f"({model} reads {list(readable)}){hint}"
    )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        a, b = _normalized(a), _normalized(b)
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _normalized(scaling: Mapping[str, Any]) -> dict[str, Any]:
    """A rope_scaling dict: ``type`` is the old spelling of ``rope_type``."""
    out = dict(scaling)
    if "type" in out:
        out.setdefault("rope_type", out.pop("type"))
    return out


def exported(model: str, args: Any, era: Era) -> dict[str, Any]:
    """The config.json the native model `args` exports (tying from the model)."""
    layout, tied = um.describe(model, args, era)
    config = get_adapter(model).hf_config(args, era, layout)
    config["tie_word_embeddings"] = tied
    return config


def derive(model: str, hf_config: Mapping[str, Any], era: Era) -> Any:
    """The upstream model args (0.2.x) / config (0.3.x) config.json describes,
    checked field by field. Raises ConversionError naming every problem."""
    adapter = get_adapter(model)
    source = with_defaults(model, hf_config)
    what = f"{model} architecture from config.json"
    build = adapter.native_args.get(era)
    if build is None:
        raise ConversionError(
            what, [f"{model} flavors cannot be derived from config.json yet"]
        )
    wrong_type = _model_type_problem(model, source)
    if wrong_type:
        raise ConversionError(what, [wrong_type])
    missing = [k for k in adapter.required if k not in source]
    if missing:
        raise ConversionError(what, [f"config.json has no {k!r}" for k in missing])
    found: list[str] = []
    args = build(source, found)
    if found:
        raise ConversionError(what, found)
    found = problems(model, source, exported(model, args, era))
    if found:
        raise ConversionError(what, found)
    return args


def resolve(
    model: str, flavor: str | None, hf_config: Mapping[str, Any], era: Era
) -> tuple[str, Any]:
    """(flavor, args) for config.json: the named flavor (checked against every
    field), else the first registered flavor it describes, else derived."""
    source = with_defaults(model, hf_config)
    wrong_type = _model_type_problem(model, source)
    if wrong_type:
        raise ConversionError(f"config.json vs {model}", [wrong_type])
    if flavor == HF_FLAVOR:
        return HF_FLAVOR, derive(model, hf_config, era)
    if flavor is not None:
        args = um.model_args(model, flavor, era)
        found = problems(model, source, exported(model, args, era))
        if found:
            found.append(f"or drop --flavor {flavor}: the flavor is then derived")
            raise ConversionError(f"config.json vs {model} {flavor}", found)
        return flavor, args
    for name, args in um.flavors(model, era).items():
        if not problems(model, source, exported(model, args, era)):
            return name, args
    return HF_FLAVOR, derive(model, hf_config, era)


def read_config(path: str | Path) -> dict[str, Any]:
    """config.json of a HF directory (or the file itself)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise ConversionError(f"HF config {file}", ["does not exist"]) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"HF config {file}", [f"unreadable ({e})"]) from e
    if not isinstance(config, dict):
        raise ConversionError(f"HF config {file}", ["not a JSON object"])
    return config


def model_for(hf_config: Mapping[str, Any]) -> str | None:
    """The titan-npu model that reads config.json's model_type, if any."""
    from torchtitan_npu.state_dict_adapters import ADAPTERS

    model_type = hf_config.get("model_type")
    found = (a.name for a in ADAPTERS.values() if model_type in a.model_types)
    return next(found, None)


# Run-time flavors of this process: model -> (era, derived args).
_RUNTIME: dict[str, tuple[Era, Any]] = {}


def register(model: str, hf_dir: str | Path, era: Era) -> Any:
    """Derive `model`'s flavor ``hf`` from hf_dir/config.json and make it a
    flavor of this process (read by ``runtime_flavors``)."""
    args = derive(model, read_config(hf_dir), era)
    _RUNTIME[model] = (era, args)
    return args


def runtime_flavors(model: str, era: Era) -> dict[str, Any]:
    """flavor -> args registered at run time for `model` (a copy each call)."""
    registered = _RUNTIME.get(model)
    if registered is None or registered[0] is not era:
        return {}
    return {HF_FLAVOR: copy.deepcopy(registered[1])}


def template(model: str, era: Era, wanted: Callable[[Any], bool]) -> Any:
    """A copy of the first registered flavor whose args satisfy `wanted`: what
    a derived 0.3.x config starts from (upstream's initializers and module
    choices for that kind of model: tied or not, dense or MoE)."""
    for args in um.flavors(model, era).values():
        if wanted(args):
            return copy.deepcopy(args)
    raise ConversionError(f"{model}", ["no registered flavor to derive from"])
