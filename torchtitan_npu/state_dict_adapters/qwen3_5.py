"""Qwen3.5 <-> HF Qwen3_5ForConditionalGeneration (dense) and
Qwen3_5MoeForConditionalGeneration (MoE); 0.3.x only.

The language model (``model.language_model.``) mixes full-attention layers
(gated q_proj: twice the rows; q/k norms; partial, interleaved MRoPE that
rotates halves like HF: no permutation) with Gated DeltaNet layers, whose HF
``in_proj_qkv`` and ``conv1d`` are native q/k/v parts concatenated. MoE
experts are one tensor per projection on both sides, in the same layout
(output dim first); HF's ``gate_up_proj`` is native w1 and w3 concatenated on
dim 1. The vision encoder (``model.visual.``): the Conv3d patch embedding is a
native Linear over the flattened patch, the fused ``qkv`` native q/k/v.
Upstream's load-balancing ``expert_bias`` has no HF counterpart (native-only);
the releases' multi-token-prediction head (``mtp.``) has no native one
(dropped, as transformers does). Upstream builds no tied output head: a tied
checkpoint imports with the embedding copied into ``lm_head``.
"""

from collections.abc import Mapping
from typing import Any

from torchtitan_npu.compat.era import Era
from torchtitan_npu.models.rope import rope_config
from torchtitan_npu.state_dict_adapters import decoder
from torchtitan_npu.state_dict_adapters.mapping import (
    Fused,
    ModelAdapter,
    Rule,
    TensorInfo,
    reshaped,
)

QKV = Fused(0, ("q", "k", "v"))
GATE_UP = Fused(1, ("1", "3"))  # w1 (gate), w3 (up)


def rules(era: Era, hf_config: Mapping[str, Any]) -> list[Rule]:
    lm, native = "model.language_model.", "layers.{layer}."
    hf = f"{lm}layers.{{layer}}."
    attn, delta = f"{hf}self_attn.", f"{hf}linear_attn."
    experts = f"{native}moe.routed_experts.inner_experts."
    out = [
        Rule(f"{lm}embed_tokens.weight", "tok_embeddings.weight"),
        Rule(f"{lm}norm.weight", "norm.weight"),
        Rule("lm_head.weight", "lm_head.weight", tied_to=f"{lm}embed_tokens.weight"),
        Rule("mtp.{rest}", None),
        Rule(f"{attn}rotary_emb.inv_freq", None),
        *(
            Rule(f"{attn}{p}_proj.weight", f"{native}attn.w{p}.weight")
            for p in ("q", "k", "v", "o")
        ),
        Rule(f"{attn}q_norm.weight", f"{native}attn.q_norm.weight"),
        Rule(f"{attn}k_norm.weight", f"{native}attn.k_norm.weight"),
        Rule(
            f"{delta}in_proj_qkv.weight",
            f"{native}attn.in_proj_{{part}}.weight",
            fused=QKV,
        ),
        Rule(f"{delta}conv1d.weight", f"{native}attn.conv_{{part}}.weight", fused=QKV),
        *(
            Rule(f"{delta}{name}", f"{native}attn.{name}")
            for name in (
                "in_proj_z.weight",
                "in_proj_a.weight",
                "in_proj_b.weight",
                "A_log",
                "dt_bias",
                "norm.weight",
                "out_proj.weight",
            )
        ),
        Rule(f"{hf}input_layernorm.weight", f"{native}attention_norm.weight"),
        Rule(f"{hf}post_attention_layernorm.weight", f"{native}ffn_norm.weight"),
        Rule(f"{hf}mlp.gate_proj.weight", f"{native}feed_forward.w1.weight"),
        Rule(f"{hf}mlp.up_proj.weight", f"{native}feed_forward.w3.weight"),
        Rule(f"{hf}mlp.down_proj.weight", f"{native}feed_forward.w2.weight"),
        Rule(f"{hf}mlp.gate.weight", f"{native}moe.router.gate.weight"),
        Rule(f"{hf}mlp.experts.gate_up_proj", f"{experts}w{{part}}_EFD", fused=GATE_UP),
        Rule(f"{hf}mlp.experts.down_proj", f"{experts}w2_EDF"),
        *(
            Rule(
                f"{hf}mlp.shared_expert.{p}_proj.weight",
                f"{native}moe.shared_experts.{w}.weight",
            )
            for p, w in (("gate", "w1"), ("up", "w3"), ("down", "w2"))
        ),
        Rule(
            f"{hf}mlp.shared_expert_gate.weight",
            f"{native}moe.shared_experts.gate.weight",
        ),
        Rule(None, f"{native}{decoder.EXPERT_BIAS[era]}"),
    ]
    return out + _vision_rules(hf_config.get("vision_config", {}))


