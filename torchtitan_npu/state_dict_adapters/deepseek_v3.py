"""DeepSeek-V3 (MLA + MoE) <-> HF DeepseekV3ForCausalLM.

Routed experts are one stacked tensor per projection natively and one tensor
per expert in HF. RoPE dims stay interleaved on both sides (HF
``rope_interleave=True``), so no permutation. Multi-token-prediction layers
(``num_nextn_predict_layers``) are HF layers ``N .. N+M-1`` after the N main
ones and upstream's ``mtp_layers.0 .. M-1`` (0.3.x); their copies of the
embedding and output head (``embed_tokens``, ``shared_head.head``) are the
main model's, which upstream's MTP shares, so they are dropped on import.
FP8 checkpoints are dequantized on import (``quantization.py``).
"""

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from torchtitan_npu.compat.era import Era
from torchtitan_npu.models.rope import rope_config, rope_length
from torchtitan_npu.state_dict_adapters import decoder
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
    main = _layer_rules(era)
    n_main = hf_config.get("num_hidden_layers", 0)
    mtp = []  # literal layer numbers, ahead of the {layer} rules they also match
    for i in range(hf_config.get("num_nextn_predict_layers") or 0):
        hf, native = f"model.layers.{n_main + i}.", f"mtp_layers.{i}."
        mtp += [
            Rule(
                r.hf.replace(_HF_LAYER, hf, 1),
                r.native.replace(_NATIVE_LAYER, native, 1),
                r.transform,
            )
            for r in main
            if r.hf and r.native and r.hf.startswith(_HF_LAYER)
        ]
        mtp += [
            Rule(f"{hf}{h}.weight", f"{native}{n}.weight")
            for h, n in [
                ("enorm", "enorm"),
                ("hnorm", "hnorm"),
                ("eh_proj", "eh_proj"),
                ("shared_head.norm", "mtp_norm"),
            ]
        ]
        mtp += [
            Rule(f"{hf}embed_tokens.weight", None),  # the main model's
            Rule(f"{hf}shared_head.head.weight", None),
        ]
    return mtp + main


_HF_LAYER, _NATIVE_LAYER = "model.layers.{layer}.", "layers.{layer}."


def _layer_rules(era: Era) -> list[Rule]:
    hf, native = _HF_LAYER, _NATIVE_LAYER
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
        "num_nextn_predict_layers": len(
            {m.group(1) for k in layout if (m := re.match(r"mtp_layers\.(\d+)\.", k))}
        ),
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
        groups=getattr(moe, "num_expert_groups", None),  # none before 0.2.1
        limited_groups=getattr(moe, "num_limited_groups", None),
        **decoder.routing(moe),
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
        max_seq_len=rope_length(rope),
        yarn=rope.scaling == "yarn" and rope.rope_factor > 1.0,
        rope_factor=float(rope.rope_factor),
        original_seq_len=rope.original_seq_len,
        beta_fast=rope.beta_fast,
        beta_slow=rope.beta_slow,
        mscale=attn.mscale,
        groups=router.num_expert_groups,
        limited_groups=router.num_limited_groups,
        **decoder.routing(router),
    )


_FACTS = {Era.TRAINSPEC: _trainspec_facts, Era.CONFIG_REGISTRY: _config_registry_facts}


# -- config.json -> native (architecture.derive) ------------------------------

REQUIRED = (
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "n_routed_experts",
    "num_experts_per_tok",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "first_k_dense_replace",
)


def _yarn(hf: Mapping[str, Any], problems: list[str]) -> dict[str, Any] | None:
    """config.json's YaRN settings, or None without rope scaling. Upstream
    folds YaRN's mscale into the softmax scale only: HF's mscale (on cos/sin)
    must equal mscale_all_dim (on the softmax), as in DeepSeek's releases."""
    scaling = decoder.yarn_scaling("deepseek_v3", hf, problems)
    if scaling is None:
        return None
    mscale, all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale is None or mscale != all_dim:
        problems.append(
            f"config.json rope_scaling mscale={mscale!r}, mscale_all_dim={all_dim!r}: "
            "upstream's deepseek_v3 needs both, equal"
        )
    need = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
    problems += [
        f"config.json rope_scaling has no {k!r}" for k in need if k not in scaling
    ]
    return {k: scaling.get(k) for k in (*need, "mscale")}


