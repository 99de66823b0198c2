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
from torchtitan_npu.state_dict_adapters import architecture, get_adapter
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
        flavor, args = architecture.resolve(model, flavor, source.config, era)
    expected, tied = um.describe(model, args, era)
    native_config = adapter.hf_config(args, era, expected)
    native_config["tie_word_embeddings"] = tied
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
        _provenance(tmp, model, flavor, era, hf_dir, source.config)
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
    hf_config: str | Path | None = None,
    era: Era | None = None,
    args: Any = None,
    progress: bool = True,
) -> Result:
    """A DCP checkpoint (training or from-hf) -> HF safetensors + index +
    config.json that transformers' from_pretrained loads. A checkpoint of a
    flavor derived from config.json (``hf``) finds that config.json itself
    (from-hf's provenance, the training run's config) or takes `hf_config`."""
    era = era or current_era()
    adapter = get_adapter(model)
    source = NativeCheckpoint(checkpoint)
    model_keys = {
        k: v
        for k, v in source.layout.items()
        if not k.startswith(TRAINING_STATE_PREFIXES)
    }
    if tokenizer is not None:
        _tokenizer_files(Path(tokenizer))  # before anything is written
    source_config, derived = _source_config(Path(checkpoint), hf_config)
    if args is None:
        recorded = source_config if derived else None
        flavor, args = _flavor_for_native(model, flavor, model_keys, era, recorded)
    expected, tied = um.describe(model, args, era)
    problems = compare_layouts(model_keys, expected, "model")
    if problems:
        raise ConversionError(
            f"native checkpoint {checkpoint} vs {model} {flavor}", problems
        )
    config = _carried_fields(source_config)
    config.update(adapter.hf_config(args, era, expected))
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


def _flavor_for_native(model, flavor, layout, era, recorded):
    """(flavor, args) of a native checkpoint; `recorded` is the config.json of
    the HF architecture it was derived from, if any."""
    if flavor == architecture.HF_FLAVOR or (flavor is None and recorded):
        if recorded is None:
            raise ConversionError(
                f"--flavor {flavor}",
                ["the checkpoint records no HF config.json; pass --hf-config HF_DIR"],
            )
        return architecture.HF_FLAVOR, architecture.derive(model, recorded, era)
    if flavor is not None:
        return flavor, um.model_args(model, flavor, era)
    closest: tuple[int, str, list[str]] | None = None
    for name, args in um.flavors(model, era).items():
        problems = compare_layouts(layout, um.native_layout(model, args, era), "model")
        if not problems:
            return name, args
        if closest is None or len(problems) < closest[0]:
            closest = (len(problems), name, problems)
    hint = (
        "pass --flavor, or --hf-config HF_DIR for a checkpoint of an architecture "
        "derived from config.json"
    )
    if closest is None:
        raise ConversionError(f"{model} checkpoint", [f"no {model} flavors; {hint}"])
    _, name, problems = closest
    raise ConversionError(
        f"{model} checkpoint: no flavor has these tensors; the closest, {name}, "
        f"differs in",
        [*problems, hint],
    )


def _source_config(checkpoint: Path, hf_config) -> tuple[dict | None, bool]:
    """(config.json the checkpoint came from, whether its architecture was
    derived from it): --hf-config, the provenance from-hf wrote, or the run it
    was trained by (``titan_npu_config.json`` of a run above it)."""
    if hf_config is not None:
        return architecture.read_config(hf_config), True
    if (checkpoint / PROVENANCE).is_file():
        record = _read_json_file(checkpoint / PROVENANCE)
        return record.get("hf_config"), record.get("flavor") == architecture.HF_FLAVOR
    for parent in list(checkpoint.resolve().parents)[:3]:
        run = parent / "titan_npu_config.json"
        if run.is_file():
            settings = _read_json_file(run).get("model", {})
            if settings.get("flavor") == architecture.HF_FLAVOR:
                return architecture.read_config(settings["hf_assets_path"]), True
            break
    return None, False


def _read_json_file(path: Path) -> dict:
    try:
        found = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"{path}", [f"unreadable ({e})"]) from e
    return found if isinstance(found, dict) else {}


def _carried_fields(source: dict | None) -> dict:
    """The source config.json's fields that describe no computation (token ids,
    position limit), kept in an export of a model derived from it."""
    if source is None:
        return {}
    skip = {"architectures", "model_type", "torch_dtype", "dtype"}
    skip.add("transformers_version")
    return {
        k: v for k, v in source.items() if k in architecture.INERT and k not in skip
    }


def _tokenizer_files(src: Path) -> list[Path]:
    found = [src / f for f in TOKENIZER_FILES if (src / f).is_file()]
    if not found:
        where = "is not a directory" if not src.is_dir() else "has no tokenizer files"
        raise ConversionError(
            f"--tokenizer {src}", [f"{where} (looked for {', '.join(TOKENIZER_FILES)})"]
        )
    return found


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for f in _tokenizer_files(src):
        shutil.copy2(f, dst / f.name)


def _provenance(out: Path, model, flavor, era, source, hf_config=None) -> None:
    record = {"model": model, "flavor": flavor, "era": era, "source": str(source)}
    if hf_config is not None:
        record["hf_config"] = hf_config
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
