"""Declarative, invertible key mappings between HF and native state dicts.

A model's mapping is a list of `Rule`s. Each rule pairs one HF key pattern
with one native key pattern and an invertible tensor transform. Patterns use
``{layer}`` and ``{expert}``; a rule whose HF pattern has ``{expert}`` and
whose native pattern does not stacks the per-expert HF tensors (in numeric
expert order) into one native tensor.

Planning works on tensor metadata only (`TensorInfo`), so a whole conversion
is checked -- every key consumed once, every target produced once, shapes and
dtypes -- before a byte is read or written; all problems are reported together
as one `ConversionError`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from torchtitan_npu.compat.era import Era
from torchtitan_npu.errors import ConversionError

PLACEHOLDERS = ("layer", "expert")

# Non-model state in a native (DCP) training checkpoint: ignored on export.
TRAINING_STATE_PREFIXES = ("optimizer.", "lr_scheduler.", "dataloader.", "train_state")


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorInfo:
        return cls(tuple(tensor.shape), tensor.dtype)

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def _unchanged(shape: tuple[int, ...]) -> tuple[int, ...]:
    return shape


@dataclass(frozen=True)
class Transform:
    """An invertible per-tensor transform; `hf_shape` / `native_shape` map a
    shape across it (the same shape unless the transform permutes dims)."""

    name: str
    to_hf: Callable[[torch.Tensor], torch.Tensor]
    from_hf: Callable[[torch.Tensor], torch.Tensor]
    hf_shape: Callable[[tuple[int, ...]], tuple[int, ...]] = _unchanged
    native_shape: Callable[[tuple[int, ...]], tuple[int, ...]] = _unchanged


IDENTITY = Transform("identity", lambda t: t, lambda t: t)


def swap_dims(a: int, b: int) -> Transform:
    """Dims `a` and `b` exchanged (a self-inverse view: DTensors keep their
    sharding of the other dims)."""

    def swap(shape: tuple[int, ...]) -> tuple[int, ...]:
        out = list(shape)
        out[a], out[b] = out[b], out[a]
        return tuple(out)

    def transpose(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(a, b)

    return Transform(f"swap_dims({a}, {b})", transpose, transpose, swap, swap)


def rope_permute(n_heads: int) -> Transform:
    """Native interleaved (complex) RoPE rows <-> HF half-split rows.

    Within each head, native rows pair (0,1), (2,3), ...; HF pairs row i with
    row i + head_dim/2. Works on weights and biases (any trailing dims).
    """

    def to_hf(t: torch.Tensor) -> torch.Tensor:
        rows, rest = t.shape[0], tuple(t.shape[1:])
        half = rows // n_heads // 2
        return t.view(n_heads, half, 2, *rest).transpose(1, 2).reshape(rows, *rest)

    def from_hf(t: torch.Tensor) -> torch.Tensor:
        rows, rest = t.shape[0], tuple(t.shape[1:])
        half = rows // n_heads // 2
        return t.view(n_heads, 2, half, *rest).transpose(1, 2).reshape(rows, *rest)

    return Transform(f"rope_permute(n_heads={n_heads})", to_hf, from_hf)


@dataclass(frozen=True)
class Rule:
    """One HF key pattern <-> one native key pattern.

    native=None drops the HF key on import (derived buffers such as
    ``rotary_emb.inv_freq``); hf=None is a native-only tensor with no HF
    counterpart (upstream's MoE ``expert_bias``): zeros on import, as
    upstream initialises it, and left out on export. tied_to names the HF key
    a tied weight is read from when the HF checkpoint omits it; on export a
    tied weight is omitted.
    """

    hf: str | None
    native: str | None
    transform: Transform = IDENTITY
    tied_to: str | None = None

    @property
    def stacked(self) -> bool:
        return "{expert}" in (self.hf or "") and "{expert}" not in (self.native or "")


def _compile(pattern: str) -> re.Pattern:
    regex = re.escape(pattern)
    for name in PLACEHOLDERS:
        regex = regex.replace(re.escape("{" + name + "}"), f"(?P<{name}>\\d+)")
    return re.compile(regex + r"\Z")


def _natural(key: str):
    """Sort key: numbers compare numerically (expert 10 after expert 9)."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key)]


@dataclass(frozen=True)
class Group:
    """One native tensor and the HF tensors it corresponds to.

    For a stacked rule `hf` lists one key per expert, in expert order.
    """

    native: str
    hf: tuple[str, ...]
    rule: Rule
    native_info: TensorInfo
    hf_infos: tuple[TensorInfo, ...]

    def to_native(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        if self.rule.hf is None:  # native-only
            return torch.zeros(self.native_info.shape, dtype=self.native_info.dtype)
        if self.rule.stacked:
            return torch.stack(tensors)
        return self.rule.transform.from_hf(tensors[0])

    def to_hf(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        if self.rule.stacked:
            return list(tensor.unbind(0))
        return [self.rule.transform.to_hf(tensor)]

    @property
    def nbytes(self) -> int:
        return self.native_info.nbytes + sum(i.nbytes for i in self.hf_infos)


@dataclass
class KeyMap:
    """A model's rules, compiled; plans conversions in both directions."""

    rules: list[Rule]
    _hf: list[tuple[re.Pattern, Rule]] = field(init=False)
    _native: list[tuple[re.Pattern, Rule]] = field(init=False)

    def __post_init__(self):
        self._hf = [(_compile(r.hf), r) for r in self.rules if r.hf]
        self._native = [(_compile(r.native), r) for r in self.rules if r.native]

    def match_hf(self, key: str) -> tuple[Rule, dict[str, str]] | None:
        return _match(self._hf, key)

    def match_native(self, key: str) -> tuple[Rule, dict[str, str]] | None:
        return _match(self._native, key)

    def plan_from_hf(
        self,
        hf: Mapping[str, TensorInfo],
        expected: Mapping[str, TensorInfo] | None = None,
    ) -> list[Group]:
        """Native groups from HF tensor metadata; `expected` is the native
        model's layout (missing / unexpected / shape / dtype are checked)."""
        problems: list[str] = []
        sources: dict[str, tuple[Rule, dict[int, str]]] = {}
        for key in sorted(hf, key=_natural):
            found = self.match_hf(key)
            if found is None:
                problems.append(f"unexpected HF key {key!r}: no rule maps it")
                continue
            rule, fields = found
            if rule.native is None:
                continue
            native = rule.native.format(**fields)
            expert = int(fields["expert"]) if rule.stacked else 0
            _, experts = sources.setdefault(native, (rule, {}))
            if expert in experts:  # two HF keys for one native tensor
                problems.append(
                    f"{native!r} mapped from {experts[expert]!r} and {key!r}"
                )
                continue
            experts[expert] = key
        for rule in self.rules:  # tied weights absent from the HF files
            if rule.tied_to is None or rule.native is None or rule.tied_to not in hf:
                continue
            native = rule.native.format()
            if native not in sources and (expected is None or native in expected):
                sources[native] = (rule, {0: rule.tied_to})
        for key in expected or {}:  # native-only tensors: no HF key maps to them
            found = self.match_native(key)
            if found is not None and found[0].hf is None:
                sources[key] = (found[0], {})
        groups = []
        broken = set()  # reported already: not "missing" as well
        for native, (rule, experts) in sources.items():
            if rule.hf is None:
                assert expected is not None  # native-only rules come from it
                groups.append(Group(native, (), rule, expected[native], ()))
                continue
            keys = tuple(experts[e] for e in sorted(experts))
            if rule.stacked and sorted(experts) != list(range(len(experts))):
                gaps = sorted(set(range(max(experts) + 1)) - set(experts))
                problems.append(f"{native}: HF experts {gaps} missing")
                broken.add(native)
                continue
            infos = tuple(hf[k] for k in keys)
            if len({i.shape for i in infos}) > 1 or len({i.dtype for i in infos}) > 1:
                problems.append(f"{native}: experts differ in shape or dtype")
                broken.add(native)
                continue
            shape = rule.transform.native_shape(infos[0].shape)
            shape = ((len(keys),) if rule.stacked else ()) + shape
            groups.append(
                Group(native, keys, rule, TensorInfo(shape, infos[0].dtype), infos)
            )
        if expected is not None:
            got = {g.native: g.native_info for g in groups}
            got |= {k: expected[k] for k in broken if k in expected}
            problems += compare_layouts(got, expected, "native")
        if problems:
            raise ConversionError(
                "HF tensors vs the model config.json describes", problems
            )
        return groups

    def plan_to_hf(
        self, native: Mapping[str, TensorInfo], *, tied: bool = False
    ) -> list[Group]:
        """HF groups from native tensor metadata (model keys only)."""
        problems: list[str] = []
        groups = []
        produced: dict[str, str] = {}
        for key in sorted(native, key=_natural):
            found = self.match_native(key)
            if found is None:
                if not key.startswith(TRAINING_STATE_PREFIXES):
                    problems.append(f"unexpected native key {key!r}: no rule maps it")
                continue
            rule, fields = found
            if (rule.tied_to is not None and tied) or rule.hf is None:
                continue
            info = native[key]
            if rule.stacked:
                keys = tuple(
                    rule.hf.format(expert=e, **fields) for e in range(info.shape[0])
                )
                infos = (TensorInfo(info.shape[1:], info.dtype),) * len(keys)
            else:
                keys = (rule.hf.format(**fields),)
                infos = (TensorInfo(rule.transform.hf_shape(info.shape), info.dtype),)
            for k in keys:
                if k in produced:
                    problems.append(f"{k!r} produced by {produced[k]!r} and {key!r}")
                produced[k] = key
            groups.append(Group(key, keys, rule, info, infos))
        if not groups and not problems:
            problems.append("no model tensors found")
        if problems:
            raise ConversionError("native tensors vs the HF mapping", problems)
        return groups


def _match(compiled, key):
    for regex, rule in compiled:
        m = regex.match(key)
        if m:
            return rule, m.groupdict()
    return None


def compare_layouts(
    got: Mapping[str, TensorInfo], want: Mapping[str, TensorInfo], side: str
) -> list[str]:
    """What differs between a checkpoint's tensors and a model's: missing and
    unexpected keys, shapes, and non-float tensors."""
    problems = [f"missing {side} key {k!r}" for k in want if k not in got]
    problems += [f"unexpected {side} key {k!r}" for k in got if k not in want]
    for k in got.keys() & want.keys():
        if got[k].shape != want[k].shape:
            problems.append(
                f"shape mismatch {k!r}: checkpoint {list(got[k].shape)}, "
                f"model {list(want[k].shape)}"
            )
        elif not got[k].dtype.is_floating_point:
            problems.append(f"dtype {k!r}: {got[k].dtype} is not a float type")
    return sorted(problems, key=_natural)


@dataclass(frozen=True)
class ModelAdapter:
    """How one model maps to HF: its rules and its config.json.

    rules(era, hf_config) -> the mapping for that era (hf_config gives the
    head counts transforms need); hf_config(args, era, layout) -> the HF
    config.json of an upstream model config/args and its native layout.

    The way back (``architecture.derive``): config.json's ``model_type`` is
    one of `model_types`; `hf_defaults` are the HF config class's values of
    fields config.json may omit (a callable: the default given config.json);
    `required` the fields it may not; each
    `neutral[field](value, config)` says the value changes nothing; and
    ``native_args[era](config, problems)`` builds the upstream args / config,
    appending what it cannot map to `problems`.
    """

    name: str
    hf_architecture: str
    rules: Callable[[Era, Mapping], list[Rule]]
    hf_config: Callable[[Any, Era, Mapping[str, TensorInfo]], dict]
    model_types: tuple[str, ...] = ()
    hf_defaults: Mapping[str, Any] = field(default_factory=dict)
    required: tuple[str, ...] = ()
    neutral: Mapping[str, Callable[[Any, Mapping], bool]] = field(default_factory=dict)
    native_args: Mapping[Era, Callable[[Mapping, list[str]], Any]] = field(
        default_factory=dict
    )

    def keymap(self, era: Era, hf_config: Mapping) -> KeyMap:
        return KeyMap(self.rules(era, hf_config))
