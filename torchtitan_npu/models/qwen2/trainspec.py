"""Qwen2 on the TrainSpec era (torchtitan 0.2.x): model args, parallelize
function and TrainSpec. The overlay registers it (`register_train_spec`)."""

import dataclasses
from dataclasses import dataclass
from typing import Any

# pyrefly: ignore[missing-module-attribute]  # 0.2.x only
from torchtitan.protocols.model import BaseModelArgs

from torchtitan_npu.models.qwen2.args import FLAVORS, Qwen2ModelArgs
from torchtitan_npu.models.qwen2.model import Qwen2Model
from torchtitan_npu.models.qwen2.parallelize import parallelize_qwen2, plan_for


@dataclass
class Qwen2Args(Qwen2ModelArgs, BaseModelArgs):
    def update_from_config(self, job_config: Any, **kwargs) -> None:
        self.max_seq_len = max(self.max_seq_len, job_config.training.seq_len)

    def get_nparams_and_flops(self, model: Any, seq_len: int) -> tuple[int, int]:
        return self.nparams_and_flops(model, seq_len)


def parallelize(model: Qwen2Model, parallel_dims: Any, job_config: Any) -> Qwen2Model:
    compile_config = job_config.compile
    plan = plan_for(
        parallel_dims,
        loss_parallel=not job_config.parallelism.disable_loss_parallel,
        ac_mode=job_config.activation_checkpoint.mode,
        compile=compile_config.enable and "model" in compile_config.components,
        training=job_config.training,
        parallelism=job_config.parallelism,
        sum_gradients=_loss_is_global_token_mean(),
    )
    return parallelize_qwen2(model, plan)


def _loss_is_global_token_mean() -> bool:
    """0.2.2 normalizes the loss by the global token count and has upstream's
    FSDP sum gradients (disable_fsdp_gradient_division); 0.2.0/0.2.1 average."""
    from torchtitan.models.llama3.infra import parallelize as llama3

    return hasattr(llama3, "disable_fsdp_gradient_division")


def train_spec() -> Any:
    """llama3's TrainSpec with the Qwen2 model: the same optimizer, scheduler,
    dataloader, tokenizer, loss, validator and pipeline builders."""
    from torchtitan.protocols.train_spec import get_train_spec

    from torchtitan_npu.compat.era import Era
    from torchtitan_npu.state_dict_adapters.upstream_adapter import adapter_class

    return dataclasses.replace(
        get_train_spec("llama3"),
        model_cls=Qwen2Model,
        model_args={
            name: Qwen2Args(**dataclasses.asdict(args))
            for name, args in FLAVORS.items()
        },
        parallelize_fn=parallelize,
        state_dict_adapter=adapter_class("qwen2", Era.TRAINSPEC),
    )
