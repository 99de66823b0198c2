"""`titan-npu checkpoint inspect`: what a DCP checkpoint holds, from its
metadata — a real FSDP(2) training checkpoint (torchrun, gloo), a from-hf
output, and the checkpoints it must refuse in one line."""

import re

import pytest
from hf_families import write_hf
from support import requires_newest_of_era, warm_train

from torchtitan_npu.bootstrap import deactivate
from torchtitan_npu.cli import main
from torchtitan_npu.compat.era import Era
from torchtitan_npu.config import preflight, resolve
from torchtitan_npu.config.schema import ConfigError
from torchtitan_npu.state_dict_adapters import convert, native_era
from torchtitan_npu.state_dict_adapters import upstream_models as um
from torchtitan_npu.tools.checkpoint_inspect import inspect

ERA = convert.current_era()


@pytest.fixture(scope="module")
def fsdp_run(launcher, tmp_path_factory):
    """A 2-step FSDP(2) run's dump folder, checkpointed in full at step 2."""
    dump = tmp_path_factory.mktemp("fsdp") / "run"
    warm_train(
        launcher, dump,
        "--checkpoint.enable", "true", "--checkpoint.interval", "2",
        "--checkpoint.last_save_model_only", "false",  # 0.2.x's default: true
        "--parallelism.data_parallel_shard_degree", "2",
        nproc=2, steps=2,
    )  # fmt: skip
    return dump


@pytest.mark.e2e
@requires_newest_of_era("DCP metadata reading is one code path per era")
def test_a_training_checkpoint_saved_under_fsdp(fsdp_run, capsys):
    path = fsdp_run / "checkpoint" / "step-2"
    info = inspect(path)
    assert (info.era, info.model, info.flavor) == (ERA, "llama3", "debugmodel")
    assert info.step == 2 and info.tokens_seen == 2 * 2 * 128  # upstream: per rank
    assert info.writers == 2
    assert info.splits["dim 0 x2"] > 0  # FSDP shards dim 0 (0.3.0's fused
    assert sum(info.splits.values()) == info.model_part.tensors  # qkv: whole)
    layout = um.native_layout("llama3", um.model_args("llama3", "debugmodel", ERA), ERA)
    assert info.model_part.tensors == len(layout)
    assert info.model_part.nbytes == sum(i.nbytes for i in layout.values())
    assert info.optimizer.nbytes >= 2 * info.model_part.nbytes  # AdamW moments
    assert info.lr_scheduler
    assert (info.dataloader_ranks, info.dp_degree) == (2, 2)
    assert info.run_layout == {"dp_shard": 2}

    assert main(["checkpoint", "inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"era          {ERA.value} (torchtitan " in out
    assert "step         2, 512 tokens seen per rank" in out
    assert "written by 2 rank(s)" in out and "dp_shard=2" in out
    assert "dataloader yes (2 dp rank(s) of 2)" in out


@pytest.mark.e2e
@requires_newest_of_era("DCP metadata reading is one code path per era")
def test_resuming_under_another_dp_degree_needs_the_data_position_left_out(
    fsdp_run,
):
    config = resolve(None, ["--job.dump_folder", str(fsdp_run)])
    config["checkpoint"]["enable"] = True
    preflight.check(config, world_size=2, launch="2 x 1")  # the same dp degree
    with pytest.raises(ConfigError) as refused:
        preflight.check(config, world_size=1, launch="1 x 1")
    line = str(refused.value)
    assert "this launch has 1" in line and "data position of 2" in line
    assert """--checkpoint.exclude_from_loading '["dataloader"]'""" in line
    config["checkpoint"]["exclude_from_loading"] = ["dataloader"]
    preflight.check(config, world_size=1, launch="1 x 1")
    deactivate()  # preflight activated the overlay in this process


@requires_newest_of_era("era-independent metadata reading (CI time)")
def test_a_from_hf_output_names_its_model_from_the_provenance(tmp_path, capsys):
    write_hf(tmp_path / "hf", "llama3")
    convert.from_hf(tmp_path / "hf", tmp_path / "dcp", "llama3", progress=False)
    info = inspect(tmp_path / "dcp")
    assert (info.era, info.model, info.flavor) == (ERA, "llama3", "hf")
    assert info.origin == convert.PROVENANCE
    assert info.step is None and info.optimizer.tensors == 0
    assert not info.lr_scheduler and info.dataloader_ranks == 0
    assert set(info.splits) == {"whole"}
    main(["checkpoint", "inspect", str(tmp_path / "dcp")])
    out = capsys.readouterr().out
    assert "step         none (model weights only)" in out
    assert "optimizer    none" in out


def test_the_era_is_read_from_the_native_names():
    args = um.model_args("llama3", "debugmodel", ERA)
    assert native_era(um.native_layout("llama3", args, ERA)) == ERA
    assert native_era(["output.weight", "layers.0.attention.wq.weight"]) == (
        Era.TRAINSPEC
    )
    assert native_era(
        ["lm_head.weight", "layers.0.attention.qkv_linear.wq.weight"]
    ) == (Era.CONFIG_REGISTRY)
    assert native_era(["tok_embeddings.weight", "norm.weight"]) is None  # in both
    assert native_era(["output.weight", "lm_head.weight"]) is None  # one of each


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: None, "does not exist"),
        (lambda p: p.mkdir(), r"no DCP \.metadata \(not a DCP checkpoint\)"),
        (lambda p: p.write_text("x"), "not a directory"),
        (
            lambda p: (p.mkdir(), (p / "model.safetensors").write_bytes(b"")),
            "an HF checkpoint .*convert from-hf",
        ),
        (
            lambda p: (p.mkdir(), (p / "__0_0.distcp").write_bytes(b"x")),
            "an unfinished save",
        ),
        (
            lambda p: (p.mkdir(), (p / ".metadata").write_bytes(b"not a pickle")),
            r"\.metadata: ",
        ),
    ],
    ids=["missing", "empty", "file", "hf", "unfinished", "corrupt-metadata"],
)
def test_what_is_no_checkpoint_is_one_line(tmp_path, capsys, make, message):
    path = tmp_path / "ckpt"
    make(path)
    assert main(["checkpoint", "inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert err.startswith(f"titan-npu: error: native checkpoint {path}: ")
    assert re.search(message, err), err
