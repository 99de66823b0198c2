"""The HF adapters of upstream's multimodal models, qwen3_5 and kimi_k2_7:
upstream's own adapters on the same tensors (bit for bit, but Qwen3.5-MoE's
experts, which take the layout transformers loads and upstream's adapter
does not), conversions both ways, tied releases and their MTP head, and
transformers' logits where transformers has the model (5.x; ``nox -s
transformers5``)."""

import contextlib
import copy
import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
import transformers
from hf_support import as_hf_deepseek
from safetensors.torch import save_file
from support import requires_era, rows_forward

from torchtitan_npu.bootstrap import activate, deactivate
from torchtitan_npu.config.batch_and_data import counts_tokens
from torchtitan_npu.state_dict_adapters import architecture, convert, get_adapter
from torchtitan_npu.state_dict_adapters import upstream_models as um
from torchtitan_npu.state_dict_adapters.upstream_adapter import adapter_class

pytestmark = requires_era("config_registry")
ERA = convert.current_era()
VOCAB = 512  # upstream's 248,320 rows cost seconds per tensor and change nothing


@pytest.fixture(scope="module", autouse=True)
def overlay():
    """Upstream's Qwen3.5 imports fla: the overlay's stand-in answers."""
    activate()
    yield
    deactivate()


def small(flavor: str):
    """The upstream flavor with a small vocabulary."""
    args = copy.deepcopy(um.model_args("qwen3_5", flavor, ERA))
    args.vocab_size = args.tok_embeddings.num_embeddings = VOCAB
    args.lm_head.out_features = VOCAB
    return args


def random_state(args, seed: int = 0) -> dict[str, torch.Tensor]:
    layout, _ = um.describe("qwen3_5", args, ERA)
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(i.shape, generator=g) for k, i in layout.items()}


def both_adapters(args):
    from torchtitan.models.qwen3_5.state_dict_adapter import Qwen35StateDictAdapter

    return adapter_class("qwen3_5", ERA)(args, None), Qwen35StateDictAdapter(args, None)


@contextlib.contextmanager
def one_device():
    """Upstream's SPMD backend as the trainer sets it on one device."""
    from torchtitan.distributed.utils import get_spmd_backend, set_spmd_backend

    backend = get_spmd_backend()
    set_spmd_backend("dtensor")
    try:
        yield
    finally:
        set_spmd_backend(backend)


def initialised(args) -> torch.nn.Module:
    """The model of `args` on CPU, initialised as upstream does, in eval mode."""
    torch.manual_seed(0)
    model = args.build()
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model.eval()


def test_dense_is_upstreams_adapter_bit_for_bit():
    args = small("debugmodel")
    state = random_state(args)
    ours, upstream = both_adapters(args)
    hf, expected = ours.to_hf(dict(state)), upstream.to_hf(dict(state))
    assert hf.keys() == expected.keys()
    assert all(torch.equal(hf[k], expected[k]) for k in hf)
    back, upstream_back = ours.from_hf(dict(hf)), upstream.from_hf(dict(hf))
    assert back.keys() == upstream_back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_moe_experts_are_in_the_layout_transformers_loads():
    """HF Qwen3.5-MoE keeps ``gate_up_proj`` as (experts, 2 * hidden, dim):
    native w1 and w3 stacked on dim 1, no transpose (upstream's adapter
    transposes, and transformers refuses the shape). Every other tensor is
    upstream's, bit for bit."""
    args = small("debugmodel_moe")
    state = random_state(args)
    ours, upstream = both_adapters(args)
    hf, expected = ours.to_hf(dict(state)), upstream.to_hf(dict(state))
    assert hf.keys() == expected.keys()
    native = "layers.0.moe.routed_experts.inner_experts."
    prefix = "model.language_model.layers.0.mlp.experts."
    w1, w3 = state[f"{native}w1_EFD"], state[f"{native}w3_EFD"]
    assert torch.equal(hf[f"{prefix}gate_up_proj"], torch.cat([w1, w3], dim=1))
    assert torch.equal(hf[f"{prefix}down_proj"], state[f"{native}w2_EDF"])
    n_experts, hidden, dim = w1.shape
    assert hf[f"{prefix}gate_up_proj"].shape == (n_experts, 2 * hidden, dim)
    others = [k for k in hf if ".mlp.experts." not in k]
    assert all(torch.equal(hf[k], expected[k]) for k in others)
    back = ours.from_hf(dict(hf))
    kept = {k for k in state if "expert_bias" not in k}  # native-only
    assert back.keys() == kept and all(torch.equal(back[k], state[k]) for k in kept)


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_moe", "35B-A3B"])
def test_config_json_names_the_flavor_back(flavor):
    """The config.json a flavor exports resolves to that flavor (metadata
    only), with the release's fields the native model has no use for."""
    args = um.model_args("qwen3_5", flavor, ERA)
    config = architecture.exported("qwen3_5", args, ERA)
    config["text_config"] |= {"mtp_num_hidden_layers": 1, "full_attention_interval": 4}
    config |= {"image_token_id": 248056, "tie_word_embeddings": True}
    found, _ = architecture.resolve("qwen3_5", None, config, ERA)
    assert found == flavor


