"""Declarative, invertible key mappings between HF and native state dicts.

A model's mapping is a list of `Rule`s. Each rule pairs one HF key pattern
with one native key pattern and an invertible tensor transform. Patterns use
``{layer}`` and ``{expert}``; a rule whose HF pattern has ``{expert}`` and
whose native pattern does not stacks the per-expert HF tensors (in numeric
expert order) into one native tensor. A `Fused` rule's native pattern has
``{part}``: one HF tensor is its native parts concatenated (q, k, v -> qkv).
A dropped HF key family may end in ``{rest}`` (any suffix).

Planning works on tensor metadata only (`TensorInfo`), so a whole conversion
is checked -- every key consumed once, every target produced once, shapes and
dtypes -- before a byte is read or written; all problems are reported together
as one `ConversionError`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from torchtitan_npu.compat.era import Era
from torchtitan_npu.errors import ConversionError

# Placeholder -> what it matches (``{part}``: a `Fused` rule's part names).
PLACEHOLDERS = {"layer": r"\d+", "expert": r"\d+", "rest": r".+"}

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


def reshaped(hf_dims: tuple[int, ...]) -> Transform:
    """Native (rows, prod(hf_dims)) <-> HF (rows, *hf_dims): a Linear's weight
    and the Conv3d it stands for."""

    def hf_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
        return (shape[0], *hf_dims)

    def native_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
        return (shape[0], math.prod(shape[1:]))

    return Transform(
        f"reshaped{hf_dims}",
        lambda t: t.reshape(hf_shape(tuple(t.shape))),
        lambda t: t.reshape(native_shape(tuple(t.shape))),
        hf_shape,
        native_shape,
    )


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
class Fused:
    """One HF tensor is the native tensors named by `parts` (the values of
    the native pattern's ``{part}``) concatenated along `dim`, in order."""

    dim: int
    parts: tuple[str, ...]


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
    fused: Fused | None = None

    @property
    def stacked(self) -> bool:
        return "{expert}" in (self.hf or "") and "{expert}" not in (self.native or "")


def _compile(pattern: str, rule: Rule) -> re.Pattern:
    regex = re.escape(pattern)
    matches = dict(PLACEHOLDERS)
    if rule.fused is not None:
        matches["part"] = "|".join(re.escape(p) for p in rule.fused.parts)
    for name, match in matches.items():
        regex = regex.replace(re.escape("{" + name + "}"), f"(?P<{name}>{match})")
    return re.compile(regex + r"\Z")


def _natural(key: str):
    """Sort key: numbers compare numerically (expert 10 after expert 9)."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key)]


@dataclass(frozen=True)
class Group:
    """Native tensors and the HF tensors they correspond to: one and one, one
    and its experts (a stacked rule; `hf` in expert order), or the parts and
    their concatenation (a fused rule; `native` in part order)."""

    native: tuple[str, ...]
    hf: tuple[str, ...]
    rule: Rule
    native_infos: tuple[TensorInfo, ...]
    hf_infos: tuple[TensorInfo, ...]

    def to_native(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.rule.hf is None:  # native-only
            return [torch.zeros(i.shape, dtype=i.dtype) for i in self.native_infos]
        if self.rule.stacked:
            return [torch.stack(tensors)]
        if self.rule.fused is not None:
            dim = self.rule.fused.dim
            sizes = [i.shape[dim] for i in self.native_infos]
            return list(tensors[0].split(sizes, dim))
        return [self.rule.transform.from_hf(tensors[0])]

    def to_hf(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.rule.stacked:
            return list(tensors[0].unbind(0))
        if self.rule.fused is not None:
            return [torch.cat(tensors, self.rule.fused.dim)]
        return [self.rule.transform.to_hf(tensors[0])]

    @property
    def nbytes(self) -> int:
        infos = self.native_infos + self.hf_infos
        return sum(i.nbytes for i in infos)


@dataclass
class KeyMap:
    """A model's rules, compiled; plans conversions in both directions."""

    rules: list[Rule]
    _hf: list[tuple[re.Pattern, Rule]] = field(init=False)
    _native: list[tuple[re.Pattern, Rule]] = field(init=False)

    def __post_init__(self):
        self._hf = [(_compile(r.hf, r), r) for r in self.rules if r.hf]
        self._native = [(_compile(r.native, r), r) for r in self.rules if r.native]

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
        model's layout (missing / unexpected / shape / dtype are checked; a
        fused rule's part sizes come from it)."""
        problems: list[str] = []
        sources: dict[str, tuple[Rule, dict[int, str]]] = {}
        groups = []
        for key in sorted(hf, key=_natural):
            found = self.match_hf(key)
            if found is None:
                problems.append(f"unexpected HF key {key!r}: no rule maps it")
                continue
            rule, fields = found
            if rule.native is None:
                continue
            if rule.fused is not None:
                group = _split(rule, fields, key, hf[key], expected, problems)
                groups += [group] if group else []
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
        broken = set()  # reported already: not "missing" as well
        for native, (rule, experts) in sources.items():
            if rule.hf is None:
                assert expected is not None  # native-only rules come from it
                groups.append(Group((native,), (), rule, (expected[native],), ()))
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
            info = TensorInfo(shape, infos[0].dtype)
            groups.append(Group((native,), keys, rule, (info,), infos))
        owners: dict[str, str] = {}  # a fused part is no other rule's target
        for g in groups:
            for n in g.native:
                source = g.hf[0] if g.hf else "nothing"
                if n in owners:
                    problems.append(f"{n!r} mapped from {owners[n]!r} and {source!r}")
                owners[n] = source
        if expected is not None:
            got = {n: i for g in groups for n, i in zip(g.native, g.native_infos)}
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
        fused: dict[str, tuple[Rule, dict[str, str]]] = {}  # HF key -> its parts
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
            if rule.fused is not None:
                part = fields.pop("part")
                fused.setdefault(rule.hf.format(**fields), (rule, {}))[1][part] = key
                continue
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
            groups.append(Group((key,), keys, rule, (info,), infos))
        for hf_key, (rule, parts) in fused.items():
            group = _fuse(rule, hf_key, parts, native, problems)
            if group is None:
                continue
            if hf_key in produced:
                problems.append(f"{hf_key!r} produced by {produced[hf_key]!r} too")
            groups.append(group)
        if not groups and not problems:
            problems.append("no model tensors found")
        if problems:
            raise ConversionError("native tensors vs the HF mapping", problems)
        return groups


def _split(rule, fields, key, info, expected, problems) -> Group | None:
    """The group of a fused HF tensor: its parts' sizes from `expected`."""
    assert rule.fused is not None and rule.native is not None
    dim, names = rule.fused.dim, rule.fused.parts
    natives = tuple(rule.native.format(part=p, **fields) for p in names)
    if expected is None:
        problems.append(f"{key}: a fused tensor is split by the model's layout")
        return None
    missing = [n for n in natives if n not in expected]
    if missing:
        problems.append(f"{key}: the model has no {missing}")
        return None
    infos = tuple(TensorInfo(expected[n].shape, info.dtype) for n in natives)
    if _concatenated(infos, dim) != info.shape:
        problems.append(
            f"shape mismatch {key!r}: checkpoint {list(info.shape)}, model parts "
            f"{[list(i.shape) for i in infos]} concatenated on dim {dim}"
        )
        return None
    return Group(natives, (key,), rule, infos, (info,))


def _fuse(rule, hf_key, parts, native, problems) -> Group | None:
    """The group of native parts concatenated into `hf_key`."""
    assert rule.fused is not None
    missing = [p for p in rule.fused.parts if p not in parts]
    if missing:
        problems.append(f"{hf_key}: native parts {missing} missing")
        return None
    keys = tuple(parts[p] for p in rule.fused.parts)
    infos = tuple(native[k] for k in keys)
    shape = _concatenated(infos, rule.fused.dim)
    if shape is None:
        problems.append(
            f"{hf_key}: parts {list(keys)} differ beyond dim {rule.fused.dim}"
        )
        return None
    return Group(keys, (hf_key,), rule, infos, (TensorInfo(shape, infos[0].dtype),))


def _concatenated(infos, dim: int) -> tuple[int, ...] | None:
    """The shape of the parts concatenated on `dim` (None: they differ
    elsewhere)."""
    rest = {i.shape[:dim] + i.shape[dim + 1 :] for i in infos}
    if len(rest) != 1:
        return None
    shape = list(infos[0].shape)
    shape[dim] = sum(i.shape[dim] for i in infos)
    return tuple(shape)


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
    fields config.json may omit (a callable: the default given config.json),
    `type_defaults[model_type]` those that differ for one of the model types
    (both checked against transformers' config classes by the tests);
    `required` the fields it may not; each
    `neutral[field](value, config)` says the value changes nothing (a
    sub-config's field as ``text_config.field``, given the sub-config);
    `unties`: a tied checkpoint imports untied (upstream builds no tied head);
    `eras`: the eras whose upstream has the model; and
    ``native_args[era](config, problems)`` builds the upstream args / config,
    appending what it cannot map to `problems`.
    """

    name: str
    hf_architecture: str
    rules: Callable[[Era, Mapping], list[Rule]]
    hf_config: Callable[[Any, Era, Mapping[str, TensorInfo]], dict]
    model_types: tuple[str, ...] = ()
    hf_defaults: Mapping[str, Any] = field(default_factory=dict)
    type_defaults: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    required: tuple[str, ...] = ()
    neutral: Mapping[str, Callable[[Any, Mapping], bool]] = field(default_factory=dict)
    native_args: Mapping[Era, Callable[[Mapping, list[str]], Any]] = field(
        default_factory=dict
    )
    unties: bool = False
    eras: tuple[Era, ...] = tuple(Era)

    def defaults_of(self, model_type: Any) -> dict[str, Any]:
        """The HF config class's defaults for `model_type`'s omitted fields."""
        return {**self.hf_defaults, **self.type_defaults.get(model_type, {})}

    def keymap(self, era: Era, hf_config: Mapping) -> KeyMap:
        return KeyMap(self.rules(era, hf_config))
