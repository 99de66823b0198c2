"""`titan-npu train` as a user meets it: errors before launch, failures in the
ranks, killed launchers, busy dump folders, the closing summary."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import SMALL_RUN, requires_default_upstream, requires_era

from torchtitan_npu import bootstrap, launcher
from torchtitan_npu.cli import main

BAD_INPUTS = [
    (["--training.steps", "abc"], "'training.steps' = 'abc': expected an integer"),
    (["--optimizer.lr", "fast"], "'optimizer.lr' = 'fast': expected a number"),
    (["--training.max_norm", "[1]"], "'training.max_norm' = [1]: expected a number"),
    (["--nproc-per-node", "0"], "--nproc-per-node '0': expected a positive integer"),
    (["--nproc-per-node", "abc"], "--nproc-per-node 'abc'"),
    (["--nnodes", "two"], "--nnodes 'two'"),
    (
        ["--nproc-per-node", "2", "--parallelism.tensor_parallel_degree", "4"],
        "needs a multiple of 4 processes, but this launch has 2",
    ),
    (["--parallelism.tensor_parallel_degree", "0"], "must be at least 1"),
    (["--training.steps", "0"], "training.steps = 0: must be at least 1"),
    (["--training.local_batch_size", "0"], "local_batch_size = 0: must be at least 1"),
    (["--optimizer.lr", "-0.1"], "optimizer.lr = -0.1: must be at least 0"),
    (["--metrics.log_freq", "0"], "metrics.log_freq = 0: must be at least 1"),
    (["--training.max_norm", "-1"], "training.max_norm = -1: must be above 0 (upst"),
    (["--training.max_norm", "0"], "0 zeroes every gradient, a negative norm flips"),
    (["--lr_scheduler.warmup_steps", "-1"], "warmup_steps = -1: must be at least 0"),
    (["--validation.freq", "0"], "validation.freq = 0: must be at least 1"),
    (
        ["--activation_checkpoint.selective_ac_option", "every2"],
        "selective_ac_option = 'every2': 'op' (per-op selective AC) or a number N",
    ),
    (["--validation.steps", "0"], "validation.steps = 0: must be at least 1, or -1"),
    (["--optimizer.name", "adamw"], "optimizer.name 'adamw' is not one torchtitan"),
    (["--optimizer.name", "adamw"], "(did you mean 'AdamW'?); it builds Adam, AdamW"),
    (["--checkpoint.keep_latest_k", "1"], "keep_latest_k = 1: upstream keeps 0 (all)"),
    (
        ["--training.local_batch_size", "3", "--training.global_batch_size", "8"],
        "training.global_batch_size 8 must be a positive multiple of "
        "local_batch_size 3 x data-parallel degree 1",
    ),
    (
        ["--nproc-per-node", "2", "--training.local_batch_size", "2"]
        + ["--training.global_batch_size", "6"],
        "local_batch_size 2 x data-parallel degree 2 (--nproc-per-node 2 x "
        "--nnodes 1) = 4",
    ),
    (
        ["--profiling.enable_profiling", "true", "--profiling.profile_freq", "2"],
        "profiling.profile_freq 2 is shorter than profiler_warmup 3 + "
        "profiler_active 1; set --profiling.profile_freq 4 or more",
    ),
    (
        ["--device", "cpu", "--profiling.enable_memory_snapshot", "true"],
        "profiling.enable_memory_snapshot records a cuda or npu allocator's",
    ),
    (
        [
            "--nproc-per-node",
            "2",
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "1F1B",
            "--training.local_batch_size",
            "1",
        ],
        "the 1F1B pipeline schedule needs a microbatch per stage (2), but local "
        "batch 1 / microbatch size 1 makes 1; set --training.local_batch_size 2",
    ),
    (
        [
            "--nproc-per-node",
            "2",
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_microbatch_size",
            "3",
        ],
        "training.local_batch_size 4 is not a multiple of "
        "parallelism.pipeline_parallel_microbatch_size 3",
    ),
    (
        ["--parallelism.expert_parallel_degree", "2"],
        "expert_parallel_degree = 2 (set by the flavor's recipe unless you set it) "
        "needs dp_shard x cp x tp (1 in this launch",
    ),
    (
        ["--training.dataset", "c4_test", "--training.dataset_path", "/no/such/data"],
        "training.dataset_path: dataset path /no/such/data does not exist",
    ),
    (["--training.dataset_path", "/no/such/data"], "training.dataset is 'embedded'"),
    (["--training.dataset", "c4tst"], "'c4tst' is not a dataset upstream's loader"),
    (["--training.dataset", "c4tst"], "(did you mean 'c4_test'?); it knows c4, "),
    (  # upstream's own debug TOML, run outside upstream's repository
        ["--training.dataset", "c4_test"],
        "training.dataset c4_test without a dataset_path reads upstream's "
        "tests/assets/c4_test from the current directory, and there is none",
    ),
    (
        ["--model.hf_assets_path", "./tests/assets/tokenizer"],
        "./tests/assets/tokenizer does not exist (set --model.hf_assets_path PATH, "
        "or embedded)",
    ),
    (["--checkpoint.initial_load_path", "/no/such/ckpt"], "/no/such/ckpt does not"),
    (["--checkpoint.initial_load_path", "/"], "checkpoint.enable is false"),
    (["--model.flavor", "hf"], "model.flavor hf reads the architecture"),
    (
        ["--model.flavor", "hf", "--model.hf_assets_path", "/"],
        " /config.json does not exist",
    ),
    (["--model.name", "nosuch"], "unknown model 'nosuch'"),
    (["--model.flavor", "nosuch"], "has no flavor 'nosuch'"),
    (["--model.flavor", "debugmdl"], "(did you mean 'debugmodel'?); known flavors"),
    (["--model.name", "qwen"], "(did you mean 'qwen3'?); known models: ["),
    (["--training.bogus_key", "1"], "'training.bogus_key' has no counterpart"),
    (["--trainng.steps", "3"], "(did you mean 'training.steps'?)"),
    (["--config", "/no/such.toml"], "train config /no/such.toml does not exist"),
    (["--training.steps", "3", "stray"], "expected a --section.key override"),
]


@pytest.fixture
def deactivate_after():
    yield
    bootstrap.deactivate()  # preflight activates the overlay in this process


@pytest.mark.parametrize("args, problem", BAD_INPUTS, ids=lambda v: str(v)[:40])
def test_bad_input_is_one_line_before_launch(
    args, problem, tmp_path, capsys, deactivate_after
):
    dump = tmp_path / "run"
    code = main(["train", "--job.dump_folder", str(dump), *args])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2, captured
    assert len(lines) == 1 and lines[0].startswith("titan-npu: error: "), lines
    assert problem in lines[0], lines[0]
    assert not dump.exists(), "nothing may be left behind"
    assert not captured.out


LATE_IN_THE_RANKS = [  # 0.3.x refuses these only after torchrun started
    (["--training.seq_len", "7"], "its 8 chunks; use a multiple of 8"),
    (
        ["--nproc-per-node", "3", "--parallelism.tensor_parallel_degree", "3"],
        "training.seq_len 256 cannot be split evenly by tensor_parallel 3 "
        "(sequence parallel): use a multiple of 3",
    ),
    (
        ["--nproc-per-node", "2", "--parallelism.context_parallel_degree", "2"]
        + ["--training.seq_len", "202"],
        "context_parallel 2 (2 chunks a rank): use a multiple of 4",
    ),
    (
        ["--nproc-per-node", "3", "--parallelism.tensor_parallel_degree", "3"]
        + ["--training.seq_len", "384"],
        "llama3 debugmodel: tensor_parallel_degree (3) must divide n_heads (16) "
        "(upstream's own check)",
    ),
    (["--training.seq_len", "262144"], "exceeds attention RoPE maximum"),
    (  # the config sections' own validation, run by upstream's parser
        ["--parallelism.pipeline_parallel_microbatch_size", "0"],
        "parallelism.pipeline_parallel_microbatch_size must be greater than 0",
    ),
    (
        ["--checkpoint.enable", "true", "--checkpoint.folder", ""],
        "train [checkpoint] refused by torchtitan {version}: The 'folder' field "
        "cannot be empty",
    ),
]


LATE_IN_THE_RANKS_0_2 = [  # 0.2.x: an assertion, or a shape error in attention
    (["--training.seq_len", "255"], "255 is not a multiple of tensor_parallel 1 x 2"),
    (
        ["--validation.enable", "true", "--validation.seq_len", "512"],
        "validation.seq_len 512 is longer than training.seq_len 256, the longest "
        "sequence torchtitan",
    ),
    (
        ["--nproc-per-node", "3", "--parallelism.tensor_parallel_degree", "3"]
        + ["--training.seq_len", "384"],
        "tensor_parallel_degree 3 does not divide llama3 debugmodel's n_heads (16)",
    ),
]


@requires_era("config_registry")
@pytest.mark.parametrize("args, problem", LATE_IN_THE_RANKS, ids=lambda v: str(v)[:40])
def test_what_upstream_refuses_in_the_ranks_is_refused_before_launch(
    args, problem, tmp_path, capsys, deactivate_after, upstream
):
    problem = problem.format(version=upstream.installed.version)
    _refused_before_launch(args, problem, tmp_path, capsys)


@requires_era("config_registry")
@pytest.mark.parametrize(
    "name, flavor",
    [
        *((name, "debugmodel") for name in ("llama3", "qwen2", "qwen3", "qwen3_5")),
        *((name, "debugmodel") for name in ("deepseek_v3", "gpt_oss", "muse_glimmer")),
        ("kimi_k2_7", "kimi_k2_5_debugmodel"),
        ("flux", "debugmodel"),  # no decoder, and it trains on images
    ],
)
def test_every_upstream_model_passes_the_checks_before_launch(
    name, flavor, deactivate_after
):
    from torchtitan_npu.config import ConfigError, preflight, resolve

    config = resolve(None, ["--model.name", name, "--model.flavor", flavor])
    if name != "flux":
        preflight.check(config, world_size=1, launch="--nproc-per-node 1")
        return
    with pytest.raises(
        ConfigError, match="'c4_test' \\(the embedded text corpus\\) is"
    ):
        preflight.check(config, world_size=1, launch="--nproc-per-node 1")


@requires_era("trainspec")
@pytest.mark.parametrize("args, problem", LATE_IN_THE_RANKS_0_2, ids=str)
def test_what_0_2_refuses_in_the_ranks_is_refused_before_launch(
    args, problem, tmp_path, capsys, deactivate_after
):
    _refused_before_launch(args, problem, tmp_path, capsys)


def test_a_tokenizer_larger_than_the_embedding_is_refused_before_launch(
    tmp_path, capsys, deactivate_after
):
    """Every era: an id past the embedding fails every rank (IndexError on
    CPU, a device-side assert on CUDA)."""
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    vocab = {f"t{i}": i for i in range(4000)}
    added = [{"id": 4000, "content": "<|end|>", "special": True}]
    (tokenizer / "tokenizer.json").write_text(
        json.dumps({"model": {"type": "BPE", "vocab": vocab}, "added_tokens": added})
    )
    problem = (
        f"the tokenizer in {tokenizer} has 4001 tokens and llama3 debugmodel embeds "
        "2048 (its vocab_size): ids from 2048 up have no embedding"
    )
    args = ["--model.hf_assets_path", str(tokenizer)]
    _refused_before_launch(args, problem, tmp_path, capsys)


@pytest.mark.parametrize(
    "files, problem",
    [
        ([], "no tokenizer upstream reads (tokenizer.json, vocab.json, vocab.txt)"),
        (["tokenizer.model"], "a SentencePiece tokenizer.model alone is not read"),
    ],
)
def test_a_folder_without_a_tokenizer_upstream_reads_is_refused_before_launch(
    files, problem, tmp_path, capsys, deactivate_after
):
    """Every era's HuggingFaceTokenizer reads tokenizer.json or vocab files."""
    folder = tmp_path / "assets"
    folder.mkdir()
    for name in ["tokenizer_config.json", *files]:
        (folder / name).write_text("{}")
    args = ["--model.hf_assets_path", str(folder)]
    _refused_before_launch(args, f"model.hf_assets_path {folder} has", tmp_path, capsys)
    _refused_before_launch(args, problem, tmp_path, capsys)


