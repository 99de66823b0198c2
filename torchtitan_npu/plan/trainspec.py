"""Plan on torchtitan 0.2.x: the run a JobConfig describes, built as
upstream's Trainer builds it (train spec, model converters, parallelize or
pipelining function, optimizers), on fake tensors."""

import inspect
import os
import tempfile
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

# pyrefly: ignore[missing-import]  # 0.2.x only
from torchtitan.train import Trainer

from torchtitan_npu.plan.estimate import materialize

# Overlay records applied while a plan is computed: expert parallelism's
# all-to-all splits evenly, MoE experts get their tokens evenly, the grouped
# experts' token order unfilled (plan/routing.py; gpt_oss's from 0.2.2);
# DDP's gradient buckets beside an unwrapped model (plan/collectives.py).
SIMULATION_RECORDS = (
    "plan_even_ep_splits",
    "plan_even_expert_tokens",
    "plan_even_gpt_oss_expert_tokens",
    "plan_permute_indices",
    "plan_ddp_buckets",
)


def upstream_config(config: dict[str, Any], version: str) -> Any:
    """The JobConfig `train` would hand over, read by upstream's own loader."""
    import tomli_w

    # pyrefly: ignore[missing-module-attribute]  # 0.2.x only
    from torchtitan.config import ConfigManager

    from torchtitan_npu.config.trainspec import translate

    job = translate(config, version=version, device_type="cpu")
    fd, path = tempfile.mkstemp(suffix=".toml")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(tomli_w.dumps(job))
        return ConfigManager().parse_args(["--job.config_file", path])
    finally:
        os.remove(path)


def parallel_dims(upstream_config: Any, world_size: int) -> Any:
    from torchtitan.distributed import ParallelDims

    p = upstream_config.parallelism
    return ParallelDims(
        dp_shard=p.data_parallel_shard_degree,
        dp_replicate=p.data_parallel_replicate_degree,
        cp=p.context_parallel_degree,
        tp=p.tensor_parallel_degree,
        pp=p.pipeline_parallel_degree,
        ep=p.expert_parallel_degree,
        etp=p.expert_tensor_parallel_degree,  # pyrefly: ignore[unexpected-keyword]
        world_size=world_size,
    )


def pipeline_degree(upstream_config: Any) -> int:
    return upstream_config.parallelism.pipeline_parallel_degree


