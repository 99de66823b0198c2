"""numerics: the rank-side capture and non-finite watch, the record-by-record
comparison, and `titan-npu numerics locate` end to end."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import full_suite_only, requires_default_upstream
from torch import nn

from torchtitan_npu.numerics import compare, hooks


class Act(nn.Module):
    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return torch.tanh(x) * self.scale


class ScaledGrad(torch.autograd.Function):
    """Identity forward; its backward multiplies by ``factor`` (a wrong kernel)."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class WrongBackward(Act):
    def forward(self, x):
        return ScaledGrad.apply(torch.tanh(x), 1.001)


class Block(nn.Module):
    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.act = act

    def forward(self, x):
        return x + self.act(self.lin(x))


class Tiny(nn.Module):
    def __init__(self, acts=None) -> None:
        super().__init__()
        acts = acts or [Act(), Act(), Act()]
        self.layers = nn.ModuleList(Block(a) for a in acts)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def tiny(acts=None) -> Tiny:
    torch.manual_seed(0)
    return Tiny(acts)


def train(
    model: nn.Module,
    spec: dict,
    *,
    steps: int = 1,
    microbatches: int = 1,
    shape_inference: bool = False,
):
    """``steps`` SGD steps on one fixed batch with the hooks of ``spec``
    (``shape_inference``: first a forward of one microbatch, as a pipeline
    stage does before its schedule)."""
    torch.manual_seed(1)
    batch = torch.randn(8, 16)
    handles = hooks.install(spec)
    try:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(steps):
            if shape_inference:
                with torch.no_grad():
                    model(batch.chunk(microbatches)[0])
            for part in batch.chunk(microbatches):
                (model(part).square().mean() / microbatches).backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        for handle in handles:
            handle.remove()


def captured(folder: Path, model: nn.Module, *, step: int = 1, **options):
    train(model, {"capture": str(folder), "step": step, "degrees": {}}, **options)
    return compare.Capture(folder)


def test_one_model_twice_is_bitwise_equal_in_every_record(tmp_path):
    a = captured(tmp_path / "a", tiny(), step=2, steps=2)
    b = captured(tmp_path / "b", tiny(), step=2, steps=2)
    forward, backward = compare.compare(a, b)
    assert [d.label for d in forward][:3] == [
        "layers.0.lin",
        "layers.0.act",
        "layers.0",
    ]
    assert len(forward) == 10 and len(backward) == 8  # 3 x (lin, act, block) + out
    assert all(d.bitwise for d in forward + backward)
    assert compare.first_departure(forward + backward, None) is None
    # backward order: the output layer's gradients first, layer 0's last
    assert backward[0].label == "out.weight" and backward[-1].label.startswith(
        "layers.0"
    )


def test_a_wrong_module_is_named_as_the_first_forward_departure(tmp_path):
    a = captured(tmp_path / "a", tiny())
    b = captured(tmp_path / "b", tiny([Act(), Act(1.001), Act()]))
    forward, backward = compare.compare(a, b)
    first = compare.first_departure(forward, None)
    assert first is not None and first.label == "layers.1.act"
    assert all(d.bitwise for d in forward[: forward.index(first)])
    assert (
        "first departure: layers.1.act: relative error 9.99e-04 > 1e-05"
        in compare.summary(forward, backward, None, 3)
    )


def test_a_wrong_backward_is_named_in_backward_only(tmp_path):
    a = captured(tmp_path / "a", tiny())
    b = captured(tmp_path / "b", tiny([Act(), Act(), WrongBackward()]))
    forward, backward = compare.compare(a, b)
    assert compare.first_departure(forward, None) is None
    first = compare.first_departure(backward, None)
    assert first is not None and first.label == "layers.2.lin.weight"
    assert [d.label for d in backward[:2]] == ["out.weight", "out.bias"]
    assert backward[0].bitwise


@pytest.mark.parametrize("shape_inference", [False, True])
def test_microbatches_are_joined_into_the_whole_batch(tmp_path, shape_inference):
    a = captured(tmp_path / "a", tiny())
    b = captured(
        tmp_path / "b", tiny(), microbatches=2, shape_inference=shape_inference
    )
    assert b.calls("forward", "layers.0.lin", 0) == 2 + shape_inference
    forward, backward = compare.compare(a, b)
    assert [d.label for d in forward][0] == "layers.0.lin"  # one record, both calls
    assert all(d.error is not None for d in forward + backward)
    assert compare.first_departure(forward + backward, None) is None


