"""Offline conversion: `titan-npu convert from-hf | to-hf`.

Both directions plan on metadata first (all problems reported at once), then
stream one tensor group at a time into a temporary directory that is renamed
into place only when complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchtitan_npu.compat.era import Era
from torchtitan_npu.state_dict_adapters import get_adapter
from torchtitan_npu.state_dict_adapters import upstream_models as um
from torchtitan_npu.state_dict_adapters.mapping import (
    TRAINING_STATE_PREFIXES,
    ConversionError,
    TensorInfo,
    compare_layouts,
)
from torchtitan_npu.state_dict_adapters.native_io import NativeCheckpoint, write_native
from torchtitan_npu.state_dict_adapters.safetensors_io import (
    CONFIG,
    DTYPE_NAMES,
    HFCheckpoint,
    ShardedWriter,
    parse_size,
)

DTYPE_ARGS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PROVENANCE = "titan_npu_convert.json"
# HF tokenizer / generation files copied by --tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)


@dataclass
class Result:
    out: Path
    flavor: str | None
    tensors: int
    nbytes: int
    seconds: float


def current_era() -> Era:
    from torchtitan_npu.compat import resolve_upstream

    return resolve_upstream().era


def from_hf(
    hf_dir: str | Path,
    out: str | Path,
    model: str,
    flavor: str | None = None,
    *,
    dtype: torch.dtype | None = None,
    era: Era | None = None,
    args: Any = None,
    progress: bool = True,
) -> Result:
    """HF safetensors -> a DCP checkpoint `titan-npu train` starts from
    (``--checkpoint.initial_load_path OUT``). Without a flavor the one whose
    HF config matches config.json is used."""
    era = era or current_era()
    adapter = get_adapter(model)
    source = HFCheckpoint(hf_dir)
    if source.config is None:
        raise ConversionError(f"HF checkpoint {hf_dir}", ["config.json missing"])
    if args is None:
        flavor, args = _flavor_for_hf(model, flavor, source.config, era)
    expected, tied = um.describe(model, args, era)
    native_config = adapter.hf_config(args, era, expected)
    native_config["tie_word_embeddings"] = tied
    mismatched = [
        f"config.json {k}={v!r}, {model} {flavor or ''} has {native_config[k]!r}"
        for k, v in _arch(source.config).items()
        if k in native_config and native_config[k] != v
    ]
    if mismatched:
        raise ConversionError(f"HF checkpoint {hf_dir}", mismatched)
    keymap = adapter.keymap(era, native_config)
    groups = {g.native: g for g in keymap.plan_from_hf(source.infos, expected)}
    layout = {
        k: TensorInfo(g.native_info.shape, dtype or g.native_info.dtype)
        for k, g in groups.items()
    }
    bar = Progress("from-hf", sum(i.nbytes for i in layout.values()), progress)

    def make(key: str) -> torch.Tensor:
        g = groups[key]
        tensor = g.to_native([source.read(k) for k in g.hf]).to(layout[key].dtype)
        bar.advance(tensor.nbytes)
        return tensor

    start = time.perf_counter()
    with atomic_dir(out) as tmp:
        write_native(tmp, layout, make)
        _provenance(tmp, model, flavor, era, hf_dir)
    bar.done()
    nbytes = sum(i.nbytes for i in layout.values())
    return Result(Path(out), flavor, len(layout), nbytes, time.perf_counter() - start)


def to_hf(
    checkpoint: str | Path,
    out: str | Path,
    model: str,
    flavor: str | None = None,
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: str | int = "5GB",
    tokenizer: str | Path | None = None,
    era: Era | None = None,
    args: Any = None,
    progress: bool = True,
) -> Result:
    """A DCP checkpoint (training or from-hf) -> HF safetensors + index +
    config.json that transformers' from_pretrained loads."""
    era = era or current_era()
    adapter = get_adapter(model)
    source = NativeCheckpoint(checkpoint)
    model_keys = {
        k: v
        for k, v in source.layout.items()
        if not k.startswith(TRAINING_STATE_PREFIXES)
    }
    if args is None:
        flavor, args = _flavor_for_native(model, flavor, model_keys, era)
    expected, tied = um.describe(model, args, era)
    problems = compare_layouts(model_keys, expected, "model")
    if problems:
        raise ConversionError(f"native checkpoint {checkpoint}", problems)
    config = adapter.hf_config(args, era, expected)
    config["tie_word_embeddings"] = tied
    groups = adapter.keymap(era, config).plan_to_hf(model_keys, tied=tied)
    first = next(iter(model_keys.values()))
    out_dtype = dtype or first.dtype
    config["torch_dtype"] = str(out_dtype).removeprefix("torch.")
    plan = [
        (k, TensorInfo(i.shape, out_dtype if i.dtype.is_floating_point else i.dtype))
        for g in groups
        for k, i in zip(g.hf, g.hf_infos)
    ]
    limit = (
        parse_size(max_shard_size)
        if isinstance(max_shard_size, str)
        else max_shard_size
    )
    total = sum(i.nbytes for _, i in plan)
    bar = Progress("to-hf", total, progress)
    start = time.perf_counter()
    with atomic_dir(out) as tmp:
        writer = ShardedWriter(tmp, plan, limit)
        for g in groups:
            tensor = source.read(g.native)
            for key, part in zip(g.hf, g.to_hf(tensor)):
                part = part.to(out_dtype) if part.is_floating_point() else part
                writer.write(key, part)
                bar.advance(part.nbytes)
            del tensor, part  # before the next read: RSS holds one group
        writer.close()
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        if tokenizer is not None:
            _copy_tokenizer(Path(tokenizer), tmp)
        _provenance(tmp, model, flavor, era, checkpoint)
    bar.done()
    return Result(Path(out), flavor, len(plan), total, time.perf_counter() - start)