def _vision_rules(vision: Mapping[str, Any]) -> list[Rule]:
    hf, native = "model.visual.", "vision_encoder."
    block, layer = f"{hf}blocks.{{layer}}.", f"{native}layers.{{layer}}."
    patch = tuple(vision.get(k, 1) for k in ("in_channels", "temporal_patch_size"))
    patch += (vision.get("patch_size", 1),) * 2
    out = [
        Rule(
            f"{hf}patch_embed.proj.weight",
            f"{native}patch_embed.weight",
            reshaped(patch),
        ),
        Rule(f"{hf}patch_embed.proj.bias", f"{native}patch_embed.bias"),
        Rule(f"{hf}pos_embed.weight", f"{native}pos_embed"),
    ]
    for s in ("weight", "bias"):
        out += [
            Rule(f"{block}attn.qkv.{s}", f"{layer}attn.w{{part}}.{s}", fused=QKV),
            *(
                Rule(f"{block}{name}.{s}", f"{layer}{name}.{s}")
                for name in (
                    "norm1",
                    "norm2",
                    "attn.proj",
                    "mlp.linear_fc1",
                    "mlp.linear_fc2",
                )
            ),
            *(
                Rule(f"{hf}merger.{name}.{s}", f"{native}merger.{name}.{s}")
                for name in ("norm", "linear_fc1", "linear_fc2")
            ),
        ]
    return out


def _shape(layout: Mapping[str, TensorInfo], key: str) -> tuple[int, ...]:
    return layout[key].shape


def hf_config(args: Any, era: Era, layout: Mapping[str, TensorInfo]) -> dict[str, Any]:
    """config.json of a Qwen35Model.Config and its layout."""
    layers = args.layers
    full = next(layer.attention for layer in layers if layer.attention is not None)
    delta = next(layer.delta_net for layer in layers if layer.delta_net is not None)
    vocab, dim = _shape(layout, "tok_embeddings.weight")
    moe = next((layer.moe for layer in layers if layer.moe is not None), None)
    text: dict[str, Any] = dict(
        model_type="qwen3_5_moe_text" if moe else "qwen3_5_text",
        vocab_size=vocab,
        hidden_size=dim,
        num_hidden_layers=len(layers),
        num_attention_heads=full.n_heads,
        num_key_value_heads=full.n_kv_heads,
        head_dim=full.head_dim,
        hidden_act="silu",
        attention_bias=False,
        attn_output_gate=True,
        rms_norm_eps=args.norm.eps,
        linear_conv_kernel_dim=delta.conv_kernel_size,
        linear_key_head_dim=delta.key_head_dim,
        linear_value_head_dim=delta.value_head_dim,
        linear_num_key_heads=delta.in_proj_q.out_features // delta.key_head_dim,
        linear_num_value_heads=delta.in_proj_a.out_features,
        layer_types=[
            "full_attention" if layer.attention is not None else "linear_attention"
            for layer in layers
        ],
        rope_parameters=dict(
            rope_type="default",
            rope_theta=float(full.rope.theta),
            partial_rotary_factor=full.rotary_dim / full.head_dim,
            mrope_section=list(full.rope.mrope_section),
            mrope_interleaved=True,
        ),
    )
    if moe is None:
        text["intermediate_size"] = _shape(layout, "layers.0.feed_forward.w1.weight")[0]
    else:
        routing = decoder.routing(moe.router)
        n_experts, hidden, _ = _shape(layout, f"layers.0.{decoder.EXPERTS[era][0]}")
        text.update(
            num_experts=n_experts,
            num_experts_per_tok=routing["top_k"],
            moe_intermediate_size=hidden,
            shared_expert_intermediate_size=_shape(
                layout, "layers.0.moe.shared_experts.w1.weight"
            )[0],
        )
        if routing["score_func"] != "softmax" or routing["route_scale"] != 1.0:
            text["titan_npu_warning"] = (
                f"native router: {routing['score_func']} scores scaled by "
                f"{routing['route_scale']}; HF Qwen3.5-MoE uses softmax, unscaled"
            )
    v = args.vision_encoder
    vision = dict(
        depth=v.num_layers,
        hidden_size=v.dim,
        hidden_act="gelu_pytorch_tanh",
        intermediate_size=_shape(
            layout, "vision_encoder.layers.0.mlp.linear_fc1.weight"
        )[0],
        num_heads=v.num_heads,
        in_channels=v.in_channels,
        patch_size=v.patch_size,
        spatial_merge_size=v.spatial_merge_size,
        temporal_patch_size=v.temporal_patch_size,
        out_hidden_size=_shape(layout, "vision_encoder.merger.linear_fc2.weight")[0],
        num_position_embeddings=v.num_position_embeddings,
    )
    kind = (
        "Qwen3_5MoeForConditionalGeneration"
        if moe
        else "Qwen3_5ForConditionalGeneration"
    )
    return dict(
        architectures=[kind],
        model_type="qwen3_5_moe" if moe else "qwen3_5",
        text_config=text,
        vision_config=vision,
    )


