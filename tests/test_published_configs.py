"""The config.json files of published checkpoints (facts, tests/data/hf_configs)
give torchtitan models, on the meta device, with exactly the tensors the
mapping expects and the parameter count of transformers' own model."""

import json
from pathlib import Path

import pytest
import torch
import transformers
from support import requires_newest_of_era

from torchtitan_npu.bootstrap import activate, deactivate
from torchtitan_npu.state_dict_adapters import ConversionError, architecture, convert
from torchtitan_npu.state_dict_adapters import upstream_models as um
from torchtitan_npu.state_dict_adapters.mapping import TensorInfo

pytestmark = requires_newest_of_era(
    "derivation differs per era, not per release (CI time): the older locked "
    "releases of an era run tests/test_hf_architecture.py"
)
ERA = convert.current_era()
CONFIGS = Path(__file__).parent / "data" / "hf_configs"
PUBLISHED = sorted(p.stem for p in CONFIGS.glob("*.json"))
# Huge MoE models: seconds of meta-device module building each.
HEAVY = {"DeepSeek-V3", "Qwen3-30B-A3B", "gpt-oss-120b"}


@pytest.fixture(scope="module", autouse=True)
def overlay():
    activate()  # 0.2.x: qwen2 is a TrainSpec the overlay registers
    yield
    deactivate()


def published(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def hf_meta_model(config: dict) -> torch.nn.Module:
    fields = {k: v for k, v in config.items() if k != "quantization_config"}
    fields.pop("auto_map", None)
    hf_config = transformers.AutoConfig.for_model(**fields)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(hf_config)


def skip_unbuildable(name: str, config: dict) -> dict:
    """What this era cannot build, checked to be refused by name."""
    if (
        ERA == "trainspec"
        and config["model_type"] == "llama"
        and config["tie_word_embeddings"]
    ):
        with pytest.raises(ConversionError, match="tie_word_embeddings=True"):
            architecture.derive("llama3", config, ERA)
        pytest.skip(f"{name}: 0.2.x llama3 ties no weights (refused by name)")
    if config.get("num_nextn_predict_layers") and ERA == "trainspec":
        with pytest.raises(ConversionError, match="--skip-mtp"):
            architecture.derive("deepseek_v3", config, ERA)
        config = {**config, "num_nextn_predict_layers": 0}  # what --skip-mtp does
    return config


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.heavy) if n in HEAVY else n for n in PUBLISHED],
)
def test_published_config_builds_the_mapped_model(name):
    config = skip_unbuildable(name, published(name))
    model = architecture.model_for(config)
    assert model is not None, name
    flavor, args = architecture.resolve(model, None, config, ERA)
    layout, tied = um.describe(model, args, era=ERA)
    hf = hf_meta_model(config)
    hf_layout = {k: TensorInfo.of(v) for k, v in hf.state_dict().items()}
    if config.get("num_nextn_predict_layers"):  # transformers builds no MTP layers
        n = config["num_hidden_layers"]
        native_mtp = {k: v for k, v in layout.items() if k.startswith("mtp_layers.")}
        assert native_mtp, name
    else:
        n, native_mtp = None, {}
    # Exactly the native tensors the mapping expects, every HF tensor consumed.
    native_config = architecture.exported(model, args, ERA)
    keymap = convert.get_adapter(model).keymap(ERA, native_config)
    main_layout = {k: v for k, v in layout.items() if k not in native_mtp}
    if n is not None:
        native_config["num_nextn_predict_layers"] = 0
        keymap = convert.get_adapter(model).keymap(ERA, native_config)
    groups = keymap.plan_from_hf(hf_layout, main_layout)
    assert {n for g in groups for n in g.native} == set(main_layout)
    # The same parameter count as transformers' model.
    native_module = um.build_meta(model, args, ERA)
    counted = {
        id(p): p.numel()
        for k, p in native_module.named_parameters()
        if not k.startswith("mtp_layers.")
    }
    hf_count = sum(p.numel() for p in hf.parameters())
    print(f"{name} on {ERA}: flavor {flavor}, {sum(counted.values()):,} parameters")
    assert sum(counted.values()) == hf_count, name
    assert tied == bool(config.get("tie_word_embeddings")), name
