"""torch-npu installed on a host without Ascend CANN: the escape hatch works.

Run by ``nox -s npu_without_cann`` with a venv that has the real torch-npu
wheel (it installs on x86_64 and then breaks ``import torch``): training on a
forced CPU device or with torch's backend autoload off must work, and the
unforced launch must fail with titan-npu's one line, not torch's traceback.
(With the autoload switch off, ``--version`` shows the CPU device: the same
code path as ``train``, without a second training run in CI.)
"""

import os
import sys
from pathlib import Path

from installed_check import run

TRAIN = [
    "train", "--training.steps", "2", "--training.local_batch_size", "2",
    "--training.seq_len", "128",
]  # fmt: skip


def main(workdir: Path) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    os.environ.pop("TITAN_NPU_DEVICE", None)
    os.environ.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)

    failed = run(workdir, *TRAIN, "--job.dump_folder", "unforced", expect=2)
    lines = failed.stderr.strip().splitlines()
    assert len(lines) == 1, failed.stderr
    assert lines[0].startswith("titan-npu: error: torch_npu is installed but cannot")
    assert "--device cpu" in lines[0] and "Traceback" not in failed.stdout
    assert not (workdir / "unforced").exists()  # nothing half-written
    print(f"unforced: {lines[0]}")

    version = run(workdir, "--version").stdout
    assert "unavailable: torch_npu is installed but cannot load" in version, version
    doctor = run(workdir, "doctor", expect=1)
    assert "NOT ACTIVE: TorchNpuLoadError" in doctor.stdout
    assert "Traceback" not in doctor.stdout + doctor.stderr

    trained = run(workdir, *TRAIN, "--device", "cpu", "--job.dump_folder", "forced")
    assert "trained steps 1-2" in trained.stdout, trained.stdout
    os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"  # torch's own switch
    version = run(workdir, "--version").stdout
    assert "device      cpu (gloo)" in version, version
    print("torch-npu without CANN: OK")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
