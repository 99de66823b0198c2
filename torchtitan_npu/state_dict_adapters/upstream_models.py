"""Upstream model flavors, their args and native layouts, on either era."""

from __future__ import annotations

import copy
import importlib
from typing import Any

import torch

from torchtitan_npu.state_dict_adapters.decoder import TRAINSPEC
from torchtitan_npu.state_dict_adapters.mapping import ConversionError, TensorInfo


def _package(model: str):
    for root in ("torchtitan.models", "torchtitan_npu.models"):
        try:
            return importlib.import_module(f"{root}.{model}")
        except ModuleNotFoundError:
            continue
    raise ConversionError(f"model {model!r}", ["no such upstream model package"])


def flavor_names(model: str, era: str) -> list[str]:
    if era == TRAINSPEC:
        from torchtitan.protocols.train_spec import get_train_spec

        return list(get_train_spec(model).model_args)
    table = next(
        (
            v
            for k, v in vars(_package(model)).items()
            if k.endswith("_configs") and isinstance(v, dict)
        ),
        {},
    )
    return list(table)


def flavors(model: str, era: str) -> dict[str, Any]:
    """flavor name -> model args (0.2.x) or model config (0.3.x)."""
    return {name: model_args(model, name, era) for name in flavor_names(model, era)}


def model_args(model: str, flavor: str, era: str) -> Any:
    """One flavor's model args (0.2.x) or model config (0.3.x)."""
    known = flavor_names(model, era)
    if flavor not in known:
        raise ConversionError(
            f"model {model!r}", [f"unknown flavor {flavor!r}; known: {sorted(known)}"]
        )
    if era == TRAINSPEC:
        from torchtitan.protocols.train_spec import get_train_spec

        return get_train_spec(model).model_args[flavor]
    return _package(model).model_registry(flavor).model


def build_meta(model: str, args: Any, era: str) -> torch.nn.Module:
    """The native model on the meta device (no memory, no init)."""
    with torch.device("meta"):
        if era != TRAINSPEC:
            return args.build()
        from torchtitan.protocols.train_spec import get_train_spec

        args = copy.deepcopy(args)
        if not hasattr(args, "moe_impl") and hasattr(args, "moe_args"):
            args.moe_impl = "standard"  # set from the job config in training
        return get_train_spec(model).model_cls(args)


def layout_of(module: torch.nn.Module) -> dict[str, TensorInfo]:
    return {k: TensorInfo.of(v) for k, v in module.state_dict().items()}


def native_layout(model: str, args: Any, era: str) -> dict[str, TensorInfo]:
    return layout_of(build_meta(model, args, era))


def describe(model: str, args: Any, era: str) -> tuple[dict[str, TensorInfo], bool]:
    """(layout, whether the output head really shares the embedding weight).

    Tying is read from the built model, not the args: 0.2.1's qwen3 has
    ``enable_weight_tying`` in its args but builds separate weights.
    """
    module = build_meta(model, args, era)
    params = dict(module.named_parameters(remove_duplicate=False))
    embedding = params.get("tok_embeddings.weight")
    tied = any(
        p is embedding for n, p in params.items() if n != "tok_embeddings.weight"
    )
    return layout_of(module), tied
