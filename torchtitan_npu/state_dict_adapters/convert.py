"""Offline conversion: `titan-npu convert from-hf | to-hf`.

Both directions plan on metadata first (all problems reported at once), then
stream one tensor group at a time into a temporary directory that is renamed
into place only when complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchtitan_npu import interrupts
from torchtitan_npu.compat.era import Era
from torchtitan_npu.errors import Interrupted, UsageError
from torchtitan_npu.state_dict_adapters import architecture, get_adapter, quantization
from torchtitan_npu.state_dict_adapters import upstream_models as um
from torchtitan_npu.state_dict_adapters.mapping import (
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
RUN_CONFIG = "titan_npu_config.json"  # written by `titan-npu train`
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
    skip_mtp: bool = False,
    era: Era | None = None,
    args: Any = None,
    progress: bool = True,
) -> Result:
    """HF safetensors -> a DCP checkpoint `titan-npu train` starts from
    (``--checkpoint.initial_load_path OUT``). Without a flavor, the registered
    flavor config.json describes, else one derived from it (``hf``). FP8
    weights are dequantized to `dtype` (default: the checkpoint's
    ``torch_dtype``); `skip_mtp` leaves out multi-token-prediction layers."""
    era = era or current_era()
    adapter = get_adapter(model)
    source: Any = HFCheckpoint(hf_dir)
    if source.config is None:
        raise ConversionError(f"HF checkpoint {hf_dir}", ["config.json missing"])
    hf_config = dict(source.config)
    source = quantization.dequantizing(source, dtype or _stored_dtype(hf_config))
    infos = source.infos
    if skip_mtp and hf_config.get("num_nextn_predict_layers"):
        infos = _without_mtp(infos, hf_config)
        hf_config["num_nextn_predict_layers"] = 0
    if args is None:
        flavor, args = architecture.resolve(model, flavor, hf_config, era)
    expected, tied = um.describe(model, args, era)
    native_config = adapter.hf_config(args, era, expected)
    native_config["tie_word_embeddings"] = tied
    keymap = adapter.keymap(era, native_config)
    groups = {n: g for g in keymap.plan_from_hf(infos, expected) for n in g.native}
    layout = {
        k: TensorInfo(i.shape, dtype or i.dtype)
        for k, g in groups.items()
        for n, i in zip(g.native, g.native_infos)
        if n == k
    }
    bar = Progress("from-hf", sum(i.nbytes for i in layout.values()), progress)
    made: dict[str, torch.Tensor] = {}  # the other parts of a fused HF tensor

    def make(key: str) -> torch.Tensor:
        if key not in made:
            g = groups[key]
            made.update(zip(g.native, g.to_native([source.read(k) for k in g.hf])))
        tensor = made.pop(key).to(layout[key].dtype)
        bar.advance(tensor.nbytes)
        return tensor

    record: dict[str, Any] = {"hf_config": hf_config}  # as imported (--skip-mtp)
    if isinstance(source, quantization.Dequantized):
        record["fp8_weights"] = quantization.key_patterns(source.quantized)
    start = time.perf_counter()
    with atomic_dir(out) as tmp, bar:
        write_native(tmp, layout, make)
        _provenance(tmp, model, flavor, era, hf_dir, **record)
    nbytes = sum(i.nbytes for i in layout.values())
    return Result(Path(out), flavor, len(layout), nbytes, time.perf_counter() - start)


def model_of(hf_dir: str | Path) -> str:
    """The titan-npu model that reads hf_dir/config.json's model_type."""
    config = architecture.read_config(hf_dir)
    model = architecture.model_for(config)
    if model is None:
        raise ConversionError(
            f"HF checkpoint {hf_dir}",
            [
                f"config.json model_type {config.get('model_type')!r} is no model "
                "titan-npu converts; pass --model if it is one under another name"
            ],
        )
    return model


def _stored_dtype(hf_config: dict) -> torch.dtype:
    """The dtype a checkpoint keeps its unquantized tensors in (config.json)."""
    name = hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16"
    found = getattr(torch, str(name), None)
    return found if isinstance(found, torch.dtype) else torch.bfloat16


