"""How good `titan-npu plan` is, on this machine (docs/plan.md has results).

    python benchmarks/plan.py accuracy [--layouts single,fsdp,...] [--model M:F]
    python benchmarks/plan.py real-sizes
    python benchmarks/plan.py search

accuracy: each matrix layout of a debug model (llama3's by default, or
--model NAME:FLAVOR), estimated (fake tensors, fake process group) and then
run for real on CPU under torchrun (gloo) with the same memory tracker:
predicted vs measured per-rank peak and model state. Run it with each era's
python (e.g. .nox/upstream-0.2.2/bin/python).

real-sizes: wall time and peak RSS of `titan-npu plan` for published sizes
(a subprocess each, so its RSS is its own), as users run it and with
--all-layers.

search: `titan-npu plan --search` at a real size with part of the layout
given on the command line (kept): candidates planned, wall time, the best.
"""

import argparse
import json
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# name -> (processes, overrides)
LAYOUTS = {
    "single": (1, []),
    "ddp": (2, ["--parallelism.data_parallel_replicate_degree", "2",
                "--parallelism.data_parallel_shard_degree", "1"]),
    "fsdp": (2, []),
    "fsdp_ac_full": (2, ["--activation_checkpoint.mode", "full"]),
    "fsdp_ac_selective": (2, ["--activation_checkpoint.mode", "selective"]),
    "tp": (2, ["--parallelism.tensor_parallel_degree", "2",
               "--parallelism.data_parallel_shard_degree", "1"]),
    "fsdp_tp": (4, ["--parallelism.tensor_parallel_degree", "2",
                    "--parallelism.data_parallel_shard_degree", "2"]),
    "hsdp": (4, ["--parallelism.data_parallel_replicate_degree", "2",
                 "--parallelism.data_parallel_shard_degree", "2"]),
    "ep": (2, ["--parallelism.expert_parallel_degree", "2"]),  # MoE models
    # flex attention's CP needs whole 128-token blocks per load-balanced half
    "cp": (2, ["--parallelism.context_parallel_degree", "2",
               "--parallelism.data_parallel_shard_degree", "1",
               "--training.seq_len", "512"]),
    "pp_1f1b": (2, ["--parallelism.pipeline_parallel_degree", "2",
                    "--parallelism.data_parallel_shard_degree", "1",
                    "--parallelism.pipeline_parallel_schedule", "1F1B"]),
    "pp_gpipe": (2, ["--parallelism.pipeline_parallel_degree", "2",
                     "--parallelism.data_parallel_shard_degree", "1",
                     "--parallelism.pipeline_parallel_schedule", "GPipe"]),
    "pp_interleaved": (2, ["--parallelism.pipeline_parallel_degree", "2",
                           "--parallelism.data_parallel_shard_degree", "1",
                           "--parallelism.pipeline_parallel_schedule",
                           "Interleaved1F1B"]),
    "pp_fsdp": (4, ["--parallelism.pipeline_parallel_degree", "2",
                    "--parallelism.data_parallel_shard_degree", "2",
                    "--parallelism.pipeline_parallel_schedule", "1F1B"]),
}  # fmt: skip

REAL_SIZES = {
    "llama3 8B, 8 devices (FSDP), seq 8192, batch 2, selective AC, bf16": [
        "--model.flavor", "8B", "--nproc-per-node", "8", "--device-name", "H100",
        "--training.seq_len", "8192", "--training.local_batch_size", "2",
        "--training.mixed_precision_param", "bfloat16",
        "--activation_checkpoint.mode", "selective",
    ],
    "llama3 8B, 128 devices (FSDP), same": [
        "--model.flavor", "8B", "--nproc-per-node", "8", "--nnodes", "16",
        "--device-name", "H100", "--training.seq_len", "8192",
        "--training.local_batch_size", "2",
        "--training.mixed_precision_param", "bfloat16",
        "--activation_checkpoint.mode", "selective",
    ],
    "deepseek_v3 671B, 256 devices (FSDP x EP 2: upstream's 671b recipe), seq 4096, "
    "batch 4, selective AC, bf16": [
        "--model.name", "deepseek_v3", "--model.flavor", "671b",
        "--nproc-per-node", "8", "--nnodes", "32", "--device-name", "Ascend910B3",
        "--training.seq_len", "4096", "--training.local_batch_size", "4",
        "--training.mixed_precision_param", "bfloat16",
        "--activation_checkpoint.mode", "selective",
        "--parallelism.expert_parallel_degree", "2",
    ],
}  # fmt: skip
# deepseek_v3 671B on 256 Ascend 910B3 with TP, EP, PP and CP given: the
# search varies activation checkpointing and the local batch.
SEARCH = [
    "--search", "--model.name", "deepseek_v3", "--model.flavor", "671b",
    "--nproc-per-node", "8", "--nnodes", "32", "--device-name", "Ascend910B3",
    "--training.seq_len", "4096", "--training.mixed_precision_param", "bfloat16",
    "--parallelism.tensor_parallel_degree", "1",
    "--parallelism.expert_parallel_degree", "32",
    "--parallelism.pipeline_parallel_degree", "1",
    "--parallelism.context_parallel_degree", "1",
]  # fmt: skip