# -- config.json -> native (architecture.derive) ------------------------------

TEXT_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "layer_types",
    "rope_parameters",
)
MOE_REQUIRED = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)
VISION_REQUIRED = (
    "depth",
    "hidden_size",
    "intermediate_size",
    "num_heads",
    "patch_size",
    "out_hidden_size",
    "num_position_embeddings",
)


def _missing(hf: Mapping[str, Any], moe: bool) -> list[str]:
    text, vision = hf["text_config"], hf["vision_config"]
    wanted = [("text_config", text, TEXT_REQUIRED + (MOE_REQUIRED if moe else ()))]
    wanted += [("vision_config", vision, VISION_REQUIRED)]
    if not moe:
        wanted += [("text_config", text, ("intermediate_size",))]
    return [
        f"config.json has no '{name}.{k}'"
        for name, sub, keys in wanted
        for k in keys
        if k not in sub
    ]


def _interval(types: list[str], problems: list[str]) -> int:
    """Upstream's layers: every `interval`-th is full attention, the rest
    linear; config.json's ``layer_types`` must be that pattern."""
    interval = next((i + 1 for i, t in enumerate(types) if t == "full_attention"), 0)
    if interval == 0 or not _interval_matches(interval, {"layer_types": types}):
        problems.append(
            f"config.json text_config.layer_types {types}: upstream's qwen3_5 makes "
            "every N-th layer full attention and the others linear"
        )
    return interval


def _mrope(text: Mapping[str, Any], problems: list[str]) -> Any:
    from torchtitan.models.qwen3_5.rope import MRoPE

    rope = dict(text["rope_parameters"])
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    if kind != "default":
        problems.append(
            f"config.json text_config.rope_parameters.rope_type {kind!r}: "
            "upstream's qwen3_5 has no RoPE scaling"
        )
        return None
    rotary_dim = round(text["head_dim"] * rope.get("partial_rotary_factor", 1.0))
    return rope_config(
        MRoPE.Config,
        text.get("max_position_embeddings", 262144),
        dim=rotary_dim,
        theta=float(rope["rope_theta"]),
        mrope_section=list(rope.get("mrope_section", [11, 11, 10])),
    )