def test_tensor_parallel_shards_are_joined_along_the_split_dimension(tmp_path):
    """A capture of two ranks, each holding half of every forward output's last
    dimension (a colwise-sharded local tensor), compares with one rank's."""
    a = captured(tmp_path / "a", tiny())
    for rank in (0, 1):
        folder = tmp_path / "b" / f"rank-{rank}"
        folder.mkdir(parents=True)
        lines = []
        for (record,) in a.records.values():
            tensor = a.load(record)
            if record.kind == "forward":
                tensor = tensor.chunk(2, dim=-1)[rank].clone()
            torch.save(tensor, folder / record.file)
            lines.append({**record.__dict__, "shape": list(tensor.shape)})
        (folder / "index.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in lines)
        )
    forward, backward = compare.compare(a, compare.Capture(tmp_path / "b"))
    assert all(d.bitwise for d in forward + backward)


def test_coordinates_follow_upstreams_mesh_order():
    degrees = {"pp": 2, "dp_shard": 2, "tp": 2}
    assert hooks.coordinates(0, degrees) == dict.fromkeys(hooks.MESH_DIMS, 0)
    assert hooks.coordinates(1, degrees)["tp"] == 1
    assert hooks.coordinates(2, degrees)["dp_shard"] == 1
    place = hooks.coordinates(7, degrees)
    assert (place["pp"], place["dp_shard"], place["tp"], place["cp"]) == (1, 1, 1, 0)


def test_an_inf_weight_is_named_in_forward_with_its_statistics(tmp_path, monkeypatch):
    monkeypatch.setenv("TITAN_NPU_RUN_DIR", str(tmp_path))
    model = tiny()
    with torch.no_grad():
        model.layers[1].lin.weight[3, 5] = float("inf")
    with pytest.raises(hooks.NonFiniteFound) as found:
        train(model, {"nonfinite": True})
    message = str(found.value)
    assert message.startswith(
        "non-finite values at step 1, forward: layers.1.lin (Linear)"
    )
    saved = json.loads((tmp_path / "nonfinite-rank-0.json").read_text())
    assert saved["module"] == "layers.1.lin" and saved["inputs"][0]["inf"] == 0
    assert saved["parameters"]["weight"]["inf"] == 1


class SqrtAct(Act):
    def forward(self, x):
        # finite, but sqrt's gradient where x < 0 is NaN, and 0 x NaN is NaN
        return torch.where(x > 0, torch.sqrt(x), 0.0)


def test_a_nan_born_in_backward_names_the_module_that_made_it(tmp_path):
    made = r"step 1, backward: layers.1.act \(SqrtAct\): the gradient it passes"
    with pytest.raises(hooks.NonFiniteFound, match=made):
        train(tiny([Act(), SqrtAct(), Act()]), {"nonfinite": True})


def test_a_finite_run_is_not_stopped_by_the_watch():
    model = tiny()
    train(model, {"nonfinite": True}, steps=3)
    assert all(torch.isfinite(p).all() for p in model.parameters())


# --- titan-npu numerics locate, train --detect-nonfinite (torchrun, gloo) ---
# CI's share: the TP bug and the Inf weight; `nox -s full` runs every one.

SMALL = ["--training.local_batch_size", "2", "--training.seq_len", "128"]
TP2 = "--nproc-per-node 2 --parallelism.tensor_parallel_degree 2"
ONE_UPSTREAM = "era-independent hooks: the default upstream is enough (CI time)"
SHARE = "CI's share sees locate in test_locate_names_the_tp_expert_bias_bug"


def titan_npu(*args: str, env: dict | None = None):
    command = [sys.executable, "-m", "torchtitan_npu.cli", *args]
    run_env = {**os.environ, "TITAN_NPU_DEVICE": "cpu", **(env or {})}
    return subprocess.run(command, env=run_env, capture_output=True, text=True)


def located(tmp_path, a: str, b: str, *shared: str, env=None):
    out = tmp_path / "locate"
    result = titan_npu(
        "numerics", "locate", "--a", a, "--b", b, "--out", str(out), *SMALL,
        *shared, env=env,
    )  # fmt: skip
    assert result.returncode in (0, 1), result.stderr[-3000:]
    report = result.stdout[result.stdout.index("numerics locate: step") :]
    return result.returncode, report, out


def first(report: str, phase: str, verdict: str = "first departure") -> str:
    block = report[report.index(f"{phase}:") :]
    line = block.splitlines()[1].strip()
    assert line.startswith(f"{verdict}: "), block
    return line.removeprefix(f"{verdict}: ")