@pytest.mark.parametrize(
    "layout, section, problem",
    [
        ("file", "training", "{data} is a file; upstream's c4_test loader reads a"),
        ("empty", "training", "{data} holds no files; upstream's c4_test loader"),
        ("no_text", "training", "records have no 'text' field (they have ['body',"),
        ("file", "validation", "{data} is a file; upstream's c4_test loader reads"),
    ],
)
def test_a_dataset_upstream_cannot_read_is_refused_before_launch(
    layout, section, problem, tmp_path, capsys, deactivate_after
):
    data = tmp_path / "data"
    data.mkdir()
    record = json.dumps({"id": 1, "body": "words"}) + "\n"
    if layout == "file":
        data = data / "data.jsonl"
        data.write_text(record)
    elif layout == "no_text":
        (data / "part-0.jsonl").write_text(record * 3)
    args = [f"--{section}.dataset", "c4_test", f"--{section}.dataset_path", str(data)]
    args += ["--validation.enable", "true"] if section == "validation" else []
    problem = problem.format(data=f"{section}.dataset_path {data}")
    _refused_before_launch(args, problem, tmp_path, capsys)


def test_a_validation_set_is_checked_only_when_validation_runs():
    from torchtitan_npu.config import ConfigError, preflight

    validation = {"dataset": "c4_test"}  # upstream's path: not in this folder
    preflight.check_dataset({"validation": validation})
    validation["enable"] = True
    with pytest.raises(ConfigError, match="validation.dataset c4_test without a"):
        preflight.check_dataset({"validation": validation})