def _shape(hf: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's MLA / MoE sizes in upstream's terms (both eras)."""
    groups = hf.get("n_group") or 1
    return dict(
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_dense_layers=hf["first_k_dense_replace"],
        n_heads=hf["num_attention_heads"],
        q_lora_rank=hf.get("q_lora_rank") or 0,
        kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"],
        qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        num_experts=hf["n_routed_experts"],
        num_shared_experts=hf.get("n_shared_experts") or 0,
        top_k=hf["num_experts_per_tok"],
        route_norm=bool(hf["norm_topk_prob"]),
        route_scale=float(hf["routed_scaling_factor"]),
        num_expert_groups=groups if groups > 1 else None,
        num_limited_groups=hf.get("topk_group") if groups > 1 else None,
    )


def _trainspec_args(hf: Mapping[str, Any], problems: list[str]) -> Any:
    """0.2.x DeepSeekV3ModelArgs (no MTP there: see from-hf --skip-mtp)."""
    # pyrefly: ignore[missing-import]  # 0.2.x only
    from torchtitan.models.deepseek_v3.model.args import DeepSeekV3ModelArgs

    # pyrefly: ignore[missing-import]  # 0.2.x only
    from torchtitan.models.moe import MoEArgs

    if hf.get("num_nextn_predict_layers"):
        problems.append(
            f"config.json num_nextn_predict_layers={hf['num_nextn_predict_layers']}: "
            "upstream's deepseek_v3 has no MTP layers before torchtitan 0.3; "
            "convert with --skip-mtp to leave them out"
        )
    yarn = _yarn(hf, problems)
    shape = _shape(hf)
    moe = dict(
        num_experts=shape["num_experts"],
        num_shared_experts=shape["num_shared_experts"],
        score_func="sigmoid",
        route_norm=shape["route_norm"],
        route_scale=shape["route_scale"],
        score_before_experts=False,  # HF weights the experts' outputs
        top_k=shape["top_k"],
    )
    if shape["num_expert_groups"] is not None:
        if "num_expert_groups" not in {f.name for f in dataclasses.fields(MoEArgs)}:
            problems.append(
                f"config.json n_group={shape['num_expert_groups']}: this torchtitan's "
                "deepseek_v3 has no expert groups"
            )
        moe.update(
            num_expert_groups=shape["num_expert_groups"],
            num_limited_groups=shape["num_limited_groups"],
        )
    if problems:
        return None
    max_seq_len = hf["max_position_embeddings"]
    rope: dict[str, Any] = dict(original_seq_len=max_seq_len)  # no YaRN
    if yarn is not None:
        rope = dict(
            original_seq_len=yarn["original_max_position_embeddings"],
            rope_factor=float(yarn["factor"]),
            beta_fast=yarn["beta_fast"],
            beta_slow=yarn["beta_slow"],
            mscale=float(yarn["mscale"]),
        )
    return DeepSeekV3ModelArgs(
        max_seq_len=max_seq_len,
        vocab_size=hf["vocab_size"],
        dim=shape["dim"],
        inter_dim=hf["intermediate_size"],
        moe_inter_dim=hf["moe_intermediate_size"],
        n_layers=shape["n_layers"],
        n_dense_layers=shape["n_dense_layers"],
        n_heads=shape["n_heads"],
        norm_eps=hf["rms_norm_eps"],
        moe_args=MoEArgs(**moe),
        q_lora_rank=shape["q_lora_rank"],
        kv_lora_rank=shape["kv_lora_rank"],
        qk_nope_head_dim=shape["qk_nope_head_dim"],
        qk_rope_head_dim=shape["qk_rope_head_dim"],
        v_head_dim=shape["v_head_dim"],
        rope_theta=float(hf["rope_theta"]),
        **rope,
    )


def _config_registry_args(hf: Mapping[str, Any], problems: list[str]) -> Any:
    """0.3.x DeepSeekV3Model.Config: upstream's MLA + MoE layer builder with
    its inits, and its MTP layers."""
    import torchtitan.models.deepseek_v3 as upstream
    from torchtitan.models.common import ComplexRoPE

    yarn = _yarn(hf, problems)
    if problems:
        return None
    shape = _shape(hf)
    dim = shape["dim"]
    rope = rope_config(
        ComplexRoPE.Config,
        hf["max_position_embeddings"],
        dim=shape["qk_rope_head_dim"],
        theta=float(hf["rope_theta"]),
    )
    mscale = 1.0
    if yarn is not None:
        rope.scaling = "yarn"
        rope.rope_factor = float(yarn["factor"])
        rope.beta_fast, rope.beta_slow = yarn["beta_fast"], yarn["beta_slow"]
        rope.original_seq_len = yarn["original_max_position_embeddings"]
        mscale = float(yarn["mscale"])
    config = decoder.retarget("deepseek_v3", hf, moe=True)
    config.lm_head.param_init = upstream._output_linear_init(dim)
    config.layers = upstream._build_dsv3_layers(
        n_layers=shape["n_layers"],
        n_dense_layers=shape["n_dense_layers"],
        dim=dim,
        n_heads=shape["n_heads"],
        q_lora_rank=shape["q_lora_rank"],
        kv_lora_rank=shape["kv_lora_rank"],
        qk_nope_head_dim=shape["qk_nope_head_dim"],
        qk_rope_head_dim=shape["qk_rope_head_dim"],
        v_head_dim=shape["v_head_dim"],
        mscale=mscale,
        dense_hidden_dim=hf["intermediate_size"],
        moe_hidden_dim=hf["moe_intermediate_size"],
        num_experts=shape["num_experts"],
        num_shared_experts=shape["num_shared_experts"],
        router_top_k=shape["top_k"],
        router_score_func="sigmoid",
        router_num_expert_groups=shape["num_expert_groups"],
        router_num_limited_groups=shape["num_limited_groups"],
        router_route_scale=shape["route_scale"],
        router_route_norm=shape["route_norm"],
        attn_backend="flex",  # model_registry's defaults
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=rope,
    )
    config.mtp_layers = upstream._build_mtp_layers(
        # pyrefly: ignore[bad-argument-type]  # the builder's layers are MLA blocks
        config.layers[-1],
        dim=dim,
        num_mtp_layers=hf.get("num_nextn_predict_layers") or 0,
    )
    decoder.set_norm_eps(config, hf["rms_norm_eps"])
    return config


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
        "routed_scaling_factor": 2.5,
        "n_group": 8,
        "topk_group": 4,
        "n_shared_experts": 1,
        "q_lora_rank": 1536,
        "max_position_embeddings": 4096,
        "num_nextn_predict_layers": 0,  # transformers builds no MTP layers
        "head_dim": lambda hf: hf.get("qk_rope_head_dim", 64),  # as transformers'
    },
    required=REQUIRED,
    neutral={
        "attention_dropout": lambda value, _: value == 0,
        "pretraining_tp": lambda value, _: value == 1,
        # MLA: every head has its own keys and values (kv_b_proj), whatever
        # config.json says
        "num_key_value_heads": lambda value, hf: (
            value in (None, hf.get("num_attention_heads"))
        ),
        # transformers 5's MTP count: its model builds no MTP layers either
        "num_mtp_layers": lambda value, _: True,
        "moe_layer_freq": lambda value, _: value == 1,
        # what HF's DeepseekV3 always does
        "scoring_func": lambda value, _: value == "sigmoid",
        "topk_method": lambda value, _: value == "noaux_tc",
        # derived by transformers' config
        "qk_head_dim": lambda value, hf: (
            value == hf.get("qk_nope_head_dim", 0) + hf.get("qk_rope_head_dim", 0)
        ),
    },
    native_args={
        Era.TRAINSPEC: _trainspec_args,
        Era.CONFIG_REGISTRY: _config_registry_args,
    },
)
