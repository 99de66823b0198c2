"""One rank of tests/test_upstream_models.py's 0.2.x MoE TP check, under
torchrun (gloo): ``tp_router.py OUT.json``.

gpt_oss debugmodel is built as upstream's Trainer builds it for TP 2 (0.2.2);
a one-device model gets its weights, and both run upstream's loss on the same
batch forward and backward. Rank 0 writes the largest difference between the
TP run's router gradients and the one device's, relative to their largest
value."""

import contextlib
import json
import sys
from pathlib import Path

import torch

from torchtitan_npu.bootstrap import activate

activate()

import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from torchtitan_npu.compat import resolve_upstream  # noqa: E402
from torchtitan_npu.compat.era import Era  # noqa: E402
from torchtitan_npu.config import resolve  # noqa: E402
from torchtitan_npu.plan import trainspec as trainer_build  # noqa: E402
from torchtitan_npu.state_dict_adapters import upstream_models as um  # noqa: E402

TP = 2


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    config = resolve(
        None,
        [
            "--model.name", "gpt_oss", "--model.flavor", "debugmodel",
            "--parallelism.tensor_parallel_degree", str(TP),
            "--parallelism.data_parallel_shard_degree", "1",
            "--training.seq_len", "64", "--training.local_batch_size", "2",
        ],
    )  # fmt: skip
    upstream = trainer_build.upstream_config(
        config, resolve_upstream().installed.version
    )
    dims = trainer_build.parallel_dims(upstream, TP)
    dims.build_mesh()
    torch.manual_seed(0)
    trainer = trainer_build.build(
        upstream, dims, torch.device("cpu"), contextlib.nullcontext()
    )
    model = trainer.model_parts[0]
    weights = {k: full(v).detach() for k, v in model.state_dict().items()}
    one_device = um.build_meta("gpt_oss", trainer.model_args, Era.TRAINSPEC)
    one_device.to_empty(device="cpu")
    with torch.no_grad():
        one_device.init_weights(buffer_device=None)  # RoPE's table
    one_device.load_state_dict(weights)

    torch.manual_seed(1)  # the same batch on both ranks
    inputs, labels = trainer_build.batch(trainer, 2)
    tokens = torch.tensor(labels.numel())  # the loss: a sum, over the tokens
    trainer_build.forward_backward(trainer, [inputs], [labels], tokens)
    batch, _, _, masks = trainer.post_dataloading_process(inputs, labels)
    (trainer.loss_fn(one_device(batch, **masks), labels) / tokens).backward()
    reference = dict(one_device.named_parameters())
    worst = 0.0
    for name, param in model.named_parameters():
        if ".router." in name:
            want = reference[name].grad
            error = (full(param.grad) - want).abs().max() / want.abs().max()
            worst = max(worst, error.item())
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"router_grad_error": worst}))
    dist.barrier()  # no rank tears gloo down while a peer still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