def test_a_field_the_flavor_lacks_is_named():
    args = um.model_args("qwen3_5", "debugmodel", ERA)
    config = architecture.exported("qwen3_5", args, ERA)
    config["text_config"]["linear_num_value_heads"] = 8
    with pytest.raises(convert.ConversionError, match="linear_num_value_heads=8"):
        architecture.resolve("qwen3_5", "debugmodel", config, ERA)


def test_tied_release_with_mtp_imports_untied_and_round_trips(tmp_path):
    """A release as Qwen ships the small ones: no ``lm_head`` (tied), an MTP
    head. The import copies the embedding into upstream's untied head and
    leaves the MTP head out; the export writes the head, and a second import
    gives back every tensor bit for bit."""
    args = small("debugmodel_moe")
    state = random_state(args)
    hf = adapter_class("qwen3_5", ERA)(args, None).to_hf(dict(state))
    del hf["lm_head.weight"]
    embed = hf["model.language_model.embed_tokens.weight"]
    hf["mtp.fc.weight"] = torch.zeros(4, 4)
    hf["mtp.layers.0.input_layernorm.weight"] = torch.zeros(4)
    release = tmp_path / "release"
    release.mkdir()
    save_file({k: v.contiguous() for k, v in hf.items()}, release / "model.safetensors")
    config = architecture.exported("qwen3_5", args, ERA) | {"tie_word_embeddings": True}
    (release / "config.json").write_text(json.dumps(config))

    convert.from_hf(release, tmp_path / "dcp", "qwen3_5", args=args, progress=False)
    imported = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load(imported, checkpoint_id=str(tmp_path / "dcp"))
    assert torch.equal(imported["lm_head.weight"], embed)
    for key in state:
        if key != "lm_head.weight" and "expert_bias" not in key:
            assert torch.equal(imported[key], state[key]), key

    convert.to_hf(
        tmp_path / "dcp", tmp_path / "hf", "qwen3_5", args=args, progress=False
    )
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert exported["tie_word_embeddings"] is False
    convert.from_hf(
        tmp_path / "hf", tmp_path / "again", "qwen3_5", args=args, progress=False
    )
    again = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load(again, checkpoint_id=str(tmp_path / "again"))
    assert all(torch.equal(again[k], imported[k]) for k in state)


def test_patch_embedding_is_transformers_conv3d():
    """The native Linear over flattened patches is HF's Conv3d weight
    reshaped: (out, channels, frames, height, width)."""
    args = small("debugmodel")
    state = random_state(args)
    hf = adapter_class("qwen3_5", ERA)(args, None).to_hf(dict(state))
    v = args.vision_encoder
    conv = hf["model.visual.patch_embed.proj.weight"]
    assert conv.shape == (
        v.dim,
        v.in_channels,
        v.temporal_patch_size,
        v.patch_size,
        v.patch_size,
    )
    assert torch.equal(conv.flatten(1), state["vision_encoder.patch_embed.weight"])


def own_size() -> dict:
    """A Qwen3.5-MoE config.json of a size no flavor has (layer pattern,
    heads, experts, eps, vision tower)."""
    config = architecture.exported("qwen3_5", small("debugmodel_moe"), ERA)
    config["text_config"].update(
        vocab_size=2048,  # the embedded tokenizer's: it trains
        hidden_size=128,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention"] * 2,
        num_attention_heads=2,
        num_key_value_heads=1,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=96,
        rms_norm_eps=1e-5,
    )
    config["vision_config"].update(
        depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128
    )
    return config


