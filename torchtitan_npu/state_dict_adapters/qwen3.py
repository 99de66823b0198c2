"""Qwen3 (dense) <-> HF Qwen3ForCausalLM.

Native Qwen3 rotates halves like HF, so no q/k permutation; q/k RMSNorms.
"""

from collections.abc import Mapping
from typing import Any

from torchtitan_npu.compat.era import Era
from torchtitan_npu.state_dict_adapters.decoder import (
    attention_facts,
    base_hf_config,
    dense_rules,
)
from torchtitan_npu.state_dict_adapters.mapping import ModelAdapter, Rule, TensorInfo


def rules(era: Era, hf_config: Mapping[str, Any]) -> list[Rule]:
    return dense_rules(era, qk_norm=True)


def hf_config(args: Any, era: Era, layout: Mapping[str, TensorInfo]) -> dict[str, Any]:
    facts = attention_facts(args, era)
    config = base_hf_config("Qwen3ForCausalLM", "qwen3", facts, layout)
    config.update(attention_bias=False, rope_scaling=None)
    return config


ADAPTER = ModelAdapter("qwen3", "Qwen3ForCausalLM", rules, hf_config)
