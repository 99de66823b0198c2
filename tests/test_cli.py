"""The command line: cheap help, clear errors, torchrun flags."""

import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan_npu.cli import build_parser, shown_local_rank, torchrun_args


def test_help_does_not_import_torch():
    code = (
        "import sys\n"
        "from torchtitan_npu.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "train" in result.stdout and "doctor" in result.stdout


def test_torchrun_flags_single_node_and_multi_node():
    parser = build_parser()
    args, _ = parser.parse_known_args(["train", "--nproc-per-node", "2"])
    assert torchrun_args(args) == [
        "--nproc-per-node=2",
        "--standalone",
        "--local-ranks-filter=0",
    ]
    args, _ = parser.parse_known_args(
        ["train", "--nnodes", "2", "--rdzv-endpoint", "head:29400", "--log-all-ranks"]
    )
    assert torchrun_args(args) == [
        "--nproc-per-node=1", "--nnodes=2", "--rdzv-backend=c10d",
        "--rdzv-endpoint=head:29400", "--rdzv-id=titan-npu",
    ]  # fmt: skip


def test_a_pipelined_launch_shows_the_last_stage_that_computes_the_loss():
    parser = build_parser()
    args, _ = parser.parse_known_args(["train", "--nproc-per-node", "4"])
    assert shown_local_rank({}, args) == 0
    pipelined = {"parallelism": {"pipeline_parallel_degree": 2}}
    assert shown_local_rank(pipelined, args) == 3  # ranks 2, 3: the last stage
    assert "--local-ranks-filter=3" in torchrun_args(args, shown_rank=3)


def test_hidden_ranks_output_goes_to_files_under_the_run(tmp_path):
    parser = build_parser()
    args, _ = parser.parse_known_args(["train", "--nproc-per-node", "4"])
    assert torchrun_args(args, 3, log_dir=tmp_path)[-3:] == [
        f"--log-dir={tmp_path}",
        "--local-ranks-filter=3",
        "--redirects=0:3,1:3,2:3",
    ]
    # torchrun's per-rank redirect names one-digit local ranks only.
    args, _ = parser.parse_known_args(["train", "--nproc-per-node", "16"])
    redirects = torchrun_args(args, 15, log_dir=tmp_path)[-1]
    assert redirects == "--redirects=" + ",".join(f"{r}:3" for r in range(10))
    for shown_alone in (["--nproc-per-node", "1"], ["--log-all-ranks"]):
        args, _ = parser.parse_known_args(
            ["train", "--nproc-per-node", "2", *shown_alone]
        )
        flags = torchrun_args(args, 0, log_dir=tmp_path)
        assert f"--log-dir={tmp_path}" in flags  # torchrun's files, not in /tmp
        assert not any(flag.startswith("--redirects") for flag in flags)


def test_bad_override_is_a_clear_error(capsys):
    from torchtitan_npu.cli import main

    assert main(["train", "--training.bogus_key", "1", "--bad"]) == 2
    assert "--section.key" in capsys.readouterr().err


def test_version_names_upstream_lock_entry_torch_and_device(upstream):
    result = subprocess.run(
        [sys.executable, "-m", "torchtitan_npu.cli", "--version"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(None, 1) for line in result.stdout.splitlines())
    assert set(lines) == {"titan-npu", "torchtitan", "torch", "torch_npu", "device"}
    entry = upstream.entry
    assert lines["torchtitan"].startswith(
        f"{entry.version} (upstream.lock: {entry.status}"
    )
    assert f"commit {entry.commit}" in lines["torchtitan"]
    assert lines["device"].split()[0] in ("npu", "cuda", "cpu")


def test_an_internal_error_keeps_its_traceback_and_is_reported(
    capsys, monkeypatch, tmp_path
):
    """A ValueError titan-npu did not mean for the user is a bug: its
    traceback, one last line naming a report file, exit 1."""
    from torchtitan_npu.cli import main
    from torchtitan_npu.tools import doctor

    def broken() -> int:
        raise ValueError("a bug in titan-npu")

    monkeypatch.setenv("TITAN_NPU_CACHE", str(tmp_path))
    monkeypatch.setattr(doctor, "run", broken)
    assert main(["doctor"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert 'raise ValueError("a bug in titan-npu")' in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("titan-npu: internal error in titan-npu ")
    assert "ValueError: a bug in titan-npu -- please report it with " in last
    report = Path(last.rsplit(" ", 1)[1])
    assert report.parent == tmp_path / "error-reports"
    assert "a bug in titan-npu" in report.read_text()


@pytest.mark.parametrize(
    "command",
    [
        ["train", "--training.steps", "2"],
        ["plan"],
        ["convert", "from-hf", "hf", "out"],
        ["checkpoint", "inspect", "ckpt"],
        ["models"],
    ],
    ids=lambda c: c[0],
)
def test_an_untested_upstream_is_one_line_before_anything_starts(
    command, capsys, monkeypatch, tmp_path
):
    from torchtitan_npu import compat
    from torchtitan_npu.cli import main

    monkeypatch.delenv(compat.ALLOW_UNTESTED_ENV, raising=False)
    monkeypatch.setattr(
        compat, "installed_upstream", lambda: compat.InstalledUpstream("9.9.9", None)
    )
    monkeypatch.chdir(tmp_path)
    assert main(command) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("titan-npu: error: torchtitan 9.9.9 is not a tested ")
    assert compat.ALLOW_UNTESTED_ENV in err
    assert list(tmp_path.iterdir()) == []  # nothing launched, nothing written
