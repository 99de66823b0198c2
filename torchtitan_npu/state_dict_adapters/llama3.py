"""Llama 3 <-> HF LlamaForCausalLM.

Native attention applies RoPE to interleaved pairs (complex multiply); HF
rotates halves, so q/k rows are permuted per head.
"""

import math
from collections.abc import Mapping
from typing import Any

from torchtitan_npu.compat.era import Era
from torchtitan_npu.models.rope import rope_config
from torchtitan_npu.state_dict_adapters import decoder
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
    config["rope_scaling"] = _rope_scaling(facts.rope, facts.rope_theta, era)
    return config


# The llama3 rope scaling settings, or None: 0.2.x args hold them apart; a
# 0.3.x RoPE config is itself scaled or not.
_SCALING = {
    Era.TRAINSPEC: lambda rope: getattr(rope, "rope_scaling_args", None),
    Era.CONFIG_REGISTRY: lambda rope: rope if rope.scaling == "llama" else None,
}


def _rope_scaling(rope, theta, era):
    scaling = _SCALING[era](rope)
    if scaling is None or _leaves_every_frequency(scaling, theta):
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


def _leaves_every_frequency(scaling, theta: float) -> bool:
    """Scaling settings under which every frequency is left as it is: 0.2.x
    always scales, so an unscaled checkpoint gets these (factor 1, and every
    wavelength below the high-frequency bound, at most 2 pi theta)."""
    bound = scaling.original_max_position_embeddings / scaling.high_freq_factor
    return scaling.scaling_factor == 1.0 and bound > 2 * math.pi * theta


def _scaling_fields(hf: Mapping[str, Any], problems: list[str]) -> dict[str, Any]:
    """config.json rope_scaling as upstream's llama scaling fields ({} if none)."""
    scaling = hf.get("rope_scaling")
    if scaling is None:
        return {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama3":
        problems.append(
            f"config.json rope_scaling.rope_type {kind!r} is not supported for "
            "llama3 (supported: 'llama3', 'default' or no rope_scaling)"
        )
        return {}
    names = {
        "factor": "scaling_factor",
        "low_freq_factor": "low_freq_factor",
        "high_freq_factor": "high_freq_factor",
        "original_max_position_embeddings": "original_max_position_embeddings",
    }
    missing = [k for k in names if k not in scaling]
    problems += [f"config.json rope_scaling has no {k!r}" for k in missing]
    return {names[k]: scaling[k] for k in names if k in scaling}


def _check_head_dim(hf: Mapping[str, Any], problems: list[str]) -> None:
    if hf["head_dim"] != hf["hidden_size"] // hf["num_attention_heads"]:
        problems.append(
            f"config.json head_dim={hf['head_dim']} is not hidden_size / "
            f"num_attention_heads ({hf['hidden_size'] // hf['num_attention_heads']}): "
            "upstream's llama3 cannot build it"
        )


def _trainspec_args(hf: Mapping[str, Any], problems: list[str]) -> Any:
    """0.2.x TransformerModelArgs: the FFN size is exactly intermediate_size
    (multiple_of = it, and a multiplier that rounds up to it)."""
    # pyrefly: ignore[missing-import]  # 0.2.x only
    from torchtitan.models.llama3.model.args import (
        RoPEScalingArgs,
        TransformerModelArgs,
    )

    _check_head_dim(hf, problems)
    if hf["tie_word_embeddings"]:
        problems.append(
            "config.json tie_word_embeddings=True: upstream's llama3 ties no "
            "weights before torchtitan 0.3 (train it on the 0.3.x era)"
        )
    dim, hidden = hf["hidden_size"], hf["intermediate_size"]
    theta = float(hf["rope_theta"])
    scaling = _scaling_fields(hf, problems) or {
        "scaling_factor": 1.0,
        "original_max_position_embeddings": int(8 * math.pi * theta) + 1,
    }
    return TransformerModelArgs(
        dim=dim,
        n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"],
        n_kv_heads=hf["num_key_value_heads"],
        vocab_size=hf["vocab_size"],
        multiple_of=hidden,
        ffn_dim_multiplier=hidden / int(2 * 4 * dim / 3),
        norm_eps=hf["rms_norm_eps"],
        rope_theta=theta,
        rope_scaling_args=RoPEScalingArgs(**scaling),
        max_seq_len=hf["max_position_embeddings"],
    )


def _config_registry_args(hf: Mapping[str, Any], problems: list[str]) -> Any:
    """0.3.x Llama3Model.Config: a registered flavor with the same tying,
    its layers rebuilt by upstream's llama3 layer builder."""
    import torchtitan.models.llama3 as upstream
    from torchtitan.models.common import ComplexRoPE

    _check_head_dim(hf, problems)
    scaling = _scaling_fields(hf, problems)
    dim, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    config = decoder.retarget("llama3", hf)
    config.lm_head.param_init = upstream._output_linear_init(dim)
    rope = rope_config(
        ComplexRoPE.Config,
        hf["max_position_embeddings"],
        dim=dim // n_heads,
        theta=float(hf["rope_theta"]),
        scaling="llama" if scaling else "none",
        **scaling,
    )
    config.layers = upstream._build_llama3_layers(
        n_layers=hf["num_hidden_layers"],
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=hf["num_key_value_heads"],
        hidden_dim=hf["intermediate_size"],
        rope=rope,
        attn_backend="flex",  # model_registry's default
    )
    decoder.set_norm_eps(config, hf["rms_norm_eps"])
    return config


ADAPTER = ModelAdapter(
    "llama3",
    "LlamaForCausalLM",
    rules,
    hf_config,
    model_types=("llama",),
    hf_defaults={
        **decoder.HF_DEFAULTS,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "head_dim": None,
        "attention_bias": False,
        "mlp_bias": False,
    },
    required=decoder.REQUIRED,
    neutral={**decoder.NEUTRAL, "pretraining_tp": lambda v, _: v == 1},
    native_args={
        Era.TRAINSPEC: _trainspec_args,
        Era.CONFIG_REGISTRY: _config_registry_args,
    },
)
