"""What the overlay costs at start-up.

Measures, each as the median of N fresh interpreters:
- overlay work: ``activate()`` after upstream's training program is already
  imported (lock read, era choice, target fingerprints, patching, rebinding) —
  the cost beyond importing torchtitan itself;
- ``import torchtitan_npu`` alone (must not import torch);
- ``import torchtitan.train`` with and without the overlay (end to end; the
  difference is within the noise of a ~20 s import on a busy machine);
- ``titan-npu --help`` wall time.

Usage: uv run python benchmarks/overlay_overhead.py [N]
"""

import os
import statistics
import subprocess
import sys
import time

ACTIVATE_AFTER_UPSTREAM = """
import time
import torchtitan.train
from torchtitan_npu import bootstrap
t = time.perf_counter()
bootstrap.activate()
print(time.perf_counter() - t)
"""
IMPORT_PACKAGE = """
import time, sys
t = time.perf_counter()
import torchtitan_npu
print(time.perf_counter() - t)
assert "torch" not in sys.modules
"""
IMPORT_UPSTREAM = """
import time
t = time.perf_counter()
{prefix}
import torchtitan.train
print(time.perf_counter() - t)
"""


# As users run it: with bytecode caches (PYTHONDONTWRITEBYTECODE=1 makes every
# titan-npu module compile from source in every process, ~45 ms of activation).
BASE_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def timed(code: str, **env: str) -> float:
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**BASE_ENV, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return float(result.stdout.strip().splitlines()[-1])


def wall(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, capture_output=True, check=True)
    return time.perf_counter() - start


def median_ms(samples: list[float]) -> str:
    return f"{statistics.median(samples) * 1000:8.1f} ms  (n={len(samples)})"


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    off = {"TITAN_NPU_NO_BOOTSTRAP": "1"}
    activation = [timed(ACTIVATE_AFTER_UPSTREAM, **off) for _ in range(n)]
    package = [timed(IMPORT_PACKAGE) for _ in range(n)]
    plain, overlaid = [], []
    for _ in range(n):  # interleaved, so drift hits both alike
        plain.append(timed(IMPORT_UPSTREAM.format(prefix=""), **off))
        overlaid.append(timed(IMPORT_UPSTREAM.format(prefix="import torchtitan_npu")))
    cli = os.path.join(os.path.dirname(sys.executable), "titan-npu")
    help_wall = [wall([cli, "--help"]) for _ in range(n)]
    print(f"overlay activate() after upstream import : {median_ms(activation)}")
    print(f"import torchtitan_npu (no torch)          : {median_ms(package)}")
    print(f"import torchtitan.train, no overlay       : {median_ms(plain)}")
    print(f"import torchtitan.train, with overlay     : {median_ms(overlaid)}")
    print(f"titan-npu --help wall time                : {median_ms(help_wall)}")


if __name__ == "__main__":
    main()
