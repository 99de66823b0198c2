"""Qwen2 on the config-registry era (torchtitan 0.3.x): the model as a
``BaseModel`` with its ``Config``, ``model_registry`` -> ``ModelSpec``, and
one ``Trainer.Config`` function per flavor (``qwen2_<flavor>``)."""

import copy
from dataclasses import dataclass, field
from typing import Any

from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.protocols.model import BaseModel
from torchtitan.protocols.model_spec import ModelSpec

from torchtitan_npu.compat.era import Era
from torchtitan_npu.models.qwen2.args import FLAVORS, Qwen2ModelArgs
from torchtitan_npu.models.qwen2.model import Qwen2Model
from torchtitan_npu.models.qwen2.parallelize import parallelize_qwen2, plan_for


class Qwen2(Qwen2Model, BaseModel):
    """Qwen2Model as an upstream 0.3.x model (output head named lm_head)."""

    HEAD = "lm_head"

    @dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        args: Qwen2ModelArgs = field(default_factory=Qwen2ModelArgs)

        @property
        def layers(self) -> list:
            """Per-layer placeholders: upstream's pipeline_llm counts them."""
            return [None] * self.args.n_layers

        def update_from_config(self, *, config, **kwargs) -> None:
            seq_len = config.training.seq_len
            self.args.max_seq_len = max(self.args.max_seq_len, seq_len)

        def get_nparams_and_flops(self, model, seq_len: int) -> tuple[int, int]:
            return self.args.nparams_and_flops(model, seq_len)

    def __init__(self, config: Config):
        Qwen2Model.__init__(self, config.args)
        self.config = config

    def verify_module_protocol(self) -> None:
        """Submodules are plain torch modules by design (single-device
        semantics, parallelized by parallelize.py), not upstream Modules."""

    # pyrefly: ignore[bad-override]  # upstream's keyword-only protocol
    def init_weights(self, **kwargs) -> None:
        Qwen2Model.init_weights(self, kwargs.get("buffer_device"))


def parallelize(
    model,
    *,
    parallel_dims,
    training,
    parallelism,
    compile_config,
    ac_config,
    dump_folder,
    skip_dp: bool = False,
) -> Any:
    ac_mode = "none"
    if ac_config is not None:
        ac_mode = "selective" if "Selective" in type(ac_config).__qualname__ else "full"
        if "MemoryBudget" in type(ac_config).__qualname__:
            raise ValueError("qwen2: memory-budget activation checkpointing")
    plan = plan_for(
        parallel_dims,
        loss_parallel=False,  # 0.3.x computes the loss on replicated logits
        ac_mode=ac_mode,
        compile=compile_config.enable and "model" in compile_config.components,
        training=training,
        parallelism=parallelism,
        sum_gradients=True,  # 0.3.x normalizes the loss by global tokens
    )
    if skip_dp:
        plan.dp_mesh = None
    return parallelize_qwen2(model, plan)


def model_registry(flavor: str) -> ModelSpec:
    from torchtitan_npu.state_dict_adapters.upstream_adapter import adapter_class

    return ModelSpec(
        name="qwen2",
        flavor=flavor,
        model=Qwen2.Config(args=copy.deepcopy(FLAVORS[flavor])),
        parallelize_fn=parallelize,
        pipelining_fn=pipeline_llm,
        post_optimizer_build_fn=None,
        state_dict_adapter=adapter_class("qwen2", Era.CONFIG_REGISTRY),
    )


def _trainer_config(flavor: str):
    """llama3's debug Trainer.Config (optimizer, scheduler, data, checkpoint)
    with the Qwen2 model and a plain cross-entropy loss over its logits."""
    config = llama3_debugmodel()
    config.model_spec = model_registry(flavor)
    vocab = FLAVORS[flavor].vocab_size
    config.loss = CrossEntropyLoss.Config(global_vocab_size=vocab)
    # Plain torch model: DTensor only on the model-parallel axes.
    config.parallelism.spmd_backend = "partial_dtensor"
    return config


def qwen2_debugmodel() -> Any:
    return _trainer_config("debugmodel")


def qwen2_debugmodel_tied() -> Any:
    return _trainer_config("debugmodel_tied")


def qwen2_0_5b() -> Any:
    return _trainer_config("0.5B")


def qwen2_1_5b() -> Any:
    return _trainer_config("1.5B")


def qwen2_7b() -> Any:
    return _trainer_config("7B")
