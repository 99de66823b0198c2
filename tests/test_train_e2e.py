"""Real training through `titan-npu train` (torchrun, gloo) on the installed
upstream: loss falls, two launches are bit-identical (TensorBoard values), and
the launcher ends with its summary, free of upstream's log noise."""

import pytest
from support import (
    assert_bit_identical,
    assert_loss_falls,
    full_suite_only,
    newest_of_its_era,
    train,
)

pytestmark = pytest.mark.e2e

SINGLE = full_suite_only("one device: the matrix's single cell (warm launches)")


@pytest.mark.parametrize(
    "nproc", [pytest.param(1, marks=SINGLE), 2], ids=["single", "fsdp2"]
)
def test_training_falls_and_is_deterministic(tmp_path, nproc):
    first = train(tmp_path / "first", nproc=nproc)
    # --plan estimates memory in a child of the launcher: nothing changes
    second = train(tmp_path / "second", "--plan", nproc=nproc)
    assert sorted(first["loss_metrics/global_avg_loss"]) == [1, 2, 3, 4]
    assert_loss_falls(first)
    assert_bit_identical(first, second)
    log = (tmp_path / "second.log").read_text()
    assert "titan-npu: plan: peak " in log and "per rank; cpu: no limit" in log

    out = (tmp_path / "first.log").read_text()
    summary = out[out.index("titan-npu: trained") :]
    assert summary.startswith("titan-npu: trained steps 1-4 in ")
    assert "loss 8." in summary and "log:" in summary and "tensorboard:" in summary
    if newest_of_its_era():  # upstream's log noise differs per era, not per release
        for noise in ("Traceback", "Peak flops undefined", "lspci", "torch.compile()"):
            assert noise not in out, noise
        assert "has no effect without an initial_load_path" not in out


def test_untranslatable_key_stops_before_training(tmp_path):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "torchtitan_npu.cli", "train",
         "--job.dump_folder", str(tmp_path), "--training.bogus_key", "1"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode != 0
    assert "titan-npu: error: train config key 'training.bogus_key'" in result.stderr
    assert "Traceback" not in result.stderr.split("titan-npu: error:")[0]
