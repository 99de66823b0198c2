"""`titan-npu convert` stopped by the user or the system: Ctrl-C and SIGTERM
end with one line and leave nothing; a SIGKILL's temp dir is removed by the
next conversion into the same output (real subprocesses)."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import transformers
from support import full_suite_only, requires_default_upstream

pytestmark = [
    pytest.mark.e2e,
    requires_default_upstream("CLI signal handling is era-independent (CI time)"),
]


@pytest.fixture(scope="module")
def big_hf(tmp_path_factory):
    """~0.3 GB of fp32 llama: long enough a conversion to stop halfway."""
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=768, intermediate_size=2048,
        num_hidden_layers=4, num_attention_heads=12, num_key_value_heads=4,
    )  # fmt: skip
    config.architectures = ["LlamaForCausalLM"]
    path = tmp_path_factory.mktemp("big") / "hf"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path, max_shard_size="100MB")
    return path


def start(source, out):
    command = [sys.executable, "-m", "torchtitan_npu.cli", "convert", "from-hf",
               str(source), str(out), "--model", "llama3"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TITAN_NPU_NO_BOOTSTRAP"}
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def wait_until_writing(process, out) -> None:
    """Until the conversion has written a file (or has ended)."""
    partial = out.parent / f".{out.name}.partial-{process.pid}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if partial.is_dir() and any(partial.iterdir()):
            return
        if process.poll() is not None:
            return
        time.sleep(0.01)
    pytest.fail("no writing seen")


def stopped_halfway(source, out, signum) -> tuple[subprocess.Popen, str]:
    """Start a conversion and signal it once it writes. On a loaded machine
    the conversion may finish between the two: then try again, fresh."""
    for _ in range(3):
        process = start(source, out)
        wait_until_writing(process, out)
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=120)
        if process.returncode != 0:
            return process, stderr
        shutil.rmtree(out)
    pytest.fail("every conversion finished before its signal arrived")


@pytest.mark.parametrize(
    "signum",
    [
        signal.SIGINT,
        pytest.param(signal.SIGTERM, marks=full_suite_only("the handler SIGINT shows")),
    ],
)
def test_signal_is_one_line_and_leaves_nothing(big_hf, signum, tmp_path):
    out = tmp_path / "out"
    process, stderr = stopped_halfway(big_hf, out, signum)
    assert process.returncode == 128 + signum, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("titan-npu:")]
    assert lines == [
        f"titan-npu: error: writing {out} stopped by {signal.Signals(signum).name}; "
        f"{out} was not written"
    ], stderr
    assert "Traceback" not in stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_killed_conversion_is_cleaned_up_by_the_next(big_hf, tmp_path):
    out = tmp_path / "out"
    stopped_halfway(big_hf, out, signal.SIGKILL)
    leftover = list(tmp_path.glob(".out.partial-*"))
    assert leftover, "SIGKILL leaves its temp dir"
    again = start(big_hf, out)
    _, stderr = again.communicate(timeout=300)
    assert again.returncode == 0, stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
