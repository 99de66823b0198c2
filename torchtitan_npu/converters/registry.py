"""The converter registry: named kernel swaps, each with per-era replacements.

A converter replaces, in a model, the module classes or functions an upstream
era implements an op with (``Replacement``), by versions that call its device
kernel (``kernels.Kernel``). Module classes are replaced by subclasses that
override the computing method only, so parameters, FQNs and checkpoints are
unchanged. Which models a converter supports is declared per era and checked.

Every replacement is also an overlay record (``records``): its target and the
upstream objects it relies on are fingerprinted in upstream.lock, shown by
doctor, and a process-wide change (a replaced function) is made and reverted
by the overlay. How a model is converted is the era's: ``converters/<era>.py``.
"""

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from torchtitan_npu.compat.era import Era
from torchtitan_npu.converters.kernels import Kernel
from torchtitan_npu.converters.quantization import suggestion
from torchtitan_npu.errors import ConverterError
from torchtitan_npu.overlay.registry import (
    Change,
    Patch,
    PatchContext,
    Target,
    in_releases,
    no_change,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Replacement:
    """What a converter replaces in one era.

    ``target`` is ``"module:qualname"`` of a module class or a function.
    ``build(kernel, original)`` returns, for a class, the attributes its
    subclass overrides; for a function, the replacement function, and then
    ``counted`` names the class (same module) whose instances call it, to
    count what was converted. ``depends`` names other upstream objects the
    replacement relies on (fingerprinted, never changed).
    """

    target: str
    models: tuple[str, ...]
    build: Callable[..., Any]
    counted: str | None = None
    depends: tuple[str, ...] = ()
    since: str | None = None  # the upstream releases it is for, as Patch's
    before: str | None = None

    def for_release(self, version: str | None) -> bool:
        return in_releases(version, self.since, self.before)

    @property
    def is_function(self) -> bool:
        return self.counted is not None


@dataclass(frozen=True)
class Converter:
    name: str
    description: str
    kernel: Kernel
    npu_ops: tuple[str, ...]
    native: str  # what the cuda/cpu implementation is
    replacements: dict[Era, tuple[Replacement, ...]]
    context_parallel: bool = True  # False: refuses context-parallel layouts
    notes: tuple[str, ...] = field(default=())

    def models(self, era: Era, version: str | None = None) -> tuple[str, ...]:
        """The models it converts in ``era`` (in upstream ``version`` if given)."""
        replacements = self.replacements.get(era, ())
        return tuple(
            sorted(
                {m for r in replacements if r.for_release(version) for m in r.models}
            )
        )

    def for_model(
        self, era: Era, model_name: str, version: str | None = None
    ) -> list[Replacement]:
        return [
            r
            for r in self.replacements.get(era, ())
            if model_name in r.models and r.for_release(version)
        ]

    def implementation(self, device_type: str) -> Any:
        return self.kernel.for_device(device_type)


CONVERTERS: dict[str, Converter] = {}


def register(converter: Converter) -> Converter:
    if converter.name in CONVERTERS:
        raise RuntimeError(f"converter {converter.name!r} is already registered")
    CONVERTERS[converter.name] = converter
    return converter


def parse_names(value: str | list[str] | None) -> list[str]:
    """``"a,b"`` (a command-line override) or ``["a", "b"]`` (TOML)."""
    if not value:
        return []
    if isinstance(value, str):
        return [n.strip() for n in value.split(",") if n.strip()]
    return list(value)


def unknown(name: str, known: Iterable[str]) -> ConverterError:
    """The error for a converter name no one registered."""
    return ConverterError(
        f"unknown converter {name!r}{suggestion(name)}; known converters: "
        f"{sorted(known)}"
    )


def get(name: str) -> Converter:
    if name not in CONVERTERS:
        raise unknown(name, CONVERTERS)
    return CONVERTERS[name]


def check(
    names: list[str],
    *,
    era: Era,
    model_name: str,
    context_parallel: bool = False,
    version: str | None = None,
) -> list[Converter]:
    """The named converters, after checking each supports this model and layout
    (in upstream ``version`` when given)."""
    converters = [get(name) for name in names]
    for converter in converters:
        supported = converter.models(era, version)
        if not supported:
            raise ConverterError(
                f"converter {converter.name!r} is not available in era {era}; "
                f"it exists for {sorted(converter.replacements)}"
            )
        if model_name not in supported:
            where = f"torchtitan {version}" if version else f"era {era}"
            raise ConverterError(
                f"converter {converter.name!r} does not support model "
                f"{model_name!r} in {where}; it supports {list(supported)}"
            )
        if context_parallel and not converter.context_parallel:
            raise ConverterError(
                f"converter {converter.name!r} does not support context parallelism"
            )
    return converters


# --- overlay records ---------------------------------------------------------------


def record_name(converter: Converter, target: str) -> str:
    return f"{converter.name}/{target.removeprefix('torchtitan.models.')}"


def _record_apply(converter: Converter, replacement: Replacement):
    def apply(target: Target, ctx: PatchContext) -> list[Change]:
        if not replacement.is_function:
            return []  # instances or config nodes are converted one by one
        kernel = converter.implementation(ctx.device_type)
        replaced = replacement.build(kernel, target.obj)
        return [Change(target.owner, target.attr, replaced)]

    return apply


_RECORD_REF = (
    "none upstream: a kernel converter, applied when model.converters names it"
)


def records(era: Era) -> list[Patch]:
    """The overlay records of every converter replacement of ``era``."""
    out: dict[str, Patch] = {}
    for converter in CONVERTERS.values():
        reason = f"converter {converter.name}: {converter.description}"
        for replacement in converter.replacements.get(era, ()):
            name = record_name(converter, replacement.target)
            out[name] = Patch(
                name=name,
                target=replacement.target,
                kind="convert",
                reason=reason,
                eras=(era,),
                upstream_ref=_RECORD_REF,
                remove_when=f"the {converter.name} converter is retired",
                apply=_record_apply(converter, replacement),
                on_request=True,
                since=replacement.since,
                before=replacement.before,
            )
            for depend in replacement.depends:
                name = record_name(converter, depend)
                out[name] = Patch(
                    name=name,
                    target=depend,
                    kind="depend",
                    reason=f"{reason} (read by the replacement of "
                    f"{replacement.target})",
                    eras=(era,),
                    upstream_ref=_RECORD_REF,
                    remove_when=f"the {converter.name} converter is retired",
                    apply=no_change,
                    since=replacement.since,
                    before=replacement.before,
                )
    return list(out.values())


def request(converter: Converter, replacement: Replacement, device_type: str) -> None:
    """Apply ``replacement``'s overlay record: refused unless the overlay is
    active and the record's targets were verified."""
    from torchtitan_npu.overlay import OVERLAY

    name = record_name(converter, replacement.target)
    OVERLAY.apply_on_request(name, device_type)


def running_version() -> str:
    """The upstream version the active overlay was applied for."""
    from torchtitan_npu.overlay import OVERLAY

    return OVERLAY.context.upstream_version


def subclass(
    cls: type, replacement: Replacement, converter_name: str, device_type: str
) -> tuple[str, dict[str, Any]]:
    """``cls``'s subclass name and attributes: the converter's overrides."""
    converter = CONVERTERS[converter_name]
    name = f"{cls.__name__}_{converter_name}"
    attrs = dict(replacement.build(converter.implementation(device_type), cls))
    attrs.update(__module__=__name__, __qualname__=name, converter=converter_name)
    return name, attrs


def report(converter: Converter, model_name: str, count: int) -> None:
    if count:
        logger.info(
            "converter %s: %d module(s) of %s", converter.name, count, model_name
        )
    else:
        logger.warning(
            "converter %s replaced nothing in model %s", converter.name, model_name
        )
