"""Training-step time with kernel converters vs without, on this machine.

For each model's debug flavor (fp32, batch 4 x seq 256 unless given), times
forward + backward + an SGD step of the unconverted model and of the model
with each converter alone and with all that apply, interleaving the variants
round by round; reports the median step time and its ratio to the
unconverted model (< 1: faster). On CPU the native kernels are PyTorch ops,
so the ratios show the converters' overhead, not NPU speed-ups.

Usage: uv run python benchmarks/converters.py [--steps N] [--models a,b]
"""

import argparse
import copy
import statistics
import time

import torch

from torchtitan_npu import converters
from torchtitan_npu.bootstrap import activate
from torchtitan_npu.overlay import OVERLAY
from torchtitan_npu.state_dict_adapters import upstream_models as um
from torchtitan_npu.tools.table import format_markdown_table


def build(model: str, names: list[str], era: str, device_type: str):
    args = copy.deepcopy(um.model_args(model, "debugmodel", era))
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
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    options = parser.parse_args()
    context = activate().context
    era, device_type = context.era, context.device_type
    rows = []
    for model in options.models.split(","):
        names = [n for n, c in converters.CONVERTERS.items() if model in c.models(era)]
        variants = {"none": [], **{n: [n] for n in names}, "all": names}
        tokens = torch.randint(
            0, 2000, (options.batch, options.seq), device=device_type
        )
        steps = {
            v: step_fn(build(model, ns, era, device_type), era, tokens)
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
        base = statistics.median(times["none"])
        for variant in variants:
            median = statistics.median(times[variant])
            rows.append([model, variant, f"{median * 1e3:.1f}", f"{median / base:.3f}"])
    print(f"device {device_type}, era {era}, batch {options.batch} x seq {options.seq}")
    print(format_markdown_table(["model", "converters", "step ms", "ratio"], rows))


if __name__ == "__main__":
    main()
