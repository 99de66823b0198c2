"""DeepSeek-V3 (MLA + MoE) <-> HF DeepseekV3ForCausalLM.

Routed experts are one stacked tensor per projection natively and one tensor
per expert in HF. RoPE dims stay interleaved on both sides (HF
``rope_interleave=True``), so no permutation.
"""

from collections.abc import Mapping
from typing import Any

from torchtitan_npu.compat.era import Era
from torchtitan_npu.state_dict_adapters.decoder import (
    EXPERT_BIAS,
    EXPERTS,
    LM_HEAD,
    mlp_rules,
    n_layers,
    routed_expert_rules,
)
from torchtitan_npu.state_dict_adapters.mapping import ModelAdapter, Rule, TensorInfo


def rules(era: Era, hf_config: Mapping[str, Any]) -> list[Rule]:
    hf, native = "model.layers.{layer}.", "layers.{layer}."
    attn = [
        ("q_proj", "wq"),
        ("q_a_proj", "wq_a"),
        ("q_a_layernorm", "q_norm"),
        ("q_b_proj", "wq_b"),
        ("kv_a_proj_with_mqa", "wkv_a"),
        ("kv_a_layernorm", "kv_norm"),
        ("kv_b_proj", "wkv_b"),
        ("o_proj", "wo"),
    ]
    out = [
        Rule(f"{hf}self_attn.{h}.weight", f"{native}attention.{n}.weight")
        for h, n in attn
    ]
    out += [
        Rule("model.embed_tokens.weight", "tok_embeddings.weight"),
        Rule(f"{hf}input_layernorm.weight", f"{native}attention_norm.weight"),
        Rule(f"{hf}post_attention_layernorm.weight", f"{native}ffn_norm.weight"),
        Rule("model.norm.weight", "norm.weight"),
        Rule("lm_head.weight", LM_HEAD[era], tied_to="model.embed_tokens.weight"),
        Rule(f"{hf}mlp.gate.e_score_correction_bias", f"{native}{EXPERT_BIAS[era]}"),
    ]
    out += mlp_rules(f"{hf}mlp.", f"{native}feed_forward.")
    out += mlp_rules(f"{hf}mlp.shared_experts.", f"{native}moe.shared_experts.")
    return out + routed_expert_rules(era)


def hf_config(args: Any, era: Era, layout: Mapping[str, TensorInfo]) -> dict[str, Any]:
    a = _facts(args, era)
    vocab, dim = layout["tok_embeddings.weight"].shape
    w1 = EXPERTS[era][0]
    moe_key = next(k for k in layout if k.endswith(w1))
    n_experts, moe_inter, _ = layout[moe_key].shape
    shared = layout.get(moe_key.replace(w1, "moe.shared_experts.w1.weight"))
    n_dense = len({k.split(".")[1] for k in layout if ".feed_forward.w1." in k})
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab,
        "hidden_size": dim,
        "intermediate_size": layout["layers.0.feed_forward.w1.weight"].shape[0],
        "moe_intermediate_size": moe_inter,
        "num_hidden_layers": n_layers(layout),
        "num_attention_heads": a["n_heads"],
        "num_key_value_heads": a["n_heads"],
        "n_routed_experts": n_experts,
        "n_shared_experts": shared.shape[0] // moe_inter if shared else 0,
        "num_experts_per_tok": a["top_k"],
        "n_group": a["groups"] or 1,
        "topk_group": a["limited_groups"] or 1,
        "norm_topk_prob": a["route_norm"],
        "routed_scaling_factor": a["route_scale"],
        "first_k_dense_replace": n_dense,
        "q_lora_rank": a["q_lora_rank"] or None,
        "kv_lora_rank": a["kv_lora_rank"],
        "qk_nope_head_dim": a["qk_nope_head_dim"],
        "qk_rope_head_dim": a["qk_rope_head_dim"],
        "head_dim": a["qk_rope_head_dim"],  # what transformers' config sets
        "v_head_dim": a["v_head_dim"],
        "rms_norm_eps": a["norm_eps"],
        "rope_theta": a["rope_theta"],
        "rope_interleave": True,
        "max_position_embeddings": a["max_seq_len"],
        "tie_word_embeddings": False,
        "attention_bias": False,
        "hidden_act": "silu",
        "rope_scaling": None,
    }
    if a["yarn"]:
        config["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": a["rope_factor"],
            "original_max_position_embeddings": a["original_seq_len"],
            "beta_fast": a["beta_fast"],
            "beta_slow": a["beta_slow"],
            "mscale": a["mscale"],
            "mscale_all_dim": a["mscale"],
        }
    if a["score_func"] != "sigmoid":
        # HF DeepseekV3 always routes with sigmoid scores.
        config["titan_npu_warning"] = (
            f"native router uses {a['score_func']!r} scores; HF uses sigmoid"
        )
    return config


