"""Upstream's low-precision training (float8, MX, NVFP4) in the one config format.

Both eras take these converters by upstream 0.2.x's names in
``model.converters``, with their settings under ``[quantize.<kind>.<format>]``::

    [model]
    converters = ["quantize.linear.float8"]

    [quantize.linear.float8]
    recipe_name = "rowwise"

0.2.x registers the names itself and reads the settings from its JobConfig;
on 0.3.x titan-npu builds upstream's converter configs from the same keys
(``converters/config_registry.py``), each key checked against that release's
fields. Either way upstream's torchao code does the work, on CUDA devices of
the capability below or, for float8 linears, emulated in eager mode anywhere
(``emulate = true``, for tests); what cannot run is refused before launch.
"""

import importlib.util
from dataclasses import dataclass
from typing import Any

from torchtitan_npu.errors import ConverterError
from torchtitan_npu.models import OPTIONAL_PACKAGES
from torchtitan_npu.reporting.table import format_table

QUANTIZE = "quantize."


@dataclass(frozen=True)
class Quantization:
    name: str  # in model.converters; its settings are [<name>]
    config_class: str  # the 0.3.x converter in torchtitan.components.quantization
    capability: tuple[int, int]  # the CUDA compute capability it needs
    emulated: bool = False  # ``emulate = true`` runs it anywhere (eager only)
    in_0_2: bool = True  # 0.2.x registers it too


QUANTIZATIONS = {
    q.name: q
    for q in (
        Quantization("quantize.linear.float8", "Float8LinearConverter", (8, 9), True),
        Quantization(
            "quantize.grouped_mm.float8", "Float8GroupedExpertsConverter", (8, 9)
        ),
        Quantization("quantize.linear.mx", "MXFP8LinearConverter", (10, 0)),
        Quantization("quantize.grouped_mm.mx", "MXFP8GroupedExpertsConverter", (10, 0)),
        Quantization(
            "quantize.linear.nvfp4", "NVFP4LinearConverter", (10, 0), in_0_2=False
        ),
    )
}


def suggestion(name: str) -> str:
    """' (did you mean ...)' for a bare format name such as 'float8'."""
    matches = [q for q in QUANTIZATIONS if q.rsplit(".", 1)[1] == name.lower()]
    return f" (did you mean {' or '.join(map(repr, matches))}?)" if matches else ""


def settings(flat: dict[str, Any], name: str) -> dict[str, Any]:
    """The keys of ``[<name>]`` in a flattened config, by field name."""
    prefix = name + "."
    return {k.removeprefix(prefix): v for k, v in flat.items() if k.startswith(prefix)}


def model_compiled(flat: dict[str, Any]) -> bool:
    """Whether the run compiles the model (upstream's condition)."""
    components = flat.get("compile.components", ["model", "loss"])
    return bool(flat.get("compile.enable")) and "model" in components


def check_runnable(names: list[str], flat: dict[str, Any], device_type: str) -> None:
    """Refuse before launch what upstream's quantization converters refuse in
    the ranks: a device without the compute capability (a float8 linear may
    be emulated in eager mode instead), or no torchao."""
    for name in names:
        quantization = QUANTIZATIONS.get(name)
        if quantization is None:
            continue
        emulate = quantization.emulated and settings(flat, name).get("emulate")
        if emulate and model_compiled(flat):
            raise ConverterError(
                f"converter {name!r} emulates float8 in eager mode only; set "
                "compile.enable = false or run it on a device that has float8"
            )
        if not (emulate or _capable(device_type, quantization)):
            _refuse_device(name, quantization, device_type)
        if not _has_torchao():
            raise ConverterError(
                f"converter {name!r} runs upstream's torchao code; install torchao "
                f"({OPTIONAL_PACKAGES['torchao']}) or drop it from model.converters"
            )


def availability_table(device_type: str) -> str:
    """Whether each quantization runs on ``device_type`` here (``doctor``)."""
    rows = []
    for name, quantization in QUANTIZATIONS.items():
        major, minor = quantization.capability
        if _capable(device_type, quantization):
            here = "runs"
        elif quantization.emulated:
            here = f"emulated only ({name}.emulate = true)"
        else:
            here = "no"
        if here != "no" and not _has_torchao():
            here += f", with torchao ({OPTIONAL_PACKAGES['torchao']})"
        eras = "0.2.x, 0.3.x" if quantization.in_0_2 else "0.3.x"
        rows.append([name, eras, f"CUDA {major}.{minor}+", here])
    headers = ["name", "upstream", "needs", f"on {_device(device_type)}"]
    return format_table(headers, rows)


def _has_torchao() -> bool:
    return importlib.util.find_spec("torchao") is not None


def _refuse_device(name: str, quantization: Quantization, device_type: str) -> None:
    major, minor = quantization.capability
    hint = (
        f", or set {name}.emulate = true to emulate it in eager mode (tests)"
        if quantization.emulated
        else ""
    )
    raise ConverterError(
        f"converter {name!r} needs a CUDA device of compute capability "
        f"{major}.{minor} or later (this run: {_device(device_type)}); drop it "
        f"from model.converters{hint}"
    )


def _capable(device_type: str, quantization: Quantization) -> bool:
    import torch

    if device_type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability() >= quantization.capability


def _device(device_type: str) -> str:
    import torch

    if device_type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{torch.cuda.get_device_name()}, capability {major}.{minor}"
    return device_type
