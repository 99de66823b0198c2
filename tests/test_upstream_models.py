"""Upstream's other models through the overlay on CPU (issue: every upstream
model trains): the paths that failed on CPU before a patch filled them."""

from importlib.util import find_spec

import pytest
import torch
from support import (
    LOSS,
    full_suite_only,
    requires_era,
    requires_newest_of_era,
    rows_forward,
    warm_train,
)

from torchtitan_npu.bootstrap import activate, deactivate
from torchtitan_npu.config.batch_and_data import counts_tokens


@pytest.fixture
def overlay():
    activate()
    yield
    deactivate()


@requires_era("config_registry")
def test_gpt_oss_trains_in_fp32_on_one_device(overlay):
    """gpt_oss's bf16 experts return their input's dtype: without the patch
    the token combine fails on fp32 params (scatter(): Expected self.dtype
    to be equal to src.dtype)."""
    from torchtitan.models.gpt_oss import model_registry

    torch.manual_seed(0)
    model = model_registry("debugmodel", attn_backend="flex").model.build()
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    logits = rows_forward(model, torch.randint(0, 2000, (1, 32)))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    logits.mean().backward()
    experts = [n for n, p in model.named_parameters() if "mlp1_weight" in n]
    grads = dict(model.named_parameters())
    assert experts and all(grads[n].grad is not None for n in experts)


