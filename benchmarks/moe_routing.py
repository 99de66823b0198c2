"""How far a layout moves an MoE model's routing from the one-device run.

Each launch builds qwen3 ``debugmodel_moe`` as upstream's Trainer builds it for
its layout (0.3.x), gives it the same weights (the one-device launch writes
them, the others read them), and trains STEPS steps on the same batches
(upstream's forward_backward_step, clipping, optimizer step with the MoE
load-balancing hook). Every router's top-k choice is recorded per step.

    torchrun --nproc-per-node 1 benchmarks/moe_routing.py DIR single
    torchrun --nproc-per-node 2 benchmarks/moe_routing.py DIR tp
    torchrun --nproc-per-node 2 benchmarks/moe_routing.py DIR fsdp
    python benchmarks/moe_routing.py DIR --compare tp fsdp

``--compare`` prints, per step, the loss and grad_norm relative to the
one-device run, how many (token, slot) expert choices differ from it, and
for the first layer where one did: the largest gap between a moved token's
k-th and (k+1)-th score (what rounding had to cross) and how far that
layer's scores moved.
"""

import contextlib
import sys
import warnings
from pathlib import Path

import torch

from torchtitan_npu.bootstrap import activate

activate()
# upstream's MoE router asks CPU autocast for float32 every layer
warnings.filterwarnings("ignore", "In CPU autocast", UserWarning)

import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor, distribute_tensor  # noqa: E402

from torchtitan_npu.compat import resolve_upstream  # noqa: E402
from torchtitan_npu.config import resolve  # noqa: E402
from torchtitan_npu.plan import config_registry as trainer_build  # noqa: E402

STEPS, SEQ, BATCH = 4, 256, 4
LAYOUTS = {
    "single": [],
    "tp": ["--parallelism.tensor_parallel_degree", "2"],
    "fsdp": ["--parallelism.data_parallel_shard_degree", "2"],
}


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def gather_rows(t: torch.Tensor, world: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t)
    return torch.cat(parts)


def run(folder: Path, layout: str) -> None:
    from torchtitan.distributed import utils as dist_utils

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = resolve(
        None,
        [
            "--model.name", "qwen3", "--model.flavor", "debugmodel_moe",
            "--parallelism.data_parallel_shard_degree", "1",
            *LAYOUTS[layout],
            "--training.seq_len", str(SEQ),
            "--training.local_batch_size", str(BATCH // (2 if layout == "fsdp" else 1)),
        ],
    )  # fmt: skip
    upstream = trainer_build.upstream_config(
        config, resolve_upstream().installed.version
    )
    dims = trainer_build.parallel_dims(upstream, world)
    dims.build_mesh()
    torch.manual_seed(0)
    trainer = trainer_build.build(
        upstream, dims, torch.device("cpu"), contextlib.nullcontext()
    )
    spec = upstream.model_spec
    if spec.post_optimizer_build_fn is not None:  # the MoE load-balancing hook
        spec.post_optimizer_build_fn(trainer.optimizers, trainer.model_parts, dims)
    model = trainer.model_parts[0]
    weights = folder / "weights.pt"
    if layout == "single":
        state = {k: full(v).detach() for k, v in model.state_dict().items()}
        torch.save(state, weights)
    else:
        saved, loaded = torch.load(weights), {}
        for name, value in model.state_dict().items():  # wq/wk/wv: fused on load
            want = saved[name].to(value.dtype)
            if isinstance(value, DTensor):
                want = distribute_tensor(want, value.device_mesh, value.placements)
            loaded[name] = want
        model.load_state_dict(loaded)
        for name, value in model.state_dict().items():
            assert torch.equal(full(value), saved[name].to(value.dtype)), name

    routes: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
    for name, module in model.named_modules():
        if name.endswith("moe.router"):

            def record(_m, inputs, out, name=name) -> None:
                scores = full(out[2]).detach()  # as chosen: with the expert bias
                if len(inputs) > 1 and inputs[1] is not None:
                    scores = scores + full(inputs[1]).detach()
                routes[-1][name] = (full(out[1]).detach(), scores)

            module.register_forward_hook(record)

    torch.manual_seed(1)
    vocab = trainer.model_config.vocab_size
    steps = []
    for _ in range(STEPS):
        tokens = torch.randint(0, vocab, (BATCH, SEQ + 1))
        if layout == "fsdp":
            tokens = tokens.chunk(world)[rank]
        positions = torch.arange(SEQ).expand(tokens.shape[0], -1)
        routes.append({})
        trainer.optimizers.zero_grad()
        loss = trainer.forward_backward_step(
            input_dict={"input": tokens[:, :-1], "positions": positions},
            labels=tokens[:, 1:],
            global_valid_tokens=torch.tensor(BATCH * SEQ),
        )
        loss = full(loss).detach().clone()
        if layout == "fsdp":  # each rank's share of the global mean
            dist.all_reduce(loss)
        norm = full(
            dist_utils.clip_grad_norm_(
                [p for m in trainer.model_parts for p in m.parameters()],
                upstream.training.max_norm,
                foreach=True,
            )
        )
        trainer.optimizers.step()
        step = dict(routes[-1])
        if layout == "fsdp":  # each rank routed its rows: gather them
            for n, (ids, scores) in step.items():
                step[n] = (gather_rows(ids, world), gather_rows(scores, world))
        steps.append({"loss": loss.item(), "grad_norm": norm.item(), "routes": step})
    if rank == 0:
        torch.save(steps, folder / f"{layout}.pt")
    dist.destroy_process_group()


def compare(folder: Path, layouts: list[str]) -> None:
    base = torch.load(folder / "single.pt")
    for layout in layouts:
        other = torch.load(folder / f"{layout}.pt")
        print(f"{layout} against one device:")
        for i, (a, b) in enumerate(zip(base, other)):
            moved, choices, first = 0, 0, ""
            for name, (ids, scores) in a["routes"].items():
                their_ids, their_scores = b["routes"][name]
                differ = ids.sort(-1).values != their_ids.sort(-1).values
                moved += int(differ.sum())
                choices += differ.numel()
                if differ.any() and not first:
                    # the gap a flip had to cross: k-th minus (k+1)-th score
                    top = scores.topk(ids.shape[-1] + 1, dim=-1).values
                    gap = (top[..., -2] - top[..., -1])[differ.any(-1)].max()
                    change = (scores - their_scores).abs().max()
                    first = (
                        f"; first in {name.removesuffix('.moe.router')}: "
                        f"gaps <= {gap:.1e}, its scores moved <= {change:.1e}"
                    )
            loss = abs(b["loss"] - a["loss"]) / abs(a["loss"])
            norm = abs(b["grad_norm"] - a["grad_norm"]) / abs(a["grad_norm"])
            print(
                f"  step {i + 1}: loss {loss:.1e}, grad_norm {norm:.1e}, "
                f"expert choices moved {moved} of {choices}{first}"
            )


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    if sys.argv[2] == "--compare":
        compare(out, sys.argv[3:])
    else:
        run(out, sys.argv[2])
