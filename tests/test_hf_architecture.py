"""Your own HF checkpoint: an architecture that is no registered flavor is
derived from config.json (flavor ``hf``), every config.json field matches,
maps or is refused by name, and the conversions stay exact (CPU, tiny random
models written by transformers, several shards, no download)."""

import json

import pytest
import torch
import transformers
from hf_families import (
    ERA,
    FAMILIES,
    MODEL,
    MOE,
    VOCAB,
    dequantized,
    write_deepseek_fp8_with_mtp,
    write_gpt_oss_mxfp4,
    write_hf,
)
from hf_support import hf_logits, load_native, native_logits, native_model
from safetensors.torch import load_file, save_file
from support import FULL_SUITE, newest_of_its_era, rows_forward

from torchtitan_npu.bootstrap import activate, deactivate
from torchtitan_npu.state_dict_adapters import ConversionError, architecture, convert

TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module", autouse=True)
def overlay():
    activate()  # CPU forward of 0.3.x FlexAttention needs the eager path
    yield
    deactivate()


def tolerance(family: str) -> float:
    # Upstream computes routed experts in bf16 (its grouped GEMM casts inputs
    # and weights), so an MoE cannot match fp32 HF to 1e-4; gpt_oss's SwiGLU
    # and expert biases are bf16 as well.
    if family == "gpt_oss":
        return 3e-3
    return 1e-3 if family in MOE else 1e-4


# What some locked releases cannot build, refused by name there: 0.2.0 and
# 0.2.1's qwen3 declares tying but builds separate weights; 0.2.0's
# deepseek_v3 has no expert groups; gpt_oss is 0.2.2's and 0.3's.
RELEASE_LIMITS = (
    "builds no tied weights",
    "has no expert groups",
    "rotates without YaRN",  # 0.2.1's gpt_oss experiment
    "not a model of this torchtitan release",  # gpt_oss before 0.2.1
)


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    family = request.param
    model = MODEL.get(family, family)
    path = tmp_path_factory.mktemp(family) / "hf"
    hf = write_hf(path, family)
    try:
        architecture.derive(model, json.loads((path / "config.json").read_text()), ERA)
    except ConversionError as e:
        if not any(limit in str(e) for limit in RELEASE_LIMITS):
            raise
        pytest.skip(f"refused by name on this release: {e}")
    return family, model, path, hf


def test_import_derives_the_flavor_and_matches_transformers(checkpoint, tmp_path):
    family, model, path, hf = checkpoint
    assert len(list(path.glob("*.safetensors"))) > 1
    result = convert.from_hf(path, tmp_path / "dcp", model, progress=False)
    assert result.flavor == architecture.HF_FLAVOR
    if family in MOE and ERA == "trainspec" and not FULL_SUITE:
        pytest.skip("0.2.x MoE forward: nox -s full (CI time; 0.3.x runs it)")
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


@pytest.fixture(scope="module")
def deepseek_fp8(tmp_path_factory):
    if not newest_of_its_era():
        pytest.skip("the FP8 path is era-independent code (CI time)")
    path = tmp_path_factory.mktemp("deepseek_fp8")
    hf, stored = write_deepseek_fp8_with_mtp(path)
    return path, hf, stored