def _refused_before_launch(args, problem, tmp_path, capsys):
    dump = tmp_path / "run"
    code = main(["train", "--job.dump_folder", str(dump), *args])
    captured = capsys.readouterr()
    assert code == 2, captured
    assert problem in captured.err
    assert len(captured.err.strip().splitlines()) == 1 and not dump.exists()


def test_a_dump_folder_that_cannot_be_made_is_one_line(capsys, deactivate_after):
    code = main(["train", "--job.dump_folder", "/proc/titan-npu/run"])
    captured = capsys.readouterr()
    assert code == 2, captured
    assert captured.err.strip() == (
        "titan-npu: error: dump folder /proc/titan-npu/run cannot be written (No "
        "such file or directory); choose another --job.dump_folder"
    )


@requires_era("trainspec")
def test_context_parallelism_with_sdpa_on_cpu_is_refused_before_launch(
    tmp_path, capsys, deactivate_after
):
    """0.2.x's default llama3 flavor runs SDPA, whose CPU kernel torch's
    context parallelism has no rule for: refused, with the flex flavors."""
    dump = tmp_path / "run"
    args = ["--parallelism.context_parallel_degree", "2", "--nproc-per-node", "2"]
    code = main(["train", "--job.dump_folder", str(dump), *args])
    captured = capsys.readouterr()
    assert code == 2, captured
    assert "context_parallel_degree 2 with llama3 debugmodel: torch's" in captured.err
    assert "debugmodel_flex_attn" in captured.err or "npu or cuda" in captured.err
    assert len(captured.err.strip().splitlines()) == 1 and not dump.exists()


