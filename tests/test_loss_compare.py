"""loss-compare: a dump folder is one run over all its launches (resumes)."""

from argparse import Namespace

import pytest
from torch.utils.tensorboard import SummaryWriter

from torchtitan_npu.errors import UsageError
from torchtitan_npu.tools.loss_compare import main, parse_steps
from torchtitan_npu.tools.scalars import GRAD_NORM, LOSS, read_scalars


def write_launch(folder, steps: dict[int, float]) -> None:
    """One launch's TensorBoard folder, as upstream writes it."""
    writer = SummaryWriter(str(folder))
    for step, loss in steps.items():
        writer.add_scalar(LOSS, loss, step)
        writer.add_scalar(GRAD_NORM, loss / 8, step)
    writer.close()


def compare(a, b, **options) -> int:
    defaults = {"rtol": 0.0, "atol": 0.0, "plot": None, "steps": None}
    return main(Namespace(run_a=str(a), run_b=str(b), **{**defaults, **options}))


def test_resumed_run_is_read_over_all_its_launches(tmp_path, capsys):
    full = {1: 8.0, 2: 7.5, 3: 7.25, 4: 7.0}
    write_launch(tmp_path / "full" / "tb" / "20261201-000000-1" / "20261201-0000", full)
    resumed = tmp_path / "resumed" / "tb"
    # steps 1-3, then a crash; the resume restarts from the step-2 checkpoint
    write_launch(
        resumed / "20261201-010000-7" / "20261201-0100", {1: 8.0, 2: 7.5, 3: 9.9}
    )
    write_launch(resumed / "20261201-020000-9" / "20261201-0200", {3: 7.25, 4: 7.0})
    assert read_scalars(tmp_path / "resumed")[LOSS] == full  # the later launch wins
    assert compare(tmp_path / "full", tmp_path / "resumed") == 0
    assert compare(tmp_path / "full", tmp_path / "resumed", steps="3-4") == 0
    assert "steps 3-4" in capsys.readouterr().out


def test_step_range_limits_the_comparison(tmp_path, capsys):
    write_launch(tmp_path / "a" / "tb" / "x", {1: 8.0, 2: 7.5, 3: 7.0})
    write_launch(tmp_path / "b" / "tb" / "x", {1: 8.0, 2: 7.5, 3: 6.0})
    assert compare(tmp_path / "a", tmp_path / "b") == 1
    assert "DIFFER from step 3" in capsys.readouterr().out
    assert compare(tmp_path / "a", tmp_path / "b", steps="1-2") == 0
    assert compare(tmp_path / "a", tmp_path / "b", steps="2-5") == 1  # 4, 5 missing


@pytest.mark.parametrize("text", ["5-2", "0-3", "a-b", "-3"])
def test_bad_step_range_is_an_error(text):
    with pytest.raises(UsageError, match="--steps"):
        parse_steps(text)


def test_missing_run_is_an_error(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        compare(tmp_path / "nope", tmp_path / "nope")


def test_computational_mode_holds_the_accuracy_thresholds(tmp_path, capsys):
    """First-step loss abs < 0.005 and rel < 0.5%, mean loss error abs < 0.01
    and rel < 1%, mean grad_norm rel error <= 10%: each limit decides alone."""
    baseline = {1: 8.0, 2: 7.0, 3: 6.0}
    write_launch(tmp_path / "b" / "tb" / "x", baseline)

    def judged(name: str, losses: dict[int, float], norms=None) -> int:
        writer = SummaryWriter(str(tmp_path / name / "tb" / "x"))
        for step, loss in losses.items():
            writer.add_scalar(LOSS, loss, step)
            norm = baseline[step] / 8 if norms is None else norms[step]
            writer.add_scalar(GRAD_NORM, norm, step)
        writer.close()
        return compare(tmp_path / name, tmp_path / "b", mode="computational")

    near = {1: 8.004, 2: 7.009, 3: 6.009}  # every error just inside
    assert judged("near", near) == 0
    out = capsys.readouterr().out
    assert out.count("pass") == 3 and "FAIL" not in out
    assert judged("first", {1: 8.006, 2: 7.0, 3: 6.0}) == 1  # abs 0.006 at step 1
    assert "first-step loss        FAIL" in capsys.readouterr().out
    assert judged("mean", {1: 8.0, 2: 7.02, 3: 6.02}) == 1  # mean abs 0.0133
    assert "mean loss error        FAIL" in capsys.readouterr().out
    norms = {s: baseline[s] / 8 * 1.11 for s in baseline}  # 11% off
    assert judged("norm", baseline, norms) == 1
    assert "mean grad_norm error   FAIL" in capsys.readouterr().out
    assert judged("same", baseline, {s: baseline[s] / 8 * 1.09 for s in baseline}) == 0


def test_computational_mode_refuses_bitwise_tolerances(tmp_path):
    write_launch(tmp_path / "a" / "tb" / "x", {1: 8.0})
    with pytest.raises(UsageError, match="computational has its own thresholds"):
        compare(tmp_path / "a", tmp_path / "a", mode="computational", rtol=1e-3)


def test_computational_mode_fails_on_a_step_one_run_lacks(tmp_path, capsys):
    write_launch(tmp_path / "a" / "tb" / "x", {1: 8.0, 2: 7.0})
    write_launch(tmp_path / "b" / "tb" / "x", {1: 8.0})
    assert compare(tmp_path / "a", tmp_path / "b", mode="computational") == 1
    assert "MISSING steps [2]" in capsys.readouterr().out
