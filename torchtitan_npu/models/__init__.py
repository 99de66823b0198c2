"""titan-npu's own models (injected into upstream) and where any model lives."""

import importlib
from types import ModuleType

# Upstream's models first, then titan-npu's injected ones.
MODEL_PACKAGES = ("torchtitan.models", "torchtitan_npu.models")


def find_model_module(name: str, submodule: str = "") -> ModuleType | None:
    """``<package>.<name>[.<submodule>]`` from upstream's models or titan-npu's;
    None when neither has it. An import error inside the module propagates."""
    for package in MODEL_PACKAGES:
        module = ".".join(filter(None, (package, name, submodule)))
        try:
            return importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is None or not (module + ".").startswith(e.name + "."):
                raise  # something the module itself imports is missing
    return None
