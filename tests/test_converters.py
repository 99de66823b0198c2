"""Kernel converters: converted models compute what upstream's do (fp32, CPU),
the npu path calls the torch_npu kernels it should, and errors are clear.

The npu dispatch tests use a stand-in torch_npu that records its calls and
answers with the native kernels' results: it checks which kernel is called
with which arguments, never NPU numerics.
"""

import copy
import logging
import sys
import types

import pytest
import torch
from hf_support import native_model
from support import (
    FULL_SUITE,
    LOSS,
    heavy_except,
    requires_newest_of_era,
    rows_forward,
    warm_train,
)

from torchtitan_npu import converters
from torchtitan_npu.bootstrap import activate, deactivate
from torchtitan_npu.compat import era_module
from torchtitan_npu.converters.ops import (
    attention,
    grouped_mm,
    rms_norm,
    rope,
    swiglu,
    token_permute,
)
from torchtitan_npu.converters.registry import ConverterError
from torchtitan_npu.overlay import OVERLAY
from torchtitan_npu.state_dict_adapters import upstream_models as um

MODELS = ["llama3", "qwen3", "qwen3_moe", "deepseek_v3", "qwen2"]  # qwen2: 0.3.x only
# A test model name -> (upstream model, flavor): qwen3's MoE debug flavor.
FLAVORS = {"qwen3_moe": ("qwen3", "debugmodel_moe")}


def model_and_flavor(name: str) -> tuple[str, str]:
    return FLAVORS.get(name, (name, "debugmodel"))


def model_args(name: str, era: str):
    """A copy of the debug model's args. 0.2.x's qwen3 MoE keeps 8 of its 64
    experts: the fp32 loop's backward (the reference) writes a whole-weight
    gradient for each expert's slice, 40 s a pass at 64."""
    args = copy.deepcopy(um.model_args(*model_and_flavor(name), era))
    if era == "trainspec" and name == "qwen3_moe":
        args.moe_args.num_experts, args.moe_args.top_k = 8, 2
    return args


NAMES = ["rms_norm", "rope", "attention", "swiglu", "grouped_mm", "token_permute"]
TOLERANCE = 1e-5  # fp32; only attention (SDPA vs FlexAttention) is not bit-exact


@pytest.fixture(scope="module", autouse=True)
def overlay():
    yield activate()  # FlexAttention's CPU backward (0.3.x) needs it
    deactivate()


@pytest.fixture(scope="module")
def era(overlay):
    return overlay.context.era


@pytest.fixture(autouse=True)
def restore_functions():
    yield
    OVERLAY.revert_on_request()


def converted_class(cls, replacement, name, device_type, era):
    return era_module("torchtitan_npu.converters", era).converted_class(
        cls, replacement, name, device_type
    )


def converted_model(name: str, names: list[str], era: str, device_type="cpu"):
    """The debug model with ``names`` applied the era's way, and the counts."""
    model, _ = model_and_flavor(name)
    args = model_args(name, era)
    if era == "trainspec":
        module = native_model(model, args, era)
        _, counts = converters.apply_named(
            module, names, era=era, model_name=model, device_type=device_type
        )
        return module, counts
    args, counts = converters.apply_named(
        args, names, era=era, model_name=model, device_type=device_type
    )
    return native_model(model, args, era), counts


def converter_names(module) -> set[str]:
    """The converters whose classes the model's modules and MoE dispatchers use."""
    parts = list(module.modules())
    parts += [getattr(m, "token_dispatcher", None) for m in parts]
    return {getattr(part, "converter", None) for part in parts} - {None}