def mib(value: int) -> str:
    return f"{value / 2**20:.2f}"


def accuracy(layouts: list[str], model: list[str]) -> None:
    from torchtitan_npu.compat import resolve_upstream
    from torchtitan_npu.config import resolve
    from torchtitan_npu.plan.estimate import estimate

    version = resolve_upstream().installed.version
    print(f"torchtitan {version} {' '.join(model)}")
    print("| layout | ranks | predicted peak MiB | measured peak MiB | error "
          "| model state (params/grads/opt MiB) | equal |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name in layouts:
        nproc, overrides = LAYOUTS[name]
        config = resolve(None, model + overrides)
        planned = estimate(config, nproc, "cpu")
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.json").write_text(json.dumps(config))
            command = [
                sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(nproc), "-m", "torchtitan_npu.plan.measure",
                str(Path(tmp) / "config.json"), tmp,
            ]  # fmt: skip
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                peak = mib(planned.worst.peak)
                print(f"| {name} | {nproc} | {peak} | run failed: "
                      f"{result.stderr.strip().splitlines()[-1:]} |")  # fmt: skip
                continue
            measured = {
                r.rank: json.loads((Path(tmp) / f"rank-{r.rank}.json").read_text())
                for r in planned.ranks  # one per pipeline stage
            }
        for predicted in planned.ranks:
            rank = measured[predicted.rank]
            error = predicted.peak / rank["peak"] - 1
            state = "/".join(mib(v) for v in predicted.model_state.values())
            equal = "yes" if predicted.model_state == rank["model_state"] else "NO"
            shown = (
                name if len(planned.ranks) == 1 else f"{name}, rank {predicted.rank}"
            )
            print(f"| {shown} | {nproc} | {mib(predicted.peak)} | {mib(rank['peak'])} "
                  f"| {error:+.2%} | {state} | {equal} |", flush=True)  # fmt: skip


def real_sizes() -> None:
    """Each size planned as users run it (deep models' repeated layers
    extended on a line) and with --all-layers (every layer stepped)."""
    for name, args in REAL_SIZES.items():
        for how in ([], ["--all-layers"]):
            command = [sys.executable, "-m", "torchtitan_npu.cli", "plan", *args, *how]
            start = time.perf_counter()
            result = subprocess.run(command, capture_output=True, text=True)
            wall = time.perf_counter() - start
            rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
            peak = [line for line in result.stdout.splitlines() if " peak " in line]
            print(f"{name} {' '.join(how)}: {peak[:1] or result.stderr[-300:]}; "
                  f"wall {wall:.1f} s; peak RSS so far {rss:.2f} GiB",
                  flush=True)  # fmt: skip


def search() -> None:
    """A search with part of the layout kept (SEARCH)."""
    command = [sys.executable, "-m", "torchtitan_npu.cli", "plan", *SEARCH]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    planned = [
        line for line in result.stderr.splitlines() if re.match(r"\[\d+/\d+\] ", line)
    ]
    print(" ".join(SEARCH))
    print(f"{len(planned)} candidates planned, wall {wall:.1f} s")
    print(result.stdout or result.stderr[-2000:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["accuracy", "real-sizes", "search"])
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--model", help="NAME:FLAVOR (default: llama3:debugmodel)")
    args = parser.parse_args()
    if args.what == "accuracy":
        name, _, flavor = (args.model or "llama3:debugmodel").partition(":")
        model = ["--model.name", name, "--model.flavor", flavor or "debugmodel"]
        accuracy(args.layouts.split(","), model)
    elif args.what == "search":
        search()
    else:
        real_sizes()


if __name__ == "__main__":
    main()
