"""Native (DCP) checkpoints: layout, per-tensor reads, streamed writes.

The writer gives DCP a plan built from metadata only (meta tensors) and makes
each tensor when DCP asks for it, so a conversion never holds the model.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torchtitan_npu.state_dict_adapters.mapping import ConversionError, TensorInfo


class NativeCheckpoint:
    """A DCP checkpoint read one tensor at a time (metadata read once)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not (self.path / ".metadata").is_file():
            raise ConversionError(
                f"native checkpoint {path}", ["no DCP .metadata (not a DCP checkpoint)"]
            )
        self._reader = _CachedMetadataReader(str(self.path))
        try:
            metadata = self._reader.read_metadata()
        except Exception as e:  # a corrupt pickle raises anything
            raise ConversionError(
                f"native checkpoint {path}", [f".metadata: {e}"]
            ) from e
        self.layout = {
            key: TensorInfo(tuple(m.size), m.properties.dtype)
            for key, m in metadata.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata)
        }

    def read(self, key: str) -> torch.Tensor:
        info = self.layout[key]
        tensor = torch.empty(info.shape, dtype=info.dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "no process group": a single reader
            dcp.load({key: tensor}, storage_reader=self._reader)
        return tensor


class _CachedMetadataReader(FileSystemReader):
    def read_metadata(self):
        if not hasattr(self, "_metadata"):
            self._metadata = super().read_metadata()
        return self._metadata


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
    # One file per tensor: DCP keeps every tensor of a file alive until the
    # file is closed, so one file per rank would hold the whole model.
    writer = FileSystemWriter(str(path), single_file_per_rank=False, sync_files=False)
    with warnings.catch_warnings(), _no_crc32():
        warnings.simplefilter("ignore")
        dcp.save(planned, storage_writer=writer, planner=_StreamingPlanner(make))


@contextlib.contextmanager
def _no_crc32():
    """torch.save without zip CRC32s (documented switch; loads are unaffected):
    checksumming is most of the CPU cost of writing."""
    from torch.utils.serialization import config as serialization

    config = serialization.save
    old, config.compute_crc32 = config.compute_crc32, False
    try:
        yield
    finally:
        config.compute_crc32 = old
