"""`titan-npu checkpoint migrate`: a training checkpoint of the other era in
this era's names, optimizer state split and fused in upstream's own layout,
resumed by a real run; and the inputs it must refuse in one line.

The real upgrade (0.2.2 trains, 0.3.0 resumes) needs both upstreams: it is
the matrix's `upgrade` cell (tests/matrix/test_upgrade.py)."""

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from support import requires_newest_of_era, warm_train

from torchtitan_npu.cli import main
from torchtitan_npu.compat.era import Era
from torchtitan_npu.compat.lock import read_lock
from torchtitan_npu.state_dict_adapters import _NAMES_ONLY, get_adapter
from torchtitan_npu.state_dict_adapters import upstream_models as um
from torchtitan_npu.state_dict_adapters.convert import RUN_CONFIG, current_era
from torchtitan_npu.state_dict_adapters.mapping import TensorInfo
from torchtitan_npu.state_dict_adapters.migrate import QKV, fuse_qkv, split_qkv
from torchtitan_npu.state_dict_adapters.native_io import NativeCheckpoint, write_native

ERA = current_era()
OTHER = next(e for e in Era if e != ERA)
VERSION = next(e.version for e in read_lock() if e.era == ERA.value)
OTHER_VERSION = next(e.version for e in read_lock() if e.era == OTHER.value)
MODEL, FLAVOR = "llama3", "debugmodel"
STEP, LR = 2, 8e-4
# One AdamW parameter group as upstream's optimizer saves it.
HYPER = {
    "lr": LR, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
    "amsgrad": False, "maximize": False, "foreach": False, "capturable": False,
    "differentiable": False, "fused": True, "decoupled_weight_decay": True,
    "initial_lr": LR,
}  # fmt: skip


def _other_era_names() -> dict[str, str]:
    """This era's model tensor -> its name in the other era (the mapping's
    names: both eras' rules through HF, as upstream's adapters name them)."""
    adapter = get_adapter(MODEL)
    here, there = (adapter.keymap(e, _NAMES_ONLY) for e in (ERA, OTHER))
    layout = um.native_layout(MODEL, um.model_args(MODEL, FLAVOR, ERA), ERA)
    by_hf = {g.hf: g.native for g in here.plan_to_hf(layout)}
    hf = {k: i for g in here.plan_to_hf(layout) for k, i in zip(g.hf, g.hf_infos)}
    return {by_hf[g.hf][0]: g.native[0] for g in there.plan_from_hf(hf)}


def _fused_parameters(names: list[str]) -> dict[str, list[str]]:
    """Optimizer parameter -> its state-dict tensors, as 0.3 keys llama3's."""
    params = {n: [n] for n in names}
    if OTHER == Era.CONFIG_REGISTRY:
        for name in [n for n in names if ".qkv_linear.wq." in n]:
            parts = [name.replace(".wq.", f".{w}.") for w in QKV]
            for p in parts:
                del params[p]
            params[name.replace(".wq.", ".wqkv.")] = parts
    return params


@pytest.fixture(scope="module")
def other_era_run(tmp_path_factory):
    """A run folder whose step-2 checkpoint has the other era's names: model,
    AdamW state (fused q/k/v where that era fuses), lr scheduler, data
    position of one dp rank, as that era's upstream saves them."""
    dump = tmp_path_factory.mktemp("other") / "run"
    (dump / "checkpoint").mkdir(parents=True)
    config = {"model": {"name": MODEL, "flavor": FLAVOR}}
    (dump / RUN_CONFIG).write_text(json.dumps(config))
    here = um.native_layout(MODEL, um.model_args(MODEL, FLAVOR, ERA), ERA)
    names = _other_era_names()
    layout = {names[k]: i for k, i in here.items()}
    generator = torch.Generator().manual_seed(0)
    objects: dict[str, object] = {"train_state.step": STEP}
    objects["train_state.ntokens_seen"] = STEP * 256
    for param, parts in _fused_parameters(list(layout)).items():
        rows = sum(layout[p].shape[0] for p in parts)
        shape = (rows, *layout[parts[0]].shape[1:])
        for field in ("exp_avg", "exp_avg_sq"):
            layout[f"optimizer.state.{param}.{field}"] = TensorInfo(
                shape, torch.float32
            )
        layout[f"optimizer.state.{param}.step"] = TensorInfo((), torch.float32)
        objects |= {f"optimizer.param_groups.{param}.{k}": v for k, v in HYPER.items()}
    buffers = {"trainspec": {"token_buffer": [1, 2, 3]}}.get(OTHER.value, {})
    buffers = buffers or {"inputs_buffer": [1], "labels_buffer": [2]}
    dataset = {"sample_idx": 9, **buffers}
    objects |= {
        "lr_scheduler.last_epoch": STEP,
        "dataloader.world_size": 1,
        "dataloader.dp_rank_0": pickle.dumps(_loader_state(dataset)),
    }
    values = {
        k: torch.full((), float(STEP))
        if k.endswith(".step")
        else torch.randn(i.shape, generator=generator)
        for k, i in layout.items()
    }
    write_native(
        dump / "checkpoint" / f"step-{STEP}", layout, values.__getitem__, objects
    )
    return dump, values


