"""Qwen2 (Qwen2.5 family), injected into upstream torchtitan on every era.

- args.py: the flavors' shapes (both eras);
- trainspec.py + model.py + parallelize.py: 0.2.x, titan-npu's own module as
  a TrainSpec (registered by the overlay);
- config_registry.py: 0.3.x, built from upstream's decoder parts: ModelSpec
  and Trainer.Config functions (`--module torchtitan_npu.models.qwen2`).
"""

from typing import Any

from torchtitan_npu.models.qwen2.args import FLAVORS, Qwen2ModelArgs

qwen2_configs = FLAVORS  # flavor table, named like upstream's <model>_configs


def model_registry(flavor: str) -> Any:
    """0.3.x ModelSpec for `flavor` (imports the 0.3.x glue on use)."""
    from torchtitan_npu.models.qwen2.config_registry import model_registry

    return model_registry(flavor)


__all__ = ["FLAVORS", "Qwen2ModelArgs", "model_registry", "qwen2_configs"]
