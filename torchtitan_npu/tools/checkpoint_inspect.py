"""``titan-npu checkpoint inspect DIR``: what a native (DCP) checkpoint holds.

Read from its metadata (and the few bytes of its step and data-position
records), never its tensors: era (from the native names), model and flavor
(from-hf's provenance or the training run's config), step, the layout it was
saved under (ranks that wrote it, how its tensors are split), tensor counts
and bytes, and which training state is in it.
"""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass, field
from pathlib import Path

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torchtitan_npu.compat.era import Era
from torchtitan_npu.state_dict_adapters import native_era
from torchtitan_npu.state_dict_adapters.convert import recorded_model
from torchtitan_npu.state_dict_adapters.mapping import TensorInfo
from torchtitan_npu.state_dict_adapters.native_io import NativeCheckpoint

_WRITER = re.compile(r"__(\d+)_")  # DCP data files: __RANK_N.distcp
_PARALLEL = {
    "data_parallel_replicate_degree": "dp_replicate",
    "data_parallel_shard_degree": "dp_shard",
    "tensor_parallel_degree": "tp",
    "pipeline_parallel_degree": "pp",
    "context_parallel_degree": "cp",
    "expert_parallel_degree": "ep",
}


@dataclass
class Part:
    tensors: int = 0
    nbytes: int = 0
    dtypes: collections.Counter = field(default_factory=collections.Counter)

    def add(self, info: TensorInfo) -> None:
        self.tensors += 1
        self.nbytes += info.nbytes
        self.dtypes[str(info.dtype).removeprefix("torch.")] += info.nbytes


@dataclass
class CheckpointInfo:
    path: Path
    era: Era | None
    model: str | None
    flavor: str | None
    origin: str  # where model/flavor were read from
    step: int | None
    tokens_seen: int | None
    writers: int
    splits: collections.Counter  # how model tensors are cut: "dim 0 x2" -> count
    model_part: Part
    optimizer: Part
    lr_scheduler: bool
    dataloader_ranks: int
    dp_degree: int | None
    run_layout: dict[str, int]


def inspect(path: str | Path) -> CheckpointInfo:
    checkpoint = NativeCheckpoint(path)  # refuses what is not a whole DCP
    metadata = checkpoint.metadata
    model_part, optimizer = Part(), Part()
    splits: collections.Counter = collections.Counter()
    for key, info in checkpoint.layout.items():
        if key in checkpoint.model_layout:
            model_part.add(info)
            stored = metadata.state_dict_metadata[key]
            assert isinstance(stored, TensorStorageMetadata)  # listed as a tensor
            splits[_split(stored)] += 1
        elif key.startswith("optimizer."):
            optimizer.add(info)
    objects = checkpoint.objects
    writers = {
        m.group(1)
        for where in metadata.storage_data.values()
        if (m := _WRITER.match(where.relative_path))
    }
    model, flavor, origin, run = recorded_model(checkpoint.path)
    return CheckpointInfo(
        path=checkpoint.path,
        era=native_era(checkpoint.model_layout),
        model=model,
        flavor=flavor,
        origin=origin,
        step=checkpoint.read_number("train_state.step"),
        tokens_seen=checkpoint.read_number("train_state.ntokens_seen"),
        writers=max(1, len(writers)),
        splits=splits,
        model_part=model_part,
        optimizer=optimizer,
        lr_scheduler=any(k.startswith("lr_scheduler.") for k in objects),
        dataloader_ranks=sum(k.startswith("dataloader.dp_rank_") for k in objects),
        dp_degree=checkpoint.read_number("dataloader.world_size"),
        run_layout={
            short: value
            for name, short in _PARALLEL.items()
            if isinstance(value := run.get("parallelism", {}).get(name), int)
            and value != 1
        },
    )


def _split(meta: TensorStorageMetadata) -> str:
    """How a tensor is cut into chunks: 'whole', 'dim 0 x2', 'dim 0 x2, dim 1 x2'."""
    cuts = [
        f"dim {d} x{n}"
        for d in range(len(meta.size))
        if (n := len({tuple(c.offsets)[d] for c in meta.chunks})) > 1
    ]
    return ", ".join(cuts) or "whole"


def report(info: CheckpointInfo) -> str:
    """The lines `titan-npu checkpoint inspect` prints."""
    from torchtitan_npu.compat.lock import read_lock

    era = "unknown (its names are common to every era)"
    if info.era is not None:
        versions = [e.version for e in read_lock() if e.era == info.era]
        era = f"{info.era.value} (torchtitan {', '.join(versions)})"
    model = "not recorded (pass --model to convert)"
    if info.model:
        model = f"{info.model} {info.flavor or '?'}  (from {info.origin})"
    step = "none (model weights only)" if info.step is None else str(info.step)
    if info.tokens_seen is not None:
        step += f", {info.tokens_seen:,} tokens seen per rank"
    layout = f"written by {info.writers} rank(s); model tensors: " + ", ".join(
        f"{n} {how}" for how, n in sorted(info.splits.items())
    )
    if info.run_layout:
        degrees = " ".join(
            f"{k}={'auto' if v == -1 else v}" for k, v in info.run_layout.items()
        )
        layout += f"; the run's config: {degrees}"
    state = [
        f"optimizer {_yes(info.optimizer.tensors)}",
        f"lr scheduler {_yes(info.lr_scheduler)}",
        f"dataloader {_yes(info.dataloader_ranks)}",
    ]
    if info.dataloader_ranks:
        dp = info.dp_degree if info.dp_degree is not None else "?"
        state[-1] += f" ({info.dataloader_ranks} dp rank(s) of {dp})"
    lines = [
        ("checkpoint", str(info.path)),
        ("era", era),
        ("model", model),
        ("step", step),
        ("layout", layout),
        ("model state", _part(info.model_part)),
        ("optimizer", _part(info.optimizer) if info.optimizer.tensors else "none"),
        ("state", ", ".join(state)),
    ]
    return "\n".join(f"{name:<12} {value}" for name, value in lines)


def _part(part: Part) -> str:
    dtypes = ", ".join(f"{d} {n / 2**20:.1f} MiB" for d, n in part.dtypes.most_common())
    return f"{part.tensors} tensors, {part.nbytes / 2**20:.1f} MiB ({dtypes})"


def _yes(value) -> str:
    return "yes" if value else "no"


def main(path: str) -> int:
    print(report(inspect(path)))
    return 0