def build(
    upstream_config: Any,
    dims: Any,
    device: torch.device,
    tensors: AbstractContextManager,
    cut: Callable[[torch.nn.Module], None] = lambda model: None,
) -> Any:
    """An upstream Trainer holding the run's model parts, optimizers, loss and
    contexts: everything its forward_backward_step reads (the model
    built on meta, then materialized on ``device`` under ``tensors``: fake or
    real; ``cut`` first changes it on meta: the plan samples deep models)."""
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed import utils as dist_utils

    # pyrefly: ignore[missing-import]  # 0.2.x only
    from torchtitan.protocols.model_converter import build_model_converters

    # pyrefly: ignore[missing-import]  # 0.2.x only
    from torchtitan.protocols.train_spec import get_train_spec
    from torchtitan.tools import utils

    job = upstream_config
    # upstream's __init__ also builds data, I/O; 0.2.x's attributes (Any: the
    # type checker reads 0.3's Trainer)
    trainer: Any = object.__new__(Trainer)
    spec = get_train_spec(job.model.name)
    model_args = spec.model_args[job.model.flavor]
    model_args.update_from_config(job)
    trainer.job_config, trainer.parallel_dims, trainer.device = job, dims, device
    trainer.train_spec, trainer.model_args = spec, model_args
    trainer.step, trainer.ntokens_seen = 0, 0
    trainer.tokenizer = None
    if getattr(model_args, "attn_type", "sdpa") in ("flex", "varlen"):
        trainer.tokenizer = spec.build_tokenizer_fn(job)  # masks need its EOS id
    with (
        torch.device("meta"),
        utils.set_default_dtype(TORCH_DTYPE_MAP[job.training.dtype]),
    ):
        model = spec.model_cls(model_args)
    cut(model)
    build_model_converters(job, dims).convert(model)
    trainer.loss_fn = spec.build_loss_fn(job, parallel_dims=dims)
    if dims.pp_enabled:
        (
            trainer.pp_schedule,
            trainer.model_parts,
            trainer.pp_has_first_stage,
            trainer.pp_has_last_stage,
        ) = spec.pipelining_fn(
            model, dims, job, device, model_args, spec.parallelize_fn, trainer.loss_fn
        )
    else:
        trainer.model_parts = [spec.parallelize_fn(model, dims, job)]
    materialize(trainer.model_parts, device, tensors, tie_weights)
    with tensors:
        trainer.optimizers = spec.build_optimizers_fn(
            trainer.model_parts, job.optimizer, dims
        )
    loss_parallel = dims.tp_enabled and not job.parallelism.disable_loss_parallel
    # pyrefly: ignore[missing-attribute]  # 0.2.x only
    train_context = dist_utils.get_train_context
    context_args = [loss_parallel]
    if "enable_compiled_autograd" in inspect.signature(train_context).parameters:
        context_args.append(job.parallelism.enable_compiled_autograd)  # 0.2.0
    trainer.train_context = train_context(*context_args)
    # pyrefly: ignore[missing-attribute]  # 0.2.x only
    trainer.maybe_enable_amp = dist_utils.maybe_enable_amp(
        dims, job.training.mixed_precision_param, device.type
    )
    return trainer


def tie_weights(part: Any) -> None:
    """What upstream's models' init_weights do before initializing."""
    if getattr(part, "enable_weight_tying", False):
        part.output.weight = part.tok_embeddings.weight


def seq_len(trainer: Any) -> int:
    return trainer.job_config.training.seq_len


def vocab_size(trainer: Any) -> int:
    return trainer.model_args.vocab_size


def batch(trainer: Any, batch_size: int) -> tuple[dict[str, torch.Tensor], Any]:
    """One batch of the configured shape (the pipeline schedule splits it)."""
    length = seq_len(trainer)
    tokens = torch.randint(
        0, vocab_size(trainer), (batch_size, length + 1), device=trainer.device
    )
    return {"input": tokens[:, :-1]}, tokens[:, 1:]


def microbatches(trainer: Any) -> tuple[int, int]:
    """0.2.x feeds the whole local batch per step (PP splits it itself)."""
    return trainer.job_config.training.local_batch_size, 1


def forward_backward(trainer: Any, inputs: list, labels: list, tokens: Any) -> None:
    """Upstream's forward_backward_step on the step's batch (0.2.2 added the
    global token count that scales the loss; 0.2.0/0.2.1 take none)."""
    step = trainer.forward_backward_step
    kwargs = {"input_dict": inputs[0], "labels": labels[0]}
    if "global_valid_tokens" in inspect.signature(step).parameters:
        kwargs["global_valid_tokens"] = tokens
    step(**kwargs)


def pp_mesh(dims: Any) -> Any:
    """The pipeline's mesh as the release's Trainer finds it (0.2.1 on:
    get_optional_mesh; 0.2.0: a slice of the world mesh)."""
    if hasattr(dims, "get_optional_mesh"):
        return dims.get_optional_mesh("pp")
    return dims.world_mesh["pp"] if dims.pp_enabled else None


def clip_grad_norm(trainer: Any) -> None:
    from torchtitan.distributed import utils as dist_utils

    dims = trainer.parallel_dims
    dist_utils.clip_grad_norm_(
        [p for m in trainer.model_parts for p in m.parameters()],
        trainer.job_config.training.max_norm,
        foreach=True,
        pp_mesh=pp_mesh(dims),
        ep_enabled=dims.ep_enabled,
    )
