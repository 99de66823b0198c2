"""Quantized HF checkpoints: block-wise FP8 (DeepSeek-V3's release format)
and MXFP4 experts (gpt-oss's).

config.json's ``quantization_config`` says ``quant_method: fp8`` with
``weight_block_size [b0, b1]``; a ``float8_e4m3fn`` weight ``W_q`` comes with
a float32 ``<name>_scale_inv`` ``S`` of shape ``(ceil(rows/b0), ceil(cols/b1))``
and stands for ``W[i, j] = W_q[i, j] * S[i // b0, j // b1]``.

``Dequantized`` presents such a checkpoint as plain float tensors (the scales
consumed), dequantizing each tensor when it is read, so an import streams as
any other. ``quantize`` is the way back for ``to-hf --dtype fp8-like-source``:
with the source's own scales, a weight that did not change since the import
gets its original FP8 bytes back.

MXFP4 (``quant_method: mxfp4``): a weight ``W`` is stored as ``W_blocks``
(uint8 ``[experts, rows, groups, 16]``: two FP4 e2m1 codes per byte, low
nibble first, 32 per group) and ``W_scales`` (uint8 ``[experts, rows,
groups]``: a power of two, exponent biased by 127). ``DequantizedMXFP4``
presents them as ``W`` in the unquantized HF layout (``[experts, cols,
rows]``, as transformers' dequantizer gives it); every value is exact in any
float type. Exports are unquantized.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from torchtitan_npu.errors import ConversionError
from torchtitan_npu.state_dict_adapters.mapping import TensorInfo

SCALE_SUFFIX = "_scale_inv"
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
_FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(FP8).to(torch.float32)
# An unchanged weight re-read from bf16 may exceed its block's old range by
# bf16's rounding; such a block keeps its old scale (and is clamped).
_RANGE_SLACK = 1 + 2**-7


@dataclass(frozen=True)
class BlockFP8:
    """The block-wise FP8 scheme of one checkpoint."""

    block: tuple[int, int]
    config: Mapping[str, Any]  # config.json's quantization_config, as it was

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        rows, cols = shape
        return (-(-rows // self.block[0]), -(-cols // self.block[1]))


@dataclass(frozen=True)
class MXFP4:
    """The MXFP4 scheme of one checkpoint (no parameters)."""

    config: Mapping[str, Any]


def scheme(hf_config: Mapping[str, Any] | None) -> BlockFP8 | MXFP4 | None:
    """The quantization of a config.json: None, block-wise FP8, MXFP4, or
    refused."""
    quantization = (hf_config or {}).get("quantization_config")
    if quantization is None:
        return None
    what = "config.json quantization_config"
    method = quantization.get("quant_method")
    if method == "mxfp4":
        return MXFP4(dict(quantization))
    if method != "fp8":
        raise ConversionError(
            what,
            [
                f"quant_method {method!r} is not supported (supported: 'fp8', "
                "block-wise, as DeepSeek-V3 publishes, and 'mxfp4', as gpt-oss "
                "does); dequantize it first"
            ],
        )
    problems = []
    fmt = quantization.get("fmt", "e4m3")
    if fmt != "e4m3":
        problems.append(f"fmt {fmt!r} is not supported (supported: 'e4m3')")
    block = quantization.get("weight_block_size")
    if not (
        isinstance(block, list | tuple)
        and len(block) == 2
        and all(isinstance(b, int) and b > 0 for b in block)
    ):
        problems.append(f"weight_block_size {block!r}: expected two positive ints")
    if problems:
        raise ConversionError(what, problems)
    return BlockFP8((block[0], block[1]), dict(quantization))


def dequantize(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    dtype: torch.dtype,
) -> torch.Tensor:
    """W_q * S, one scale per block, in `dtype` (float32 products, rounded
    once). By table: every block's 256 possible products are computed once,
    each element is then one lookup at (its block, its code) -- exactly the
    elementwise product, 3x faster than widening and multiplying. A few
    block-rows at a time, so the int32 indices stay small."""
    rows, cols = weight.shape
    b0, b1 = block
    grid_cols = scale_inv.shape[1]
    products = scale_inv.to(torch.float32).reshape(-1, 1) * _FP8_VALUES
    table = products.to(dtype).reshape(-1)  # [block][code]
    column_block = (torch.arange(cols, dtype=torch.int32) // b1) * 256
    codes = weight.view(torch.uint8)
    out = torch.empty(rows, cols, dtype=dtype)
    step = max(1, (8 << 20) // (b0 * cols * 4)) * b0  # ~8 MB of int32
    for start in range(0, rows, step):
        chunk = codes[start : start + step]
        row = torch.arange(start, start + chunk.shape[0], dtype=torch.int32)
        index = chunk.to(torch.int32).add_(column_block)
        index.add_(((row // b0) * (grid_cols * 256)).unsqueeze(1))
        torch.index_select(
            table, 0, index.view(-1), out=out[start : start + step].view(-1)
        )
    return out


def quantize(
    weight: torch.Tensor,
    block: tuple[int, int],
    reference: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_q, S) of a 2-D weight: S = block amax / 448, or the `reference`
    scale of each block whose values it still covers."""
    rows, cols = weight.shape
    b0, b1 = block
    grid = (-(-rows // b0), -(-cols // b1))
    padded = torch.zeros(grid[0] * b0, grid[1] * b1, dtype=torch.float32)
    padded[:rows, :cols] = weight.to(torch.float32)
    amax = padded.view(grid[0], b0, grid[1], b1).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    if reference is not None:
        reference = reference.to(torch.float32)
        covered = amax <= reference * FP8_MAX * _RANGE_SLACK
        scale = torch.where(covered, reference, scale)
    full = scale.repeat_interleave(b0, 0)[:rows].repeat_interleave(b1, 1)[:, :cols]
    values = (weight.to(torch.float32) / full).clamp(-FP8_MAX, FP8_MAX)
    return values.to(FP8), scale


class Dequantized:
    """An HF checkpoint's tensors with FP8 weights read as `dtype` floats.

    Same interface as ``HFCheckpoint`` (``infos``, ``read``, ``config``).
    Every problem (a weight without its scale, a scale without its weight, a
    scale of the wrong shape) is reported at once, before anything is read.
    """

    def __init__(self, source: Any, quantization: BlockFP8, dtype: torch.dtype):
        self.source, self.scheme, self.dtype = source, quantization, dtype
        self.config = source.config
        self.quantized: set[str] = set()
        self.infos: dict[str, TensorInfo] = {}
        problems = []
        for key, info in source.infos.items():
            if key.endswith(SCALE_SUFFIX):
                if key.removesuffix(SCALE_SUFFIX) not in source.infos:
                    problems.append(f"{key!r} scales no weight")
                continue
            if info.dtype != FP8:
                self.infos[key] = info
                continue
            scale = source.infos.get(key + SCALE_SUFFIX)
            if scale is None:
                problems.append(f"FP8 weight {key!r} has no {key + SCALE_SUFFIX!r}")
                continue
            want = (
                quantization.scale_shape(info.shape) if len(info.shape) == 2 else None
            )
            if want is None or scale.shape != want:
                problems.append(
                    f"{key + SCALE_SUFFIX!r} has shape {list(scale.shape)}, the "
                    f"{quantization.block} blocks of {list(info.shape)} need "
                    f"{list(want) if want else 'a 2-D weight'}"
                )
                continue
            self.quantized.add(key)
            self.infos[key] = TensorInfo(info.shape, dtype)
        if problems:
            raise ConversionError(f"FP8 checkpoint {source.path}", problems)

    def read(self, key: str) -> torch.Tensor:
        tensor = self.source.read(key)
        if key not in self.quantized:
            return tensor
        scale = self.source.read(key + SCALE_SUFFIX)
        return dequantize(tensor, scale, self.scheme.block, self.dtype)

    @property
    def nbytes(self) -> int:
        return self.source.nbytes


def dequantizing(source: Any, dtype: torch.dtype) -> Any:
    """`source` with its quantized weights read as `dtype` floats (itself if
    config.json declares no quantization)."""
    found = scheme(source.config)
    if found is None:
        return source
    if isinstance(found, MXFP4):
        return DequantizedMXFP4(source, dtype)
    return Dequantized(source, found, dtype)


BLOCKS, SCALES = "_blocks", "_scales"
# FP4 e2m1 codes 0..15: a sign bit, then 2 exponent bits and 1 mantissa bit.
_FP4_VALUES = torch.tensor(
    [
        0.0,
        0.5,
        1.0,
        1.5,
        2.0,
        3.0,
        4.0,
        6.0,
        -0.0,
        -0.5,
        -1.0,
        -1.5,
        -2.0,
        -3.0,
        -4.0,
        -6.0,
    ]
)
_MXFP4_EXPONENT_BIAS = 127


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``[E, rows, groups, 16]`` codes and ``[E, rows, groups]`` exponents ->
    ``[E, groups * 32, rows]`` in `dtype`, one expert at a time (float32
    intermediates of one expert only)."""
    experts, rows, groups, width = blocks.shape
    out = torch.empty(experts, groups * width * 2, rows, dtype=dtype)
    for e in range(experts):
        codes = blocks[e].to(torch.int64)
        pairs = torch.stack((codes & 0x0F, codes >> 4), dim=-1)  # low nibble first
        values = _FP4_VALUES[pairs].reshape(rows, groups, width * 2)
        exponent = scales[e].to(torch.int32) - _MXFP4_EXPONENT_BIAS
        values = torch.ldexp(values, exponent.unsqueeze(-1))
        out[e] = values.reshape(rows, groups * width * 2).T
    return out


class DequantizedMXFP4:
    """An HF checkpoint's tensors with MXFP4 ``W_blocks`` / ``W_scales`` pairs
    read as one `dtype` ``W``. Same interface as ``HFCheckpoint``; every
    unpaired or misshapen pair is reported at once, before anything is read."""

    def __init__(self, source: Any, dtype: torch.dtype):
        self.source, self.dtype, self.config = source, dtype, source.config
        self.quantized: set[str] = set()
        self.infos: dict[str, TensorInfo] = {}
        problems = []
        for key, info in source.infos.items():
            if key.endswith(SCALES):
                if key.removesuffix(SCALES) + BLOCKS not in source.infos:
                    problems.append(f"{key!r} scales no {BLOCKS} weight")
                continue
            if not key.endswith(BLOCKS):
                self.infos[key] = info
                continue
            name = key.removesuffix(BLOCKS)
            scale = source.infos.get(name + SCALES)
            if scale is None:
                problems.append(f"MXFP4 weight {key!r} has no {name + SCALES!r}")
                continue
            if (
                len(info.shape) != 4
                or info.dtype != torch.uint8
                or scale.shape != info.shape[:-1]
                or scale.dtype != torch.uint8
            ):
                problems.append(
                    f"{key!r} {list(info.shape)} {info.dtype} with scales "
                    f"{list(scale.shape)} {scale.dtype}: expected uint8 blocks "
                    "[experts, rows, groups, 16], uint8 scales [experts, rows, groups]"
                )
                continue
            experts, rows, groups, width = info.shape
            self.quantized.add(name)
            self.infos[name] = TensorInfo((experts, groups * width * 2, rows), dtype)
        if problems:
            raise ConversionError(f"MXFP4 checkpoint {source.path}", problems)

    def read(self, key: str) -> torch.Tensor:
        if key not in self.quantized:
            return self.source.read(key)
        blocks = self.source.read(key + BLOCKS)
        return dequantize_mxfp4(blocks, self.source.read(key + SCALES), self.dtype)

    @property
    def nbytes(self) -> int:
        return self.source.nbytes


def key_patterns(keys: Iterable[str]) -> list[str]:
    """HF keys with their numbers abstracted (``model.layers.{n}.mlp...``): a
    short record of which keys a checkpoint quantized."""
    return sorted({re.sub(r"\.\d+\.", ".{n}.", k) for k in keys})


def matches(key: str, patterns: Iterable[str]) -> bool:
    return re.sub(r"\.\d+\.", ".{n}.", key) in set(patterns)
