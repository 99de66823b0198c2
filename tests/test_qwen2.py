"""titan-npu's Qwen2: the real Qwen2.5 shapes, registration on this era, and
the model's single-device semantics (no download; training is in the matrix)."""

import pytest
import torch

from torchtitan_npu.bootstrap import activate, deactivate
from torchtitan_npu.compat import resolve_upstream
from torchtitan_npu.models.qwen2 import FLAVORS
from torchtitan_npu.models.qwen2.model import Qwen2Model
from torchtitan_npu.state_dict_adapters import upstream_models as um

ERA = resolve_upstream().era

# Parameter counts of Qwen/Qwen2.5-{0.5B,1.5B,7B} (tied embeddings counted once).
HF_PARAMS = {"0.5B": 494_032_768, "1.5B": 1_543_714_304, "7B": 7_615_616_512}


@pytest.mark.parametrize("flavor", HF_PARAMS)
def test_flavors_have_the_real_qwen2_5_shapes(flavor):
    """The era's model (0.3.x: built from upstream's parts) has Qwen2.5's
    parameter count, and so does its FLOP counter."""
    activate()
    try:
        args = um.model_args("qwen2", flavor, ERA)
        model = um.build_meta("qwen2", args, ERA)
    finally:
        deactivate()
    assert sum(p.numel() for p in model.parameters()) == HF_PARAMS[flavor]
    counter = getattr(args, "get_nparams_and_flops", None) or args.nparams_and_flops
    nparams, flops = counter(model, 4096)
    assert nparams == HF_PARAMS[flavor] and flops > 6 * (nparams // 2)


def test_a_tied_flavor_stays_tied_after_the_meta_device_build():
    """to_empty gives the embedding and the head tensors of their own; the
    initialization ties them again (on 0.2.x it did not: the head kept
    to_empty's uninitialized memory and trained apart)."""
    activate()
    try:
        args = um.model_args("qwen2", "debugmodel_tied", ERA)
        model = um.build_meta("qwen2", args, ERA)
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights(buffer_device=torch.device("cpu"))
    finally:
        deactivate()
    head = model.output if ERA == "trainspec" else model.lm_head
    assert head.weight is model.tok_embeddings.weight
    assert torch.isfinite(head.weight).all()
    names = {n for n, _ in model.named_parameters()}
    assert "tok_embeddings.weight" in names and len(names) == len(
        list(model.parameters())
    )


def test_registered_through_the_overlay_on_this_era():
    activate()
    try:
        if ERA == "trainspec":
            from torchtitan.protocols.train_spec import get_train_spec

            spec = get_train_spec("qwen2")
            assert spec.model_cls is Qwen2Model
            assert set(spec.model_args) == set(FLAVORS)
        else:
            from torchtitan_npu.config.config_registry import base_config

            config = base_config("qwen2", "0.5B")
            assert config.model_spec.name == "qwen2"
            model = config.model_spec.model
            assert (model.dim, model.vocab_size, len(model.layers)) == (896, 151936, 24)
        adapter = (spec if ERA == "trainspec" else config.model_spec).state_dict_adapter
        assert adapter.__name__ == "TitanNpuQwen2StateDictAdapter"
    finally:
        deactivate()
    if ERA == "trainspec":  # reverting the overlay unregisters it
        from torchtitan.protocols.train_spec import _extra_train_specs

        assert "qwen2" not in _extra_train_specs


def test_pipeline_stage_semantics():
    """ModuleDict layers keep FQNs when a stage drops modules; absent input /
    output modules pass hidden states through."""
    args = FLAVORS["debugmodel"]
    torch.manual_seed(0)
    full = Qwen2Model(args)
    full.init_weights()
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    first, last = Qwen2Model(args), Qwen2Model(args)
    first.load_state_dict(full.state_dict())
    last.load_state_dict(full.state_dict())
    for name in ("2", "3"):
        del first.layers[name]
    for name in ("0", "1"):
        del last.layers[name]
    first.norm = first.output = last.tok_embeddings = None
    assert [k for k in last.state_dict() if k.startswith("layers.")][0].startswith(
        "layers.2."
    )
    torch.testing.assert_close(last(first(tokens)), full(tokens), rtol=0, atol=0)


def test_flavor_table_is_what_the_converter_sees():
    activate()
    try:
        assert set(um.flavors("qwen2", ERA)) == set(FLAVORS)
    finally:
        deactivate()
