"""HF checkpoints of every family, written by transformers with shapes no
upstream flavor has, and DeepSeek-V3 in its FP8 release format (no download)."""

import json

import torch
import transformers
from safetensors.torch import save_file

from torchtitan_npu.state_dict_adapters import convert

ERA = convert.current_era()
VOCAB = 2048  # the embedded tokenizer's: the checkpoints also train

# Shapes no upstream flavor has, with the features real checkpoints use.
FAMILIES = {
    "llama3": dict(
        architecture="LlamaForCausalLM",
        model_type="llama",
        hidden_size=128,
        intermediate_size=320,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        # upstream's llama3 ties weights from 0.3 on
        tie_word_embeddings=ERA != "trainspec",
        max_position_embeddings=1024,
    ),
    "qwen2": dict(
        architecture="Qwen2ForCausalLM",
        model_type="qwen2",
        hidden_size=96,
        intermediate_size=224,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        max_position_embeddings=1024,
    ),
    "qwen3": dict(
        architecture="Qwen3ForCausalLM",
        model_type="qwen3",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=48,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        max_position_embeddings=1024,
    ),
    "qwen3_moe": dict(
        architecture="Qwen3MoeForCausalLM",
        model_type="qwen3_moe",
        hidden_size=64,
        intermediate_size=192,  # unused: every layer is MoE
        moe_intermediate_size=48,
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        max_position_embeddings=1024,
    ),
    "deepseek_v3": dict(
        architecture="DeepseekV3ForCausalLM",
        model_type="deepseek_v3",
        hidden_size=64,
        intermediate_size=160,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling={
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 256,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        tie_word_embeddings=False,
        max_position_embeddings=1024,
    ),
    "gpt_oss": dict(
        architecture="GptOssForCausalLM",
        model_type="gpt_oss",
        hidden_size=64,
        intermediate_size=48,
        num_local_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=8,  # shorter than the test tokens: the window counts
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=150000.0,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 2.0,  # max_position_embeddings / original
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 512,
        },
        swiglu_limit=7.0,
        tie_word_embeddings=False,
        max_position_embeddings=1024,
    ),
}
# The titan-npu model of each family above.
MODEL = {"qwen3_moe": "qwen3"}
MOE = ("qwen3_moe", "deepseek_v3", "gpt_oss")


def write_hf(
    path, family: str, seed: int = 0, **changes
) -> transformers.PreTrainedModel:
    fields = {**FAMILIES[family], "vocab_size": VOCAB, **changes}
    architecture_name = fields.pop("architecture")
    config = transformers.AutoConfig.for_model(**fields)
    config.architectures = [architecture_name]
    torch.manual_seed(seed)
    hf = getattr(transformers, architecture_name)(config).eval()
    with torch.no_grad():  # HF zero-inits biases; make every tensor count
        for p in hf.parameters():
            if p.abs().sum() == 0:
                p.normal_(0, 0.02)
    hf.save_pretrained(path, max_shard_size="200KB")
    return hf


def _block_quantize(weight: torch.Tensor, block: tuple[int, int]):
    """DeepSeek's block-wise FP8 of a weight, written independently of
    titan-npu's: (float8 values, float32 scale_inv per block)."""
    rows, cols = weight.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    scale = torch.empty(grid)
    values = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            r = slice(i * block[0], (i + 1) * block[0])
            c = slice(j * block[1], (j + 1) * block[1])
            scale[i, j] = weight[r, c].abs().max().float() / 448.0
            values[r, c] = (weight[r, c].float() / scale[i, j]).to(values.dtype)
    return values, scale


def _fp8_weight(key: str) -> bool:
    """The weights DeepSeek-V3 ships in FP8: linear layers, not the router,
    embeddings, head or norms."""
    linear = ("_proj.weight", "eh_proj.weight")
    return key.endswith(linear) and ".mlp.gate." not in key


