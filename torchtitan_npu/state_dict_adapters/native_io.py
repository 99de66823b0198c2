"""Native (DCP) checkpoints: layout, per-tensor reads, streamed writes.

The writer gives DCP a plan built from metadata only (meta tensors) and makes
each tensor when DCP asks for it, so a conversion never holds the model.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torchtitan_npu.state_dict_adapters.mapping import ConversionError, TensorInfo


def native_layout(path: str | Path) -> dict[str, TensorInfo]:
    """Every tensor a DCP checkpoint holds (model and training state)."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise ConversionError(
            f"native checkpoint {path}", ["no DCP .metadata (not a DCP checkpoint)"]
        )
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # a corrupt pickle raises anything
        raise ConversionError(f"native checkpoint {path}", [f".metadata: {e}"]) from e
    return {
        key: TensorInfo(tuple(m.size), m.properties.dtype)
        for key, m in metadata.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }


def read_native(path: str | Path, key: str, info: TensorInfo) -> torch.Tensor:
    tensor = torch.empty(info.shape, dtype=info.dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group": a single reader
        dcp.load({key: tensor}, storage_reader=FileSystemReader(str(path)))
    return tensor


class _StreamingPlanner(DefaultSavePlanner):
    def __init__(self, make: Callable[[str], torch.Tensor]):
        super().__init__()
        self._make = make

    def lookup_object(self, index):
        return self._make(index.fqn)


def write_native(
    path: Path, layout: dict[str, TensorInfo], make: Callable[[str], torch.Tensor]
) -> None:
    """A DCP checkpoint with `layout`'s tensors; make(key) builds each."""
    planned = {
        k: torch.empty(i.shape, dtype=i.dtype, device="meta") for k, i in layout.items()
    }
    writer = FileSystemWriter(str(path), single_file_per_rank=True, thread_count=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(planned, storage_writer=writer, planner=_StreamingPlanner(make))
