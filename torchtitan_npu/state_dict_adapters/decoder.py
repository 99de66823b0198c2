"""What the dense decoder models (llama3, qwen3, qwen2) share: native names
per era, the dense rules, and era-neutral reads of upstream model args."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torchtitan_npu.compat.era import Era
from torchtitan_npu.models.rope import rope_length
from torchtitan_npu.state_dict_adapters.mapping import (
    IDENTITY,
    Rule,
    TensorInfo,
    Transform,
)

# The output head's native name.
LM_HEAD = {Era.TRAINSPEC: "output.weight", Era.CONFIG_REGISTRY: "lm_head.weight"}
# Prefix of the q/k/v projections (0.3.x nests them in qkv_linear).
QKV = {Era.TRAINSPEC: "attention.", Era.CONFIG_REGISTRY: "attention.qkv_linear."}


# Routed experts (w1, w3, w2) and the router's load-balancing bias (0.3.x
# renamed them).
EXPERTS = {
    Era.TRAINSPEC: ("moe.experts.w1", "moe.experts.w3", "moe.experts.w2"),
    Era.CONFIG_REGISTRY: (
        "moe.routed_experts.inner_experts.w1_EFD",
        "moe.routed_experts.inner_experts.w3_EFD",
        "moe.routed_experts.inner_experts.w2_EDF",
    ),
}
EXPERT_BIAS = {
    Era.TRAINSPEC: "moe.expert_bias",
    Era.CONFIG_REGISTRY: "moe.expert_bias_E",
}


def routed_expert_rules(era: Era) -> list[Rule]:
    """HF per-expert SwiGLU weights stacked into the native grouped tensors,
    and the router's gate."""
    hf, native = "model.layers.{layer}.mlp.", "layers.{layer}."
    w1, w3, w2 = EXPERTS[era]
    return [
        Rule(f"{hf}gate.weight", f"{native}moe.router.gate.weight"),
        Rule(f"{hf}experts.{{expert}}.gate_proj.weight", f"{native}{w1}"),
        Rule(f"{hf}experts.{{expert}}.up_proj.weight", f"{native}{w3}"),
        Rule(f"{hf}experts.{{expert}}.down_proj.weight", f"{native}{w2}"),
    ]


def dense_rules(
    era: Era,
    *,
    q: Transform = IDENTITY,
    k: Transform = IDENTITY,
    bias: bool = False,
    qk_norm: bool = False,
    qkv_prefix: str | None = None,
    head: str | None = None,
    mlp: bool = True,
) -> list[Rule]:
    """Embedding, attention, SwiGLU MLP (unless `mlp` is False), norms and
    (tie-able) output head."""
    hf, native = "model.layers.{layer}.", "layers.{layer}."
    p = qkv_prefix if qkv_prefix is not None else QKV[era]
    rules = [Rule("model.embed_tokens.weight", "tok_embeddings.weight")]
    suffixes = ["weight", "bias"] if bias else ["weight"]
    for s in suffixes:
        rules += [
            Rule(f"{hf}self_attn.q_proj.{s}", f"{native}{p}wq.{s}", q),
            Rule(f"{hf}self_attn.k_proj.{s}", f"{native}{p}wk.{s}", k),
            Rule(f"{hf}self_attn.v_proj.{s}", f"{native}{p}wv.{s}"),
        ]
    rules += [
        Rule(f"{hf}self_attn.o_proj.weight", f"{native}attention.wo.weight"),
        Rule(f"{hf}self_attn.rotary_emb.inv_freq", None),
        Rule(f"{hf}input_layernorm.weight", f"{native}attention_norm.weight"),
        Rule(f"{hf}post_attention_layernorm.weight", f"{native}ffn_norm.weight"),
        Rule("model.norm.weight", "norm.weight"),
        Rule(
            "lm_head.weight",
            head or LM_HEAD[era],
            tied_to="model.embed_tokens.weight",
        ),
    ]
    if qk_norm:
        rules += [
            Rule(f"{hf}self_attn.q_norm.weight", f"{native}attention.q_norm.weight"),
            Rule(f"{hf}self_attn.k_norm.weight", f"{native}attention.k_norm.weight"),
        ]
    if not mlp:
        return rules
    return rules + mlp_rules(hf + "mlp.", native + "feed_forward.")


def mlp_rules(hf: str, native: str) -> list[Rule]:
    """SwiGLU: gate = w1, up = w3, down = w2."""
    return [
        Rule(f"{hf}gate_proj.weight", f"{native}w1.weight"),
        Rule(f"{hf}up_proj.weight", f"{native}w3.weight"),
        Rule(f"{hf}down_proj.weight", f"{native}w2.weight"),
    ]


def n_layers(layout: Mapping[str, TensorInfo]) -> int:
    found = {int(m.group(1)) for k in layout if (m := re.match(r"layers\.(\d+)\.", k))}
    return max(found) + 1 if found else 0


@dataclass(frozen=True)
class Attention:
    """Era-neutral facts about a decoder's attention and rope."""

    n_heads: int
    n_kv_heads: int
    head_dim: int | None
    norm_eps: float
    rope: Any  # 0.3.x RoPE.Config; 0.2.x the model args themselves
    rope_theta: float
    max_seq_len: int
    tied: bool


def attention_facts(args: Any, era: Era) -> Attention:
    """Read heads / eps / rope / tying from upstream model args of either era."""
    return _ATTENTION_FACTS[era](args)