def write_own_size(directory, seed: int = 0):
    """An HF directory of `own_size` (sharded safetensors + index + config.json,
    as to-hf writes them) and the native state it holds."""
    config = own_size()
    args = architecture.derive("qwen3_5", config, ERA)
    state = random_state(args, seed)
    dcp.save(state, checkpoint_id=str(directory.parent / "own-dcp"))
    convert.to_hf(
        directory.parent / "own-dcp", directory, "qwen3_5", args=args,
        max_shard_size="1MB", progress=False,
    )  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    return args, state


def test_a_size_no_flavor_has_is_derived_and_imports_exactly(tmp_path):
    """config.json of its own size: no registered flavor matches, so the
    flavor is derived (``hf``) with upstream's builders; the import gives back
    every tensor bit for bit."""
    args, state = write_own_size(tmp_path / "hf")
    result = convert.from_hf(
        tmp_path / "hf", tmp_path / "dcp", "qwen3_5", progress=False
    )
    assert result.flavor == architecture.HF_FLAVOR
    imported = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load(imported, checkpoint_id=str(tmp_path / "dcp"))
    for key in state:
        if "expert_bias" not in key:  # native-only: zeros on import
            assert torch.equal(imported[key], state[key]), key
    layers = args.layers
    assert [layer.attention is not None for layer in layers] == [False, True] * 2
    assert layers[1].attention.n_heads == 2 and layers[0].moe.num_experts == 4


def test_a_layer_pattern_upstream_cannot_build_is_named():
    config = own_size()
    config["text_config"]["layer_types"] = ["full_attention"] + ["linear_attention"] * 3
    with pytest.raises(convert.ConversionError, match="every N-th layer full"):
        architecture.derive("qwen3_5", config, ERA)


@pytest.mark.e2e
def test_own_size_trains_from_its_hf_directory(launcher, tmp_path):
    """``--model.flavor hf --model.hf_assets_path DIR``: the derived Qwen3.5-MoE
    loads DIR's weights through the adapter in training and the loss falls."""
    from support import assert_loss_falls, warm_train

    from torchtitan_npu.assets import ensure_default_assets

    hf_dir = tmp_path / "hf"
    write_own_size(hf_dir)
    for file in ensure_default_assets().tokenizer_path.iterdir():
        (hf_dir / file.name).write_bytes(file.read_bytes())
    scalars = warm_train(
        launcher, tmp_path / "run", "--model.flavor", "hf", "--model.hf_assets_path",
        str(hf_dir), "--parallelism.expert_parallel_degree", "1",
        "--optimizer.lr", "3e-3", steps=4,
    )  # fmt: skip
    assert_loss_falls(scalars)
    assert f"Loading the checkpoint from {hf_dir}" in (tmp_path / "run.log").read_text()


@pytest.mark.skipif(
    not hasattr(transformers, "Qwen3_5ForConditionalGeneration"),
    reason="transformers has no Qwen3.5 before 5.x (nox -s transformers5)",
)
@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_moe", "own size"])
def test_logits_match_transformers(flavor):
    """The same weights in transformers' Qwen3.5 give the native logits on a
    text batch (its grouped linear-attention heads through the fla stand-in
    too)."""
    if flavor == "own size":
        args = architecture.derive("qwen3_5", own_size(), ERA)
    else:
        args = small(flavor)
    with one_device():
        model = initialised(args)
        with torch.no_grad():
            for p in model.parameters():  # zero-initialised norms count too
                if not p.any():
                    p.normal_(0, 0.1)
        config = architecture.exported("qwen3_5", args, ERA)
        kind = config["architectures"][0]
        hf_config = getattr(
            transformers, kind.replace("ForConditionalGeneration", "Config")
        )(
            text_config=config["text_config"],
            vision_config=config["vision_config"],
            tie_word_embeddings=False,
        )
        hf = getattr(transformers, kind)(hf_config).eval()
        weights = adapter_class("qwen3_5", ERA)(args, None).to_hf(model.state_dict())
        hf.load_state_dict(weights, strict=True)
        tokens = torch.randint(
            0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1)
        )
        with torch.no_grad():
            ours = rows_forward(model, tokens)
            theirs = hf(input_ids=tokens).logits
    tolerance = 1e-5 if flavor == "debugmodel" else 3e-4  # MoE: routing sums
    assert (ours - theirs).abs().max() <= tolerance * theirs.abs().max()


