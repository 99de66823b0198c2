"""Your own HF checkpoint: an architecture that is no registered flavor is
derived from config.json (flavor ``hf``), every config.json field matches,
maps or is refused by name, and the conversions stay exact (CPU, tiny random
models written by transformers, several shards, no download)."""

import json

import pytest
import torch
import transformers
from hf_support import hf_logits, load_native, native_logits, native_model
from safetensors.torch import load_file

from torchtitan_npu.bootstrap import activate, deactivate
from torchtitan_npu.state_dict_adapters import ConversionError, architecture, convert

ERA = convert.current_era()
VOCAB = 512
TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))

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
}
# The titan-npu model of each family above.
MODEL = {"qwen3_moe": "qwen3"}
MOE = ("qwen3_moe", "deepseek_v3")


@pytest.fixture(scope="module", autouse=True)
def overlay():
    activate()  # CPU forward of 0.3.x FlexAttention needs the eager path
    yield
    deactivate()


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


def tolerance(family: str) -> float:
    # Upstream 0.3.x computes routed experts in bf16 (GroupedExperts casts
    # inputs and weights), so an MoE cannot match fp32 HF to 1e-4 there.
    return 1e-3 if family in MOE else 1e-4


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    family = request.param
    path = tmp_path_factory.mktemp(family) / "hf"
    hf = write_hf(path, family)
    return family, MODEL.get(family, family), path, hf


def test_import_derives_the_flavor_and_matches_transformers(checkpoint, tmp_path):
    family, model, path, hf = checkpoint
    assert len(list(path.glob("*.safetensors"))) > 1
    result = convert.from_hf(path, tmp_path / "dcp", model, progress=False)
    assert result.flavor == architecture.HF_FLAVOR
    if family in MOE and ERA == "trainspec":
        pytest.skip("0.2.x MoE router calls torch.histc on int64: no CPU kernel")
    config = json.loads((path / "config.json").read_text())
    args = architecture.derive(model, config, ERA)
    native = native_model(model, args, ERA)
    load_native(native, tmp_path / "dcp")
    diff = (native_logits(native, TOKENS, ERA) - hf_logits(hf, TOKENS)).abs().max()
    print(f"{family} on {ERA}: logits max abs diff {diff:.2e}")
    assert diff <= tolerance(family), f"{family}: max abs diff {diff}"


def test_round_trip_is_exact_and_loads_in_transformers(checkpoint, tmp_path):
    family, model, path, hf = checkpoint
    convert.from_hf(path, tmp_path / "dcp", model, progress=False)
    convert.to_hf(tmp_path / "dcp", tmp_path / "out", model, progress=False)
    original = {}
    for file in path.glob("*.safetensors"):
        original.update(load_file(file))
    exported = {}
    for file in (tmp_path / "out").glob("*.safetensors"):
        exported.update(load_file(file))
    assert exported.keys() == original.keys()  # tied: no lm_head gained
    for key, tensor in original.items():
        assert torch.equal(exported[key], tensor), key
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert torch.equal(hf_logits(reloaded.eval(), TOKENS), hf_logits(hf, TOKENS))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config.get("bos_token_id") == hf.config.bos_token_id  # carried over