@pytest.mark.e2e
@requires_default_upstream(ONE_UPSTREAM)
def test_locate_names_the_tp_expert_bias_bug(tmp_path):
    """gpt_oss under TP 2 without its record: each rank adds the whole expert
    output bias. Forward departs first at layer 0's routed experts; of the
    gradients (all downstream of that), an expert output bias's departs most:
    it is tp times too large."""
    code, report, out = located(
        tmp_path, "", TP2, "--model.name", "gpt_oss", "--model.flavor", "debugmodel",
        env={"TITAN_NPU_DISABLE_PATCHES": "gpt_oss_tp_expert_bias"},
    )  # fmt: skip
    assert code == 1
    assert first(report, "forward").startswith("layers.0.moe.routed_experts")
    largest = first(report, "backward", "largest departure")
    assert "routed_experts.inner_experts.mlp2_bias" in largest.split(":")[0], report
    assert (out / "report.json").is_file() and (out / "locate.png").is_file()


@pytest.mark.e2e
@requires_default_upstream(ONE_UPSTREAM)
@full_suite_only(SHARE)
def test_locate_names_a_wrong_rope_kernel(tmp_path):
    """A rope converter whose sine has the wrong sign (tests/wrong_rope) is
    named at the first attention block's rope."""
    wrong = str(Path(__file__).parent / "wrong_rope")
    code, report, _ = located(
        tmp_path, "", "--model.converters rope", env={"PYTHONPATH": wrong}
    )
    assert code == 1
    assert first(report, "forward").startswith("layers.0.attention.rope")


@pytest.mark.e2e
@requires_default_upstream(ONE_UPSTREAM)
@full_suite_only(SHARE)
def test_locate_converters_on_and_off_agree_and_pass_loss_compare(tmp_path):
    """The native kernels behind every converter move no record beyond the
    fp32 tolerance, and the two runs pass loss-compare's computational mode."""
    converters = "--model.converters rms_norm,rope,attention,swiglu"
    code, report, out = located(tmp_path, "", converters)
    assert code == 0, report
    assert report.count("no record departs") == 2
    compared = titan_npu(
        "loss-compare", str(out / "A"), str(out / "B"), "--mode", "computational"
    )
    assert compared.returncode == 0, compared.stdout


@pytest.mark.e2e
@requires_default_upstream(ONE_UPSTREAM)
@full_suite_only(SHARE)
def test_locate_the_same_layout_twice_is_bitwise_everywhere(tmp_path):
    code, report, _ = located(tmp_path, "", "")
    assert code == 0
    for phase in ("forward", "backward"):
        counts = report[report.index(f"{phase}:") :].splitlines()[0]
        compared, equal = (
            int(w) for w in counts.replace(",", " ").split() if w.isdigit()
        )
        assert compared == equal > 0, counts


@pytest.mark.e2e
@requires_default_upstream(ONE_UPSTREAM)
@full_suite_only(SHARE)
def test_locate_refuses_two_different_models_by_parameter(tmp_path):
    result = titan_npu(
        "numerics", "locate", "--b", "--model.name qwen3 --model.flavor debugmodel",
        "--out", str(tmp_path / "out"), *SMALL,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("titan-npu: error: setups A and B build different models: ")


def locate_line(capsys, *args: str) -> str:
    from torchtitan_npu.cli import main

    assert main(["numerics", "locate", *args]) == 2
    return capsys.readouterr().err.strip()


def test_locate_refuses_a_step_beyond_the_run(tmp_path, capsys):
    line = locate_line(capsys, "--step", "7", "--out", str(tmp_path / "o"),
                       "--training.steps", "5")  # fmt: skip
    assert line == (
        "titan-npu: error: --step 7 is beyond setup A's training.steps 5: pick a "
        "step it trains, or raise --training.steps"
    )
    assert not (tmp_path / "o").exists()


def test_locate_refuses_an_output_folder_it_cannot_use(tmp_path, capsys):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "report.json").write_text("{}")
    line = locate_line(capsys, "--out", str(tmp_path / "used"))
    assert line.startswith(f"titan-npu: error: --out {tmp_path / 'used'} already holds")
    (tmp_path / "file").write_text("")
    line = locate_line(capsys, "--out", str(tmp_path / "file" / "sub"))
    assert line.startswith(
        f"titan-npu: error: --out {tmp_path / 'file' / 'sub'} cannot be written"
    )


def test_locate_refuses_a_setup_that_is_not_train_arguments(tmp_path, capsys):
    line = locate_line(
        capsys, "--b", "--nproc-per-node 2 'unclosed", "--out", str(tmp_path)
    )
    assert line.startswith("titan-npu: error: --b ") and "No closing quotation" in line