def _without_mtp(infos: dict, hf_config: dict) -> dict:
    """The HF tensors minus those of the MTP layers (layers >= N)."""
    n_main = hf_config["num_hidden_layers"]
    kept = {}
    for key, info in infos.items():
        m = re.match(r"model\.layers\.(\d+)\.", key)
        if m is None or int(m.group(1)) < n_main:
            kept[key] = info
    print(
        f"titan-npu convert: --skip-mtp: left out {len(infos) - len(kept)} tensors "
        f"of {hf_config['num_nextn_predict_layers']} MTP layer(s)",
        file=sys.stderr,
    )
    return kept


def to_hf(
    checkpoint: str | Path,
    out: str | Path,
    model: str,
    flavor: str | None = None,
    *,
    dtype: torch.dtype | None = None,
    fp8_like_source: bool = False,
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
    (from-hf's provenance, the training run's config) or takes `hf_config`
    (a config.json or the source HF directory). `fp8_like_source` writes the
    source's block-wise FP8 (its own scales where it is still there)."""
    limit = (
        parse_size(max_shard_size)
        if isinstance(max_shard_size, str)
        else max_shard_size
    )
    if limit <= 0:
        raise UsageError(
            f"--max-shard-size {max_shard_size}: a shard holds at least one "
            "tensor; give a positive size such as 5GB"
        )
    era = era or current_era()
    adapter = get_adapter(model)
    source = NativeCheckpoint(checkpoint)
    model_keys = source.model_layout
    if tokenizer is not None:
        _tokenizer_files(Path(tokenizer))  # before anything is written
    origin = _origin(Path(checkpoint), hf_config)
    if args is None:
        recorded = origin.config if origin.derived else None
        flavor, args = _flavor_for_native(model, flavor, model_keys, era, recorded)
    expected, tied = um.describe(model, args, era)
    problems = compare_layouts(model_keys, expected, "model")
    if problems:
        raise ConversionError(
            f"native checkpoint {checkpoint} vs {model} {flavor}", problems
        )
    config = _carried_fields(origin.config)
    config.update(adapter.hf_config(args, era, expected))
    config["tie_word_embeddings"] = tied
    groups = adapter.keymap(era, config).plan_to_hf(model_keys, tied=tied)
    first = next(iter(model_keys.values()))
    out_dtype = dtype or first.dtype
    config["torch_dtype"] = str(out_dtype).removeprefix("torch.")
    fp8 = origin.fp8_export() if fp8_like_source else None
    if fp8 is not None:
        config["quantization_config"] = fp8.scheme.config
    plan = []
    for g in groups:
        for k, i in zip(g.hf, g.hf_infos):
            if fp8 is not None and fp8.covers(k, i):
                plan += fp8.planned(k, i)
            else:
                kept = out_dtype if i.dtype.is_floating_point else i.dtype
                plan.append((k, TensorInfo(i.shape, kept)))
    total = sum(i.nbytes for _, i in plan)
    bar = Progress("to-hf", total, progress)
    start = time.perf_counter()
    with atomic_dir(out) as tmp, bar:
        with ShardedWriter(tmp, plan, limit) as writer:
            for g in groups:
                tensors = [source.read(n) for n in g.native]
                for key, part in zip(g.hf, g.to_hf(tensors)):
                    if fp8 is not None and fp8.covers(key, TensorInfo.of(part)):
                        for name, stored in fp8.quantized(key, part):
                            writer.write(name, stored)
                            bar.advance(stored.nbytes)
                        continue
                    part = part.to(out_dtype) if part.is_floating_point() else part
                    writer.write(key, part)
                    bar.advance(part.nbytes)
                del tensors, part  # before the next read: RSS holds one group
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        if tokenizer is not None:
            _copy_tokenizer(Path(tokenizer), tmp)
        _provenance(tmp, model, flavor, era, checkpoint)
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


@dataclass
class _Origin:
    """The HF checkpoint a native checkpoint came from, as far as it is known:
    its config.json, whether the architecture was derived from it, its
    directory, and which of its weights were FP8."""

    config: dict | None = None
    derived: bool = False
    directory: Path | None = None
    fp8_weights: list[str] | None = None

    def fp8_export(self) -> _FP8Export:
        scheme = quantization.scheme(self.config)
        if isinstance(scheme, quantization.MXFP4):
            raise ConversionError(
                "--dtype fp8-like-source",
                ["the source is MXFP4, which export does not write; use --dtype bf16"],
            )
        if scheme is None:
            raise ConversionError(
                "--dtype fp8-like-source",
                [
                    "the checkpoint's source is no FP8 checkpoint, or unknown; "
                    "pass --hf-config SOURCE_DIR"
                ],
            )
        reference = None
        if self.directory is not None and self.directory.is_dir():
            try:
                reference = HFCheckpoint(self.directory)
            except ConversionError:
                reference = None  # changed since the import: fresh scales
        patterns = self.fp8_weights
        if patterns is None and reference is not None:
            fp8 = [k for k, i in reference.infos.items() if i.dtype == quantization.FP8]
            patterns = quantization.key_patterns(fp8)
        if not patterns:
            raise ConversionError(
                "--dtype fp8-like-source",
                ["which weights the source kept in FP8 is unknown; pass --hf-config"],
            )
        return _FP8Export(scheme, set(patterns), reference)


@dataclass
class _FP8Export:
    """Writes the source's FP8 weights, with its own scales where available."""

    scheme: quantization.BlockFP8
    patterns: set[str]
    reference: HFCheckpoint | None

    def covers(self, key: str, info: TensorInfo) -> bool:
        return len(info.shape) == 2 and quantization.matches(key, self.patterns)

    def planned(self, key: str, info: TensorInfo) -> list[tuple[str, TensorInfo]]:
        scale = TensorInfo(self.scheme.scale_shape(info.shape), torch.float32)
        return [
            (key, TensorInfo(info.shape, quantization.FP8)),
            (key + quantization.SCALE_SUFFIX, scale),
        ]

    def quantized(self, key: str, weight: torch.Tensor) -> list[tuple[str, Any]]:
        scale_key = key + quantization.SCALE_SUFFIX
        old = None
        if self.reference is not None and scale_key in self.reference.infos:
            old = self.reference.read(scale_key)
        values, scale = quantization.quantize(weight, self.scheme.block, old)
        return [(key, values), (scale_key, scale)]


def _origin(checkpoint: Path, hf_config) -> _Origin:
    """Where a native checkpoint came from: --hf-config (a config.json or the
    source directory), the provenance from-hf wrote, or the run it was
    trained by (``titan_npu_config.json`` of a run above it)."""
    if hf_config is not None:
        path = Path(hf_config)
        return _Origin(
            architecture.read_config(path), True, path if path.is_dir() else None
        )
    if (checkpoint / PROVENANCE).is_file():
        record = read_json_file(checkpoint / PROVENANCE)
        return _Origin(
            record.get("hf_config"),
            record.get("flavor") == architecture.HF_FLAVOR,
            Path(record["source"]) if record.get("source") else None,
            record.get("fp8_weights"),
        )
    run = run_config(checkpoint)
    settings = run[1].get("model", {}) if run else {}
    if settings.get("flavor") == architecture.HF_FLAVOR:
        directory = Path(settings["hf_assets_path"])
        return _Origin(architecture.read_config(directory), True, directory)
    return _Origin()


def recorded_model(path: Path) -> tuple[str | None, str | None, str, dict]:
    """(model, flavor, where that was read, the run's config) from from-hf's
    provenance or the config of the training run the checkpoint is in."""
    if (path / PROVENANCE).is_file():
        record = read_json_file(path / PROVENANCE)
        return record.get("model"), record.get("flavor"), PROVENANCE, {}
    run = run_config(path)
    if run is None:
        return None, None, "not recorded", {}
    where, config = run
    settings = config.get("model", {})
    return settings.get("name"), settings.get("flavor"), str(where), config


def run_config(checkpoint: Path) -> tuple[Path, dict] | None:
    """(path, contents) of the config of the training run a checkpoint is in
    (``DUMP_FOLDER/checkpoint/step-N``), if it is in one."""
    for parent in list(checkpoint.resolve().parents)[:3]:
        if (parent / RUN_CONFIG).is_file():
            return parent / RUN_CONFIG, read_json_file(parent / RUN_CONFIG)
    return None


def read_json_file(path: Path) -> dict:
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


def _provenance(out: Path, model, flavor, era, source, **more) -> None:
    record = {"model": model, "flavor": flavor, "era": era, "source": str(source)}
    record.update(more)
    (out / PROVENANCE).write_text(json.dumps(record, indent=2) + "\n")


def check_out(out: str | Path) -> Path:
    """OUT, refused if it exists with anything in it."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConversionError(f"output {out}", ["exists and is not empty"])
    return out


@contextlib.contextmanager
def atomic_dir(out: str | Path) -> Iterator[Path]:
    """A temp dir beside `out`, renamed to `out` only on success. Ctrl-C or
    SIGTERM stop at the next tensor (``Interrupted``) and leave nothing; temp
    dirs of killed runs (SIGKILL) are removed here."""
    out = check_out(out)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove_abandoned(out)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as e:
        where = e.filename or out.parent
        raise ConversionError(
            f"output {out}", [f"cannot create {where}: {e.strerror}"]
        ) from None
    try:
        with _stop_on_signals():
            yield tmp
            if out.exists():
                out.rmdir()
            tmp.rename(out)
    except BaseException:  # DCP wraps errors in a BaseException
        if _STOP.signum is not None:  # whatever the writer made of it
            raise Interrupted(_STOP.signum, f"writing {out}") from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _remove_abandoned(out: Path) -> None:
    """Remove temp dirs of conversions into `out` whose process is gone; a
    live one is another conversion writing `out`."""
    for partial in out.parent.glob(f".{out.name}.partial-*"):
        pid = partial.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(partial, ignore_errors=True)
            continue
        except PermissionError:
            pass  # alive, another user's
        raise ConversionError(
            f"output {out}", [f"another conversion (pid {pid}) is writing it"]
        )


class _Stop:
    signum: int | None = None


_STOP = _Stop()


def _stop_on_signals() -> contextlib.AbstractContextManager[None]:
    """SIGINT / SIGTERM: stop at the next tensor (``check_stop``); a second
    one stops at once."""

    def handler(signum, frame):
        if _STOP.signum is not None:
            raise Interrupted(signum, "conversion")
        _STOP.signum = signum

    _STOP.signum = None
    return interrupts.handled(handler)


def check_stop() -> None:
    """Raise ``Interrupted`` if a signal arrived (called between tensors)."""
    if _STOP.signum is not None:
        raise Interrupted(_STOP.signum, "conversion")


class Progress:
    """Progress on stderr (bytes, GB/s) for a ``with`` block: on a terminal one
    line redrawn twice a second, into a file or pipe a line every 30 s; the
    last line at the end, or the open line ended when the block fails."""

    def __init__(self, label: str, total: int, enabled: bool):
        self.label, self.total, self.enabled = label, max(total, 1), enabled
        self.done_bytes, self.start, self.shown = 0, time.perf_counter(), 0.0
        self.redraw = sys.stderr.isatty()
        self.interval = 0.5 if self.redraw else 30.0

    def advance(self, nbytes: int) -> None:
        check_stop()
        self.done_bytes += nbytes
        now = time.perf_counter()
        if self.enabled and now - max(self.shown, self.start) > self.interval:
            self.shown = now
            self._print()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if not self.enabled:
            return
        if kind is None:
            self._print()
            if self.redraw:
                sys.stderr.write("\n")
        elif self.shown and self.redraw:
            sys.stderr.write("\n")  # the error's line is its own

    def _print(self) -> None:
        seconds = max(time.perf_counter() - self.start, 1e-9)
        frac = self.done_bytes / self.total
        bar = "#" * int(30 * frac)
        start, end = ("\r", "") if self.redraw else ("", "\n")
        sys.stderr.write(
            f"{start}{self.label} [{bar:<30}] {frac:6.1%} "
            f"{self.done_bytes / 1e9:.2f}/{self.total / 1e9:.2f} GB "
            f"{self.done_bytes / 1e9 / seconds:.2f} GB/s{end}"
        )
        sys.stderr.flush()


__all__ = ["DTYPE_ARGS", "DTYPE_NAMES", "Result", "atomic_dir", "from_hf", "to_hf"]