@pytest.mark.parametrize(
    ("family", "change", "field"),
    [
        ("llama3", {"rms_norm_eps": 1e-6, "hidden_size": 256, "head_dim": 64}, None),
        (
            "llama3",
            {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
            "rope_type",
        ),
        ("llama3", {"mlp_bias": True}, "mlp_bias"),
        ("llama3", {"hidden_act": "gelu"}, "hidden_act"),
        (
            "qwen2",
            {"use_sliding_window": True, "sliding_window": 64},
            "use_sliding_window",
        ),
        ("qwen3", {"attention_bias": True}, "attention_bias"),
    ],
)
def test_fields_that_change_the_model_are_mapped_or_refused(family, change, field):
    config = {**FAMILIES[family], "vocab_size": VOCAB, **change}
    config.pop("architecture")
    if field is None:  # mapped: the derived model has them
        args = architecture.derive(family, config, ERA)
        assert architecture.exported(family, args, ERA)["rms_norm_eps"] == 1e-6
        return
    with pytest.raises(ConversionError, match=field):
        architecture.derive(family, config, ERA)


def test_a_registered_flavor_is_used_only_when_every_field_matches(tmp_path):
    """llama3 debugmodel's shapes with another eps are not the debug flavor."""
    from torchtitan_npu.state_dict_adapters import upstream_models as um

    debug = architecture.exported(
        "llama3", um.model_args("llama3", "debugmodel", ERA), ERA
    )
    assert architecture.resolve("llama3", None, debug, ERA)[0] == "debugmodel"
    other = {**debug, "rms_norm_eps": debug["rms_norm_eps"] * 10}
    flavor, args = architecture.resolve("llama3", None, other, ERA)
    assert flavor == architecture.HF_FLAVOR
    with pytest.raises(ConversionError, match="rms_norm_eps"):
        architecture.resolve("llama3", "debugmodel", other, ERA)


@pytest.mark.skipif(ERA != "trainspec", reason="0.3.x llama3 ties weights")
def test_tied_llama_is_refused_by_name_before_0_3():
    config = {**FAMILIES["llama3"], "vocab_size": VOCAB, "tie_word_embeddings": True}
    config.pop("architecture")
    with pytest.raises(ConversionError, match="tie_word_embeddings=True: upstream"):
        architecture.derive("llama3", config, ERA)


def test_qwen2_tied_checkpoint_is_not_the_untied_flavor():
    from torchtitan_npu.state_dict_adapters import upstream_models as um

    untied = architecture.exported(
        "qwen2", um.model_args("qwen2", "debugmodel", ERA), ERA
    )
    tied = {**untied, "tie_word_embeddings": True}
    assert architecture.resolve("qwen2", None, tied, ERA)[0] == "debugmodel_tied"


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
    from safetensors.torch import save_file

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


@pytest.fixture(scope="module")
def deepseek_fp8(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_fp8")
    hf, stored = write_deepseek_fp8_with_mtp(path)
    return path, hf, stored


@pytest.mark.skipif(ERA == "trainspec", reason="upstream has MTP from 0.3 on")
def test_deepseek_fp8_with_mtp_imports_dequantized(deepseek_fp8, tmp_path):
    path, hf, stored = deepseek_fp8
    result = convert.from_hf(path, tmp_path / "dcp", "deepseek_v3", progress=False)
    assert result.flavor == architecture.HF_FLAVOR
    config = json.loads((path / "config.json").read_text())
    args = architecture.derive("deepseek_v3", config, ERA)
    assert len(args.mtp_layers) == 1
    native = native_model("deepseek_v3", args, ERA)
    load_native(native, tmp_path / "dcp")
    state = native.state_dict()
    torch.testing.assert_close(  # an FP8 weight, dequantized
        state["layers.0.attention.wq_a.weight"],
        hf.state_dict()["model.layers.0.self_attn.q_a_proj.weight"],
        rtol=0,
        atol=0,
    )
    assert torch.equal(  # the MTP layer's own tensors
        state["mtp_layers.0.eh_proj.weight"].float(),
        _dequantized(stored, "model.layers.3.eh_proj.weight"),
    )
    positions = torch.arange(TOKENS.shape[1]).expand_as(TOKENS)
    with torch.no_grad():
        masks = native.get_attention_masks(positions)
        main_logits = native(TOKENS, attention_masks=masks)[0]
    diff = (main_logits - hf_logits(hf, TOKENS)).abs().max()
    print(f"deepseek_v3 FP8 + MTP on {ERA}: main logits max abs diff {diff:.2e}")
    assert diff <= tolerance("deepseek_v3")


def _dequantized(stored, key, block=(16, 32)):
    values, scale = stored[key], stored[key + "_scale_inv"]
    full = scale.repeat_interleave(block[0], 0)[: values.shape[0]]
    full = full.repeat_interleave(block[1], 1)[:, : values.shape[1]]
    return values.float() * full


@pytest.mark.skipif(ERA == "trainspec", reason="upstream has MTP from 0.3 on")
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_deepseek_fp8_export_like_source_is_bit_exact(deepseek_fp8, dtype, tmp_path):
    """FP8 weights and scales come back byte for byte, also through bf16."""
    path, hf, stored = deepseek_fp8
    convert.from_hf(path, tmp_path / "dcp", "deepseek_v3", dtype=dtype, progress=False)
    convert.to_hf(
        tmp_path / "dcp", tmp_path / "fp8", "deepseek_v3",
        fp8_like_source=True, progress=False,
    )  # fmt: skip
    exported = {}
    for file in (tmp_path / "fp8").glob("*.safetensors"):
        exported.update(load_file(file))
    copies = {
        "model.layers.3.embed_tokens.weight",
        "model.layers.3.shared_head.head.weight",
    }
    assert exported.keys() == stored.keys() - copies  # the main model's copies
    for key, tensor in exported.items():
        want = stored[key]
        if want.dtype == torch.float32 and not key.endswith("_scale_inv"):
            want = want.to(dtype or want.dtype)  # unquantized: the DCP's dtype
        assert tensor.dtype == want.dtype, key
        assert torch.equal(tensor.view(torch.uint8), want.view(torch.uint8)), key
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [16, 32]
    # bf16 by default: the dequantized weights
    convert.to_hf(tmp_path / "dcp", tmp_path / "bf16", "deepseek_v3", progress=False)
    plain = {}
    for file in (tmp_path / "bf16").glob("*.safetensors"):
        plain.update(load_file(file))
    assert all(t.dtype != torch.float8_e4m3fn for t in plain.values())
    assert "quantization_config" not in json.loads(
        (tmp_path / "bf16" / "config.json").read_text()
    )


@pytest.mark.skipif(ERA != "trainspec", reason="0.3.x imports MTP layers")
def test_deepseek_mtp_needs_skip_mtp_before_0_3(deepseek_fp8, tmp_path):
    path, _, _ = deepseek_fp8
    with pytest.raises(ConversionError, match="--skip-mtp"):
        convert.from_hf(path, tmp_path / "a", "deepseek_v3", progress=False)
    result = convert.from_hf(
        path, tmp_path / "b", "deepseek_v3", skip_mtp=True, progress=False
    )
    assert result.flavor == architecture.HF_FLAVOR


def _edited_copy(source, target, *, config=None, drop=()):
    """A copy of an HF directory with config.json edited and tensors dropped."""
    from safetensors.torch import save_file

    target.mkdir()
    index = json.loads((source / "model.safetensors.index.json").read_text())
    kept = {}
    for file in sorted(source.glob("*.safetensors")):
        tensors = {k: v for k, v in load_file(file).items() if k not in drop}
        save_file(tensors, target / file.name, metadata={"format": "pt"})
        kept.update(dict.fromkeys(tensors, file.name))
    index["weight_map"] = kept
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    hf_config = json.loads((source / "config.json").read_text())
    hf_config.update(config or {})
    (target / "config.json").write_text(json.dumps(hf_config))
    return target


def _refused(path, model, match, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match=match) as error:
        convert.from_hf(path, out, model, progress=False)
    assert "\n" not in str(error.value), str(error.value)  # one line
    assert not out.exists()
    assert not list(tmp_path.glob(".out.partial-*"))
    return str(error.value)


def test_bad_hf_inputs_are_one_line_and_write_nothing(deepseek_fp8, tmp_path):
    moe_dir = tmp_path / "moe"
    write_hf(moe_dir, "qwen3_moe")
    expert = "model.layers.1.mlp.experts.3.up_proj.weight"
    cases = [
        (dict(drop={expert}), moe_dir, "qwen3", r"HF experts \[3\] missing"),
        (
            dict(config={"moe_intermediate_size": 40}),
            moe_dir,
            "qwen3",
            "shape mismatch",
        ),
        (
            dict(config={"quantization_config": {"quant_method": "gptq", "bits": 4}}),
            moe_dir,
            "qwen3",
            "quant_method 'gptq' is not supported",
        ),
        (
            dict(drop={"model.layers.0.self_attn.o_proj.weight_scale_inv"}),
            deepseek_fp8[0],
            "deepseek_v3",
            "has no 'model.layers.0.self_attn.o_proj.weight_scale_inv'",
        ),
        (
            dict(config={"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}),
            moe_dir,
            "qwen3",
            "rope_scaling",
        ),
    ]
    for n, (edit, source, model, match) in enumerate(cases):
        case = tmp_path / f"case{n}"
        case.mkdir()
        message = _refused(
            _edited_copy(source, case / "hf", **edit), model, match, case
        )
        print(message)
