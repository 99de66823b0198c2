"""One rank of tests/test_upstream_models.py's gpt_oss TP check, under
torchrun (gloo): ``tp_experts.py OUT.json``.

gpt_oss debugmodel is built as upstream's Trainer builds it for TP 2 and
given the weights of a one-device model; both run a forward and a backward
of the same scalar. Rank 0 writes, for layer 0's routed experts: how far the
TP ranks' summed partial outputs are from the one-device experts on the same
input (max abs difference / max abs value), and the ratio of the norms of
the output bias's gradient (TP / one device)."""

import contextlib
import json
import sys
from pathlib import Path

import torch

from torchtitan_npu.bootstrap import activate

activate()

import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor, distribute_tensor  # noqa: E402

from torchtitan_npu.compat import resolve_upstream  # noqa: E402
from torchtitan_npu.compat.era import Era  # noqa: E402
from torchtitan_npu.config import resolve  # noqa: E402
from torchtitan_npu.plan import config_registry as trainer_build  # noqa: E402
from torchtitan_npu.state_dict_adapters import upstream_models as um  # noqa: E402

SEQ, TP = 64, 2


def main(out: Path) -> None:
    from torchtitan.distributed.utils import set_spmd_backend

    dist.init_process_group("gloo")
    config = resolve(
        None,
        [
            "--model.name", "gpt_oss", "--model.flavor", "debugmodel",
            "--parallelism.tensor_parallel_degree", str(TP),
            "--parallelism.data_parallel_shard_degree", "1",
            "--training.seq_len", str(SEQ),
        ],
    )  # fmt: skip
    upstream = trainer_build.upstream_config(
        config, resolve_upstream().installed.version
    )
    dims = trainer_build.parallel_dims(upstream, TP)
    dims.build_mesh()
    trainer = trainer_build.build(
        upstream, dims, torch.device("cpu"), contextlib.nullcontext()
    )
    model = trainer.model_parts[0]

    set_spmd_backend("dtensor")  # one device, as the trainer sets it there
    torch.manual_seed(0)
    one_device = um.model_args("gpt_oss", "debugmodel", Era.CONFIG_REGISTRY).build()
    with torch.no_grad():
        one_device.init_weights(buffer_device=torch.device("cpu"))
        full = dict(one_device.named_parameters())
        for name, param in model.named_parameters():
            value = full[name].detach().to(param.dtype)
            if isinstance(param, DTensor):
                value = distribute_tensor(value, param.device_mesh, param.placements)
            param.copy_(value)

    seen: dict[str, tuple] = {}
    hidden: dict[int, torch.Tensor] = {}
    experts = model.layers["0"].moe.routed_experts.inner_experts

    def record(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        seen.setdefault("experts", (inputs[0].detach(), inputs[1], output.detach()))

    experts.register_forward_hook(record)
    for m in (model, one_device):
        key = id(m)
        m.norm.register_forward_hook(lambda _, i, o, key=key: hidden.update({key: o}))
    torch.manual_seed(1)
    tokens = torch.randint(0, 2000, (2, SEQ))
    positions = torch.arange(SEQ).expand_as(tokens)
    weights = torch.randn(2, SEQ, one_device.norm.weight.shape[0])

    def backward_of_the_scalar(m: torch.nn.Module) -> None:
        m(tokens, attention_masks=m.get_attention_masks(positions), positions=positions)
        h = hidden[id(m)]
        if h.shape[1] == SEQ:  # replicated: each rank's share of the sum
            (h * weights).sum().div(
                dist.get_world_size() if m is model else 1
            ).backward()
        else:  # sequence parallel: this rank's tokens
            (
                h * weights.narrow(1, dist.get_rank() * h.shape[1], h.shape[1])
            ).sum().backward()

    set_spmd_backend(upstream.parallelism.spmd_backend)
    with trainer.train_context():
        backward_of_the_scalar(model)
    set_spmd_backend("dtensor")
    backward_of_the_scalar(one_device)

    routed, counts, partial = seen["experts"]
    summed = partial.float().clone()
    dist.all_reduce(summed)
    reference = one_device.layers["0"].moe.routed_experts.inner_experts
    with torch.no_grad():
        want = reference(routed, counts).float()
    grad = experts.mlp2_bias_ED.grad
    grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
    if dist.get_rank() == 0:
        result = {
            "output_error": ((summed - want).abs().max() / want.abs().max()).item(),
            "bias_grad_ratio": (
                grad.norm() / reference.mlp2_bias_ED.grad.norm()
            ).item(),
        }
        out.write_text(json.dumps(result))
    dist.barrier()  # no rank tears gloo down while a peer still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