def forward_backward(module, era: str):
    """Logits and every parameter's gradient of a fixed batch (train mode)."""
    tokens = torch.randint(0, 2000, (2, 32), generator=torch.Generator().manual_seed(1))
    module.train()
    module.zero_grad()
    if era == "trainspec":
        logits = module(tokens)
    else:
        logits = rows_forward(module, tokens)
    logits.float().pow(2).mean().backward()
    grads = {
        n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None
    }
    return logits.detach(), grads


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def reference(era):
    """Each model unconverted: state dict, logits, gradients."""
    cache = {}

    def get(name, loop_experts=False):
        """``loop_experts``: 0.2.x's per-expert loop (fp32) instead of its
        grouped path, which casts to bf16 where the converter does not."""
        if (name, loop_experts) not in cache:
            model, _ = model_and_flavor(name)
            args = model_args(name, era)
            if loop_experts:
                args.moe_args.use_grouped_mm = False
            module = native_model(model, args, era)
            state = module.state_dict()
            cache[name, loop_experts] = (state, *forward_backward(module, era))
        return cache[name, loop_experts]

    return get


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("model", heavy_except(MODELS, "llama3"))
def test_converted_model_matches_upstream(model, name, era, reference):
    if era == "trainspec" and model == "deepseek_v3" and not FULL_SUITE:
        pytest.skip("0.2.x deepseek_v3: nox -s full (CI: qwen3_moe shows 0.2.x MoE)")
    converter = converters.get(name)
    if not converter.models(era):
        pytest.skip(f"{name} is not available in this era")
    if model_and_flavor(model)[0] not in converter.models(era):
        pytest.skip(f"{name} does not apply to {model} (no such layers)")
    if name in ("grouped_mm", "token_permute") and model == "qwen3":
        pytest.skip("qwen3 debugmodel is dense (qwen3_moe covers these)")
    if model == "qwen3_moe" and name not in ("grouped_mm", "token_permute"):
        pytest.skip("qwen3's dense layers: the qwen3 rows cover them")
    module, (count,) = converted_model(model, [name], era)
    assert count > 0
    assert name in converter_names(module) or (
        name == "rope" and era == "trainspec"  # a function, not a module class
    )
    in_param_dtype = era == "trainspec" and name == "grouped_mm"
    state, logits, grads = reference(model, loop_experts=in_param_dtype)
    module.load_state_dict(state)
    conv_logits, conv_grads = forward_backward(module, era)
    forward = (conv_logits - logits).abs().max().item()
    backward = max_abs_diff(conv_grads, grads)
    print(f"{model} {name}: {count} replaced, fwd {forward:.2e}, bwd {backward:.2e}")
    assert forward <= TOLERANCE and backward <= TOLERANCE
    if name != "attention":  # same arithmetic, another code path: bit-exact
        assert forward == 0.0


@pytest.mark.parametrize("model", heavy_except(["llama3", "deepseek_v3"], "llama3"))
def test_all_converters_together(model, era, reference):
    names = [n for n in NAMES if model in converters.get(n).models(era)]
    module, counts = converted_model(model, names, era)
    assert all(counts) and converter_names(module) >= set(names) - {"rope"}
    # 0.2.x: the converted experts compute in fp32 (see the grouped_mm test)
    loop_experts = era == "trainspec" and "grouped_mm" in names
    state, logits, grads = reference(model, loop_experts=loop_experts)
    module.load_state_dict(state)
    conv_logits, conv_grads = forward_backward(module, era)
    assert (conv_logits - logits).abs().max().item() <= TOLERANCE
    assert max_abs_diff(conv_grads, grads) <= TOLERANCE


def test_grouped_experts_module_matches_upstream_loop(era):
    """Routed experts alone (runs on 0.2.x too, where the MoE router cannot)."""
    torch.manual_seed(0)
    dim, hidden, num_experts = 16, 24, 4
    if era == "trainspec":
        from torchtitan.models.moe.moe import GroupedExperts

        experts = GroupedExperts(dim, hidden, num_experts, use_grouped_mm=False)
    else:
        from torchtitan.models.common.moe import GroupedExperts

        experts = GroupedExperts.Config(
            dim=dim, hidden_dim=hidden, num_experts=num_experts
        ).build()
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.1)
    converted = copy.deepcopy(experts)
    converter = converters.get("grouped_mm")
    (replacement,) = converter.replacements[era]
    converted.__class__ = converted_class(
        type(experts), replacement, "grouped_mm", "cpu", era
    )
    x = torch.randn(20, dim, requires_grad=True)
    counts = torch.tensor([5, 0, 9, 6])
    expected = experts(x, counts)
    actual = converted(x, counts)
    if era == "trainspec":  # upstream's fp32 loop vs the converter in fp32
        torch.testing.assert_close(actual, expected, rtol=0, atol=TOLERANCE)
    else:  # both bf16 grouped GEMMs (upstream's casts kept)
        assert torch.equal(actual, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [1, 3, 6])