# -- kimi_k2_7 (Kimi K2.5: MoonViT + DeepSeek-V3) ------------------------------


def kimi_args(flavor: str = "debugmodel"):
    return copy.deepcopy(um.model_args("kimi_k2_7", flavor, ERA))


def kimi_state(args, seed: int = 0) -> dict[str, torch.Tensor]:
    layout, _ = um.describe("kimi_k2_7", args, ERA)
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(i.shape, generator=g) for k, i in layout.items()}


def test_kimi_is_upstreams_adapter_bit_for_bit():
    from torchtitan.models.kimi_k2_7.state_dict_adapter import (
        KimiK25StateDictAdapter,
    )

    args = kimi_args()
    state = kimi_state(args)
    ours = adapter_class("kimi_k2_7", ERA)(args, None)
    upstream = KimiK25StateDictAdapter(args, None)
    hf, expected = ours.to_hf(dict(state)), upstream.to_hf(dict(state))
    assert hf.keys() == expected.keys()
    assert all(torch.equal(hf[k], expected[k]) for k in hf)
    back, upstream_back = ours.from_hf(dict(hf)), upstream.from_hf(dict(hf))
    assert back.keys() == upstream_back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)
    assert all(torch.equal(upstream_back[k], state[k]) for k in state)


def test_kimi_vl_projector_spelling_imports_too():
    """Kimi-VL names the projector ``multi_modal_projector.linear_1/2``, K2.5
    ``mm_projector.proj.0/2``: both import; the export is K2.5's."""
    args = kimi_args()
    state = kimi_state(args)
    ours = adapter_class("kimi_k2_7", ERA)(args, None)
    hf = ours.to_hf(dict(state))
    spelled = {
        k.replace("mm_projector.", "multi_modal_projector.")
        .replace("proj.0", "linear_1")
        .replace("proj.2", "linear_2"): v
        for k, v in hf.items()
    }
    assert spelled.keys() != hf.keys()
    back = ours.from_hf(spelled)
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_kimi_text_only_flavor_is_a_deepseek_checkpoint():
    """Moonlight has no vision tower: its checkpoint is DeepSeek-V3's (on the
    meta device: the full 16B layout, planned both ways)."""
    args = kimi_args("moonlight-16B-A3B")
    layout, tied = um.describe("kimi_k2_7", args, ERA)
    adapter = get_adapter("kimi_k2_7")
    config = adapter.hf_config(args, ERA, layout)
    assert config["model_type"] == "deepseek_v3"
    keymap = adapter.keymap(ERA, config)
    hf = {
        k: i
        for g in keymap.plan_to_hf(layout, tied=tied)
        for k, i in zip(g.hf, g.hf_infos)
    }
    assert "model.embed_tokens.weight" in hf and not any(
        k.startswith("language_model.") for k in hf
    )
    back = keymap.plan_from_hf(hf, expected=layout)
    assert {n for g in back for n in g.native} == set(layout)


def kimi_in_transformers(model, args, path):
    """``model``'s export to ``path``, loaded by transformers' own
    from_pretrained (which renames the release's keys itself)."""
    hf = adapter_class("kimi_k2_7", ERA)(args, None).to_hf(model.state_dict())
    save_file({k: v.contiguous() for k, v in hf.items()}, path / "model.safetensors")
    config = architecture.exported("kimi_k2_7", args, ERA)
    (path / "config.json").write_text(json.dumps(config))
    return transformers.AutoModelForImageTextToText.from_pretrained(
        path, dtype=torch.float32
    ).eval()