def _trainspec_attention(args: Any) -> Attention:
    n_heads = args.n_heads
    return Attention(
        n_heads=n_heads,
        n_kv_heads=getattr(args, "n_kv_heads", None) or n_heads,
        head_dim=getattr(args, "head_dim", None),
        norm_eps=args.norm_eps,
        rope=args,
        rope_theta=float(args.rope_theta),
        max_seq_len=args.max_seq_len,
        tied=bool(getattr(args, "enable_weight_tying", False)),
    )


def _config_registry_attention(args: Any) -> Attention:
    attn = args.layers[0].attention
    qkv_linear = getattr(attn, "qkv_linear", None)
    n_heads = attn.n_heads
    n_kv = getattr(qkv_linear, "n_kv_heads", None) or attn.n_kv_heads or n_heads
    head_dim = getattr(qkv_linear, "head_dim", None) or attn.head_dim
    return Attention(
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        norm_eps=args.norm.eps,
        rope=attn.rope,
        rope_theta=float(attn.rope.theta),
        max_seq_len=rope_length(attn.rope),
        tied=bool(getattr(args, "enable_weight_tying", False)),
    )


_ATTENTION_FACTS = {
    Era.TRAINSPEC: _trainspec_attention,
    Era.CONFIG_REGISTRY: _config_registry_attention,
}


def base_hf_config(
    architecture: str,
    model_type: str,
    facts: Attention,
    layout: Mapping[str, TensorInfo],
) -> dict[str, Any]:
    """The config.json fields every HF decoder shares."""
    vocab, dim = layout["tok_embeddings.weight"].shape
    ffn = layout.get("layers.0.feed_forward.w1.weight")
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": dim,
        "num_hidden_layers": n_layers(layout),
        "num_attention_heads": facts.n_heads,
        "num_key_value_heads": facts.n_kv_heads,
        "head_dim": facts.head_dim or dim // facts.n_heads,
        "rms_norm_eps": facts.norm_eps,
        "rope_theta": facts.rope_theta,
        "max_position_embeddings": facts.max_seq_len,
        "tie_word_embeddings": facts.tied,
        "hidden_act": "silu",
    }
    if ffn is not None:
        config["intermediate_size"] = ffn.shape[0]
    return config


# -- config.json -> native (architecture.derive) ------------------------------

# config.json fields a decoder cannot do without.
REQUIRED = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
)
# HF decoder config classes' defaults for fields config.json may omit.
HF_DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": None,  # = num_attention_heads
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "rope_scaling": None,
}


def _no_sliding_window(value: Any, config: Mapping[str, Any]) -> bool:
    return not config.get("use_sliding_window")


# Fields whose value (given the config) changes nothing the native model does.
NEUTRAL = {
    "attention_dropout": lambda value, _: value == 0,
    "use_sliding_window": lambda value, _: value is False,
    "sliding_window": _no_sliding_window,
    "max_window_layers": _no_sliding_window,
    "layer_types": lambda value, _: (
        value is None or all(t == "full_attention" for t in value)
    ),
}


def routing(router: Any) -> dict[str, Any]:
    """A router's top_k / score_func / route_norm / route_scale: 0.2.x
    ``MoEArgs`` and 0.3.x router configs name them alike."""
    return {
        k: getattr(router, k)
        for k in ("top_k", "score_func", "route_norm", "route_scale")
    }


def yarn_scaling(
    model: str, hf: Mapping[str, Any], problems: list[str]
) -> dict[str, Any] | None:
    """config.json's ``rope_scaling`` if it is YaRN, None without scaling;
    another type is a problem (the models that read this support only YaRN)."""
    scaling = hf.get("rope_scaling")
    if scaling is None:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "yarn":
        problems.append(
            f"config.json rope_scaling.rope_type {kind!r} is not supported for "
            f"{model} (supported: 'yarn' or no rope_scaling)"
        )
        return None
    return dict(scaling)


def is_moe(config: Any) -> bool:
    """A 0.3.x decoder config with MoE layers."""
    return any(getattr(layer, "moe", None) for layer in config.layers)


def retarget(model: str, hf: Mapping[str, Any], *, moe: bool = False) -> Any:
    """A copy of a registered 0.3.x flavor with config.json's tying (and MoE
    or not), its embedding, final norm and head resized to config.json's.
    The caller builds the layers."""
    from torchtitan_npu.state_dict_adapters.architecture import template

    tied = bool(hf["tie_word_embeddings"])
    config = template(
        model,
        Era.CONFIG_REGISTRY,
        lambda c: bool(c.enable_weight_tying) == tied and is_moe(c) == moe,
    )
    dim, vocab = hf["hidden_size"], hf["vocab_size"]
    config.dim, config.vocab_size = dim, vocab
    config.tok_embeddings.num_embeddings = vocab
    config.tok_embeddings.embedding_dim = dim
    if hasattr(config.norm, "normalized_shape"):
        config.norm.normalized_shape = dim
    else:  # qwen3_5's OffsetRMSNorm
        config.norm.dim = dim
    config.lm_head.in_features, config.lm_head.out_features = dim, vocab
    return config


def set_norm_eps(config: Any, eps: float) -> None:
    """Every RMSNorm of a 0.3.x model config gets config.json's epsilon."""
    from torchtitan.models.common.nn_modules import RMSNorm

    for _, norm, _, _ in config.traverse(RMSNorm.Config):
        norm.eps = eps
