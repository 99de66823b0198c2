"""gpt-oss <-> HF GptOssForCausalLM.

Attention with biases and per-head sinks; sliding-window layers as
config.json's ``layer_types`` say; YaRN RoPE that rotates halves like HF (no
permutation). The experts are one tensor per projection on both sides, HF's
input dim first (``x @ W``), native's output dim first: dims 1 and 2 swap.
The gate/up columns interleave on both sides. Upstream's load-balancing
``expert_bias`` has no HF counterpart (native-only). The MXFP4 expert blocks
of OpenAI's releases are dequantized on import (``quantization.py``).
"""

from collections.abc import Mapping
from typing import Any

from torchtitan_npu.compat.era import Era
from torchtitan_npu.errors import ConversionError
from torchtitan_npu.models.rope import rope_config
from torchtitan_npu.state_dict_adapters import decoder
from torchtitan_npu.state_dict_adapters.decoder import attention_facts, base_hf_config
from torchtitan_npu.state_dict_adapters.mapping import (
    ModelAdapter,
    Rule,
    TensorInfo,
    swap_dims,
)

# Native names of the experts' (gate_up weight, gate_up bias, down weight,
# down bias).
EXPERTS = {
    Era.TRAINSPEC: tuple(
        f"moe.experts.{n}"
        for n in ("mlp1_weight", "mlp1_bias", "mlp2_weight", "mlp2_bias")
    ),
    Era.CONFIG_REGISTRY: tuple(
        f"moe.routed_experts.inner_experts.{n}"
        for n in ("mlp1_weight_EGD", "mlp1_bias_EG", "mlp2_weight_EDF", "mlp2_bias_ED")
    ),
}
# 0.2.1 has gpt_oss as an experiment whose RoPE ignores its YaRN arguments.
NO_YARN = (
    "this torchtitan's gpt_oss (an experiment before 0.2.2) rotates without YaRN, "
    "which gpt-oss checkpoints use: convert with torchtitan 0.2.2 or later"
)


def rules(era: Era, hf_config: Mapping[str, Any]) -> list[Rule]:
    hf, native = "model.layers.{layer}.", "layers.{layer}."
    gate_up, gate_up_bias, down, down_bias = EXPERTS[era]
    swap = swap_dims(1, 2)
    return [
        *decoder.dense_rules(era, bias=True, mlp=False),
        Rule(f"{hf}self_attn.o_proj.bias", f"{native}attention.wo.bias"),
        Rule(f"{hf}self_attn.sinks", f"{native}attention.sinks"),
        Rule(f"{hf}mlp.router.weight", f"{native}moe.router.gate.weight"),
        Rule(f"{hf}mlp.router.bias", f"{native}moe.router.gate.bias"),
        Rule(f"{hf}mlp.experts.gate_up_proj", f"{native}{gate_up}", swap),
        Rule(f"{hf}mlp.experts.gate_up_proj_bias", f"{native}{gate_up_bias}"),
        Rule(f"{hf}mlp.experts.down_proj", f"{native}{down}", swap),
        Rule(f"{hf}mlp.experts.down_proj_bias", f"{native}{down_bias}"),
        Rule(None, f"{native}{decoder.EXPERT_BIAS[era]}"),
    ]


def hf_config(args: Any, era: Era, layout: Mapping[str, TensorInfo]) -> dict[str, Any]:
    facts = attention_facts(args, era)
    m = _FACTS[era](args)
    down = next(k for k in layout if k.endswith(EXPERTS[era][2]))
    n_experts, _, hidden = layout[down].shape
    config = base_hf_config("GptOssForCausalLM", "gpt_oss", facts, layout)
    config.update(
        intermediate_size=hidden,
        num_local_experts=n_experts,
        num_experts_per_tok=m["top_k"],
        attention_bias=True,
        attention_dropout=0.0,
        sliding_window=m["window"],
        layer_types=[
            "sliding_attention" if sliding else "full_attention"
            for sliding in m["sliding"]
        ],
        swiglu_limit=m["swiglu_limit"],
        rope_scaling=m["rope_scaling"],
    )
    routing = (m["score_func"], m["route_norm"], m["route_scale"])
    if routing != ("softmax", True, 1.0):
        config["titan_npu_warning"] = (
            f"native router: {routing[0]} scores, route_norm={routing[1]}, scaled by "
            f"{routing[2]}; HF GptOss uses softmax over the top-k, unscaled"
        )
    return config


