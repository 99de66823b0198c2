"""Upstream model flavors, their args and native layouts, on either era."""

from __future__ import annotations

import copy
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

import torch

from torchtitan_npu.compat.era import Era
from torchtitan_npu.models import find_model_module
from torchtitan_npu.state_dict_adapters.mapping import ConversionError, TensorInfo


def _package(model: str) -> ModuleType:
    package = find_model_module(model)
    if package is None:
        raise ConversionError(f"model {model!r}", ["no such upstream model package"])
    return package


def _train_spec(model: str) -> Any:
    from torchtitan.protocols.train_spec import get_train_spec

    try:
        return get_train_spec(model)
    except ValueError:  # "TrainSpec X is not registered."
        raise ConversionError(
            f"model {model!r}", ["not a model of this torchtitan release"]
        ) from None


def _trainspec_build(model: str, args: Any) -> torch.nn.Module:
    args = copy.deepcopy(args)
    if not hasattr(args, "moe_impl") and hasattr(args, "moe_args"):
        args.moe_impl = "standard"  # set from the job config in training
    return _train_spec(model).model_cls(args)


def _config_registry_flavor_names(model: str) -> list[str]:
    tables = (
        v
        for k, v in vars(_package(model)).items()
        if k.endswith("_configs") and isinstance(v, dict)
    )
    return list(next(tables, {}))


class _Registry(NamedTuple):
    """How an era's upstream lists flavors, gives their args, builds a model."""

    flavor_names: Callable[[str], list[str]]
    model_args: Callable[[str, str], Any]
    build: Callable[[str, Any], torch.nn.Module]


_REGISTRY = {
    Era.TRAINSPEC: _Registry(
        flavor_names=lambda model: list(_train_spec(model).model_args),
        model_args=lambda model, flavor: _train_spec(model).model_args[flavor],
        build=_trainspec_build,
    ),
    Era.CONFIG_REGISTRY: _Registry(
        flavor_names=_config_registry_flavor_names,
        model_args=lambda model, flavor: _package(model).model_registry(flavor).model,
        build=lambda model, args: args.build(),
    ),
}


def flavor_names(model: str, era: Era) -> list[str]:
    return _REGISTRY[era].flavor_names(model)


def flavors(model: str, era: Era) -> dict[str, Any]:
    """flavor name -> model args (0.2.x) or model config (0.3.x)."""
    return {name: model_args(model, name, era) for name in flavor_names(model, era)}


def model_args(model: str, flavor: str, era: Era) -> Any:
    """One flavor's model args (0.2.x) or model config (0.3.x)."""
    known = flavor_names(model, era)
    if flavor not in known:
        raise ConversionError(
            f"model {model!r}", [f"unknown flavor {flavor!r}; known: {sorted(known)}"]
        )
    return _REGISTRY[era].model_args(model, flavor)


def build_meta(model: str, args: Any, era: Era) -> torch.nn.Module:
    """The native model on the meta device (no memory, no init)."""
    with torch.device("meta"):
        return _REGISTRY[era].build(model, args)


def layout_of(module: torch.nn.Module) -> dict[str, TensorInfo]:
    return {k: TensorInfo.of(v) for k, v in module.state_dict().items()}


def native_layout(model: str, args: Any, era: Era) -> dict[str, TensorInfo]:
    return describe(model, args, era)[0]


# describe() per (model, era, repr(args)): a conversion asks about the same
# args several times, and building a large model, even on meta, takes time.
_DESCRIBED: dict[tuple[str, Era, str], tuple[dict[str, TensorInfo], bool]] = {}


def describe(model: str, args: Any, era: Era) -> tuple[dict[str, TensorInfo], bool]:
    """(layout, whether the output head really shares the embedding weight).

    Tying is read from the built model, not the args: 0.2.1's qwen3 has
    ``enable_weight_tying`` in its args but builds separate weights.
    """
    key = (model, era, repr(args))
    if key not in _DESCRIBED:
        if len(_DESCRIBED) >= 16:
            _DESCRIBED.pop(next(iter(_DESCRIBED)))
        _DESCRIBED[key] = _describe(model, args, era)
    layout, tied = _DESCRIBED[key]
    return dict(layout), tied


def _describe(model: str, args: Any, era: Era) -> tuple[dict[str, TensorInfo], bool]:
    module = build_meta(model, args, era)
    params = dict(module.named_parameters(remove_duplicate=False))
    embedding = params.get("tok_embeddings.weight")
    tied = any(
        p is embedding for n, p in params.items() if n != "tok_embeddings.weight"
    )
    return layout_of(module), tied