@requires_era("trainspec")
def test_gpt_oss_0_2_2_initialises_every_parameter_in_fp32(overlay):
    """0.2.2's gpt_oss cast its layers to bf16 (fp32 embedding: 'mat1 and mat2
    must have the same dtype') and never initialised its router's gate bias
    (NaN losses from step 1): every parameter is set after the meta build,
    whatever memory held (NaN here), and one fp32 step is finite."""
    pytest.importorskip("torchtitan.models.gpt_oss", reason="gpt_oss is 0.2.2's")
    import copy

    from torchtitan.protocols.train_spec import get_train_spec

    spec = get_train_spec("gpt_oss")
    args = copy.deepcopy(spec.model_args["debugmodel"])
    args.vocab_size, args.max_seq_len = 2048, 64
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
        model.init_weights(buffer_device=torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    unset = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
    assert not unset
    tokens = torch.randint(0, 2048, (2, 64))
    logits = model(tokens, model.get_attention_masks(tokens, None))
    assert torch.isfinite(logits).all()
    logits.mean().backward()


def test_models_lists_each_model_and_flavor_with_its_size(capsys, overlay):
    from torchtitan_npu.cli import main

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    rows = {tuple(line.split()[:2]): line for line in out.splitlines()[3:] if line}
    assert "6.2M" in rows[("llama3", "debugmodel")]  # 6,163,712 parameters
    assert "matrix" in rows[("llama3", "debugmodel")]
    assert "3.9M" in rows[("qwen2", "debugmodel")]  # titan-npu's injected model
    if ("qwen3_5", "debugmodel") in rows:  # 0.3's models, fla or not
        assert "136.5M" in rows[("qwen3_5", "debugmodel")]  # 136,488,880


@requires_era("config_registry")
def test_a_model_whose_optional_package_is_missing_says_what_installs_it(
    monkeypatch,
):
    """Without torchvision, kimi_k2_7's recipes do not import: one line names
    the package and the extra, before anything is launched."""
    import sys

    from torchtitan_npu.config.config_registry import base_config
    from torchtitan_npu.config.schema import ConfigError

    importers = ("torchtitan.models.kimi", "torchtitan.hf_datasets.multimodal")
    for name in [n for n in sys.modules if n.startswith(importers)]:
        monkeypatch.delitem(sys.modules, name)  # imported again, without it
    monkeypatch.setitem(sys.modules, "torchvision", None)  # as if not installed
    with pytest.raises(ConfigError) as error:
        base_config("kimi_k2_7", "kimi_k2_5_debugmodel")
    assert str(error.value) == (
        "model 'kimi_k2_7' needs torchvision (pip install 'titan-npu[multimodal]')"
    )


@requires_era("config_registry")
@pytest.mark.skipif(find_spec("torchao") is not None, reason="torchao is installed")
def test_a_flavor_whose_recipe_needs_a_missing_package_says_what_installs_it():
    """0.3's llama3 `8b_mxfp8` recipe builds torchao's MX linear converter,
    which raises ImportError without torchao: one line, not a traceback."""
    from torchtitan_npu.config.config_registry import base_config
    from torchtitan_npu.config.schema import ConfigError

    with pytest.raises(ConfigError) as error:
        base_config("llama3", "8b_mxfp8")
    assert str(error.value) == (
        "model 'llama3' flavor '8b_mxfp8' needs torchao (pip install torchao)"
    )


@requires_era("config_registry")
def test_a_flavor_by_its_model_registry_name_is_accepted():
    """0.3's --model.flavor is a config function's name (qwen3 `moe_debug`);
    the model registry's name for the same model (`debugmodel_moe`) works."""
    from torchtitan_npu.config.config_registry import base_config

    assert base_config("qwen3", "debugmodel_moe").model_spec.flavor == "debugmodel_moe"
    assert base_config("qwen3", "moe_debug").model_spec.flavor == "debugmodel_moe"


@pytest.mark.parametrize("window", [(-1, 0), (3, 0), (-1, -1)])
def test_varlen_reference_is_attention_within_each_sequence(window):
    """The CPU varlen reference equals SDPA run on each packed sequence alone
    (GQA: 4 query heads over 2 kv heads)."""
    import torch.nn.functional as F

    from torchtitan_npu.kernels.varlen_attention import varlen_attention_reference

    lengths, generator = [5, 9, 2], torch.Generator().manual_seed(0)
    q = torch.randn(sum(lengths), 4, 8, generator=generator)
    k, v = (torch.randn(sum(lengths), 2, 8, generator=generator) for _ in "kv")
    cu = torch.tensor([0, 5, 14, 16], dtype=torch.int32)
    got = varlen_attention_reference(
        q, k, v, cu, cu, 9, 9, window_size=window, enable_gqa=True
    )
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        n = end - start
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        mask = torch.ones(n, n, dtype=torch.bool)
        if window[0] >= 0:
            mask &= j >= i - window[0]
        if window[1] >= 0:
            mask &= j <= i + window[1]
        ref = F.scaled_dot_product_attention(
            *(t[start:end].transpose(0, 1) for t in (q, k, v)),
            attn_mask=mask,
            enable_gqa=True,
        ).transpose(0, 1)
        torch.testing.assert_close(got[start:end], ref, rtol=1e-5, atol=1e-6)


@requires_era("config_registry")
def test_gpt_oss_varlen_on_cpu_matches_its_flex_flavor(overlay):
    """gpt_oss's default (varlen) attention runs on CPU through the reference
    and gives the flex flavor's logits for the same weights. Varlen computes
    in bf16, as flash does: tokens differ by bf16 noise (~0.3% of the logit
    scale), and a token whose bf16 change flips an expert choice of the
    router by more: at most one in 16 tokens may."""
    from torchtitan.models.gpt_oss import model_registry

    models = {}
    for backend in ("varlen", "flex"):
        torch.manual_seed(0)
        models[backend] = model_registry(
            "debugmodel", attn_backend=backend
        ).model.build()
        with torch.no_grad():
            models[backend].init_weights(buffer_device=torch.device("cpu"))
    models["flex"].load_state_dict(models["varlen"].state_dict())
    tokens = torch.randint(0, 2000, (2, 32), generator=torch.Generator().manual_seed(1))
    logits = {}
    for backend, model in models.items():
        logits[backend] = rows_forward(model, tokens)
    logits["varlen"].mean().backward()
    scale = logits["flex"].abs().max()
    per_token = (logits["varlen"] - logits["flex"]).abs().amax(-1).flatten() / scale
    assert per_token.median() < 0.01, per_token
    assert (per_token > 0.02).sum() <= per_token.numel() // 16, per_token


@requires_era("config_registry")
def test_qwen3_5_trains_on_cpu_and_packed_documents_stay_apart(overlay):
    """Qwen3.5 without flash-linear-attention: its linear-attention layers run
    the PyTorch gated delta rule and causal conv of the fla stand-in, on a
    text-only batch (no image/video placeholders). A document packed behind
    another gives the logits it has alone: attention masks, conv and the
    recurrent state all restart at the boundary."""
    from torchtitan.distributed.utils import get_spmd_backend, set_spmd_backend
    from torchtitan.models.qwen3_5 import model_registry

    backend = get_spmd_backend()
    set_spmd_backend("dtensor")  # the trainer's choice on one device
    try:
        torch.manual_seed(0)
        model = model_registry("debugmodel").model.build()
        with torch.no_grad():
            model.init_weights(buffer_device=torch.device("cpu"))
        generator = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, 2000, (96,), generator=generator)
        positions = torch.cat([torch.arange(40), torch.arange(56)])
        rows = not counts_tokens()  # 0.3.0: a batch of rows, here one

        def logits(tokens, positions):
            if rows:
                tokens, positions = tokens[None], positions[None]
            masks = model.get_attention_masks(positions)
            out = model(tokens, attention_masks=masks, positions=positions)
            return out[0] if rows else out

        packed = logits(tokens, positions)
        alone = logits(tokens[40:], positions[40:])
        scale = alone.abs().max()
        assert (packed[40:] - alone).abs().max() <= 1e-4 * scale
        packed.mean().backward()
        linear = model.layers["0"].attn  # a GatedDeltaNet
        for p in (linear.A_log, linear.dt_bias, linear.conv_q.weight):
            assert p.grad is not None and torch.isfinite(p.grad).all()
    finally:
        set_spmd_backend(backend)


