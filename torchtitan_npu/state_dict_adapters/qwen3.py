"""Qwen3 <-> HF Qwen3ForCausalLM (dense) and Qwen3MoeForCausalLM (MoE).

Native Qwen3 rotates halves like HF, so no q/k permutation; q/k RMSNorms.
MoE layers: softmax top-k routing (``norm_topk_prob`` = upstream's
``route_norm``), per-expert HF weights stacked natively; upstream's
load-balancing ``expert_bias`` has no HF counterpart (native-only: zeros on
import, as upstream initialises it; not exported).
"""

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
from torchtitan_npu.state_dict_adapters.mapping import ModelAdapter, Rule, TensorInfo


def rules(era: Era, hf_config: Mapping[str, Any]) -> list[Rule]:
    native_only = Rule(None, f"layers.{{layer}}.{decoder.EXPERT_BIAS[era]}")
    moe = [*decoder.routed_expert_rules(era), native_only]
    return dense_rules(era, qk_norm=True) + moe


def hf_config(args: Any, era: Era, layout: Mapping[str, TensorInfo]) -> dict[str, Any]:
    facts = attention_facts(args, era)
    config = base_hf_config("Qwen3ForCausalLM", "qwen3", facts, layout)
    config.update(attention_bias=False, rope_scaling=None)
    moe = _MOE[era](args)
    if moe is None:
        return config
    w1 = next(k for k in layout if k.endswith(decoder.EXPERTS[era][0]))
    n_experts, moe_hidden, _ = layout[w1].shape
    dense = sorted({int(k.split(".")[1]) for k in layout if ".feed_forward.w1." in k})
    config.update(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        num_experts=n_experts,
        num_experts_per_tok=moe["top_k"],
        moe_intermediate_size=moe_hidden,
        norm_topk_prob=bool(moe["route_norm"]),
        decoder_sparse_step=1,
        mlp_only_layers=dense,
    )
    if moe["score_func"] != "softmax" or moe["route_scale"] != 1.0:
        config["titan_npu_warning"] = (
            f"native router: {moe['score_func']} scores scaled by "
            f"{moe['route_scale']}; HF Qwen3-MoE uses softmax, unscaled"
        )
    return config


def _trainspec_moe(args: Any) -> dict[str, Any] | None:
    if not getattr(args, "moe_enabled", False):
        return None
    return decoder.routing(args.moe_args)


def _config_registry_moe(args: Any) -> dict[str, Any] | None:
    layer = next((layer for layer in args.layers if layer.moe), None)
    if layer is None:
        return None
    return decoder.routing(layer.moe.router)


# The routing facts of an MoE flavor's args, or None for a dense one.
_MOE = {Era.TRAINSPEC: _trainspec_moe, Era.CONFIG_REGISTRY: _config_registry_moe}


def _is_moe(hf: Mapping[str, Any]) -> bool:
    return hf.get("model_type") == "qwen3_moe"


def _check_moe(hf: Mapping[str, Any], problems: list[str]) -> None:
    if hf.get("mlp_only_layers"):
        problems.append(
            f"config.json mlp_only_layers={hf['mlp_only_layers']}: upstream's qwen3 "
            "builds every layer of an MoE model as MoE"
        )
    if hf.get("decoder_sparse_step", 1) != 1:
        problems.append(
            f"config.json decoder_sparse_step={hf['decoder_sparse_step']}: upstream's "
            "qwen3 builds every layer of an MoE model as MoE"
        )
    missing = [
        k
        for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
        if k not in hf
    ]
    problems += [f"config.json has no {k!r}" for k in missing]


def _trainspec_args(hf: Mapping[str, Any], problems: list[str]) -> Any:
    # pyrefly: ignore[missing-import]  # 0.2.x only
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs

    moe = {}
    if _is_moe(hf):
        # pyrefly: ignore[missing-import]  # 0.2.x only
        from torchtitan.models.moe import MoEArgs

        _check_moe(hf, problems)
        if problems:
            return None
        moe = dict(
            moe_enabled=True,
            moe_inter_dim=hf["moe_intermediate_size"],
            moe_args=MoEArgs(
                num_experts=hf["num_experts"],
                num_shared_experts=0,
                top_k=hf["num_experts_per_tok"],
                score_func="softmax",
                route_norm=bool(hf["norm_topk_prob"]),
                route_scale=1.0,
                score_before_experts=False,
            ),
        )
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
        **moe,
    )


def _config_registry_args(hf: Mapping[str, Any], problems: list[str]) -> Any:
    """0.3.x Qwen3Model.Config: a registered flavor with the same tying (dense
    or MoE), its layers rebuilt by upstream's qwen3 layer builders."""
    import torchtitan.models.qwen3 as upstream
    from torchtitan.models.common import CosSinRoPE

    moe = _is_moe(hf)
    if moe:
        _check_moe(hf, problems)
        if problems:
            return None
    config = decoder.retarget("qwen3", hf, moe=moe)
    head_dim = hf["head_dim"]
    shape = dict(
        n_layers=hf["num_hidden_layers"],
        dim=hf["hidden_size"],
        n_heads=hf["num_attention_heads"],
        n_kv_heads=hf["num_key_value_heads"],
        head_dim=head_dim,
        attn_backend="flex",  # model_registry's default
        rope=rope_config(
            CosSinRoPE.Config,
            hf["max_position_embeddings"],
            dim=head_dim,
            theta=float(hf["rope_theta"]),
        ),
    )
    if moe:
        config.layers = upstream._build_qwen3_moe_layers(
            **shape,
            moe_hidden_dim=hf["moe_intermediate_size"],
            num_experts=hf["num_experts"],
            top_k=hf["num_experts_per_tok"],
            moe_comm_backend="standard",  # model_registry's default
        )
        for layer in config.layers:
            assert layer.moe is not None  # every layer of the MoE builder's
            layer.moe.router.route_norm = bool(hf["norm_topk_prob"])
    else:
        config.layers = upstream._build_qwen3_layers(
            **shape, hidden_dim=hf["intermediate_size"]
        )
    decoder.set_norm_eps(config, hf["rms_norm_eps"])
    return config


ADAPTER = ModelAdapter(
    "qwen3",
    "Qwen3ForCausalLM",
    rules,
    hf_config,
    model_types=("qwen3", "qwen3_moe"),
    hf_defaults={
        **decoder.HF_DEFAULTS,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "head_dim": 128,
        "attention_bias": False,
        "max_position_embeddings": 32768,
        "norm_topk_prob": False,  # Qwen3MoeConfig's
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_key_value_heads": 32,  # Qwen3Config's (None: num_attention_heads)
    },
    type_defaults={  # Qwen3MoeConfig's
        "qwen3_moe": {
            "num_key_value_heads": 4,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 768,
        }
    },
    required=decoder.REQUIRED,
    neutral={
        **decoder.NEUTRAL,
        # an MoE model whose every layer is MoE has no dense MLP
        "intermediate_size": lambda value, hf: (
            _is_moe(hf) and not hf.get("mlp_only_layers")
        ),
        # MoE fields (with their defaults) of a dense model
        "norm_topk_prob": lambda value, hf: not _is_moe(hf),
        "decoder_sparse_step": lambda value, hf: not _is_moe(hf),
        "mlp_only_layers": lambda value, hf: not _is_moe(hf),
    },
    native_args={
        Era.TRAINSPEC: _trainspec_args,
        Era.CONFIG_REGISTRY: _config_registry_args,
    },
)
