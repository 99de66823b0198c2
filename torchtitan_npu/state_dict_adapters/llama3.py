"""Llama 3 <-> HF LlamaForCausalLM.

Native attention applies RoPE to interleaved pairs (complex multiply); HF
rotates halves, so q/k rows are permuted per head.
"""

from collections.abc import Mapping
from typing import Any

from torchtitan_npu.compat.era import Era
from torchtitan_npu.state_dict_adapters.decoder import (
    attention_facts,
    base_hf_config,
    dense_rules,
)
from torchtitan_npu.state_dict_adapters.mapping import (
    ModelAdapter,
    Rule,
    TensorInfo,
    rope_permute,
)


def rules(era: Era, hf_config: Mapping[str, Any]) -> list[Rule]:
    n_heads = hf_config["num_attention_heads"]
    n_kv = hf_config.get("num_key_value_heads") or n_heads
    return dense_rules(era, q=rope_permute(n_heads), k=rope_permute(n_kv))


def hf_config(args: Any, era: Era, layout: Mapping[str, TensorInfo]) -> dict[str, Any]:
    facts = attention_facts(args, era)
    config = base_hf_config("LlamaForCausalLM", "llama", facts, layout)
    config.update(attention_bias=False, mlp_bias=False)
    config["rope_scaling"] = _rope_scaling(facts.rope, era)
    return config


# The llama3 rope scaling settings, or None: 0.2.x args hold them apart; a
# 0.3.x RoPE config is itself scaled or not.
_SCALING = {
    Era.TRAINSPEC: lambda rope: getattr(rope, "rope_scaling_args", None),
    Era.CONFIG_REGISTRY: lambda rope: rope if rope.scaling == "llama" else None,
}


def _rope_scaling(rope, era):
    scaling = _SCALING[era](rope)
    if scaling is None:
        return None
    return {
        "rope_type": "llama3",
        "factor": float(scaling.scaling_factor),
        "low_freq_factor": float(scaling.low_freq_factor),
        "high_freq_factor": float(scaling.high_freq_factor),
        "original_max_position_embeddings": int(
            scaling.original_max_position_embeddings
        ),
    }


ADAPTER = ModelAdapter("llama3", "LlamaForCausalLM", rules, hf_config)
