"""Converters in the TrainSpec era (torchtitan 0.2.x).

Each converter becomes an upstream ``ModelConverter`` registered under its
name (overlay patch ``converters``), so ``model.converters = ["rms_norm"]``
in the job config applies it to the model upstream builds on the meta device,
before parallelization.
"""

from torchtitan_npu.converters.registry import (
    Converter,
    ConverterError,
    all_converters,
    apply_to_module,
    check,
    parse_names,
)

ERA = "trainspec"


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
            )

        def convert(self, model) -> None:
            apply_to_module(
                model,
                converter,
                era=ERA,
                model_name=self.model_name,
                device_type=device_type,
            )

        def post_optimizer_hook(self, model) -> None:
            pass

    KernelConverter.__qualname__ = KernelConverter.__name__ = f"{converter.name}"
    return KernelConverter


def model_converter_classes(device_type: str) -> dict[str, type]:
    return {
        name: model_converter_class(converter, device_type)
        for name, converter in all_converters().items()
    }


def checked_names(value, *, model_name: str, context_parallel: bool) -> list[str]:
    """The job config's converter list; titan-npu's names checked for the model.

    Upstream's own converters (float8, mx, ...) pass through by name.
    """
    import torchtitan.components.quantization  # noqa: F401  (registers its names)
    from torchtitan.protocols import model_converter

    names = parse_names(value)
    ours = [n for n in names if n in all_converters()]
    upstream = set(model_converter._registry_model_converter_cls) - set(ours)
    unknown = [n for n in names if n not in ours and n not in upstream]
    if unknown:
        known = sorted(set(all_converters()) | upstream)
        raise ConverterError(
            f"unknown converter {unknown[0]!r}; known converters: {known}"
        )
    check(ours, era=ERA, model_name=model_name, context_parallel=context_parallel)
    return names