def _other_era_checkpoint(path: Path) -> None:
    """A DCP checkpoint with the native names of the era not installed."""
    import torch
    import torch.distributed.checkpoint as dcp

    from torchtitan_npu.state_dict_adapters import convert

    names = {
        "trainspec": ["lm_head.weight", "layers.0.attention.qkv_linear.wq.weight"],
        "config_registry": ["output.weight", "layers.0.attention.wq.weight"],
    }[convert.current_era()]
    dcp.save({k: torch.zeros(2, 2) for k in names}, checkpoint_id=str(path))


def _model_checkpoint(path: Path, name: str, *, training_state: bool) -> None:
    """A DCP checkpoint of `name` debugmodel's tensors (zeros), and its
    training state (as a full save has it) or not (a model-only save)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from torchtitan_npu.config import era_config
    from torchtitan_npu.state_dict_adapters import convert

    model = era_config(convert.current_era()).meta_model(name, "debugmodel")
    state = {k: torch.zeros(v.shape) for k, v in model.state_dict().items()}
    if training_state:
        state["train_state"] = {"step": 3}
        for section in ("optimizer", "lr_scheduler", "dataloader"):
            state[section] = {"x": torch.zeros(1)}
    dcp.save(state, checkpoint_id=str(path))


@pytest.mark.parametrize(
    "name, training_state, problem",
    [
        ("qwen3", True, "does not fit llama3 debugmodel: it has 42 in another shape"),
        ("llama3", False, "holds the model only (no optimizer, lr_scheduler, "),
    ],
)
def test_a_checkpoint_the_run_cannot_resume_is_refused_before_launch(
    name, training_state, problem, tmp_path, capsys, deactivate_after
):
    """Another model trained into the dump folder (every rank would fail in
    DCP's load), or a model-only last step (the run would miss its state)."""
    dump = tmp_path / "run"
    _model_checkpoint(
        dump / "checkpoint" / "step-3", name, training_state=training_state
    )
    code = main(
        ["train", "--job.dump_folder", str(dump), "--checkpoint.enable", "true"]
    )
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(lines) == 1 and problem in lines[0], lines
    assert not (dump / "logs").exists()  # nothing launched


def test_a_seed_checkpoint_resumes_model_only(tmp_path, deactivate_after):
    """Upstream loads a step-0 (``create_seed_checkpoint``) model-only."""
    from torchtitan_npu.config import preflight, resolve

    dump = tmp_path / "run"
    _model_checkpoint(dump / "checkpoint" / "step-0", "llama3", training_state=False)
    overrides = ["--job.dump_folder", str(dump), "--checkpoint.enable", "true"]
    preflight.check(resolve(None, overrides), world_size=1, launch="1 process")


def test_a_run_at_its_last_step_says_so_and_launches_nothing(
    tmp_path, capsys, deactivate_after
):
    """The same command again after a finished run (upstream would start up
    and stop): one line, exit 0."""
    dump = tmp_path / "run"
    _model_checkpoint(dump / "checkpoint" / "step-3", "llama3", training_state=True)
    args = ["train", "--job.dump_folder", str(dump), "--checkpoint.enable", "true"]
    assert main([*args, "--training.steps", "3"]) == 0
    assert capsys.readouterr().out == (
        f"titan-npu: nothing to train: {dump}/checkpoint/step-3 is at step 3 and "
        "training.steps is 3; raise --training.steps to train on, or train afresh "
        "in another --job.dump_folder\n"
    )
    assert not (dump / "logs").exists()


@pytest.mark.parametrize(
    "holds, in_hf, problem",
    [
        ("dcp", True, "has none: it is a DCP checkpoint; load it without --checkp"),
        ("nothing", True, "has none; point --checkpoint.initial_load_path at an HF"),
        ("safetensors", False, "or train from it as it is with --checkpoint.initial_"),
    ],
)
def test_a_checkpoint_of_the_other_format_is_refused_before_launch(
    holds, in_hf, problem, tmp_path, capsys, deactivate_after
):
    """HF safetensors loaded as DCP, or DCP (or nothing) loaded as HF."""
    import torch
    from safetensors.torch import save_file

    initial = tmp_path / "initial"
    initial.mkdir()
    if holds == "dcp":
        _model_checkpoint(initial, "llama3", training_state=False)
    elif holds == "safetensors":
        save_file({"model.norm.weight": torch.ones(2)}, initial / "model.safetensors")
    args = ["--checkpoint.enable", "true", "--checkpoint.initial_load_path"]
    args += [str(initial), "--checkpoint.initial_load_in_hf", str(in_hf).lower()]
    _refused_before_launch(args, problem, tmp_path, capsys)


def test_load_step_is_the_checkpoint_checked(tmp_path, capsys, deactivate_after):
    dump = tmp_path / "run"
    load = ["--checkpoint.enable", "true", "--checkpoint.load_step", "5"]
    assert main(["train", "--job.dump_folder", str(dump), *load]) == 2
    assert capsys.readouterr().err == (
        f"titan-npu: error: checkpoint.load_step 5: there is no checkpoint folder "
        f"{dump}/checkpoint to load it from\n"
    )
    _model_checkpoint(dump / "checkpoint" / "step-3", "llama3", training_state=True)
    assert main(["train", "--job.dump_folder", str(dump), *load]) == 2
    err = capsys.readouterr().err
    assert err.startswith("titan-npu: error: checkpoint to load: native checkpoint ")
    assert "step-5: does not exist" in err


@pytest.mark.parametrize("how", ["initial_load_path", "resume", "unfinished"])
def test_a_checkpoint_that_cannot_load_is_refused_before_launch(
    how, tmp_path, capsys, deactivate_after
):
    dump = tmp_path / "run"
    args = ["--checkpoint.enable", "true"]
    if how == "initial_load_path":
        _other_era_checkpoint(tmp_path / "old")
        args += ["--checkpoint.initial_load_path", str(tmp_path / "old")]
        problem = "has the parameter names of torchtitan "
    elif how == "resume":
        _other_era_checkpoint(dump / "checkpoint" / "step-3")
        problem = "has the parameter names of torchtitan "
    else:
        (tmp_path / "cut").mkdir()
        (tmp_path / "cut" / "__0_0.distcp").write_bytes(b"x")
        args += ["--checkpoint.initial_load_path", str(tmp_path / "cut")]
        problem = "an unfinished save"
    code = main(["train", "--job.dump_folder", str(dump), *args])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith("titan-npu: error: "), lines
    assert problem in lines[0], lines[0]
    if how != "unfinished":
        assert "titan-npu checkpoint migrate " in lines[0]
    assert not (dump / "logs").exists()  # nothing launched


def test_process_counts():
    assert launcher.world_size("4", "2") == 8
    assert launcher.world_size("8", "1:4") is None  # elastic: torchrun decides
    for nproc, nnodes in [("0", "1"), ("-1", "1"), ("2", "0"), ("2", "3:1")]:
        with pytest.raises(launcher.LaunchError):
            launcher.world_size(nproc, nnodes)


def test_busy_dump_folder_is_refused_and_a_dead_owner_frees_it(tmp_path):
    owner = launcher.DumpFolderLock(tmp_path)
    owner.acquire()
    second = launcher.DumpFolderLock(tmp_path)
    with pytest.raises(launcher.LaunchError, match=f"pid {os.getpid()} on "):
        second.acquire()
    owner.release(started=True)
    second.acquire()  # the kernel dropped the first flock
    second.release(started=True)
    assert tmp_path.is_dir()


def test_failure_line_names_the_root_cause_rank(tmp_path):
    log = tmp_path / "launcher.log"
    torchrun_tail = [
        "Failures:",
        "  <NO_OTHER_FAILURES>",
        "Root Cause (first observed failure):",
        "[0]:",
        "  rank      : 1 (local_rank: 1)",
        "  exitcode  : -9 (pid: 4242)",
    ]
    result = launcher.RunResult(1, log, torchrun_tail, 1.0)
    line, code = launcher.failure_line(result, tmp_path)
    assert line == f"rank 1 was killed by SIGKILL (full log: {log})"
    assert code == 128 + signal.SIGKILL
    errors = tmp_path / "errors"
    errors.mkdir()
    record = {"rank": "1", "message": "ValueError: bad shard", "exitcode": 1}
    (errors / "rank-1.json").write_text(json.dumps({**record, "time": 2.0}))
    record = {"rank": "0", "message": "RuntimeError: peer gone", "exitcode": 1}
    (errors / "rank-0.json").write_text(json.dumps({**record, "time": 3.0}))
    line, code = launcher.failure_line(result, tmp_path)
    assert line.startswith("rank 1 failed: ValueError: bad shard; 1 other rank(s)")
    assert code == 1


def test_failure_line_points_at_the_failed_hidden_ranks_output(tmp_path):
    torchrun_tail = [
        "Failures:",
        "  <NO_OTHER_FAILURES>",
        "Root Cause (first observed failure):",
        "[0]:",
        "  rank      : 5 (local_rank: 1)",
        "  exitcode  : 1 (pid: 4242)",
    ]
    result = launcher.RunResult(1, tmp_path / "launcher.log", torchrun_tail, 1.0)
    line, _ = launcher.failure_line(result, tmp_path)
    assert "its output" not in line  # the rank was shown, or its file is gone
    output = tmp_path / launcher.RANKS_DIR / "run_x1" / "attempt_0" / "1"
    output.mkdir(parents=True)
    (output / "stderr.log").write_text("Traceback ...\n")
    line, _ = launcher.failure_line(result, tmp_path)
    assert line == (
        f"rank 5 exited with code 1 (its output: {output / 'stderr.log'}; "
        f"full log: {tmp_path / 'launcher.log'})"
    )
    # Local ranks from 10 up cannot be redirected: the line says what to do.
    unlogged = [t.replace("local_rank: 1)", "local_rank: 12)") for t in torchrun_tail]
    result = launcher.RunResult(1, tmp_path / "launcher.log", unlogged, 1.0)
    line, _ = launcher.failure_line(result, tmp_path, shown_rank=0)
    assert "(its output was not kept: rerun with --log-all-ranks; full log" in line
    for shown in (12, None):  # on the terminal, in the full log
        line, _ = launcher.failure_line(result, tmp_path, shown_rank=shown)
        assert "its output" not in line


def test_failure_line_joins_a_message_wrapped_over_a_few_lines(tmp_path):
    """0.2.x's parallelize asserts with a message over three indented lines;
    its last line alone ("(3) and 2 * CP degree (1).") says nothing."""
    errors = tmp_path / "errors"
    errors.mkdir()
    message = (
        "AssertionError: \n        Sequence length 256 must be divisible by the "
        "product of TP degree\n        (3) and 2 * CP degree (1).\n        "
    )
    record = {"rank": "0", "message": message, "exitcode": 1, "time": 1.0}
    (errors / "rank-0.json").write_text(json.dumps(record))
    result = launcher.RunResult(1, tmp_path / "launcher.log", [], 1.0)
    line, _ = launcher.failure_line(result, tmp_path)
    assert line.startswith(
        "rank 0 failed: AssertionError: Sequence length 256 must be divisible by "
        "the product of TP degree (3) and 2 * CP degree (1). (full log: "
    )


def test_failure_line_puts_a_killed_rank_before_the_peer_it_broke(tmp_path):
    # torchrun's clock has one-second steps: a rank killed by a signal and
    # the peer that then raised over the broken connection share a poll, and
    # torchrun names the lower rank as the root cause.
    torchrun_tail = [
        "Failures:",
        "[1]:",
        "  rank      : 1 (local_rank: 1)",
        "  exitcode  : -9 (pid: 4243)",
        "Root Cause (first observed failure):",
        "[0]:",
        "  rank      : 0 (local_rank: 0)",
        "  exitcode  : 1 (pid: 4242)",
    ]
    errors = tmp_path / "errors"
    errors.mkdir()
    record = {"rank": "0", "message": "RuntimeError: Connection reset by peer"}
    (errors / "rank-0.json").write_text(
        json.dumps({**record, "exitcode": 1, "time": 1})
    )
    result = launcher.RunResult(1, tmp_path / "launcher.log", torchrun_tail, 1.0)
    line, code = launcher.failure_line(result, tmp_path)
    assert line.startswith(
        "rank 1 was killed by SIGKILL; 1 other rank(s) failed after it"
    )
    assert code == 128 + signal.SIGKILL


# End to end: real launchers, torchrun and workers.


def launch(dump: Path, *args: str, steps: int = 4) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "TITAN_NPU_NO_BOOTSTRAP"}
    env.setdefault("TITAN_NPU_DEVICE", "cpu")
    command = [
        sys.executable, "-m", "torchtitan_npu.cli", "train",
        "--job.dump_folder", str(dump), "--training.steps", str(steps),
        *SMALL_RUN, *args,
    ]  # fmt: skip
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def wait_for_step(process: subprocess.Popen, step: int) -> list[str]:
    seen = []
    for line in process.stdout:
        seen.append(line)
        if f"step: {step:2d}" in launcher._ANSI.sub("", line):
            return seen
    raise AssertionError(f"the run ended before step {step}:\n{''.join(seen)}")