@pytest.mark.e2e
@requires_default_upstream(ONE_UPSTREAM)
def test_detect_nonfinite_names_the_layer_whose_weight_holds_an_inf(tmp_path):
    """One Inf in layer 1's w1 weight: `train --detect-nonfinite` stops at
    that linear's output in step 1's forward, in one line, with the module's
    input and parameter statistics beside the log."""
    from torch.distributed.checkpoint.format_utils import (
        dcp_to_torch_save,
        torch_save_to_dcp,
    )

    seed = tmp_path / "seed"
    made = titan_npu(
        "train", *SMALL, "--job.dump_folder", str(seed),
        "--checkpoint.enable", "true", "--checkpoint.create_seed_checkpoint", "true",
        "--parallelism.data_parallel_shard_degree", "1", "--training.steps", "1",
    )  # fmt: skip
    assert made.returncode == 0, made.stderr[-3000:]
    plain = tmp_path / "seed.pt"
    dcp_to_torch_save(seed / "checkpoint" / "step-0", plain)
    state = torch.load(plain, weights_only=True)
    key = next(k for k in state if k.endswith("layers.1.feed_forward.w1.weight"))
    state[key][7, 3] = float("inf")
    torch.save(state, plain)
    broken = tmp_path / "broken"
    torch_save_to_dcp(plain, broken)
    run = tmp_path / "run"
    result = titan_npu(
        "train", "--detect-nonfinite", *SMALL, "--job.dump_folder", str(run),
        "--checkpoint.enable", "true", "--checkpoint.initial_load_path", str(broken),
        "--checkpoint.initial_load_model_only", "true", "--training.steps", "2",
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert "non-finite values at step 1, forward: layers.1.feed_forward.w1 " in line
    (saved,) = run.glob("logs/*/nonfinite-rank-0.json")
    stats = json.loads(saved.read_text())
    assert stats["parameters"]["weight"]["inf"] == 1
    assert stats["inputs"][0]["nan"] == stats["inputs"][0]["inf"] == 0
    assert not list(run.glob("checkpoint/step-*")), "no checkpoint of a broken run"


def test_a_capture_exports_as_an_msprobe_dump(tmp_path):
    """msprobe's layout and names (dump.json "Module.<fqn>.<class>.forward.<n>",
    "...parameters_grad.0"; its statistics; the tensor files it names)."""
    from torchtitan_npu.numerics import msprobe

    capture = captured(tmp_path / "a", tiny())
    (folder,) = msprobe.export(capture, tmp_path / "dump", step=1)
    assert folder == tmp_path / "dump" / "step0" / "rank0"
    dump = json.loads((folder / "dump.json").read_text())
    assert (dump["task"], dump["level"], dump["framework"]) == (
        "tensor",
        "L0",
        "pytorch",
    )
    output = dump["data"]["Module.layers.1.act.Act.forward.0"]["output"][0]
    tensor = torch.load(folder / "dump_tensor_data" / output["data_name"])
    assert output["shape"] == [8, 16] and output["Max"] == pytest.approx(
        float(tensor.max())
    )
    grads = dump["data"]["Module.layers.1.lin.Linear.parameters_grad.0"]
    assert set(grads) == {"weight", "bias"}
    assert (folder / "dump_tensor_data" / grads["weight"][0]["data_name"]).is_file()
    assert json.loads((folder / "construct.json").read_text())


def test_locate_refuses_a_setup_train_would_refuse_before_running_anything(
    tmp_path, capsys
):
    line = locate_line(
        capsys, "--b", "--nproc-per-node 2 --parallelism.tensor_parallel_degree 3",
        "--out", str(tmp_path / "o"),
    )  # fmt: skip
    assert line.startswith("titan-npu: error: ") and "--b" in line, line
    assert not (tmp_path / "o").exists()


def test_a_record_one_setup_lacks_is_reported_not_compared(tmp_path):
    a = captured(tmp_path / "a", tiny())
    captured(tmp_path / "b", tiny())
    index = tmp_path / "b" / "rank-0" / "index.jsonl"
    lines = index.read_text().splitlines()
    index.write_text("".join(f"{ln}\n" for ln in lines if '"layers.1.act"' not in ln))
    forward, _ = compare.compare(a, compare.Capture(tmp_path / "b"))
    (missing,) = [d for d in forward if d.error is None]
    assert missing.label == "layers.1.act" and "B has no such record" in missing.note
    assert all(d.bitwise for d in forward if d is not missing)


def test_a_setups_own_train_switches_reach_its_runs():
    from torchtitan_npu.cli import build_parser
    from torchtitan_npu.numerics.locate import parse_setup

    words = ["--nproc-per-node", "2", "--detect-nonfinite", "--training.steps", "3"]
    flags, overrides = build_parser().parse_known_args(["train", *words])
    setup = parse_setup("B", " ".join(words), flags, overrides)
    assert setup.flag_args() == ["--nproc-per-node", "2", "--detect-nonfinite"]
    assert setup.flag_args(single=True) == ["--detect-nonfinite"]
    assert setup.overrides == ["--training.steps", "3"] and setup.world_size == 2
