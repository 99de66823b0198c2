"""HF <-> native state dicts: declarative mappings per model, offline
conversion (`titan-npu convert`) and upstream's in-training adapter hook."""

from torchtitan_npu.state_dict_adapters import deepseek_v3, llama3, qwen2, qwen3
from torchtitan_npu.state_dict_adapters.mapping import (
    ConversionError,
    KeyMap,
    ModelAdapter,
    Rule,
    TensorInfo,
)

ADAPTERS: dict[str, ModelAdapter] = {
    a.name: a
    for a in (llama3.ADAPTER, qwen3.ADAPTER, deepseek_v3.ADAPTER, qwen2.ADAPTER)
}


def get_adapter(model: str) -> ModelAdapter:
    if model not in ADAPTERS:
        raise ConversionError(
            f"model {model!r}", [f"no HF adapter; known: {sorted(ADAPTERS)}"]
        )
    return ADAPTERS[model]


__all__ = [
    "ADAPTERS",
    "ConversionError",
    "KeyMap",
    "ModelAdapter",
    "Rule",
    "TensorInfo",
    "get_adapter",
]
