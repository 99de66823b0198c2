"""Kimi K2.5 / Kimi-VL (MoonViT + DeepSeek-V3) <-> their HF releases; 0.3.x only.

The language model is DeepSeek-V3: ``deepseek_v3``'s rules under the
releases' ``language_model.`` prefix. The vision tower (``vision_tower.``):
the Conv2d patch embedding is the native Linear over flattened patches, the
fused ``wqkv`` the native q/k/v (no permutation: MoonViT rotates interleaved
pairs on both sides), ``norm0`` / ``norm1`` and ``fc0`` / ``fc1`` the native
``norm1`` / ``norm2`` and ``linear_fc1`` / ``linear_fc2``; the projector is
written as K2.5 spells it (``mm_projector.proj.0/2``) and read as Kimi-VL
spells it too (``multi_modal_projector.linear_1/2``). A text-only flavor
(Moonlight) is a plain DeepSeek-V3 checkpoint.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

from torchtitan_npu.compat.era import Era
from torchtitan_npu.state_dict_adapters import deepseek_v3
from torchtitan_npu.state_dict_adapters.mapping import (
    Fused,
    ModelAdapter,
    Rule,
    TensorInfo,
    reshaped,
)

VISION = "vision_encoder."
LM_PREFIX = "language_model."


def rules(era: Era, hf_config: Mapping[str, Any]) -> list[Rule]:
    if "vision_config" not in hf_config:  # text only: a DeepSeek-V3 checkpoint
        return deepseek_v3.rules(era, hf_config)
    lm = [
        dataclasses.replace(
            r,
            hf=r.hf and LM_PREFIX + r.hf,
            tied_to=r.tied_to and LM_PREFIX + r.tied_to,
        )
        for r in deepseek_v3.rules(era, hf_config["text_config"])
    ]
    return lm + _vision_rules(hf_config["vision_config"])


def _vision_rules(vision: Mapping[str, Any]) -> list[Rule]:
    hf, native = "vision_tower.", VISION
    block, layer = f"{hf}encoder.blocks.{{layer}}.", f"{native}layers.{{layer}}."
    patch = (vision.get("in_channels", 3),) + (vision.get("patch_size", 1),) * 2
    out = [
        Rule(
            f"{hf}patch_embed.proj.weight",
            f"{native}patch_embed.weight",
            reshaped(patch),
        ),
        Rule(f"{hf}patch_embed.proj.bias", f"{native}patch_embed.bias"),
        Rule(f"{hf}patch_embed.pos_emb.weight", f"{native}pos_embed"),
    ]
    qkv = Fused(0, ("q", "k", "v"))
    for s in ("weight", "bias"):
        pairs = [
            ("norm0", "norm1"),
            ("norm1", "norm2"),
            ("wo", "attn.proj"),
            ("mlp.fc0", "mlp.linear_fc1"),
            ("mlp.fc1", "mlp.linear_fc2"),
        ]
        out += [Rule(f"{block}{h}.{s}", f"{layer}{n}.{s}") for h, n in pairs]
        out += [
            Rule(f"{block}wqkv.{s}", f"{layer}attn.w{{part}}.{s}", fused=qkv),
            Rule(f"{hf}encoder.final_layernorm.{s}", f"{native}final_norm.{s}"),
        ]
        projector = [("pre_norm", "pre_norm"), ("proj.0", "linear_1")]
        projector += [("proj.2", "linear_2")]
        out += [
            Rule(f"mm_projector.{h}.{s}", f"{native}projector.{n}.{s}")
            for h, n in projector
        ]
        # Kimi-VL's spelling: read (a second rule for the same native key)
        out += [
            Rule(f"multi_modal_projector.{n}.{s}", f"{native}projector.{n}.{s}")
            for _, n in projector
        ]
    return out


def hf_config(args: Any, era: Era, layout: Mapping[str, TensorInfo]) -> dict[str, Any]:
    """config.json: DeepSeek-V3's for a text-only flavor; else its
    ``text_config`` nested with the vision tower's ``vision_config``."""
    text_layout = {k: i for k, i in layout.items() if not k.startswith(VISION)}
    text = deepseek_v3.hf_config(args, era, text_layout)
    v = args.vision_encoder
    if v is None:
        return text
    text.pop("architectures")  # the text model's: the release names the whole
    vision = dict(
        model_type="kimi_k25_vision",
        hidden_size=v.dim,
        num_hidden_layers=v.num_layers,
        num_attention_heads=v.num_heads,
        intermediate_size=layout[f"{VISION}layers.0.mlp.linear_fc1.weight"].shape[0],
        hidden_act="gelu_pytorch_tanh",
        patch_size=v.patch_size,
        in_channels=v.in_channels,
        pos_emb_height=v.init_pos_emb_height,
        pos_emb_width=v.init_pos_emb_width,
        merge_kernel_size=list(v.merge_kernel_size),
    )
    return dict(
        architectures=["KimiK25ForConditionalGeneration"],
        model_type="kimi_k25",
        text_config=text,
        vision_config=vision,
        projection_hidden_size=v.dim,
    )


ADAPTER = ModelAdapter(
    "kimi_k2_7",
    "KimiK25ForConditionalGeneration",
    rules,
    hf_config,
    model_types=("kimi_k25", "deepseek_v3"),  # Moonlight: a DeepSeek-V3
    hf_defaults={  # transformers 5's Kimi_K25Config
        "tie_word_embeddings": True,
        "projection_hidden_size": 1152,
    },
    # upstream's projector LayerNorm eps
    neutral={"projection_layer_norm_eps": lambda value, _: value == 1e-5},
    required=("text_config", "vision_config"),
    eras=(Era.CONFIG_REGISTRY,),  # no 0.2.x torchtitan has kimi_k2_7
)
