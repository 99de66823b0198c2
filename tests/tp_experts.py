"""One rank of tests/test_upstream_models.py's gpt_oss TP check, under
torchrun (gloo): ``tp_experts.py OUT.json``.

gpt_oss debugmodel is built as upstream's Trainer builds it for TP 2 and
given the weights of a one-device model; one forward records layer 0's
routed experts (their input, token counts and this rank's partial output).
Rank 0 writes how far the TP ranks' summed partials are from the one-device
experts on the same input (max abs difference / max abs value)."""

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

SEQ = 64


def main(out: Path) -> None:
    from torchtitan.distributed.utils import set_spmd_backend

    dist.init_process_group("gloo")
    config = resolve(
        None,
        [
            "--model.name", "gpt_oss", "--model.flavor", "debugmodel",
            "--parallelism.tensor_parallel_degree", "2",
            "--parallelism.data_parallel_shard_degree", "1",
            "--training.seq_len", str(SEQ),
        ],
    )  # fmt: skip
    upstream = trainer_build.upstream_config(
        config, resolve_upstream().installed.version
    )
    dims = trainer_build.parallel_dims(upstream, 2)
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
    set_spmd_backend(upstream.parallelism.spmd_backend)

    seen = {}

    def record(module, inputs, output):
        seen.setdefault("experts", (inputs[0].detach(), inputs[1], output.detach()))

    experts = model.layers["0"].moe.routed_experts.inner_experts
    experts.register_forward_hook(record)
    torch.manual_seed(1)
    tokens = torch.randint(0, 2000, (2, SEQ))
    positions = torch.arange(SEQ).expand_as(tokens)
    with torch.no_grad(), trainer.train_context():
        masks = model.get_attention_masks(positions)
        model(tokens, attention_masks=masks, positions=positions)
    routed, counts, partial = seen["experts"]
    summed = partial.float().clone()
    dist.all_reduce(summed)
    set_spmd_backend("dtensor")
    reference = one_device.layers["0"].moe.routed_experts.inner_experts
    with torch.no_grad():
        want = reference(routed, counts).float()
    if dist.get_rank() == 0:
        error = ((summed - want).abs().max() / want.abs().max()).item()
        out.write_text(json.dumps({"relative_error": error}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