def workers_of(dump: Path) -> dict[int, str]:
    """pid -> RANK of the live worker processes training into ``dump``."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            if "torchtitan_npu.entry" not in cmdline or str(dump) not in cmdline:
                continue
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        rank = next((e[5:].decode() for e in environ if e.startswith(b"RANK=")), "?")
        found[int(proc.name)] = rank
    return found


def wait_until(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


@pytest.mark.e2e
@requires_default_upstream("the launcher's process handling is era-independent")
def test_killed_rank_is_one_line_with_its_signal(tmp_path):
    dump = tmp_path / "run"
    process = launch(dump, "--nproc-per-node", "2", steps=200)
    wait_for_step(process, 1)
    victim = next(pid for pid, rank in workers_of(dump).items() if rank == "1")
    os.kill(victim, signal.SIGKILL)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGKILL, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("titan-npu: error: rank 1 was killed by SIGKILL")
    assert "Traceback" not in out + err
    log = Path(lines[0].rsplit("full log: ", 1)[1].rstrip(")"))
    assert "ChildFailedError" in log.read_text()  # the details are kept
    # The hidden rank's own output is kept too, and the line says where.
    output = Path(lines[0].split("its output: ", 1)[1].split(";", 1)[0])
    assert output.parent.name == "1" and output.is_relative_to(log.parent)
    assert output.read_text().strip()  # rank 1 logs only warnings: torch's


@pytest.mark.e2e
@requires_default_upstream("the launcher's process handling is era-independent")
def test_killed_launcher_takes_its_workers_and_frees_the_folder(tmp_path):
    dump = tmp_path / "run"
    process = launch(
        dump,
        "--checkpoint.enable", "true", "--checkpoint.interval", "1",
        steps=500,
    )  # fmt: skip
    wait_for_step(process, 2)
    assert workers_of(dump)
    second = launch(dump)
    _, err = second.communicate(timeout=120)
    assert second.returncode == 2
    assert f"is in use by a live run (pid {process.pid} on" in err
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert wait_until(lambda: not workers_of(dump), 30), workers_of(dump)
    checkpoints = sorted((dump / "checkpoint").glob("step-*"))
    time.sleep(3)
    assert sorted((dump / "checkpoint").glob("step-*")) == checkpoints
    lock = launcher.DumpFolderLock(dump)
    lock.acquire()  # nobody holds it any more
    lock.release(started=True)


@pytest.mark.e2e
@requires_default_upstream("the launcher's process handling is era-independent")
def test_ctrl_c_is_passed_on_and_summarised(tmp_path):
    """A SIGINT to the launcher alone (a terminal's Ctrl-C reaches only the
    launcher: the run has its own session) stops the run, which says what it
    trained; exit 130, no traceback, no worker left."""
    dump = tmp_path / "run"
    process = launch(dump, steps=500)
    wait_for_step(process, 2)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGINT, err
    assert "Traceback" not in out + err
    summary = out[out.index("titan-npu: stopped by SIGINT; trained steps 1-") :]
    assert f"log:          {dump}/logs/" in summary
    assert not workers_of(dump)


def test_interrupted_summary_says_so_even_before_a_step(tmp_path):
    result = launcher.RunResult(130, tmp_path / "launcher.log", [], 7.2, 2)
    summary = launcher.run_summary(result, tmp_path, None)
    assert (
        summary.splitlines()[0]
        == "titan-npu: stopped by SIGINT; no step trained in 7 s"
    )


def test_summary_tells_training_loss_from_validation_loss(tmp_path):
    lines = [
        "[titan] - INFO - step:  1  loss:  8.11227  grad_norm:  0.8576",
        "[titan] - INFO - validate step:  1  loss:  8.0449  memory:  1.28GiB",
        "[titan] - INFO - step:  2  loss:  8.02526  grad_norm:  0.8412",
        "[titan] - INFO - validate step:  2  loss:  7.9955  memory:  1.39GiB",
    ]
    result = launcher.RunResult(0, tmp_path / "launcher.log", lines, 12.0, None)
    summary = launcher.run_summary(result, tmp_path, None)
    assert summary.splitlines()[0] == (
        "titan-npu: trained steps 1-2 in 12 s; loss 8.1123 -> 8.0253; "
        "validation loss 7.9955 (step 2)"
    )


def test_signal_before_launch_is_one_line(capsys):
    from torchtitan_npu.cli import _interruptible

    def preflight() -> int:
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("the signal did not stop it")

    before = signal.getsignal(signal.SIGTERM)
    assert _interruptible(preflight, "train", "nothing was launched") == 143
    err = capsys.readouterr().err
    assert err == "titan-npu: error: train stopped by SIGTERM; nothing was launched\n"
    assert signal.getsignal(signal.SIGTERM) is before  # handler restored