def _loader_state(dataset: dict) -> dict:
    """torchdata's StatefulDataLoader state after 2 batches of 4 samples."""
    return {
        "_index_sampler_state": None,
        "_sampler_iter_state": {"samples_yielded": 8},
        "_sampler_iter_yielded": 2,
        "_num_yielded": 2,
        "_IterableDataset_len_called": None,
        "_shared_seed": None,
        "fetcher_state": {"dataset_iter_state": None, "fetcher_ended": False},
        "dataset_state": dataset,
        "_iterator_finished": False,
    }


def test_fused_qkv_is_upstreams_layout():
    """fuse_qkv(wq, wk, wv) is the fused parameter upstream's model holds;
    split_qkv undoes it (GQA qwen3: 2 q heads per kv head, head_dim 128)."""
    if ERA != Era.CONFIG_REGISTRY:
        pytest.skip("only 0.3's models fuse q/k/v")
    from torchtitan_npu.state_dict_adapters.migrate import _head_dim

    for model in ("llama3", "qwen3"):
        args = um.model_args(model, "debugmodel", ERA)
        torch.manual_seed(0)
        module = um._REGISTRY[ERA].build(model, args)
        for p in module.parameters():
            torch.nn.init.normal_(p)
        state = module.state_dict()
        fused = dict(module.named_parameters())[
            "layers.0.attention.qkv_linear.wqkv.weight"
        ]
        parts = [state[f"layers.0.attention.qkv_linear.{w}.weight"] for w in QKV]
        head_dim = _head_dim(module, "layers.0.attention.qkv_linear.wqkv.weight")
        assert torch.equal(fuse_qkv(parts, head_dim), fused.detach())
        rows = [p.shape[0] for p in parts]
        for got, want in zip(split_qkv(fused.detach(), rows, head_dim), parts):
            assert torch.equal(got, want)


@pytest.mark.e2e
@requires_newest_of_era("one migration per era")
def test_a_migrated_checkpoint_has_the_same_state_and_resumes(
    other_era_run, launcher, tmp_path, capsys
):
    dump, values = other_era_run
    out = tmp_path / "migrated"
    source = dump / "checkpoint" / f"step-{STEP}"
    assert main(["checkpoint", "migrate", str(source), str(out), "--to", VERSION]) == 0
    said = capsys.readouterr().out
    assert "data position: kept for 1 data-parallel rank(s)" in said
    migrated = NativeCheckpoint(out)
    names = _other_era_names()
    for new, old in names.items():  # model tensors: renamed, bit for bit
        assert torch.equal(migrated.read(new), values[old]), new
    here = um.build_meta(MODEL, um.model_args(MODEL, FLAVOR, ERA), ERA)
    old_params = _fused_parameters([names[k] for k in um.layout_of(here)])
    by_part = {p: param for param, parts in old_params.items() for p in parts}
    for param, _ in here.named_parameters():  # AdamW state, in this era's layout
        parts = [names[k] for k in ([param] if param in names else _qkv(param))]
        for field in ("exp_avg", "exp_avg_sq"):
            old = [_moment(values, old_params, by_part[p], p, field) for p in parts]
            want = old[0] if len(parts) == 1 else fuse_qkv(old, 16)
            got = migrated.read(f"optimizer.state.{param}.{field}")
            assert torch.equal(got, want), (param, field)
        assert migrated.read_object(f"optimizer.param_groups.{param}.lr") == LR
    dataset = pickle.loads(migrated.read_object("dataloader.dp_rank_0"))[
        "dataset_state"
    ]
    assert dataset["sample_idx"] == 9 and not any(
        v for k, v in dataset.items() if k.endswith("buffer")
    )

    resumed = warm_train(
        launcher, tmp_path / "resumed",
        "--checkpoint.enable", "true",
        "--checkpoint.initial_load_path", str(out),
        "--checkpoint.initial_load_model_only", "false",
        steps=STEP + 1,
    )  # fmt: skip
    assert sorted(resumed["loss_metrics/global_avg_loss"]) == [STEP + 1]


