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

from torchtitan_npu.tools.scalars import read_scalars

pytestmark = pytest.mark.e2e


def test_training_falls_with_its_plan_and_summary(tmp_path):
    """A fresh launch on two processes (FSDP), `--plan` first, validating on
    the embedded corpus's held-out part."""
    validation = ["--validation.enable", "true", "--validation.freq", "2"]
    scalars = train(
        tmp_path / "run", "--plan", *validation, "--validation.steps", "2", nproc=2
    )
    loss = scalars["loss_metrics/global_avg_loss"]
    assert sorted(loss) == [1, 2, 3, 4]
    assert_loss_falls(scalars)
    held_out = read_scalars(tmp_path / "run", ("validation_metrics/loss",))
    held_out = held_out["validation_metrics/loss"]
    assert sorted(held_out) == [1, 2, 4] and held_out[4] < held_out[1]
    out = (tmp_path / "run.log").read_text()
    assert "titan-npu: plan: peak " in out and "per rank; cpu: no limit" in out
    summary = out[out.index("titan-npu: trained") :]
    assert summary.startswith("titan-npu: trained steps 1-4 in ")
    losses = f"loss {loss[1]:.4f} -> {loss[4]:.4f}"  # training's, then held out
    assert summary.splitlines()[0].endswith(
        f"{losses}; validation loss {held_out[4]:.4f} (step 4)"
    )
    assert "log:" in summary and "tensorboard:" in summary
    if newest_of_its_era():  # upstream's log noise differs per era, not per release
        for noise in ("Traceback", "Peak flops undefined", "lspci", "torch.compile()"):
            assert noise not in out, noise
        assert "has no effect without an initial_load_path" not in out


@full_suite_only("CI's determinism checks: the matrix cells (warm launches)")
@pytest.mark.parametrize("nproc", [1, 2], ids=["single", "fsdp2"])
def test_fresh_launches_are_bit_identical(tmp_path, nproc):
    """Two fresh launches, the second with `--plan` (a child of the launcher
    estimates memory: nothing of the run changes)."""
    first = train(tmp_path / "first", nproc=nproc)
    second = train(tmp_path / "second", "--plan", nproc=nproc)
    assert_bit_identical(first, second)


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
