"""The device check: the first minutes on a CUDA or Ascend host, prepared.

``uv run nox -s device`` (or ``uv run python benchmarks/device_check.py``)
runs, on this machine's accelerator, each check below and writes one
markdown report (``outputs/device-check/report.md``), in under 8 minutes on
the debug models:

1. doctor: versions, CANN, the device, the peak FLOPs and determinism settings;
2. kernels (npu): each converter's torch_npu kernel against its PyTorch
   reference on the device, forward and backward, on small inputs;
3. numerics: 20 steps on the device and on the CPU from one seed checkpoint,
   judged by ``loss-compare --mode computational``;
4. speed (cuda): steps/s of ``titan-npu train`` against upstream's own
   launcher on the same settings (upstream runs there unpatched);
5. memory: ``titan-npu plan --measure`` on 2 layouts: the plan's peak against
   the device's measured one.

Without an accelerator (``--dry-run``, or nothing but a CPU) it runs doctor
and writes what it would check and the exact commands. Not in CI.
"""

import argparse
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

OUT = Path("outputs/device-check")
SMALL = ["--training.local_batch_size", "2", "--training.seq_len", "256"]
TITAN_NPU = [sys.executable, "-m", "torchtitan_npu.cli"]


@dataclass
class Check:
    title: str
    what: str
    commands: list[list[str]] = field(default_factory=list)
    run: object = None  # a function returning markdown, instead of commands
    devices: tuple[str, ...] = ("npu", "cuda")


def device_type() -> str:
    from torchtitan_npu.distributed import select_device_type

    return select_device_type()


def kernels_report(device: str) -> str:
    """Each converter's npu kernel against its native reference, on ``device``."""
    from torchtitan_npu.converters.ops import (
        attention,
        grouped_mm,
        rms_norm,
        rope,
        swiglu,
    )

    def on(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)

    cases = {
        "rms_norm": (rms_norm, lambda: (on(2, 128, 256), (256,), on(256), 1e-6)),
        "rope": (
            rope,
            lambda: (on(2, 128, 4, 64, dtype=torch.float32),
                     torch.randn(1, 128, 1, 64, device=device),
                     torch.randn(1, 128, 1, 64, device=device), False),
        ),
        "attention": (
            attention,
            lambda: (on(2, 4, 128, 64), on(2, 4, 128, 64), on(2, 4, 128, 64)),
        ),
        "swiglu": (swiglu, lambda: (on(256, 512), on(256, 512))),
        "grouped_mm": (
            grouped_mm,
            lambda: (on(96, 64), on(3, 64, 32),
                     torch.tensor([32, 64, 96], device=device, dtype=torch.int32)),
        ),
    }  # fmt: skip

    def fresh(a):
        if not isinstance(a, torch.Tensor):
            return a
        return a.detach().clone().requires_grad_(a.requires_grad)

    rows = ["| kernel | forward max abs err | backward max abs err |", "|---|---|---|"]
    for name, (module, inputs) in cases.items():
        torch.manual_seed(0)
        args = inputs()
        kwargs = {"mask": None, "scale": None, "enable_gqa": False}
        extra = kwargs if name == "attention" else {}
        try:
            outputs = []
            for kernel in (module.npu, module.native):
                copies = [fresh(a) for a in args]
                out = kernel(*copies, **extra)
                out.float().sum().backward()
                grads = [c.grad for c in copies if isinstance(c, torch.Tensor)
                         and c.grad is not None]  # fmt: skip
                outputs.append((out.detach().float(), grads))
            (fused, fused_grads), (native, native_grads) = outputs
            forward = (fused - native).abs().max().item()
            backward = max(
                ((f.float() - n.float()).abs().max().item()
                 for f, n in zip(fused_grads, native_grads)),
                default=0.0,
            )  # fmt: skip
            rows.append(f"| {name} | {forward:.3e} | {backward:.3e} |")
        except Exception as e:  # a kernel that fails is the finding
            rows.append(f"| {name} | FAILED: {type(e).__name__}: {e} | |")
    return "\n".join(rows)


