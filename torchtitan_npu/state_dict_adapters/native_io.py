"""Native (DCP) checkpoints: layout, per-tensor reads, streamed writes.

The writer gives DCP a plan built from metadata only (meta tensors) and makes
each tensor when DCP asks for it, so a conversion never holds the model.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import pickle
import struct
import warnings
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from torchtitan_npu.state_dict_adapters import direct_io
from torchtitan_npu.state_dict_adapters.mapping import (
    TRAINING_STATE_PREFIXES,
    ConversionError,
    TensorInfo,
)

# Written beside the DCP files by titan-npu's own writes (from-hf, migrate),
# whose records carry no zip CRC32: each tensor's CRC32, checked on read.
CHECKSUMS = "titan_npu_checksums.json"


def tensor_crc32(tensor: torch.Tensor) -> int:
    """CRC32 of a tensor's bytes (row-major)."""
    flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
    # pyrefly: ignore[bad-argument-type]  # numpy arrays are buffers
    return zlib.crc32(memoryview(flat.numpy()))


class NativeCheckpoint:
    """A DCP checkpoint read one tensor at a time (metadata read once)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not (self.path / ".metadata").is_file():
            raise ConversionError(f"native checkpoint {path}", [_why_not(self.path)])
        self._reader = _CachedMetadataReader(str(self.path))
        try:
            self.metadata = metadata = self._reader.read_metadata()
        except Exception as e:  # a corrupt pickle raises anything
            raise ConversionError(
                f"native checkpoint {path}", [f".metadata: {e}"]
            ) from e
        self.layout = {
            key: TensorInfo(tuple(m.size), m.properties.dtype)
            for key, m in metadata.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata)
        }
        self.model_layout = {
            k: i
            for k, i in self.layout.items()
            if not k.startswith(TRAINING_STATE_PREFIXES)
        }  # the model's own tensors (not optimizer, lr scheduler, dataloader)
        self.objects = [
            key
            for key, m in metadata.state_dict_metadata.items()
            if isinstance(m, BytesStorageMetadata)
        ]
        problems = _missing_data(self.path, metadata)
        if problems:
            raise ConversionError(f"native checkpoint {path}", problems)
        self.checksums = _read_checksums(self.path)

    def read(self, key: str) -> torch.Tensor:
        """One tensor: its records read straight into place when they are
        plain torch.save tensors (RSS: the tensor once), else via dcp.load."""
        info = self.layout[key]
        tensor = torch.empty(info.shape, dtype=info.dtype)
        try:
            self._read_records(key, tensor)
        except _Corrupt as e:
            what = f"native checkpoint {self.path}"
            raise ConversionError(what, [f"{key}: {e}"]) from None
        except _NotPlain:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "no process group": one reader
                dcp.load({key: tensor}, storage_reader=self._reader)
        expected = self.checksums.get(key)
        if expected is not None and tensor_crc32(tensor) != expected:
            raise ConversionError(
                f"native checkpoint {self.path}",
                [
                    f"{key}: its bytes fail the CRC32 recorded in {CHECKSUMS} "
                    "when it was written (a corrupted data file)"
                ],
            )
        return tensor

    def read_object(self, key: str) -> object:
        """One of `objects` (a step, a count, a hyper-parameter: its bytes are
        a torch.save'd object); ConversionError if it is not plain data."""
        where = self.metadata.storage_data[MetadataIndex(key)]
        with open(self.path / where.relative_path, "rb") as f:
            f.seek(where.offset)
            raw = f.read(where.length)
        try:
            return torch.load(io.BytesIO(raw), weights_only=True)
        except Exception as e:  # the restricted unpickler refuses anything else
            what = f"native checkpoint {self.path}"
            raise ConversionError(what, [f"{key}: not plain data ({e})"]) from None

    def read_number(self, key: str) -> int | None:
        """An integer record (a step, a count); None if there is none."""
        if key not in self.objects:
            return None
        value = self.read_object(key)
        return int(value) if isinstance(value, int | torch.Tensor) else None

    def _read_records(self, key: str, tensor: torch.Tensor) -> None:
        metadata = self._reader.read_metadata()
        flat = tensor.view(-1).view(torch.uint8)
        row = tensor[0].numel() if tensor.dim() else 1
        stored = metadata.state_dict_metadata[key]
        assert isinstance(stored, TensorStorageMetadata), key  # checked when listed
        for chunk in stored.chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            if tensor.dim() and (
                any(offsets[1:]) or sizes[1:] != tuple(tensor.shape[1:])
            ):
                raise _NotPlain  # not a contiguous run of rows
            start = (offsets[0] if offsets else 0) * row * tensor.element_size()
            nbytes = tensor.element_size()
            for d in sizes:
                nbytes *= d
            where = metadata.storage_data[MetadataIndex(key, torch.Size(offsets))]
            if where.transform_descriptors:
                raise _NotPlain
            _read_record(
                self.path / where.relative_path,
                where.offset,
                where.length,
                sizes,
                flat[start : start + nbytes],
            )


def _read_checksums(path: Path) -> dict[str, int]:
    """key -> CRC32 from the checksum file, {} where there is none."""
    file = path / CHECKSUMS
    if not file.is_file():
        return {}
    try:
        sums = json.loads(file.read_text())["crc32"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise ConversionError(
            f"native checkpoint {path}", [f"{CHECKSUMS}: {e}"]
        ) from None
    return {str(k): int(v) for k, v in sums.items()}


def _why_not(path: Path) -> str:
    """Why `path` (no .metadata) is no DCP checkpoint, and what it is instead."""
    if not path.exists():
        return "does not exist"
    if not path.is_dir():
        return "not a directory"
    if any(path.glob("*.safetensors")):
        return "an HF checkpoint (*.safetensors): titan-npu convert from-hf converts it"
    if any(path.glob("*.distcp")):
        return "data files but no .metadata: an unfinished save (killed while saving?)"
    return "no DCP .metadata (not a DCP checkpoint)"


def _missing_data(path: Path, metadata) -> list[str]:
    """Data files the metadata names that are missing or shorter than the
    records it places in them (a truncated or partial checkpoint)."""
    needed: dict[str, int] = {}
    for where in metadata.storage_data.values():
        end = where.offset + where.length
        needed[where.relative_path] = max(needed.get(where.relative_path, 0), end)
    problems = []
    for name, end in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            problems.append(f"data file {name} is missing")
        elif file.stat().st_size < end:
            problems.append(
                f"data file {name} is truncated ({file.stat().st_size} bytes, "
                f"its records need {end})"
            )
    return problems


class _Corrupt(Exception):
    """A record whose bytes do not match the checksum stored with them."""


class _NotPlain(Exception):
    """A DCP record the direct reader does not handle (dcp.load does)."""


def _read_record(path: Path, offset: int, length: int, sizes, out: torch.Tensor):
    """Read the data of a torch.save'd contiguous tensor stored at
    path[offset:offset+length] (a zip archive) into the uint8 tensor `out`."""
    with open(path, "rb") as f:
        try:
            archive = zipfile.ZipFile(_Slice(f, offset, length))
            prefix = archive.namelist()[0].split("/")[0] + "/"

            def member(name: str) -> bytes:  # no CRC check: ours are written without
                info = archive.getinfo(name)
                f.seek(_data_start(f, offset, info))
                return f.read(info.file_size)

            if member(prefix + "byteorder") != b"little":
                raise _NotPlain
            storage, storage_offset, size, stride = _TensorPickle(
                io.BytesIO(member(prefix + "data.pkl"))
            ).load()
            info = archive.getinfo(prefix + "data/" + storage)
        except (pickle.UnpicklingError, KeyError, zipfile.BadZipFile, TypeError) as e:
            raise _NotPlain from e
        contiguous = [1] * len(size)
        for i in range(len(size) - 2, -1, -1):
            contiguous[i] = contiguous[i + 1] * size[i + 1]
        if (
            storage_offset != 0
            or tuple(size) != tuple(sizes)
            or list(stride) != contiguous
            or info.compress_type != zipfile.ZIP_STORED
            or info.file_size != out.numel()
        ):
            raise _NotPlain
        f.seek(_data_start(f, offset, info))
        # pyrefly: ignore[bad-argument-type]  # numpy arrays are buffers
        data = memoryview(out.numpy())
        if f.readinto(data) != out.numel():
            raise _NotPlain
        # torch.save records a CRC32 per member (titan-npu's own conversions
        # write none, 0): a mismatch is a corrupted data file.
        if info.CRC and zlib.crc32(data) != info.CRC:
            raise _Corrupt(f"data file {path.name} fails its CRC32 check (corrupted)")


def _data_start(f, offset: int, info: zipfile.ZipInfo) -> int:
    """File position of a stored zip member's data (after its local header)."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise _NotPlain
    f.seek(offset + info.header_offset)
    header = f.read(30)
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return offset + info.header_offset + 30 + name_len + extra_len


class _Slice(io.RawIOBase):
    """A read-only, seekable window [offset, offset + length) of a file."""

    def __init__(self, f, offset: int, length: int):
        self._f, self._offset, self._length, self._pos = f, offset, length, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self._pos

    def seek(self, pos, whence=io.SEEK_SET):
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}
        self._pos = base[whence] + pos
        return self._pos

    def read(self, n=-1):
        n = self._length - self._pos if n is None or n < 0 else n
        n = max(0, min(n, self._length - self._pos))
        self._f.seek(self._offset + self._pos)
        data = self._f.read(n)
        self._pos += len(data)
        return data


class _TensorPickle(pickle.Unpickler):
    """Reads a torch.save data.pkl of one plain tensor without its data:
    -> (storage key, storage offset, size, stride). Anything else is refused."""

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *rest: (
                storage,
                offset,
                size,
                stride,
            )
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name.endswith("Storage"):
            return name
        raise pickle.UnpicklingError(f"not a plain tensor: {module}.{name}")

    def persistent_load(self, pid):
        return pid[2]  # ('storage', type, key, location, numel)


class _CachedMetadataReader(FileSystemReader):
    def read_metadata(self):
        if not hasattr(self, "_metadata"):
            self._metadata = super().read_metadata()
        return self._metadata


class _StreamingPlanner(DefaultSavePlanner):
    def __init__(self, make: Callable[[str], torch.Tensor], objects: dict):
        super().__init__()
        self._make, self._objects = make, objects

    def lookup_object(self, index):
        if index.fqn in self._objects:
            return self._objects[index.fqn]
        return self._make(index.fqn)


class _DirectFileSystem(FileSystem):
    def __init__(self, files: direct_io.Writer):
        self._files = files

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        stream = self._files.create(path)
        try:
            yield stream
        finally:
            stream.close()


class _DirectWriter(FileSystemWriter):
    """DCP's file writer, its files written past the page cache (direct_io)."""

    def __init__(self, files: direct_io.Writer, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fs = _DirectFileSystem(files)


def write_native(
    path: Path,
    layout: dict[str, TensorInfo],
    make: Callable[[str], torch.Tensor],
    objects: dict[str, object] | None = None,
) -> None:
    """A DCP checkpoint with `layout`'s tensors, make(key) building each, and
    `objects` (steps, hyper-parameters, data positions: saved as DCP saves
    non-tensor state)."""
    objects = objects or {}
    sums: dict[str, int] = {}

    def made(key: str) -> torch.Tensor:
        tensor = make(key)
        sums[key] = tensor_crc32(tensor)
        return tensor

    planned: dict[str, object] = {
        k: torch.empty(i.shape, dtype=i.dtype, device="meta") for k, i in layout.items()
    }
    planned.update(objects)
    # One file per tensor: DCP keeps every tensor of a file alive until the
    # file is closed, so one file per rank would hold the whole model.
    with direct_io.Writer() as files, warnings.catch_warnings(), _no_crc32():
        writer = _DirectWriter(
            files, str(path), single_file_per_rank=False, sync_files=False
        )
        warnings.simplefilter("ignore")
        dcp.save(
            planned, storage_writer=writer, planner=_StreamingPlanner(made, objects)
        )
    (path / CHECKSUMS).write_text(json.dumps({"crc32": sums}, sort_keys=True))


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
