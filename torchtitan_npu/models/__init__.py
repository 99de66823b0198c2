"""titan-npu's own models (injected into upstream) and where any model lives."""

import importlib
from types import ModuleType

# The flavor whose architecture is derived from an HF directory's config.json.
HF_FLAVOR = "hf"
# Upstream's models first, then titan-npu's injected ones.
MODEL_PACKAGES = ("torchtitan.models", "torchtitan_npu.models")

# Optional packages some upstream models and recipes import (multimodal
# encoders and datasets, low-precision training) -> what installs them.
OPTIONAL_PACKAGES = {
    "torchvision": "pip install 'titan-npu[multimodal]'",
    "torchao": "pip install torchao",
}


def needs(error: Exception) -> str:
    """What a model or flavor that failed to build needs, in a few words."""
    if isinstance(error, ModuleNotFoundError) and error.name:
        package = error.name.split(".")[0]
    else:
        text = str(error)
        package = next((p for p in OPTIONAL_PACKAGES if p in text), "")
    if package:
        how = OPTIONAL_PACKAGES.get(package, f"pip install {package}")
        return f"needs {package} ({how})"
    return f"not on this machine: {str(error).splitlines()[0][:60]}"


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