def write_deepseek_fp8_with_mtp(path, block=(16, 32)):
    """A tiny DeepSeek-V3 in its release format: FP8 linear weights with
    block scales, bf16-free fp32 elsewhere, one MTP layer after the main ones.
    Returns the transformers model whose weights are the dequantized ones."""
    hf = write_hf(path / "staging", "deepseek_v3")
    config = json.loads((path / "staging" / "config.json").read_text())
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    n_main = config["num_hidden_layers"]
    generator = torch.Generator().manual_seed(7)
    for key in list(state):  # the MTP layer: a copy of the last layer's shapes
        prefix = f"model.layers.{n_main - 1}."
        if key.startswith(prefix):
            mtp_key = f"model.layers.{n_main}." + key.removeprefix(prefix)
            state[mtp_key] = torch.randn(state[key].shape, generator=generator) * 0.02
    dim = config["hidden_size"]
    mtp = f"model.layers.{n_main}."
    state[mtp + "enorm.weight"] = torch.ones(dim) + 0.1 * torch.randn(dim)
    state[mtp + "hnorm.weight"] = torch.ones(dim) + 0.1 * torch.randn(dim)
    state[mtp + "eh_proj.weight"] = torch.randn(dim, 2 * dim) * 0.02
    state[mtp + "shared_head.norm.weight"] = torch.ones(dim)
    state[mtp + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    state[mtp + "shared_head.head.weight"] = state["lm_head.weight"].clone()
    stored = {}
    with torch.no_grad():
        for key, tensor in state.items():
            if not _fp8_weight(key):
                stored[key] = tensor.contiguous()
                continue
            values, scale = _block_quantize(tensor, block)
            stored[key], stored[key + "_scale_inv"] = values, scale
            full = scale.repeat_interleave(block[0], 0)[: tensor.shape[0]]
            full = full.repeat_interleave(block[1], 1)[:, : tensor.shape[1]]
            if key in hf.state_dict():  # transformers' model: dequantized weights
                hf.state_dict()[key].copy_(values.float() * full)
    keys = sorted(stored)
    half = len(keys) // 2
    index = {}
    for n, part in enumerate((keys[:half], keys[half:])):
        name = f"model-{n + 1:05d}-of-00002.safetensors"
        save_file({k: stored[k] for k in part}, path / name, metadata={"format": "pt"})
        index.update({k: name for k in part})
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": index})
    )
    config["num_nextn_predict_layers"] = 1
    config["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(block),
    }
    (path / "config.json").write_text(json.dumps(config))
    return hf, stored


def dequantized(stored, key, block=(16, 32)):
    values, scale = stored[key], stored[key + "_scale_inv"]
    full = scale.repeat_interleave(block[0], 0)[: values.shape[0]]
    full = full.repeat_interleave(block[1], 1)[:, : values.shape[1]]
    return values.float() * full


_FP4_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _mxfp4_quantize(weight: torch.Tensor):
    """MXFP4 of an [experts, rows, cols] weight, groups of 32 along cols,
    written independently of titan-npu's: (uint8 blocks, uint8 scales)."""
    experts, rows, cols = weight.shape
    groups = weight.float().reshape(experts, rows, cols // 32, 32)
    amax = groups.abs().amax(-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).to(torch.int32)
    scaled = groups / torch.exp2(exponent.float()).unsqueeze(-1)
    magnitude = (scaled.abs().unsqueeze(-1) - _FP4_MAGNITUDES).abs().argmin(-1)
    code = magnitude + 8 * (scaled < 0)
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exponent + 127).to(torch.uint8)


def write_gpt_oss_mxfp4(path):
    """A tiny gpt-oss in OpenAI's release format: MXFP4 expert weights
    (``*_blocks`` / ``*_scales``, stored output-dim first), the rest as is.
    Returns the transformers model whose expert weights are what
    transformers' own dequantizer makes of the blocks."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = write_hf(path / "staging", "gpt_oss", intermediate_size=64)
    config = json.loads((path / "staging" / "config.json").read_text())
    stored = {}
    with torch.no_grad():
        for key, tensor in hf.state_dict().items():
            if not key.endswith(("experts.gate_up_proj", "experts.down_proj")):
                stored[key] = tensor.contiguous()
                continue
            blocks, scales = _mxfp4_quantize(tensor.transpose(1, 2))
            stored[key + "_blocks"], stored[key + "_scales"] = blocks, scales
            tensor.copy_(
                convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            )
    save_file(stored, path / "model.safetensors", metadata={"format": "pt"})
    config["quantization_config"] = {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    }
    (path / "config.json").write_text(json.dumps(config))
    return hf, stored
