"""Training-step time with kernel converters vs without, on this machine.

For each model's debug flavor (fp32, batch 4 x seq 256 unless given), times
forward + backward + an SGD step of the unconverted model and of the model
with each converter alone and with all that apply, interleaving the variants
round by round; reports the median step time and its ratio to the
unconverted model (< 1: faster). On CPU the native kernels are PyTorch ops,
so the ratios show the converters' overhead, not NPU speed-ups.

With --isolate each variant runs alone in its own process (no
interleaving), and its peak resident memory (VmHWM) is reported too: for
models whose variants do not fit in memory together, e.g. qwen3's MoE debug
flavor.

Usage: uv run python benchmarks/converters.py [--steps N] [--models a,b:flavor]
       [--variants none,grouped_mm,...] [--isolate]
"""

import argparse
import copy
import statistics
import subprocess
import sys
import time

import torch

from torchtitan_npu import converters
from torchtitan_npu.bootstrap import activate
from torchtitan_npu.overlay import OVERLAY
from torchtitan_npu.reporting.table import format_markdown_table
from torchtitan_npu.state_dict_adapters import upstream_models as um


def build(spec: str, names: list[str], era: str, device_type: str):
    model, _, flavor = spec.partition(":")
    args = copy.deepcopy(um.model_args(model, flavor or "debugmodel", era))
    if era == "trainspec":
        from torchtitan.protocols.train_spec import get_train_spec

        module = get_train_spec(model).model_cls(args)
        converters.apply_named(
            module, names, era=era, model_name=model, device_type=device_type
        )
    else:
        args, _ = converters.apply_named(
            args, names, era=era, model_name=model, device_type=device_type
        )
        module = args.build()
    torch.manual_seed(0)
    with torch.no_grad():
        try:
            module.init_weights(buffer_device=torch.device(device_type))
        except TypeError:
            module.init_weights()
    return module.to(device_type).train()


def step_fn(module, era: str, tokens: torch.Tensor):
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-4)
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)

    def step():
        if era == "trainspec":
            logits = module(tokens)
        else:
            masks = module.get_attention_masks(positions)
            logits = module(tokens, attention_masks=masks)
        logits.float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--models", default="llama3,qwen3,deepseek_v3")
    parser.add_argument("--variants", help="default: none, each converter, all")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--isolate", action="store_true", help="a process each")
    options = parser.parse_args()
    context = activate().context
    era, device_type = context.era, context.device_type
    rows = []
    for spec in options.models.split(","):
        model = spec.partition(":")[0]
        names = [n for n, c in converters.CONVERTERS.items() if model in c.models(era)]
        variants = {"none": [], **{n: [n] for n in names}, "all": names}
        if options.variants:
            variants = {v: variants[v] for v in options.variants.split(",")}
        if options.isolate:
            measured = {v: _isolated(spec, v, options) for v in variants}
        else:
            measured = _interleaved(spec, variants, era, device_type, options)
        base = measured["none"][0] if "none" in measured else None
        for variant, (median, peak) in measured.items():
            row = [spec, variant, f"{median * 1e3:.1f}"]
            row.append(f"{median / base:.3f}" if base else "")
            rows.append(row + ([f"{peak / 2**30:.2f}"] if options.isolate else []))
    print(f"device {device_type}, era {era}, batch {options.batch} x seq {options.seq}")
    headers = ["model", "converters", "step ms", "ratio"]
    headers += ["peak RSS GiB"] if options.isolate else []
    print(format_markdown_table(headers, rows))


def _interleaved(spec, variants, era, device_type, options):
    """{variant: (median step s, None)}, the variants timed round by round."""
    tokens = torch.randint(0, 2000, (options.batch, options.seq), device=device_type)
    steps = {
        v: step_fn(build(spec, ns, era, device_type), era, tokens)
        for v, ns in variants.items()
    }
    times: dict[str, list[float]] = {v: [] for v in variants}
    for round_ in range(options.steps + 2):  # two warm-up rounds
        for variant, step in steps.items():
            start = time.perf_counter()
            step()
            if device_type != "cpu":
                getattr(torch, device_type).synchronize()
            if round_ >= 2:
                times[variant].append(time.perf_counter() - start)
    OVERLAY.revert_on_request()
    return {v: (statistics.median(t), None) for v, t in times.items()}


def _isolated(spec: str, variant: str, options) -> tuple[float, int]:
    """(median step s, peak RSS bytes) of one variant in a process of its own."""
    command = [
        sys.executable, __file__, "--models", spec, "--variants", variant,
        "--steps", str(options.steps), "--batch", str(options.batch),
        "--seq", str(options.seq),
    ]  # fmt: skip
    lines = subprocess.run(
        command, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    row = next(x for x in lines if x.startswith(f"| {spec} | {variant} |"))
    peak = next(x for x in lines if x.startswith("VmHWM"))  # kB
    return float(row.split("|")[3]) / 1e3, int(peak.split()[1]) * 1024


if __name__ == "__main__":
    main()
    if "--variants" in sys.argv:  # a child of --isolate: its peak memory
        with open("/proc/self/status") as status:
            print(next(x for x in status if x.startswith("VmHWM")).strip())