def test_token_permute_matches_upstream_dispatch(top_k, dtype, era):
    """Dispatch and combine, forward and backward, bit for bit (0.3.x)."""
    if era == "trainspec":
        pytest.skip("0.2.x permutes inside MoE.forward: no token_permute there")
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    (replacement, _) = converters.get("token_permute").replacements[era]
    converted_cls = converted_class(
        LocalTokenDispatcher, replacement, "token_permute", "cpu", era
    )
    generator = torch.Generator().manual_seed(top_k)
    tokens, experts, dim = 40, 8, 16
    expert_ids = torch.stack(
        [torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)]
    )
    counts = torch.bincount(expert_ids.view(-1), minlength=experts)
    x = torch.randn(tokens, dim, generator=generator).to(dtype)
    scores = torch.rand(tokens, top_k, generator=generator)

    def run(cls):
        dispatcher = cls(cls.Config(num_experts=experts, top_k=top_k))
        x_in, scores_in = x.clone().requires_grad_(), scores.clone().requires_grad_()
        routed, routed_counts, metadata = dispatcher.dispatch(
            x_in, scores_in, expert_ids, counts
        )
        out = dispatcher.combine(routed * 2 + 1, metadata, x_in)
        out.float().pow(2).sum().backward()
        return routed, routed_counts, out, x_in.grad, scores_in.grad

    for expected, actual in zip(run(LocalTokenDispatcher), run(converted_cls)):
        assert torch.equal(actual, expected)


# --- the npu path, with a recording stand-in torch_npu ---------------------------


