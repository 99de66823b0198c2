"""How `titan-npu train` fails on bad input: exit code, time to fail, the line.

    uv run python benchmarks/failures.py [WORKDIR]

Runs each bad input as a user would (a fresh `titan-npu train` process, CPU)
and prints a Markdown table: case, exit code, seconds, lines on the
terminal, the last line. The time includes the launcher's import of torch
and upstream, which every launch pays.
"""

import subprocess
import sys
import tempfile
import time
from pathlib import Path

# case -> its arguments (the case itself when None)
CASES = {
    "--training.steps abc": None,
    "--optimizer.lr fast": None,
    "--training.mixed_precision_param fp8": None,
    "--activation_checkpoint.mode sometimes": None,
    "--nproc-per-node 0": None,
    "--nproc-per-node abc": None,
    "tp 4 on 2 processes": "--nproc-per-node 2 --parallelism.tensor_parallel_degree 4",
    "missing dataset path": "--training.dataset c4_test --training.dataset_path /no/d",
    "missing checkpoint": "--checkpoint.initial_load_path /no/ckpt",
    "--model.name nosuch": None,
    "--model.flavor nosuch": None,
    "--training.bogus_key 1": None,
    "missing config file": "--config /no/such.toml",
    "malformed TOML": "--config {bad_toml}",
}


def main(workdir: Path) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    bad_toml = workdir / "bad.toml"
    bad_toml.write_text("[training\nsteps = 3\n")
    print("| case | exit | seconds | terminal lines | the line |")
    print("|---|---|---|---|---|")
    for name, text in CASES.items():
        args = (text or name).replace("{bad_toml}", str(bad_toml)).split()
        command = [sys.executable, "-m", "torchtitan_npu.cli", "train"]
        command += ["--job.dump_folder", str(workdir / "run"), *args]
        start = time.monotonic()
        result = subprocess.run(command, capture_output=True, text=True, cwd=workdir)
        seconds = time.monotonic() - start
        lines = (result.stdout + result.stderr).strip().splitlines()
        last = lines[-1].replace("|", "\\|") if lines else ""
        print(
            f"| {name} | {result.returncode} | {seconds:.1f} | {len(lines)} | {last} |",
            flush=True,
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()))
