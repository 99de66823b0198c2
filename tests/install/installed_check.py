"""What a new user does with the installed wheel, from an empty directory.

Run by ``nox -s dist`` with the fresh venv's python: ``python installed_check.py
WORKDIR``. Every command runs the venv's ``titan-npu`` in ``WORKDIR`` (empty,
outside the checkout), so nothing can come from the source tree.
"""

import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent
TITAN_NPU = str(BIN / "titan-npu")


def run(workdir: Path, *args: str, expect: int = 0) -> subprocess.CompletedProcess:
    start = time.monotonic()
    result = subprocess.run(
        [TITAN_NPU, *args], cwd=workdir, capture_output=True, text=True
    )
    seconds = time.monotonic() - start
    print(f"$ titan-npu {' '.join(args)}  -> exit {result.returncode}, {seconds:.1f} s")
    print(result.stdout.rstrip()[-2500:])
    if result.returncode != expect:
        print(result.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"titan-npu {args[0]}: exit {result.returncode}, not {expect}")
    return result


def same_safetensors(a: Path, b: Path) -> None:
    """Both HF folders hold the same tensors, bit for bit."""
    from safetensors.torch import load_file

    files_a = sorted(p.name for p in a.glob("*.safetensors"))
    files_b = sorted(p.name for p in b.glob("*.safetensors"))
    assert files_a and files_a == files_b, (files_a, files_b)
    for name in files_a:
        ta, tb = load_file(a / name), load_file(b / name)
        assert ta.keys() == tb.keys(), name
        for key in ta:
            assert ta[key].dtype == tb[key].dtype and ta[key].equal(tb[key]), key
    print(f"round trip exact: {len(files_a)} safetensors file(s) identical")


def broken_lock(workdir: Path) -> None:
    """A malformed upstream.lock in the install is one line, exit 2."""
    import torchtitan_npu

    lock = Path(torchtitan_npu.__file__).parent / "upstream.lock"
    original = lock.read_bytes()
    try:
        lock.write_text(
            original.decode().replace("\n[[upstream]]\n", "\n[[upstream]\n", 1)
        )
        result = run(workdir, "--version", expect=2)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and str(lock) in lines[0], result.stderr
        print(f"malformed lock: {lines[0]}")
    finally:
        lock.write_bytes(original)


def main(workdir: Path) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    assert not any(workdir.iterdir()), f"{workdir} is not empty"
    version = run(workdir, "--version").stdout
    assert "upstream.lock: tested" in version, version
    run(workdir, "doctor")
    run(workdir, "compat", "check")
    run(
        workdir, "train", "--device", "cpu",
        "--training.steps", "2", "--training.local_batch_size", "2",
        "--training.seq_len", "128",
        "--checkpoint.enable", "true", "--checkpoint.interval", "2",
        "--job.dump_folder", "run",
    )  # fmt: skip
    checkpoint = workdir / "run" / "checkpoint" / "step-2"
    assert checkpoint.is_dir(), sorted((workdir / "run").rglob("*"))
    run(workdir, "convert", "to-hf", str(checkpoint), "hf", "--model", "llama3")
    run(workdir, "convert", "from-hf", "hf", "dcp", "--model", "llama3")
    run(workdir, "convert", "to-hf", "dcp", "hf-again", "--model", "llama3")
    same_safetensors(workdir / "hf", workdir / "hf-again")
    run(workdir, "loss-compare", "run", "run")
    broken_lock(workdir)
    print("installed package: OK")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
