"""Qwen2 (titan-npu's injected model) <-> HF Qwen2ForCausalLM.

The native model rotates halves like HF (no permutation); q/k/v carry
biases; the head is ``output`` on 0.2.x and ``lm_head`` on 0.3.x.
"""

from typing import Any

from torchtitan_npu.state_dict_adapters.decoder import dense_rules, n_layers
from torchtitan_npu.state_dict_adapters.mapping import ModelAdapter, Rule


def rules(era, hf_config) -> list[Rule]:
    return dense_rules(era, bias=True, qkv_prefix="attention.")


def hf_config(args, era, layout) -> dict[str, Any]:
    a = getattr(args, "args", args)  # 0.3.x: the model Config holds the args
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": a.vocab_size,
        "hidden_size": a.dim,
        "intermediate_size": a.hidden_dim,
        "num_hidden_layers": n_layers(layout),
        "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.n_kv_heads,
        "rms_norm_eps": a.norm_eps,
        "rope_theta": a.rope_theta,
        "max_position_embeddings": a.max_seq_len,
        "tie_word_embeddings": a.tie_embeddings,
        "hidden_act": "silu",
        "use_sliding_window": False,
        "rope_scaling": None,
    }


ADAPTER = ModelAdapter("qwen2", "Qwen2ForCausalLM", rules, hf_config)