def _yarn(factor, beta_fast, beta_slow, original, truncate) -> dict[str, Any] | None:
    if factor == 1.0:
        return None
    return {
        "rope_type": "yarn",
        "factor": float(factor),
        "beta_fast": float(beta_fast),
        "beta_slow": float(beta_slow),
        "original_max_position_embeddings": original,
        "truncate": truncate,
    }


def _trainspec_facts(args: Any) -> dict[str, Any]:
    if not hasattr(args, "ntk_beta"):
        raise ConversionError("gpt_oss", [NO_YARN])
    return dict(
        **decoder.routing(args.moe_args),
        window=args.sliding_window_size,
        sliding=[i % 2 == 0 for i in range(args.n_layers)],  # upstream's layers
        swiglu_limit=args.swiglu_limit,
        # 0.2.x's YaRN keeps fractional cutoffs (ntk_alpha / ntk_beta)
        rope_scaling=_yarn(
            args.rope_factor,
            args.ntk_beta,
            args.ntk_alpha,
            args.original_seq_len,
            False,
        ),
    )


def _config_registry_facts(args: Any) -> dict[str, Any]:
    layer = args.layers[0]
    router, rope = layer.moe.router, layer.attention.rope
    windows = [block.attention.sliding_window_size for block in args.layers]
    scaled = rope.scaling == "yarn"
    return dict(
        **decoder.routing(router),
        window=next((w for w in windows if w is not None), None),
        sliding=[w is not None for w in windows],
        swiglu_limit=layer.moe.routed_experts.inner_experts.swiglu_limit,
        rope_scaling=_yarn(
            rope.rope_factor if scaled else 1.0,
            rope.beta_fast,
            rope.beta_slow,
            rope.original_seq_len,
            rope.truncate,
        ),
    )


_FACTS = {Era.TRAINSPEC: _trainspec_facts, Era.CONFIG_REGISTRY: _config_registry_facts}


# -- config.json -> native (architecture.derive) ------------------------------

REQUIRED = (*decoder.REQUIRED, "num_local_experts", "num_experts_per_tok")


def _rope(hf: Mapping[str, Any], problems: list[str]) -> dict[str, Any] | None:
    """config.json's YaRN settings (None: no scaling)."""
    scaling = decoder.yarn_scaling("gpt_oss", hf, problems)
    if scaling is None:
        return None
    extra = sorted(set(scaling) - {"rope_type", "type", *_YARN_DEFAULTS})
    problems += [
        f"config.json rope_scaling.{k} is not supported for gpt_oss" for k in extra
    ]
    return {**_YARN_DEFAULTS, **scaling}


# transformers' YaRN defaults of the fields gpt-oss uses.
_YARN_DEFAULTS = {
    "factor": 1.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "original_max_position_embeddings": 4096,
    "truncate": True,
}


def _sliding(hf: Mapping[str, Any]) -> list[bool]:
    return [t == "sliding_attention" for t in hf["layer_types"]]


def _check(hf: Mapping[str, Any], problems: list[str]) -> None:
    if hf["tie_word_embeddings"]:
        problems.append(
            "config.json tie_word_embeddings=True: upstream's gpt_oss has no tied "
            "output head"
        )
    if len(hf["layer_types"]) != hf["num_hidden_layers"]:
        problems.append(
            f"config.json layer_types has {len(hf['layer_types'])} entries for "
            f"{hf['num_hidden_layers']} layers"
        )


