"""Real training through `titan-npu train` (torchrun, gloo) on the installed
upstream: loss falls, and two launches are bit-identical (TensorBoard values)."""

import pytest
from support import assert_bit_identical, assert_loss_falls, train

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("nproc", [1, 2], ids=["single", "fsdp2"])
def test_training_falls_and_is_deterministic(tmp_path, nproc):
    first = train(tmp_path / "first", nproc=nproc)
    # --plan estimates memory in a child of the launcher: nothing changes
    second = train(tmp_path / "second", "--plan", nproc=nproc)
    assert sorted(first["loss_metrics/global_avg_loss"]) == [1, 2, 3, 4]
    assert_loss_falls(first)
    assert_bit_identical(first, second)
    log = (tmp_path / "second.log").read_text()
    assert "titan-npu: plan: peak " in log and "per rank; cpu: no limit" in log


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