def _moment(values, params, param, part, field) -> torch.Tensor:
    """The source moment of state-dict tensor `part` (of parameter `param`)."""
    moment = values[f"optimizer.state.{param}.{field}"]
    parts = params[param]
    if len(parts) == 1:
        return moment
    rows = [values[p].shape[0] for p in parts]
    return split_qkv(moment, rows, 16)[parts.index(part)]  # debugmodel: head_dim 16


def _qkv(param: str) -> list[str]:
    return [param.replace(".wqkv.", f".{w}.") for w in QKV]


@pytest.mark.parametrize(
    "case",
    ["its own era", "unknown version", "other era's version", "OUT exists",
     "missing", "unfinished save", "truncated shard", "no run config",
     "another flavor"],
)  # fmt: skip
def test_bad_input_is_one_line(case, other_era_run, tmp_path, capsys):
    dump, _ = other_era_run
    source, out, to = dump / "checkpoint" / f"step-{STEP}", tmp_path / "out", VERSION
    expected = {
        "its own era": "already has torchtitan",
        "unknown version": "not a locked upstream",
        "other era's version": "run the migration with torchtitan",
        "OUT exists": "exists and is not empty",
        "missing": "does not exist",
        "unfinished save": "an unfinished save",
        "truncated shard": "truncated",
        "no run config": "no run config",
        "another flavor": "another model or flavor",
    }[case]
    if case == "its own era":
        source = tmp_path / "own"
        layout = {"tok_embeddings.weight": TensorInfo((2, 2), torch.float32)}
        layout |= {
            "lm_head.weight" if ERA == Era.CONFIG_REGISTRY else "output.weight": layout[
                "tok_embeddings.weight"
            ]
        }
        write_native(source, layout, lambda k: torch.zeros(2, 2))
    elif case == "unknown version":
        to = "9.9.9"
    elif case == "other era's version":
        to = OTHER_VERSION
    elif case == "OUT exists":
        out.mkdir()
        (out / "x").write_text("")
    elif case == "missing":
        source = tmp_path / "nowhere"
    elif case == "unfinished save":
        source = tmp_path / "cut"
        source.mkdir()
        (source / "__0_0.distcp").write_bytes(b"x")
    elif case in ("truncated shard", "no run config", "another flavor"):
        copy = tmp_path / "run" / "checkpoint" / "step-2"
        shutil.copytree(source, copy)
        source = copy
        if case == "truncated shard":
            shutil.copy(dump / RUN_CONFIG, tmp_path / "run" / RUN_CONFIG)
            shard = max(copy.glob("*.distcp"), key=lambda f: f.stat().st_size)
            os.truncate(shard, shard.stat().st_size // 2)
        if case == "another flavor":
            other = {"model": {"name": MODEL, "flavor": "8B"}}
            (tmp_path / "run" / RUN_CONFIG).write_text(json.dumps(other))
    code = main(["checkpoint", "migrate", str(source), str(out), "--to", to])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith("titan-npu: error: "), lines
    assert expected in lines[0], lines[0]
    assert case == "OUT exists" or not out.exists()
    assert not list(tmp_path.glob(".out.partial-*"))


@pytest.mark.e2e
@requires_newest_of_era("one kill per era")
def test_a_killed_migration_leaves_no_out(other_era_run, tmp_path):
    """SIGKILL while writing: OUT never appears (it is a rename at the end);
    the next migration into OUT removes the killed one's temp dir."""
    dump, _ = other_era_run
    source, out = dump / "checkpoint" / f"step-{STEP}", tmp_path / "out"
    command = [sys.executable, "-m", "torchtitan_npu.cli", "checkpoint", "migrate",
               str(source), str(out), "--to", VERSION]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TITAN_NPU_NO_BOOTSTRAP"}
    for _ in range(3):  # on a loaded machine it may finish before the kill
        process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE)
        partial = tmp_path / f".out.partial-{process.pid}"
        deadline = time.monotonic() + 180
        while process.poll() is None and time.monotonic() < deadline:
            if partial.is_dir() and any(partial.iterdir()):
                process.send_signal(signal.SIGKILL)
                break
            time.sleep(0.005)
        process.communicate(timeout=60)
        if process.returncode == -signal.SIGKILL:
            break
        assert process.returncode == 0, "the migration failed"
        shutil.rmtree(out)
    else:
        pytest.fail("every migration finished before its kill")
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == [partial.name]
    assert main(["checkpoint", "migrate", str(source), str(out), "--to", VERSION]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