def _config_registry_args(hf: Mapping[str, Any], problems: list[str]) -> Any:
    """0.3.x GptOssModel.Config: upstream's gpt-oss layers (its inits), with
    config.json's heads, windows and YaRN."""
    import torchtitan.models.gpt_oss as upstream
    from torchtitan.models.common import CosSinRoPE

    _check(hf, problems)
    yarn = _rope(hf, problems)
    if problems:
        return None
    rope = rope_config(
        CosSinRoPE.Config,
        hf["max_position_embeddings"],
        dim=hf["head_dim"],
        theta=float(hf["rope_theta"]),
    )
    if yarn is not None:
        rope.scaling = "yarn"
        rope.rope_factor = float(yarn["factor"])
        rope.beta_fast, rope.beta_slow = yarn["beta_fast"], yarn["beta_slow"]
        rope.original_seq_len = yarn["original_max_position_embeddings"]
        rope.truncate = bool(yarn["truncate"])
    config = decoder.retarget("gpt_oss", hf, moe=True)
    coeff = next(layer.moe for layer in config.layers if layer.moe).load_balance_coeff
    shape = dict(dim=hf["hidden_size"], attn_backend="varlen", fuse_qkv=True)
    config.layers = upstream._build_gptoss_layers(
        **shape,
        n_layers=hf["num_hidden_layers"],
        hidden_dim=hf["intermediate_size"],
        num_experts=hf["num_local_experts"],
        top_k=hf["num_experts_per_tok"],
        load_balance_coeff=coeff,
        moe_comm_backend="standard",  # model_registry's defaults
        rope=rope,
    )
    for i, (layer, sliding) in enumerate(zip(config.layers, _sliding(hf))):
        layer.attention = upstream._make_gptoss_attn_config(
            **shape,
            layer_id=i,
            n_heads=hf["num_attention_heads"],
            n_kv_heads=hf["num_key_value_heads"],
            head_dim=hf["head_dim"],
            sliding_window_size=hf["sliding_window"] if sliding else None,
            rope=rope,
        )
        assert layer.moe is not None  # every gpt-oss layer is MoE
        experts = layer.moe.routed_experts.inner_experts
        # pyrefly: ignore[missing-attribute]  # a GptOssGroupedExperts.Config
        experts.swiglu_limit = hf["swiglu_limit"]
    decoder.set_norm_eps(config, hf["rms_norm_eps"])
    return config


def _trainspec_args(hf: Mapping[str, Any], problems: list[str]) -> Any:
    """0.2.x GptOssModelArgs (its layers alternate: even ones slide)."""
    # pyrefly: ignore[missing-import]  # 0.2.x only
    from torchtitan.models.moe import MoEArgs

    from torchtitan_npu.state_dict_adapters import upstream_models as um

    registered = um.model_args(
        "gpt_oss", um.flavor_names("gpt_oss", Era.TRAINSPEC)[0], Era.TRAINSPEC
    )
    if not hasattr(registered, "ntk_beta"):
        problems.append(NO_YARN)
        return None
    _check(hf, problems)
    yarn = _rope(hf, problems) or {**_YARN_DEFAULTS, "truncate": False}
    if yarn["truncate"]:
        problems.append(
            "config.json rope_scaling.truncate=True: 0.2.x's gpt_oss YaRN keeps "
            "fractional cutoffs (truncate=False)"
        )
    if problems:
        return None
    return type(registered)(
        max_seq_len=hf["max_position_embeddings"],
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        moe_inter_dim=hf["intermediate_size"],
        n_layers=hf["num_hidden_layers"],
        norm_eps=hf["rms_norm_eps"],
        moe_args=MoEArgs(
            num_experts=hf["num_local_experts"],
            num_shared_experts=0,
            score_func="softmax",
            route_norm=True,
            route_scale=1.0,
            gate_bias=True,
            score_before_experts=False,
            top_k=hf["num_experts_per_tok"],
            load_balance_coeff=1e-3,  # the registered flavors'
        ),
        swiglu_limit=hf["swiglu_limit"],
        head_dim=hf["head_dim"],
        n_heads=hf["num_attention_heads"],
        n_kv_heads=hf["num_key_value_heads"],
        sliding_window_size=hf["sliding_window"],
        original_seq_len=yarn["original_max_position_embeddings"],
        rope_theta=float(hf["rope_theta"]),
        rope_factor=float(yarn["factor"]),
        ntk_alpha=float(yarn["beta_slow"]),
        ntk_beta=float(yarn["beta_fast"]),
    )


def _default_layer_types(hf: Mapping[str, Any]) -> list[str]:
    """GptOssConfig's: even layers slide."""
    n = hf.get("num_hidden_layers", 0)
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]


ADAPTER = ModelAdapter(
    "gpt_oss",
    "GptOssForCausalLM",
    rules,
    hf_config,
    model_types=("gpt_oss",),
    hf_defaults={  # GptOssConfig's
        **decoder.HF_DEFAULTS,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000.0,
        "head_dim": 64,
        "num_key_value_heads": 8,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "attention_bias": True,
        "attention_dropout": 0.0,
        "layer_types": _default_layer_types,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
    },
    required=REQUIRED,
    neutral={
        # unread by transformers' GptOss: the release's own names of known facts
        "experts_per_token": lambda value, hf: value == hf.get("num_experts_per_tok"),
        "initial_context_length": lambda value, hf: True,
        # transformers 5's name for the SwiGLU slope upstream fixes at 1.702
        "swiglu_alpha": lambda value, _: value == 1.702,
    },
    native_args={
        Era.TRAINSPEC: _trainspec_args,
        Era.CONFIG_REGISTRY: _config_registry_args,
    },
)