def _config_registry_args(hf: Mapping[str, Any], problems: list[str]) -> Any:
    """Qwen35Model.Config: upstream's layers and vision encoder (its inits)
    with config.json's shapes."""
    import torchtitan.models.qwen3_5 as upstream
    from torchtitan.models.qwen3_5.model import OffsetRMSNorm

    try:  # upstream main keeps the gated delta net's parts in gdn.py
        from torchtitan.models.qwen3_5.gdn import RMSNormGated  # pyrefly: ignore
    except ImportError:
        from torchtitan.models.qwen3_5.model import RMSNormGated  # pyrefly: ignore

    moe = hf.get("model_type") == "qwen3_5_moe"
    problems += _missing(hf, moe)
    if problems:
        return None
    text, vision = hf["text_config"], hf["vision_config"]
    interval = _interval(text["layer_types"], problems)
    rope = _mrope(text, problems)
    if problems:
        return None
    untied = {**text, "tie_word_embeddings": False}  # upstream ties nothing
    config = decoder.retarget("qwen3_5", untied, moe=moe)
    dim = text["hidden_size"]
    shape = dict(
        n_layers=text["num_hidden_layers"],
        dim=dim,
        n_heads=text["num_attention_heads"],
        n_kv_heads=text["num_key_value_heads"],
        head_dim=text["head_dim"],
        rotary_dim=rope.dim,
        rope=rope,
        n_key_heads=text["linear_num_key_heads"],
        n_value_heads=text["linear_num_value_heads"],
        key_head_dim=text["linear_key_head_dim"],
        value_head_dim=text["linear_value_head_dim"],
        full_attention_interval=interval,
        attn_backend="flex",  # model_registry's default
    )
    if moe:
        config.layers = upstream._build_qwen35_moe_layers(
            **shape,
            moe_hidden_dim=text["moe_intermediate_size"],
            num_experts=text["num_experts"],
            top_k=text["num_experts_per_tok"],
            shared_expert_hidden_dim=text["shared_expert_intermediate_size"],
            moe_comm_backend="standard",
        )
    else:
        config.layers = upstream._build_qwen35_layers(
            **shape, hidden_dim=text["intermediate_size"]
        )
    config.vision_encoder = upstream._qwen35_vision_encoder_config(
        dim=vision["hidden_size"],
        ffn_dim=vision["intermediate_size"],
        num_layers=vision["depth"],
        num_heads=vision["num_heads"],
        patch_size=vision["patch_size"],
        temporal_patch_size=vision["temporal_patch_size"],
        spatial_merge_size=vision["spatial_merge_size"],
        out_hidden_size=vision["out_hidden_size"],
        num_position_embeddings=vision["num_position_embeddings"],
        in_channels=vision["in_channels"],
    )
    for kind in (OffsetRMSNorm.Config, RMSNormGated.Config):
        for _, norm, _, _ in config.traverse(kind):
            norm.eps = text["rms_norm_eps"]
    return config


def _interval_matches(value: Any, text: Mapping[str, Any]) -> bool:
    """``full_attention_interval``: unread when ``layer_types`` is given."""
    types = text.get("layer_types") or []
    return all(
        (t == "full_attention") == ((i + 1) % value == 0) for i, t in enumerate(types)
    )


ADAPTER = ModelAdapter(
    "qwen3_5",
    "Qwen3_5ForConditionalGeneration",
    rules,
    hf_config,
    model_types=("qwen3_5", "qwen3_5_moe"),
    hf_defaults={
        "tie_word_embeddings": False,
        "text_config": {  # Qwen3_5TextConfig's
            "hidden_act": "silu",
            "attention_bias": False,
            "attn_output_gate": True,
            "rms_norm_eps": 1e-6,
            "linear_conv_kernel_dim": 4,
            "head_dim": 256,
        },
        "vision_config": {  # Qwen3_5VisionConfig's
            "hidden_act": "gelu_pytorch_tanh",
            "in_channels": 3,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
    },
    required=("text_config", "vision_config"),
    neutral={
        # the MTP head is dropped on import (upstream has none)
        "text_config.mtp_num_hidden_layers": lambda value, text: True,
        "text_config.mtp_use_dedicated_embeddings": lambda value, text: True,
        "text_config.full_attention_interval": _interval_matches,
        "text_config.attention_dropout": lambda value, text: value == 0.0,
        "vision_config.deepstack_visual_indexes": lambda value, vision: not value,
        # token ids of the vision markers (the dataloader's, not the model's)
        "image_token_id": lambda value, hf: True,
        "video_token_id": lambda value, hf: True,
        "vision_start_token_id": lambda value, hf: True,
        "vision_end_token_id": lambda value, hf: True,
    },
    native_args={Era.CONFIG_REGISTRY: _config_registry_args},
    unties=True,
    eras=(Era.CONFIG_REGISTRY,),  # no 0.2.x torchtitan has qwen3_5
)
