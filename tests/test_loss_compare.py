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
