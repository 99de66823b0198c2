"""Qwen2 (titan-npu's injected model) <-> HF Qwen2ForCausalLM.

Native attention rotates halves like HF (no permutation) and q/k/v carry
biases. On 0.2.x the model is titan-npu's own (``models/qwen2/model.py``); on
0.3.x it is built from upstream's decoder parts, with upstream's names.
"""

from collections.abc import Mapping
from typing import Any

from torchtitan_npu.compat.era import Era
from torchtitan_npu.state_dict_adapters import decoder
from torchtitan_npu.state_dict_adapters.decoder import (
    attention_facts,
    dense_rules,
    n_layers,
)
from torchtitan_npu.state_dict_adapters.mapping import ModelAdapter, Rule, TensorInfo


def rules(era: Era, hf_config: Mapping[str, Any]) -> list[Rule]:
    return dense_rules(era, bias=True)


def _trainspec_shape(args: Any, layout) -> dict[str, Any]:
    """0.2.x: titan-npu's Qwen2ModelArgs."""
    return {
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
    }


def _config_registry_shape(config: Any, layout) -> dict[str, Any]:
    """0.3.x: upstream's decoder config."""
    facts = attention_facts(config, Era.CONFIG_REGISTRY)
    return {
        "num_attention_heads": facts.n_heads,
        "num_key_value_heads": facts.n_kv_heads,
        "rms_norm_eps": facts.norm_eps,
        "rope_theta": facts.rope_theta,
        "max_position_embeddings": facts.max_seq_len,
        "tie_word_embeddings": facts.tied,
    }


_SHAPE = {Era.TRAINSPEC: _trainspec_shape, Era.CONFIG_REGISTRY: _config_registry_shape}


def hf_config(args: Any, era: Era, layout: Mapping[str, TensorInfo]) -> dict[str, Any]:
    vocab, dim = layout["tok_embeddings.weight"].shape
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": vocab,
        "hidden_size": dim,
        "intermediate_size": layout["layers.0.feed_forward.w1.weight"].shape[0],
        "num_hidden_layers": n_layers(layout),
        **_SHAPE[era](args, layout),
        "hidden_act": "silu",
        "use_sliding_window": False,
        "rope_scaling": None,
    }


def _qwen2_args(hf: Mapping[str, Any]) -> Any:
    from torchtitan_npu.models.qwen2.args import Qwen2ModelArgs

    return Qwen2ModelArgs(
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"],
        n_kv_heads=hf["num_key_value_heads"],
        vocab_size=hf["vocab_size"],
        hidden_dim=hf["intermediate_size"],
        norm_eps=hf["rms_norm_eps"],
        rope_theta=float(hf["rope_theta"]),
        max_seq_len=hf["max_position_embeddings"],
        tie_embeddings=bool(hf["tie_word_embeddings"]),
    )


def _trainspec_args(hf: Mapping[str, Any], problems: list[str]) -> Any:
    import dataclasses

    from torchtitan_npu.models.qwen2.trainspec import Qwen2Args

    return Qwen2Args(**dataclasses.asdict(_qwen2_args(hf)))


def _config_registry_args(hf: Mapping[str, Any], problems: list[str]) -> Any:
    from torchtitan_npu.models.qwen2.config_registry import model_config

    return model_config(_qwen2_args(hf))


ADAPTER = ModelAdapter(
    "qwen2",
    "Qwen2ForCausalLM",
    rules,
    hf_config,
    model_types=("qwen2",),
    hf_defaults={
        **decoder.HF_DEFAULTS,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "num_key_value_heads": 32,  # Qwen2Config's (None: num_attention_heads)
    },
    required=decoder.REQUIRED,
    neutral={**decoder.NEUTRAL, "use_mrope": lambda value, _: value is False},
    native_args={
        Era.TRAINSPEC: _trainspec_args,
        Era.CONFIG_REGISTRY: _config_registry_args,
    },
)
