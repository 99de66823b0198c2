"""FSDP over an embedding on 2 ranks, one forward and backward under PyTorch's
memory tracker: ``reduce_scatter_memory.py fake`` plans it (fake tensors, the
fake process group, collectives as gloo has them), under torchrun
``reduce_scatter_memory.py real`` runs it on gloo. Rank 0 prints the peak's
parts (bytes) as JSON."""

import contextlib
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import fully_shard

from torchtitan_npu.plan.collectives import collectives_for

VOCAB, DIM = 32768, 64


def main(mode: str) -> None:
    tensors: contextlib.AbstractContextManager = contextlib.nullcontext()
    if mode == "fake":
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
        tensors = FakeTensorMode(allow_non_fake_inputs=True)
    else:
        dist.init_process_group("gloo")
    with torch.device("meta"):
        model = torch.nn.Sequential(
            torch.nn.Embedding(VOCAB, DIM), torch.nn.Linear(DIM, 8)
        )
    fully_shard(model[0])
    fully_shard(model)
    with tensors:
        model.to_empty(device="cpu")
        for p in model.parameters():
            torch.nn.init.normal_(p)
        tokens = torch.randint(0, VOCAB, (2, 64))
        memory = MemTracker()
        memory.track_external(model)
        with memory, collectives_for("cpu"):
            model(tokens).sum().backward()
    peak = next(iter(memory.get_tracker_snapshot("peak").values()))
    if dist.get_rank() == 0:
        print(json.dumps({str(k): v for k, v in peak.items()}))
    dist.barrier()  # no rank tears gloo down while a peer still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