@pytest.mark.skipif(
    not hasattr(transformers, "Kimi_K25ForConditionalGeneration"),
    reason="transformers has no Kimi K2.5 before 5.x (nox -s transformers5)",
)
def test_kimi_text_logits_match_transformers(tmp_path):
    """The export, loaded by transformers' own from_pretrained (which renames
    the release's keys itself), gives the native logits on a text batch. The
    debug flavor routes as HF's DeepSeek-V3 does: sigmoid, normalized top-k,
    eps 1e-6 (upstream's uses softmax and 1e-5)."""
    args = as_hf_deepseek(kimi_args())
    with one_device():
        model = initialised(args)
        loaded = kimi_in_transformers(model, args, tmp_path)
        tokens = torch.randint(
            0, 2000, (2, 32), generator=torch.Generator().manual_seed(1)
        )
        with torch.no_grad():
            ours = rows_forward(model, tokens)
            theirs = loaded(input_ids=tokens).logits
    # upstream's GroupedExperts compute in bf16 (as deepseek_v3's, see
    # docs/hf_checkpoints.md [1])
    assert (ours - theirs).abs().max() <= 1e-3 * theirs.abs().max()


def image_batch(sizes: list[tuple[int, int]], patch: int):
    """(raster patches of every image, concatenated; the same padded per
    image as upstream takes them; grid_thw)."""
    grid = torch.tensor([[1, h, w] for h, w in sizes])
    counts = grid.prod(-1).tolist()
    g = torch.Generator().manual_seed(0)
    patches = torch.randn(sum(counts), 3, patch, patch, generator=g)
    padded = torch.zeros(len(counts), max(counts), 3 * patch * patch)
    for i, image in enumerate(patches.flatten(1).split(counts)):
        padded[i, : len(image)] = image
    return patches, padded, grid


def encoded(encoder, images: list, grid: torch.Tensor) -> list:
    """Each image's merged features (2 x 2 patches a token), the images
    encoded as one batch: zero-padded rows (0.3.0), or one packed patch
    sequence (upstream main)."""
    merged = [count // 4 for count in grid.prod(-1).tolist()]
    if counts_tokens():
        return list(encoder(torch.cat(images), grid_thw=grid).split(merged))
    padded = torch.nn.utils.rnn.pad_sequence(images, batch_first=True)
    out = encoder(padded, grid_thw=grid)
    return [out[i, :m] for i, m in enumerate(merged)]


@pytest.mark.parametrize("model", ["kimi_k2_7", "qwen3_5"])
def test_images_in_one_batch_encode_as_each_alone(model):
    """The vision towers on CPU (their block mask built eagerly by the
    overlay: the compiled builder's CPU code does not compile): each image of
    a batch gets the features it gets alone."""
    args = kimi_args() if model == "kimi_k2_7" else small("debugmodel")
    with one_device():
        encoder = initialised(args).vision_encoder
        grid = torch.tensor([[1, 8, 12], [1, 4, 6]])  # [t, h, w] in patches
        counts = grid.prod(-1).tolist()
        g = torch.Generator().manual_seed(0)
        pixels = torch.randn(2, counts[0], encoder.patch_embed.in_features, generator=g)
        images = [pixels[i, :count] for i, count in enumerate(counts)]
        with torch.no_grad():
            batch = encoded(encoder, images, grid)
            for i, image in enumerate(images):
                alone = encoded(encoder, [image], grid[i : i + 1])[0]
                torch.testing.assert_close(batch[i], alone)


@pytest.mark.skipif(
    not hasattr(transformers, "Kimi_K25ForConditionalGeneration"),
    reason="transformers has no Kimi K2.5 before 5.x (nox -s transformers5)",
)
def test_kimi_vision_features_match_transformers(tmp_path):
    """The export's vision tower and projector, in transformers, give the
    native image features: two images of other sizes than the position
    table's (bicubic resampling), one batch (upstream pads them, transformers
    concatenates)."""
    args = as_hf_deepseek(kimi_args())
    with one_device():
        model = initialised(args)
        with torch.no_grad():
            for p in model.vision_encoder.parameters():  # zero-initialised too
                if not p.any():
                    p.normal_(0, 0.1)
        loaded = kimi_in_transformers(model, args, tmp_path)
        patches, padded, grid = image_batch(
            [(8, 12), (4, 6)], args.vision_encoder.patch_size
        )
        counts = grid.prod(-1).tolist()
        with torch.no_grad():
            ours = model.vision_encoder(padded, grid_thw=grid)
            theirs = loaded.model.get_image_features(patches, image_grid_thw=grid)
        for i, features in enumerate(theirs.pooler_output):
            assert features.shape[0] == counts[i] // 4  # 2 x 2 patches merged
            torch.testing.assert_close(
                ours[i, : len(features)], features, rtol=1e-5, atol=1e-5
            )
