"""Qwen3 (dense) <-> HF Qwen3ForCausalLM.

Native Qwen3 rotates halves like HF, so no q/k permutation; q/k RMSNorms.
"""

from collections.abc import Mapping
from typing import Any

from torchtitan_npu.compat.era import Era
from torchtitan_npu.state_dict_adapters import decoder
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


def _trainspec_args(hf: Mapping[str, Any], problems: list[str]) -> Any:
    # pyrefly: ignore[missing-import]  # 0.2.x only
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs

    return Qwen3ModelArgs(
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"],
        n_kv_heads=hf["num_key_value_heads"],
        vocab_size=hf["vocab_size"],
        head_dim=hf["head_dim"],
        hidden_dim=hf["intermediate_size"],
        norm_eps=hf["rms_norm_eps"],
        rope_theta=float(hf["rope_theta"]),
        qk_norm=True,
        max_seq_len=hf["max_position_embeddings"],
        enable_weight_tying=bool(hf["tie_word_embeddings"]),
    )


def _config_registry_args(hf: Mapping[str, Any], problems: list[str]) -> Any:
    """0.3.x Qwen3Model.Config: a registered dense flavor with the same tying,
    its layers rebuilt by upstream's qwen3 layer builder."""
    import torchtitan.models.qwen3 as upstream
    from torchtitan.models.common import CosSinRoPE

    config = decoder.retarget("qwen3", hf)
    head_dim = hf["head_dim"]
    config.layers = upstream._build_qwen3_layers(
        n_layers=hf["num_hidden_layers"],
        dim=hf["hidden_size"],
        n_heads=hf["num_attention_heads"],
        n_kv_heads=hf["num_key_value_heads"],
        head_dim=head_dim,
        hidden_dim=hf["intermediate_size"],
        attn_backend="flex",  # model_registry's default
        rope=CosSinRoPE.Config(
            dim=head_dim,
            max_seq_len=hf["max_position_embeddings"],
            theta=float(hf["rope_theta"]),
        ),
    )
    decoder.set_norm_eps(config, hf["rms_norm_eps"])
    return config


ADAPTER = ModelAdapter(
    "qwen3",
    "Qwen3ForCausalLM",
    rules,
    hf_config,
    model_types=("qwen3",),
    hf_defaults={
        **decoder.HF_DEFAULTS,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "head_dim": 128,
        "attention_bias": False,
        "max_position_embeddings": 32768,
    },
    required=decoder.REQUIRED,
    neutral=decoder.NEUTRAL,
    native_args={
        Era.TRAINSPEC: _trainspec_args,
        Era.CONFIG_REGISTRY: _config_registry_args,
    },
)
