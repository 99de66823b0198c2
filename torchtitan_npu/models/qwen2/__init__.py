"""Qwen2 (Qwen2.5 family), injected into upstream torchtitan on every era.

- args.py / model.py / parallelize.py: era-neutral model and parallelism;
- trainspec.py: the 0.2.x TrainSpec (registered by the overlay);
- config_registry.py: the 0.3.x BaseModel / ModelSpec / Trainer.Config
  functions (`--module torchtitan_npu.models.qwen2`).
"""

from typing import Any

from torchtitan_npu.models.qwen2.args import FLAVORS, Qwen2ModelArgs

qwen2_configs = FLAVORS  # flavor table, named like upstream's <model>_configs


def model_registry(flavor: str) -> Any:
    """0.3.x ModelSpec for `flavor` (imports the 0.3.x glue on use)."""
    from torchtitan_npu.models.qwen2.config_registry import model_registry

    return model_registry(flavor)


__all__ = ["FLAVORS", "Qwen2ModelArgs", "model_registry", "qwen2_configs"]
