"""Kernel converters: named op swaps with torch_npu kernels on npu and
PyTorch-native references on cuda/cpu, bridged into each upstream era."""

from torchtitan_npu.converters.registry import (
    CONVERTERS,
    Converter,
    ConverterError,
    Replacement,
    all_converters,
    apply_named,
    apply_to_config,
    apply_to_module,
    check,
    get,
    parse_names,
    restore_functions,
)

__all__ = [
    "CONVERTERS",
    "Converter",
    "ConverterError",
    "Replacement",
    "all_converters",
    "apply_named",
    "apply_to_config",
    "apply_to_module",
    "check",
    "get",
    "parse_names",
    "restore_functions",
]