def torchrun_check(script: str, disabled: str | None, tmp_path) -> dict:
    """A two-rank script of tests/ under torchrun (gloo), with the overlay
    record ``disabled`` off where given: the JSON rank 0 wrote."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "result.json"
    env = {**os.environ, "TITAN_NPU_DEVICE": "cpu"}
    if disabled:
        env["TITAN_NPU_DISABLE_PATCHES"] = disabled
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", str(Path(__file__).parent / script),
               str(out)]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


@requires_era("config_registry")
@pytest.mark.e2e
@pytest.mark.parametrize(
    "record",
    ["applied", pytest.param("disabled", marks=full_suite_only("shows the bug"))],
)
def test_gpt_oss_tp_experts_add_their_bias_once(record, tmp_path):
    """Under TP 2 the two ranks' partial expert outputs sum to the one-device
    experts (bf16 rounding apart) and the output bias gets the one-device
    gradient; without `gpt_oss_tp_expert_bias` each rank adds the whole bias
    and its gradient is twice as large (real torchrun, gloo)."""
    disabled = "gpt_oss_tp_expert_bias" if record == "disabled" else None
    measured = torchrun_check("tp_experts.py", disabled, tmp_path)
    error, ratio = measured["output_error"], measured["bias_grad_ratio"]
    if record == "applied":
        assert error < 1.5e-2, error  # bf16 partial sums (eps 7.8e-3)
        assert abs(ratio - 1) < 2e-2, ratio
    else:
        assert error > 5e-2 and ratio > 1.5, measured  # 1.93 measured


@requires_era("config_registry")
@pytest.mark.e2e
def test_expert_parallel_trains_on_gloo_as_fsdp_does(launcher, tmp_path):
    """EP 2 over FSDP 2 on gloo (the token exchange sends uneven shares, which
    gloo's list all_to_all refuses: `gloo_*_token_exchange`) gives the loss of
    FSDP 2 alone on the same batches: the routed experts are the same math,
    placed on other ranks."""
    model = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"]
    fsdp = warm_train(launcher, tmp_path / "fsdp", *model, nproc=2, steps=2)
    ep = warm_train(
        launcher, tmp_path / "ep", *model,
        "--parallelism.expert_parallel_degree", "2", nproc=2, steps=2,
    )  # fmt: skip
    assert sorted(ep[LOSS]) == [1, 2]
    for step, loss in fsdp[LOSS].items():
        assert ep[LOSS][step] == pytest.approx(loss, rel=1e-5), (step, ep, fsdp)


@requires_era("trainspec")
@requires_newest_of_era("gpt_oss is in 0.2.2 only of its era")
@pytest.mark.e2e
@pytest.mark.parametrize(
    "record",
    ["applied", pytest.param("disabled", marks=full_suite_only("shows the bug"))],
)
def test_tp_gives_the_router_its_one_device_gradient(record, tmp_path):
    """0.2.x under TP 2: gpt_oss's routing scores multiply the experts' partial
    outputs, so each rank's gradient of them is partial; `moe_tp_score_gradient`
    sums it over the ranks, and the router gets the one-device gradient
    (without it each rank keeps its own share: the ranks' replicated routers
    drift apart, and a resume from the one copy a checkpoint keeps diverges)."""
    disabled = "moe_tp_score_gradient" if record == "disabled" else None
    error = torchrun_check("tp_router.py", disabled, tmp_path)["router_grad_error"]
    if record == "applied":
        assert error < 1e-4, error  # fp32 (0.2.2's layers on CPU)
    else:
        assert error > 0.1, error
