"""Converters in the TrainSpec era (torchtitan 0.2.x).

Each converter becomes an upstream ``ModelConverter`` registered under its
name (overlay patch ``converters``), so ``model.converters = ["rms_norm"]``
in the job config applies it to the model upstream builds on the meta device,
before parallelization: the model's module instances get converted classes,
and a replaced function (RoPE) is swapped through its overlay record.
"""

import functools
from typing import Any

from torchtitan_npu.compat.era import Era
from torchtitan_npu.converters.quantization import check_runnable
from torchtitan_npu.converters.registry import (
    CONVERTERS,
    Converter,
    Replacement,
    check,
    parse_names,
    report,
    request,
    running_version,
    subclass,
    unknown,
)
from torchtitan_npu.overlay.registry import resolve_target

ERA = Era.TRAINSPEC


@functools.cache
def converted_class(
    cls: type, replacement: Replacement, converter_name: str, device_type: str
) -> type:
    """``cls``'s subclass that computes with the converter's device kernel."""
    name, attrs = subclass(cls, replacement, converter_name, device_type)
    return type(name, (cls,), attrs)


def apply_to_module(
    model: Any, converter: Converter, *, model_name: str, device_type: str
) -> int:
    """Convert a built model in place; returns how many modules now use it."""
    count = 0
    for replacement in converter.for_model(ERA, model_name, running_version()):
        target = resolve_target(replacement.target)
        if replacement.counted is not None:  # a function: count its users
            users = getattr(target.owner, replacement.counted)
            used = sum(type(m) is users for m in model.modules())
            if used:
                request(converter, replacement, device_type)
            count += used
            continue
        converted = converted_class(
            target.obj, replacement, converter.name, device_type
        )
        matching = [m for m in model.modules() if type(m) is target.obj]
        if matching:
            request(converter, replacement, device_type)
        for module in matching:
            module.__class__ = converted
        count += len(matching)
    report(converter, model_name, count)
    return count


def apply_named(
    model: Any, names: list[str], *, model_name: str, device_type: str
) -> tuple[Any, list[int]]:
    """Apply converters by name, in order; returns (model, counts)."""
    checked = check(names, era=ERA, model_name=model_name, version=running_version())
    counts = [
        apply_to_module(model, c, model_name=model_name, device_type=device_type)
        for c in checked
    ]
    return model, counts


def model_converter_class(converter: Converter, device_type: str) -> type:
    """``converter`` as a class of upstream's ModelConverter protocol."""

    class KernelConverter:
        def __init__(self, job_config, parallel_dims):
            self.model_name = job_config.model.name
            check(
                [converter.name],
                era=ERA,
                model_name=self.model_name,
                context_parallel=parallel_dims.cp_enabled,
                version=running_version(),
            )

        def convert(self, model) -> None:
            apply_to_module(
                model, converter, model_name=self.model_name, device_type=device_type
            )

        def post_optimizer_hook(self, model) -> None:
            pass

    KernelConverter.__qualname__ = KernelConverter.__name__ = f"{converter.name}"
    return KernelConverter


def model_converter_classes(device_type: str) -> dict[str, type]:
    return {
        name: model_converter_class(converter, device_type)
        for name, converter in CONVERTERS.items()
    }


def checked_names(
    flat: dict[str, Any],
    *,
    model_name: str,
    context_parallel: bool,
    version: str,
    device_type: str | None,
) -> list[str]:
    """The job config's converter list; titan-npu's names checked for the model.

    Upstream's own converters (``quantize.linear.float8``, ...) pass through
    by name, refused here when ``device_type`` cannot run them.
    """
    import torchtitan.components.quantization  # noqa: F401  (registers its names)

    # pyrefly: ignore[missing-module-attribute]  # 0.2.x only
    from torchtitan.protocols import model_converter

    names = parse_names(flat.get("model.converters"))
    ours = [n for n in names if n in CONVERTERS]
    upstream = set(model_converter._registry_model_converter_cls) - set(ours)
    for name in names:
        if name not in ours and name not in upstream:
            raise unknown(name, {*CONVERTERS, *upstream})
    if device_type is not None:
        check_runnable(names, flat, device_type)
    check(
        ours,
        era=ERA,
        model_name=model_name,
        context_parallel=context_parallel,
        version=version,
    )
    return names