def checks(device: str) -> list[Check]:
    seed = OUT / "seed"
    checkpoint = ["--checkpoint.enable", "true"]
    load = [
        *checkpoint, "--checkpoint.initial_load_path", str(seed / "checkpoint/step-0"),
        "--checkpoint.initial_load_model_only", "true", "--checkpoint.interval", "100",
    ]  # fmt: skip
    numerics = [
        [*TITAN_NPU, "train", "--device", "cpu", *SMALL, "--training.steps", "1",
         *checkpoint, "--checkpoint.create_seed_checkpoint", "true",
         "--parallelism.data_parallel_shard_degree", "1",
         "--job.dump_folder", str(seed)],
        *[[*TITAN_NPU, "train", "--device", where, *SMALL, "--training.steps", "20",
           *load, "--job.dump_folder", str(OUT / f"train-{where}")]
          for where in (device, "cpu")],
        [*TITAN_NPU, "loss-compare", str(OUT / f"train-{device}"),
         str(OUT / "train-cpu"), "--mode", "computational"],
    ]  # fmt: skip
    upstream_train = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", "1", "-m", "torchtitan.train", "--module", "llama3",
        "--config", "llama3_debugmodel", "--training.steps", "30",
    ]  # fmt: skip
    return [
        Check("doctor", "versions, CANN, device, peak FLOPs, determinism",
              [[*TITAN_NPU, "doctor"]], devices=("npu", "cuda", "cpu")),
        Check("kernels", "each converter's torch_npu kernel vs its PyTorch "
              "reference on the device (bf16; forward and backward)",
              run=lambda: kernels_report(device), devices=("npu",)),
        Check("numerics", "20 steps on the device vs on the CPU from one seed "
              "checkpoint, judged by loss-compare --mode computational", numerics),
        Check("speed", "titan-npu train vs upstream's own launcher, 30 steps of "
              "the debug llama: compare the tps lines of both logs",
              [[*TITAN_NPU, "train", "--training.steps", "30",
                "--job.dump_folder", str(OUT / "speed")], upstream_train],
              devices=("cuda",)),
        Check("memory", "the plan's peak against the device's measured "
              "max_memory_allocated, single and fsdp (2 devices when present)",
              [[*TITAN_NPU, "plan", "--measure", *SMALL],
               [*TITAN_NPU, "plan", "--measure", "--nproc-per-node", "2", *SMALL]]),
    ]  # fmt: skip


def run_commands(commands: list[list[str]], timeout: float) -> tuple[str, bool]:
    parts, ok = [], True
    for command in commands:
        start = time.perf_counter()
        try:
            result = subprocess.run(
                command, capture_output=True, text=True, timeout=timeout
            )
            code, text = result.returncode, (result.stdout + result.stderr)
        except subprocess.TimeoutExpired:
            code, text = "timeout", ""
        ok = ok and code == 0
        shown = text.strip().splitlines()
        if len(shown) > 30:  # the head says what ran, the tail how it ended
            shown = [*shown[:12], "...", *shown[-15:]]
        tail = "\n".join(shown)
        parts.append(
            f"`{shlex.join(command)}` -> exit {code} "
            f"({time.perf_counter() - start:.0f} s)\n\n```\n{tail}\n```"
        )
    return "\n\n".join(parts), ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="say, do not run")
    parser.add_argument("--timeout", type=float, default=240, help="per command, s")
    args = parser.parse_args(argv)
    device = device_type()
    dry = args.dry_run or device == "cpu"
    OUT.mkdir(parents=True, exist_ok=True)
    lines = [
        f"# titan-npu device check: {device}"
        f"{' (dry run: what would run on an accelerator)' if dry else ''}",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}, host {os.uname().nodename}",
    ]
    failed = []
    for check in checks(device if not dry else "npu"):
        lines += ["", f"## {check.title}: {check.what}", ""]
        runnable = device in check.devices and (not dry or check.title == "doctor")
        if not runnable:
            where = ", ".join(check.devices)
            lines.append(f"not run here (on {where}); would run:")
            lines += [f"- `{shlex.join(c)}`" for c in check.commands]
            if check.run is not None:
                lines.append("- the kernel comparison in benchmarks/device_check.py")
            continue
        if check.run is not None:
            lines.append(check.run())  # type: ignore[operator]
            continue
        text, ok = run_commands(check.commands, args.timeout)
        lines.append(text)
        if not ok:
            failed.append(check.title)
    lines += ["", f"checks that failed: {', '.join(failed) or 'none'}"]
    report = OUT / "report.md"
    report.write_text("\n".join(lines) + "\n")
    print(f"device check ({device}{', dry run' if dry else ''}): {report}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
