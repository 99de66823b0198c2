"""HF <-> native state dicts: declarative mappings per model, offline
conversion (`titan-npu convert`) and upstream's in-training adapter hook."""

from collections.abc import Iterable

from torchtitan_npu.compat.era import Era
from torchtitan_npu.state_dict_adapters import (
    deepseek_v3,
    gpt_oss,
    kimi_k2_7,
    llama3,
    qwen2,
    qwen3,
    qwen3_5,
)
from torchtitan_npu.state_dict_adapters.mapping import (
    ConversionError,
    KeyMap,
    ModelAdapter,
    Rule,
    TensorInfo,
)

ADAPTERS: dict[str, ModelAdapter] = {
    a.name: a
    for a in (
        llama3.ADAPTER,
        qwen3.ADAPTER,
        deepseek_v3.ADAPTER,
        qwen2.ADAPTER,
        gpt_oss.ADAPTER,
        qwen3_5.ADAPTER,
        kimi_k2_7.ADAPTER,
    )
}


def get_adapter(model: str) -> ModelAdapter:
    if model not in ADAPTERS:
        raise ConversionError(
            f"model {model!r}", [f"no HF adapter; known: {sorted(ADAPTERS)}"]
        )
    return ADAPTERS[model]


# Enough of a config.json for the rules' names (their transforms go unused).
_NAMES_ONLY = {"num_attention_heads": 1, "num_key_value_heads": 1}


def native_era(keys: Iterable[str]) -> Era | None:
    """The upstream era whose native names the model keys of a checkpoint
    use (0.3 renamed ``output`` to ``lm_head``, ``attention.wq`` to
    ``attention.qkv_linear.wq``, ...); None if no name tells them apart."""
    keys = list(keys)
    matched = {}
    for era in Era:
        maps = [a.keymap(era, _NAMES_ONLY) for a in ADAPTERS.values() if era in a.eras]
        matched[era] = {k for k in keys if any(m.match_native(k) for m in maps)}
    best = max(matched.values(), key=len)
    winners = [era for era, found in matched.items() if found == best]
    if len(winners) > 1 or any(
        found - best for found in matched.values()
    ):  # equal, or each era has names of its own
        return None
    return winners[0]


__all__ = [
    "ADAPTERS",
    "ConversionError",
    "KeyMap",
    "ModelAdapter",
    "Rule",
    "TensorInfo",
    "get_adapter",
    "native_era",
]
