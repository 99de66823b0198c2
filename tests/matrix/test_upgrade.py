"""The `upgrade` cell: a run of the older locked upstream (``--upgrade-from``,
its environment's python) trains steps 1-8 and saves at step 4; `checkpoint
migrate` turns step 4 into the installed upstream's names; then

- logits: the installed upstream's model with the migrated weights gives
  the older one's logits on the same tokens (fp32; max-abs-diff reported);
- optimizer and training state: migrating back with the older upstream
  gives the saved checkpoint's tensors bit for bit (the optimizer's fused
  q/k/v layout itself is checked against upstream's model in
  tests/test_checkpoint_migrate.py);
- the installed upstream resumes at step 5 and its loss continues the older
  run's curve. The eras pack text into sequences differently (0.2 one token
  stream, 0.3 per sample), so the batches after the resume are not the same
  ones and single steps differ by the batch-to-batch noise (up to ~3% on
  the debug model); the mean over steps 5-8 must agree within
  LOSS_CONTINUES. Both curves go into the report, side by side.
"""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support import drop_checkpoints, train

from torchtitan_npu.compat.lock import read_lock
from torchtitan_npu.state_dict_adapters.migrate import migrate
from torchtitan_npu.state_dict_adapters.native_io import NativeCheckpoint
from torchtitan_npu.tools.scalars import LOSS

pytestmark = pytest.mark.matrix

STEPS, SAVED = 8, 4
LOSS_CONTINUES = 0.02  # relative, the mean loss of the steps after the resume
LOGITS_ATOL = 1e-4  # fp32, two implementations of the same math
HERE = Path(__file__).resolve().parent


def _run(python: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{HERE.parent}"}
    result = subprocess.run(
        [python, *args], env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def _version(python: str) -> str:
    code = "from importlib.metadata import version; print(version('torchtitan'))"
    return _run(python, "-c", code).strip()


def test_upgrade(upgrade, upstream, workdir, matrix_data, results, request):
    old_python = request.config.getoption("--upgrade-from")
    if not old_python:
        pytest.skip("needs --upgrade-from PYTHON (nox passes the older upstream's)")
    version, old = upstream.installed.version, _version(old_python)
    cell = {"upstream": version, "era": upstream.era, "layout": "upgrade"}
    cell |= {"nproc": 1, "status": "fail", "reason": f"from {old}: a step failed"}
    results.append(cell)
    assert old in {e.version for e in read_lock()}, old
    start = time.perf_counter()
    data = [
        "--training.dataset", "c4_test", "--training.dataset_path", str(matrix_data),
        "--checkpoint.enable", "true", "--checkpoint.interval", str(SAVED),
        "--checkpoint.last_save_model_only", "false",
    ]  # fmt: skip
    before_dump = workdir / f"upgrade-{old}"
    before = train(before_dump, *data, steps=STEPS, python=old_python)
    saved = before_dump / "checkpoint" / f"step-{SAVED}"
    migrated = workdir / "upgrade-migrated"
    result = migrate(saved, migrated, version, progress=False)

    logits = {}
    for name, python, checkpoint in [
        ("old", old_python, saved),
        ("new", sys.executable, migrated),
    ]:
        out = workdir / f"upgrade-logits-{name}.pt"
        _run(python, str(HERE / "native_logits.py"), str(checkpoint), str(out))
        logits[name] = torch.load(out)
    logits_diff = (logits["old"] - logits["new"]).abs().max().item()

    back = workdir / "upgrade-migrated-back"
    _run(old_python, "-m", "torchtitan_npu.cli", "checkpoint", "migrate",
         str(migrated), str(back), "--to", old)  # fmt: skip
    source, returned = NativeCheckpoint(saved), NativeCheckpoint(back)
    differ = [
        k
        for k in source.layout
        if k not in returned.layout or not torch.equal(source.read(k), returned.read(k))
    ]

    resumed_dump = workdir / "upgrade-resumed"
    resumed = train(
        resumed_dump, *data,
        "--checkpoint.initial_load_path", str(migrated),
        "--checkpoint.initial_load_model_only", "false",
        steps=STEPS,
    )  # fmt: skip
    after = list(range(SAVED + 1, STEPS + 1))
    problems = []
    if logits_diff > LOGITS_ATOL:
        problems.append(f"logits differ by {logits_diff:.2e}")
    if differ:
        problems.append(f"{len(differ)} tensors differ after migrating back")
    if sorted(resumed[LOSS]) != after:
        problems.append(f"resumed steps {sorted(resumed[LOSS])}, not {after}")
    mean = {
        name: sum(run[LOSS].get(s, 0.0) for s in after) / len(after)
        for name, run in (("before", before), ("resumed", resumed))
    }
    mean_rel = abs(mean["resumed"] - mean["before"]) / mean["before"]
    if mean_rel > LOSS_CONTINUES:
        problems.append(f"the loss does not continue: mean {mean}")
    cell.update(
        status="fail" if problems else "pass",
        reason="; ".join(problems),
        wall_s=round(time.perf_counter() - start, 1),
        parity_max_rel_loss=mean_rel,
        parity_max_rel_grad_norm=0.0,
        logits_max_abs_diff=logits_diff,
        upgrade_from=old,
        data=result.data,
        loss_before={str(s): v for s, v in before[LOSS].items()},
        loss={str(s): v for s, v in resumed[LOSS].items()},
        dump=str(resumed_dump),
    )
    if not problems:
        for folder in (migrated, back):
            shutil.rmtree(folder)
        for run in (before_dump, resumed_dump):
            drop_checkpoints(run)
    assert not problems, f"upgrade {old} -> {version}: {problems}"