class RecordingTorchNpu(types.ModuleType):
    """Records torch_npu calls; answers with the native kernels (shapes only)."""

    def __init__(self):
        super().__init__("torch_npu")
        self.calls: list[tuple[str, tuple, dict]] = []

    def _record(self, name, args, kwargs):
        self.calls.append((name, args, kwargs))

    def npu_rms_norm(self, x, gamma, epsilon):
        self._record("npu_rms_norm", (x, gamma), {"epsilon": epsilon})
        return rms_norm.native(x, gamma.shape, gamma, epsilon), None

    def npu_rotary_mul(self, x, cos, sin, rotary_mode):
        self._record("npu_rotary_mul", (x, cos, sin), {"rotary_mode": rotary_mode})
        return rope.native(x, cos, sin, rotary_mode == "interleave")

    def npu_fusion_attention(self, q, k, v, head_num, input_layout, **kwargs):
        self._record("npu_fusion_attention", (q, k, v, head_num, input_layout), kwargs)
        mask = None if kwargs["sparse_mode"] == 3 else ~kwargs["atten_mask"]
        out = attention.native(
            q,
            k,
            v,
            mask=mask,
            scale=kwargs["scale"],
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return (out,)

    def npu_swiglu(self, x, dim):
        self._record("npu_swiglu", (x,), {"dim": dim})
        gate, up = x.chunk(2, dim=dim)
        return swiglu.native(gate, up)

    def npu_grouped_matmul(self, x, weight, **kwargs):
        self._record("npu_grouped_matmul", (x, weight), kwargs)
        return [grouped_mm.loop(x[0], weight[0], kwargs["group_list"])]

    def npu_moe_token_permute(self, tokens, indices):
        self._record("npu_moe_token_permute", (tokens, indices), {})
        return token_permute.permute_native(tokens, indices)

    def npu_moe_token_unpermute(self, permuted_tokens, sorted_indices, probs):
        self._record(
            "npu_moe_token_unpermute", (permuted_tokens, sorted_indices, probs), {}
        )
        return token_permute.unpermute_native(permuted_tokens, sorted_indices, probs)


@pytest.fixture
def torch_npu(monkeypatch):
    stand_in = RecordingTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", stand_in)
    return stand_in


def test_npu_kernels_call_torch_npu(torch_npu):
    x = torch.randn(2, 8, 4, 16)
    rms_norm.npu(x, (16,), None, None)
    name, (_, gamma), kwargs = torch_npu.calls[-1]
    assert name == "npu_rms_norm" and torch.equal(gamma, torch.ones(16))
    assert kwargs == {"epsilon": torch.finfo(torch.float32).eps}

    cos, sin = torch.randn(1, 8, 1, 16), torch.randn(1, 8, 1, 16)
    rope.npu(x, cos, sin, False)
    assert torch_npu.calls[-1][2] == {"rotary_mode": "half"}
    rope.npu(x, cos, sin, True)
    assert torch_npu.calls[-1][2] == {"rotary_mode": "interleave"}

    q = torch.randn(2, 4, 8, 16)
    attention.npu(q, q, q, mask=None, scale=None, enable_gqa=False)
    name, args, kwargs = torch_npu.calls[-1]
    assert args[3:] == (4, "BNSD") and kwargs["sparse_mode"] == 3
    assert kwargs["atten_mask"].shape == (2048, 2048)
    assert kwargs["atten_mask"][0, 1] and not kwargs["atten_mask"][1, 0]
    assert kwargs["scale"] == 16**-0.5 and kwargs["keep_prob"] == 1.0
    allowed = torch.ones(1, 1, 8, 8, dtype=torch.bool).tril()
    attention.npu(q, q, q, mask=allowed, scale=0.5, enable_gqa=False)
    kwargs = torch_npu.calls[-1][2]
    assert kwargs["sparse_mode"] == 0 and torch.equal(kwargs["atten_mask"], ~allowed)

    gate, up = torch.randn(3, 5), torch.randn(3, 5)
    swiglu.npu(gate, up)
    name, (fused,), kwargs = torch_npu.calls[-1]
    assert torch.equal(fused, torch.cat((gate, up), -1)) and kwargs == {"dim": -1}

    a, b_t = torch.randn(10, 4), torch.randn(3, 4, 6)
    offs = torch.tensor([2, 2, 10], dtype=torch.int32)
    grouped_mm.npu(a, b_t, offs)
    name, ([x], [w]), kwargs = torch_npu.calls[-1]
    assert x is a and w is b_t and kwargs["group_list"].dtype == torch.int64
    assert kwargs["group_list"].tolist() == [2, 2, 10]
    modes = (kwargs["split_item"], kwargs["group_type"], kwargs["group_list_type"])
    assert modes == (2, 0, 0)

    tokens = torch.randn(6, 4, dtype=torch.bfloat16)
    expert_ids = torch.randint(8, (6, 2))
    routed, rows = token_permute.permute_npu(tokens, expert_ids)
    name, args, _ = torch_npu.calls[-1]
    assert name == "npu_moe_token_permute" and args == (tokens, expert_ids)
    probs = torch.rand(6, 2)
    token_permute.unpermute_npu(routed, rows, probs)
    name, (permuted, sorted_indices, weights), _ = torch_npu.calls[-1]
    assert permuted is routed and sorted_indices is rows
    assert weights.dtype == torch.bfloat16 and torch.equal(weights, probs.bfloat16())


def test_npu_kernels_leave_dtensors_to_native(torch_npu, tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        mesh = init_device_mesh("cpu", (1,))
        gate, up = (
            distribute_tensor(torch.randn(3, 5), mesh, [Replicate()]) for _ in "gu"
        )
        out = swiglu.npu(gate, up)
        assert isinstance(out, DTensor) and torch_npu.calls == []
        swiglu.npu(gate.to_local(), up.to_local())
        assert [name for name, _, _ in torch_npu.calls] == ["npu_swiglu"]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("model", heavy_except(["llama3", "qwen3"], "llama3"))
def test_converted_model_on_npu_calls_each_kernel(model, era, torch_npu):
    names = ["rms_norm", "rope", "attention", "swiglu"]
    module, counts = converted_model(model, names, era, device_type="npu")
    assert all(counts)
    forward_backward(module, era)
    called = {name for name, _, _ in torch_npu.calls}
    assert called == {
        "npu_rms_norm",
        "npu_rotary_mul",
        "npu_fusion_attention",
        "npu_swiglu",
    }
    modes = {kw["rotary_mode"] for n, _, kw in torch_npu.calls if n == "npu_rotary_mul"}
    assert modes == {"interleave" if model == "llama3" else "half"}
    eps = {kw["epsilon"] for n, _, kw in torch_npu.calls if n == "npu_rms_norm"}
    norms = [m for m in module.modules() if isinstance(m, torch.nn.RMSNorm)]
    assert eps == {m.eps or torch.finfo(torch.float32).eps for m in norms}
    heads = {a[3] for n, a, _ in torch_npu.calls if n == "npu_fusion_attention"}
    assert heads == {
        a[0].shape[1] for n, a, _ in torch_npu.calls if n == "npu_fusion_attention"
    }


@pytest.mark.heavy
def test_converted_moe_model_on_npu_calls_each_kernel(era, torch_npu):
    names = [n for n in NAMES if "deepseek_v3" in converters.get(n).models(era)]
    module, counts = converted_model("deepseek_v3", names, era, device_type="npu")
    assert all(counts)
    forward_backward(module, era)
    assert {name for name, _, _ in torch_npu.calls} == {
        *(op for name in names for op in converters.get(name).npu_ops)
    }


# --- errors ----------------------------------------------------------------------


def test_unknown_converter_lists_known():
    with pytest.raises(
        ConverterError, match=r"unknown converter 'fused_norm'.*'rms_norm'"
    ):
        converters.get("fused_norm")


def test_unsupported_model_is_an_error(era):
    with pytest.raises(ConverterError, match="does not support model 'llama3'"):
        converters.check(["grouped_mm"], era=era, model_name="llama3")
    with pytest.raises(ConverterError, match="does not support model 'llama4'"):
        converters.check(["rms_norm"], era=era, model_name="llama4")
    if era == "trainspec":
        with pytest.raises(ConverterError, match="not available in era trainspec"):
            converters.check(["token_permute"], era=era, model_name="deepseek_v3")


def test_attention_refuses_context_parallel(era):
    with pytest.raises(ConverterError, match="context parallelism"):
        converters.check(
            ["attention"], era=era, model_name="llama3", context_parallel=True
        )
    converters.check(["rms_norm"], era=era, model_name="llama3", context_parallel=True)


def test_replaced_nothing_warns(era, caplog):
    with caplog.at_level(logging.WARNING):
        _, (count,) = converted_model("qwen3", ["grouped_mm"], era)
    assert count == 0
    assert "converter grouped_mm replaced nothing in model qwen3" in caplog.text


def test_doctor_lists_every_converter(era):
    from torchtitan_npu.tools.doctor import converter_table

    cpu, npu = converter_table(era, "cpu"), converter_table(era, "npu")
    for name in NAMES:
        converter = converters.get(name)
        (row,) = [line for line in cpu.splitlines() if line.startswith(name + " ")]
        assert converter.native in row
        assert ", ".join(converter.models(era)) in row
        assert all(f"torch_npu.{op}" in npu for op in converter.npu_ops)


def test_names_from_the_command_line():
    assert converters.parse_names("rms_norm, rope") == ["rms_norm", "rope"]
    assert converters.parse_names(["swiglu"]) == ["swiglu"]
    assert converters.parse_names(None) == []


def test_train_config_translation(era, upstream):
    config = {
        "model": {
            "name": "llama3",
            "flavor": "debugmodel",
            "converters": "rms_norm,rope",
        }
    }
    version = upstream.installed.version
    if era == "trainspec":
        from torchtitan_npu.config.trainspec import translate

        job = translate(config, version=version)
        assert job["model"]["converters"] == ["rms_norm", "rope"]
        config["model"]["converters"] = ["rms_norm", "nope"]
        with pytest.raises(ConverterError, match=r"'nope'.*'quantize.linear.float8'"):
            translate(config, version=version)
        return
    from torchtitan.models.common.nn_modules import RMSNorm

    from torchtitan_npu.config.config_registry import translate

    trainer = translate(config, version=version, device_type="cpu")
    norms = list(trainer.model_spec.model.traverse(RMSNorm.Config))
    assert norms and all(
        type(n).__qualname__ == "RMSNorm_rms_norm.Config" for _, n, _, _ in norms
    )
    config["model"]["converters"] = ["nope"]
    with pytest.raises(ConverterError, match="unknown converter 'nope'"):
        translate(config, version=version, device_type="cpu")


# --- training ----------------------------------------------------------------------


@pytest.mark.e2e
@requires_newest_of_era("one end-to-end converter run per era")
def test_training_with_converters_matches_without(launcher, tmp_path):
    names = "rms_norm,rope,attention,swiglu"
    plain = warm_train(launcher, tmp_path / "plain", steps=3)
    converted = warm_train(
        launcher, tmp_path / "converted", "--model.converters", names, steps=3
    )
    for step, loss in plain[LOSS].items():
        assert converted[LOSS][step] == pytest.approx(loss, rel=1e-5, abs=0)
    log = (tmp_path / "converted.log").read_text()
    for name in names.split(","):
        assert f"converter {name}:" in log
