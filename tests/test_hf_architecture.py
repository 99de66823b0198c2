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
}
# The titan-npu model of each family above.
MODEL = {"qwen3_moe": "qwen3"}


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
    return 1e-3 if family == "qwen3_moe" else 1e-4


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
    if family == "qwen3_moe" and ERA == "trainspec":
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