@pytest.mark.skipif(ERA == "trainspec", reason="upstream has MTP from 0.3 on")
def test_deepseek_fp8_with_mtp_importsdequantized(deepseek_fp8, tmp_path):
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
        dequantized(stored, "model.layers.3.eh_proj.weight"),
    )
    with torch.no_grad():
        main_logits = rows_forward(native, TOKENS)[0]
    diff = (main_logits - hf_logits(hf, TOKENS)).abs().max()
    print(f"deepseek_v3 FP8 + MTP on {ERA}: main logits max abs diff {diff:.2e}")
    assert diff <= tolerance("deepseek_v3")


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
    # the export knows the architecture as imported: without the MTP layer
    convert.to_hf(tmp_path / "b", tmp_path / "c", "deepseek_v3", progress=False)
    config = json.loads((tmp_path / "c" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 0


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_is_the_float32_product_for_every_fp8_code(dtype):
    from torchtitan_npu.state_dict_adapters import quantization

    block = (16, 32)
    codes = torch.arange(256, dtype=torch.uint8).repeat(40, 3)[:, :700]  # ragged
    weight = codes.view(quantization.FP8)
    grid = (-(-weight.shape[0] // block[0]), -(-weight.shape[1] // block[1]))
    scale = torch.rand(grid, generator=torch.Generator().manual_seed(0)) + 0.5
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    expected = (weight.to(torch.float32) * full[:40, :700]).to(dtype)
    got = quantization.dequantize(weight, scale, block, dtype)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(got.view(bits), expected.view(bits))  # NaN codes included


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory):
    if not newest_of_its_era():
        pytest.skip("the MXFP4 path is era-independent code (CI time)")
    path = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    hf, stored = write_gpt_oss_mxfp4(path)
    return path, hf, stored


def test_gpt_oss_mxfp4_imports_dequantized_as_transformers_does(
    gpt_oss_mxfp4, tmp_path
):
    path, hf, stored = gpt_oss_mxfp4
    result = convert.from_hf(path, tmp_path / "dcp", "gpt_oss", progress=False)
    assert result.flavor == architecture.HF_FLAVOR
    args = architecture.derive(
        "gpt_oss", json.loads((path / "config.json").read_text()), ERA
    )
    native = native_model("gpt_oss", args, ERA)
    load_native(native, tmp_path / "dcp")
    state, theirs = native.state_dict(), hf.state_dict()
    for hf_name, native_name in [
        ("gate_up_proj", "mlp1_weight"),
        ("down_proj", "mlp2_weight"),
    ]:
        native_key = next(
            k for k in state if k.startswith("layers.1.") and native_name in k
        )
        expected = theirs[f"model.layers.1.mlp.experts.{hf_name}"].transpose(1, 2)
        assert torch.equal(state[native_key], expected), hf_name  # bit for bit
    diff = (native_logits(native, TOKENS, ERA) - hf_logits(hf, TOKENS)).abs().max()
    print(f"gpt_oss MXFP4 on {ERA}: logits max abs diff {diff:.2e}")
    assert diff <= tolerance("gpt_oss")
    # Exported unquantized: transformers loads it without a quantizer.
    convert.to_hf(tmp_path / "dcp", tmp_path / "out", "gpt_oss", progress=False)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config
    exported = load_file(next((tmp_path / "out").glob("*.safetensors")))
    assert not any(k.endswith(("_blocks", "_scales")) for k in exported)
    assert torch.equal(
        exported["model.layers.0.mlp.experts.down_proj"],
        theirs["model.layers.0.mlp.experts.down_proj"],
    )
    with pytest.raises(ConversionError, match="MXFP4"):
        convert.to_hf(
            tmp_path / "dcp", tmp_path / "fp8", "gpt_oss", fp8_like_source=True
        )


def test_gpt_oss_mxfp4_blocks_without_scales_are_named(gpt_oss_mxfp4, tmp_path):
    path, _, stored = gpt_oss_mxfp4
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((path / "config.json").read_text())
    key = "model.layers.0.mlp.experts.down_proj_scales"
    kept = {k: v for k, v in stored.items() if k != key}
    save_file(kept, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=f"has no '{key}'"):
        convert.from_hf(broken, tmp_path / "dcp", "gpt_oss", progress=False)
    assert not (tmp_path / "dcp").exists()


def _transformers_classes():
    from torchtitan_npu.state_dict_adapters import ADAPTERS

    for adapter in ADAPTERS.values():
        for model_type in adapter.model_types:
            if adapter.name == "kimi_k2_7" and model_type == "deepseek_v3":
                continue  # Moonlight: read with deepseek_v3's table
            try:
                config = transformers.AutoConfig.for_model(model_type)
            except (KeyError, ValueError):
                continue  # a model type this transformers lacks (qwen3_5, kimi)
            yield pytest.param(adapter, model_type, type(config), id=model_type)


@pytest.mark.parametrize("adapter, model_type, cls", list(_transformers_classes()))
def test_each_family_table_matches_transformers_config_class(adapter, model_type, cls):
    """Every argument of transformers' config class is inert, required, has
    the transformers default in the family's table, or has a default that
    changes nothing (``neutral``): an omitted field is never guessed."""
    import inspect

    params = inspect.signature(cls.__init__).parameters.values()
    class_defaults = {
        p.name: p.default for p in params if p.default is not inspect.Parameter.empty
    }
    table = adapter.defaults_of(model_type)
    # every model's config (outputs, labels, ...: transformers' own base class)
    base = inspect.signature(transformers.PretrainedConfig.__init__).parameters
    problems = []
    for name, default in class_defaults.items():
        if name in architecture.INERT or name in adapter.required or name in base:
            continue
        if name == "rope_parameters" and "rope_scaling" in table:
            continue  # transformers 5's spelling, read as rope_theta + rope_scaling
        if name in table:
            if default is None and callable(table[name]):
                continue  # derived from the other fields, as in the class's __init__
            ours = table[name]
            ours = ours(class_defaults) if callable(ours) else ours
            if not architecture._same(ours, default) and not (
                name == "mlp_only_layers" and not ours and not default
            ):
                problems.append(f"{name}: table {ours!r}, transformers {default!r}")
        elif name in adapter.neutral:
            if not adapter.neutral[name](default, class_defaults):
                problems.append(
                    f"{name}: transformers' default {default!r} is not neutral"
                )
        else:
            problems.append(f"{name}: in no table (transformers' default {default!r})")
    assert not problems, f"{cls.__name__}: {problems}"


def test_a_field_the_native_model_has_and_config_json_omits_is_named():
    args = architecture.um.model_args("llama3", "debugmodel", convert.current_era())
    native = architecture.exported("llama3", args, convert.current_era())
    native = {**native, "some_new_field": 3}
    source = architecture.with_defaults(
        "llama3", {k: v for k, v in native.items() if k != "some_new_field"}
    )
    found = architecture.problems("llama3", source, native)
    assert found == [
        "config.json has no 'some_new_field' (the native model has 3 and titan-npu "
        "does not know transformers' default): add it"
    ]


def test_transformers5_rope_parameters_read_as_theta_and_scaling():
    """transformers 5 writes ``rope_parameters``; the 4.x fields it replaces
    derive the same model, and a changed norm eps is never a registered flavor."""
    era = convert.current_era()
    args = architecture.um.model_args("llama3", "debugmodel", era)
    old = architecture.exported("llama3", args, era)
    new = {k: v for k, v in old.items() if k not in ("rope_theta", "rope_scaling")}
    new["rope_parameters"] = {"rope_theta": old["rope_theta"], **old["rope_scaling"]}
    assert architecture.resolve("llama3", None, new, era)[0] == "debugmodel"
    unscaled = {**new, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    assert architecture.resolve("llama3", None, unscaled, era)[0] == "hf"
    for eps in ({"rms_norm_eps": 1e-6}, {"rms_norm_eps": 1e-6, "rope_scaling": None}):
        assert architecture.resolve("llama3", None, {**old, **eps}, era)[0] == "hf"