def _flavor_for_hf(model, flavor, config, era):
    adapter = get_adapter(model)
    if flavor is not None:
        return flavor, um.model_args(model, flavor, era)
    arch = _arch(config)
    candidates = {}
    for name, args in um.flavors(model, era).items():
        layout = um.native_layout(model, args, era)
        if _arch(adapter.hf_config(args, era, layout)) == arch:
            candidates[name] = args
    if not candidates:
        raise ConversionError(
            f"{model} from config.json",
            [
                f"no {model} flavor has this architecture ({arch}); "
                "pass --flavor or register a flavor with these shapes"
            ],
        )
    name = next(iter(candidates))
    return name, candidates[name]


def _flavor_for_native(model, flavor, layout, era):
    if flavor is not None:
        return flavor, um.model_args(model, flavor, era)
    for name, args in um.flavors(model, era).items():
        if not compare_layouts(layout, um.native_layout(model, args, era), "model"):
            return name, args
    raise ConversionError(
        f"{model} checkpoint", ["no flavor has these tensor shapes; pass --flavor"]
    )


# config.json fields that decide the architecture (weights + numerics). Tying
# is not one: a tied HF checkpoint imports into an untied model exactly.
_ARCH_FIELDS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "n_routed_experts",
    "n_shared_experts",
    "q_lora_rank",
    "kv_lora_rank",
    "rope_theta",
)


def _arch(config: dict) -> dict:
    return {k: config.get(k) for k in _ARCH_FIELDS if config.get(k) is not None}


def _copy_tokenizer(src: Path, dst: Path) -> None:
    found = [src / f for f in TOKENIZER_FILES if (src / f).is_file()]
    if not found:
        raise ConversionError(f"--tokenizer {src}", ["no tokenizer files found"])
    for f in found:
        shutil.copy2(f, dst / f.name)


def _provenance(out: Path, model, flavor, era, source) -> None:
    record = {"model": model, "flavor": flavor, "era": era, "source": str(source)}
    (out / PROVENANCE).write_text(json.dumps(record, indent=2) + "\n")


@contextlib.contextmanager
def atomic_dir(out: str | Path) -> Iterator[Path]:
    """A temp dir beside `out`, renamed to `out` only on success."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConversionError(f"output {out}", ["exists and is not empty"])
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class Progress:
    """A one-line progress bar on stderr (bytes, GB/s)."""

    def __init__(self, label: str, total: int, enabled: bool):
        self.label, self.total, self.enabled = label, max(total, 1), enabled
        self.done_bytes, self.start, self.shown = 0, time.perf_counter(), 0.0

    def advance(self, nbytes: int) -> None:
        self.done_bytes += nbytes
        now = time.perf_counter()
        if self.enabled and now - self.shown > 0.5:
            self.shown = now
            self._print("\r")

    def done(self) -> None:
        if self.enabled:
            self._print("\r")
            sys.stderr.write("\n")

    def _print(self, prefix: str) -> None:
        seconds = max(time.perf_counter() - self.start, 1e-9)
        frac = self.done_bytes / self.total
        bar = "#" * int(30 * frac)
        sys.stderr.write(
            f"{prefix}{self.label} [{bar:<30}] {frac:6.1%} "
            f"{self.done_bytes / 1e9:.2f}/{self.total / 1e9:.2f} GB "
            f"{self.done_bytes / 1e9 / seconds:.2f} GB/s"
        )
        sys.stderr.flush()


__all__ = ["DTYPE_ARGS", "DTYPE_NAMES", "Result", "atomic_dir", "from_hf", "to_hf"]