def _facts(args, era):
    """Era-neutral routing / MLA / rope facts of DeepSeek-V3 model args."""
    return _FACTS[era](args)


def _trainspec_facts(args):
    moe = args.moe_args
    return dict(
        n_heads=args.n_heads,
        q_lora_rank=args.q_lora_rank,
        kv_lora_rank=args.kv_lora_rank,
        qk_nope_head_dim=args.qk_nope_head_dim,
        qk_rope_head_dim=args.qk_rope_head_dim,
        v_head_dim=args.v_head_dim,
        norm_eps=args.norm_eps,
        rope_theta=float(args.rope_theta),
        max_seq_len=args.max_seq_len,
        yarn=args.max_seq_len > args.original_seq_len,
        rope_factor=float(args.rope_factor),
        original_seq_len=args.original_seq_len,
        beta_fast=args.beta_fast,
        beta_slow=args.beta_slow,
        mscale=args.mscale,
        top_k=moe.top_k,
        groups=getattr(moe, "num_expert_groups", None),  # none before 0.2.1
        limited_groups=getattr(moe, "num_limited_groups", None),
        route_norm=moe.route_norm,
        route_scale=moe.route_scale,
        score_func=moe.score_func,
    )


def _config_registry_facts(args):
    attn = args.layers[0].attention
    rope = attn.rope
    router = next(layer.moe for layer in args.layers if layer.moe).router
    return dict(
        n_heads=attn.n_heads,
        q_lora_rank=attn.q_lora_rank,
        kv_lora_rank=attn.kv_lora_rank,
        qk_nope_head_dim=attn.qk_nope_head_dim,
        qk_rope_head_dim=attn.qk_rope_head_dim,
        v_head_dim=attn.v_head_dim,
        norm_eps=args.norm.eps,
        rope_theta=float(rope.theta),
        max_seq_len=rope.max_seq_len,
        yarn=rope.scaling == "yarn" and rope.rope_factor > 1.0,
        rope_factor=float(rope.rope_factor),
        original_seq_len=rope.original_seq_len,
        beta_fast=rope.beta_fast,
        beta_slow=rope.beta_slow,
        mscale=attn.mscale,
        top_k=router.top_k,
        groups=router.num_expert_groups,
        limited_groups=router.num_limited_groups,
        route_norm=router.route_norm,
        route_scale=router.route_scale,
        score_func=router.score_func,
    )


_FACTS = {Era.TRAINSPEC: _trainspec_facts, Era.CONFIG_REGISTRY: _config_registry_facts}

ADAPTER = ModelAdapter(
    "deepseek_v3",
    "DeepseekV3ForCausalLM",
    rules,
    hf_config,
    model_types=("deepseek_v3",),
    hf_defaults={
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "rope_scaling": None,
        "rope_interleave": True,
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "norm_topk_prob": True,
    },
    neutral={
        "attention_dropout": lambda value, _: value == 0,
        "pretraining_tp": lambda value, _: value == 1,
        "moe_layer_freq": lambda value, _: value == 1,
        # what HF's DeepseekV3 always does
        "scoring_func": lambda value, _: value == "sigmoid",
        "topk_method": lambda value, _: value == "noaux_tc",
        "num_nextn_predict_layers": lambda value, _: value == 0,
    },
)
