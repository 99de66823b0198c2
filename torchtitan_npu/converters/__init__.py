"""Kernel converters: named op swaps with torch_npu kernels on npu and
PyTorch-native references on cuda/cpu, bridged into each upstream era.

The table is complete at import: ``ops`` registers the built-in converters.
"""

from typing import Any

from torchtitan_npu.compat.era import Era, era_module
from torchtitan_npu.converters import ops  # noqa: F401  (registers the built-ins)
from torchtitan_npu.converters.registry import (
    CONVERTERS,
    Converter,
    ConverterError,
    Replacement,
    check,
    get,
    parse_names,
    records,
)


def apply_named(
    target: Any, names: list[str], *, era: Era, model_name: str, device_type: str
) -> tuple[Any, list[int]]:
    """Apply converters by name, in order, the era's way: to a built model
    (TrainSpec) or a model config (config registry). Returns (target, counts)."""
    bridge = era_module(__name__, era)
    return bridge.apply_named(
        target, names, model_name=model_name, device_type=device_type
    )


__all__ = [
    "CONVERTERS",
    "Converter",
    "ConverterError",
    "Replacement",
    "apply_named",
    "check",
    "get",
    "parse_names",
    "records",
]
