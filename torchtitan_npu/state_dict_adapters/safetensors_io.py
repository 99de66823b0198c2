"""HF checkpoint directories: validated reading and streamed sharded writing.

Reading validates every header (and the index) before any tensor is read.
Writing streams: each shard's header is written from the plan, then tensors
are appended one by one, so memory holds one tensor group at a time.
"""

from __future__ import annotations

import json
import mmap
import re
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from torchtitan_npu.errors import UsageError
from torchtitan_npu.state_dict_adapters import direct_io
from torchtitan_npu.state_dict_adapters.mapping import ConversionError, TensorInfo

INDEX = "model.safetensors.index.json"
CONFIG = "config.json"

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class HFCheckpoint:
    """A HF model directory: config.json + safetensors (+ index when sharded)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        problems: list[str] = []
        if not self.path.is_dir():
            why = "not a directory" if self.path.exists() else "does not exist"
            raise ConversionError(f"HF checkpoint {self.path}", [why])
        self.config = _read_json(self.path / CONFIG, problems, required=False)
        files = sorted(self.path.glob("*.safetensors"))
        index = _read_json(self.path / INDEX, problems, required=False)
        weight_map: dict = {}
        if index is not None:
            listed_map = index.get("weight_map") if isinstance(index, dict) else None
            if isinstance(listed_map, dict):
                weight_map = listed_map
            else:
                problems.append(f"{INDEX}: no 'weight_map' object")
            listed = sorted(set(weight_map.values()))
            missing = [f for f in listed if not (self.path / f).is_file()]
            problems += [f"{INDEX} names {f!r}, which does not exist" for f in missing]
            files = [self.path / f for f in listed if f not in missing]
        elif not files:
            problems.append("no *.safetensors files")
        self.files: dict[str, Path] = {}
        self.infos: dict[str, TensorInfo] = {}
        for file in files:
            try:
                with safe_open(file, framework="pt") as handle:
                    for key in handle.keys():
                        s = handle.get_slice(key)
                        dtype = DTYPES.get(s.get_dtype())
                        if dtype is None:
                            problems.append(
                                f"{file.name}: {key}: dtype {s.get_dtype()}"
                            )
                            continue
                        if key in self.files:
                            first = self.files[key].name
                            problems.append(f"{key!r} in both {first} and {file.name}")
                        self.files[key] = file
                        self.infos[key] = TensorInfo(tuple(s.get_shape()), dtype)
            except (SafetensorError, OSError) as e:
                problems.append(f"{file.name}: unreadable safetensors ({e})")
        if index is not None:
            for key, name in weight_map.items():
                if key in self.files and self.files[key].name != name:
                    problems.append(f"{INDEX}: {key!r} is in {self.files[key].name}")
                elif key not in self.files and (self.path / name).is_file():
                    problems.append(f"{INDEX}: {key!r} is not in {name}")
            problems += [
                f"{k!r} is not in {INDEX}" for k in self.files if k not in weight_map
            ]
        if problems:
            raise ConversionError(f"HF checkpoint {self.path}", problems)
        self._headers: dict[Path, tuple[int, dict]] = {}

    def read(self, key: str) -> torch.Tensor:
        """One tensor, zero-copy: a private mapping of just its bytes, unmapped
        when the tensor is freed (so RSS holds only live tensors)."""
        file = self.files[key]
        if file not in self._headers:
            self._headers[file] = _header(file)
        base, header = self._headers[file]
        begin, end = header[key]["data_offsets"]
        info = self.infos[key]
        if end == begin:
            return torch.empty(info.shape, dtype=info.dtype)
        start = base + begin
        aligned = start - start % mmap.ALLOCATIONGRANULARITY
        with open(file, "rb") as f:
            mapped = mmap.mmap(
                f.fileno(), start - aligned + end - begin, offset=aligned,
                access=mmap.ACCESS_COPY,
            )  # fmt: skip
        data = torch.frombuffer(
            mapped, dtype=torch.uint8, count=end - begin, offset=start - aligned
        )
        return data.view(info.dtype).reshape(info.shape)

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.infos.values())


def _header(file: Path) -> tuple[int, dict]:
    """(data start offset, header) of a safetensors file (validated at open)."""
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return 8 + size, json.loads(f.read(size))


def _read_json(path: Path, problems: list[str], *, required: bool):
    if not path.exists():
        if required:
            problems.append(f"{path.name} missing")
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        problems.append(f"{path.name}: not valid JSON ({e})")
        return None


def parse_size(text: str) -> int:
    """'5GB' -> 5 * 10**9 (also KB/MB/GiB/MiB/bytes), like HF's max_shard_size."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise UsageError(f"bad size {text!r}; use e.g. 5GB, 500MB, 2GiB")
    number, unit = float(m.group(1)), (m.group(2) or "B").upper()
    power = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[0]]
    base = 1024 if "I" in unit else 1000
    return int(number * base**power)


class ShardedWriter:
    """Writes planned tensors, in plan order, into size-capped shards."""

    def __init__(self, out: Path, plan: list[tuple[str, TensorInfo]], max_shard: int):
        self.out = out
        shards: list[list[tuple[str, TensorInfo]]] = [[]]
        size = 0
        for key, info in plan:
            if shards[-1] and size + info.nbytes > max_shard:
                shards.append([])
                size = 0
            shards[-1].append((key, info))
            size += info.nbytes
        n = len(shards)
        self.names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self.shards = shards
        self.plan = [(k, i, s) for s, entries in enumerate(shards) for k, i in entries]
        self._next = 0
        self._files = direct_io.Writer()
        self._file: direct_io.DirectFile | None = None
        self._shard = -1

    def write(self, key: str, tensor: torch.Tensor) -> None:
        planned, info, shard = self.plan[self._next]
        if key != planned or TensorInfo.of(tensor) != info:
            raise AssertionError(f"write order/shape: got {key}, planned {planned}")
        if shard != self._shard:
            self._open(shard)
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        assert self._file is not None  # _open above
        # pyrefly: ignore[bad-argument-type]  # numpy arrays are buffers
        self._file.write(memoryview(data.numpy()))
        self._next += 1

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(self, kind, *_) -> None:
        """Finish the shards and the index; on an error, write nothing more."""
        self.close() if kind is None else self._files.abort()

    def close(self) -> None:
        if self._next != len(self.plan):
            raise AssertionError(
                f"{len(self.plan) - self._next} planned tensors unwritten"
            )
        if self._file:
            self._file.close()
        self._files.finish()
        weight_map = {k: self.names[s] for k, _, s in self.plan}
        total = sum(i.nbytes for _, i, _ in self.plan)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (self.out / INDEX).write_text(json.dumps(index, indent=2) + "\n")

    def _open(self, shard: int) -> None:
        if self._file:
            self._file.close()
        self._shard = shard
        self._file = self._files.create(self.out / self.names[shard])
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for key, info in self.shards[shard]:
            header[key] = {
                "dtype": DTYPE_NAMES[info.dtype],
                "shape": list(info.shape),
                "data_offsets": [offset, offset + info.nbytes],
            }
            offset += info.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._file.write(struct.pack("<Q", len(raw)) + raw)
