"""Plan on torchtitan 0.3.x: the run a ``Trainer.Config`` describes, built
as upstream's Trainer builds it (model spec, parallelize or pipelining
function, optimizer), on fake tensors."""

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

# pyrefly: ignore[missing-import]  # 0.3.x only
from torchtitan.trainer import Trainer

from torchtitan_npu.config.batch_and_data import counts_tokens, sequence_batch
from torchtitan_npu.plan.estimate import materialize

# Overlay records applied while a plan is computed: expert parallelism routes
# evenly (plan/routing.py), varlen attention's documents are the batch's rows
# (plan/attention.py).
SIMULATION_RECORDS = ("plan_routed_tokens", "plan_even_splits", "plan_varlen_metadata")


def upstream_config(config: dict[str, Any], version: str) -> Any:
    """The ``Trainer.Config`` `train` would hand over (translated for CPU, where
    the plan is computed)."""
    from torchtitan_npu.config.config_registry import translate

    return translate(config, version=version, device_type="cpu")


def parallel_dims(upstream_config: Any, world_size: int) -> Any:
    from torchtitan.distributed import ParallelDims

    return ParallelDims.from_config(upstream_config.parallelism, world_size)


def build(
    upstream_config: Any,
    dims: Any,
    device: torch.device,
    tensors: AbstractContextManager,
    cut: Callable[[torch.nn.Module], None] = lambda model: None,
) -> Any:
    """An upstream Trainer holding the run's model parts, optimizers, loss and
    step functions: everything its forward_backward_step reads (the model
    built on meta, then materialized on ``device`` under ``tensors``: fake or
    real; ``cut`` first changes it on meta: the plan samples deep models)."""
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.tools import utils

    config = upstream_config
    # process-wide, as upstream's Trainer.__init__ sets it before parallelizing
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
    trainer = object.__new__(Trainer)  # upstream's __init__ also builds data, I/O
    spec = config.model_spec
    model_config = spec.model
    model_config.update_from_config(config=config)
    trainer.config, trainer.parallel_dims, trainer.device = config, dims, device
    trainer.model_config, trainer.step, trainer.ntokens_seen = model_config, 0, 0
    trainer.loss_fn = config.loss.build(compile_config=config.compile)
    with (
        torch.device("meta"),
        utils.set_default_dtype(TORCH_DTYPE_MAP[config.training.dtype]),
    ):
        model = model_config.build()
    cut(model)
    common = dict(
        parallel_dims=dims,
        training=config.training,
        parallelism=config.parallelism,
        compile_config=config.compile,
        ac_config=config.activation_checkpoint,
        dump_folder=config.dump_folder,
    )
    if dims.pp_enabled:
        (
            trainer.pp_schedule,
            trainer.model_parts,
            trainer.pp_has_first_stage,
            trainer.pp_has_last_stage,
        ) = spec.pipelining_fn(
            model,
            **common,
            device=device,
            model_config=model_config,
            parallelize_fn=spec.parallelize_fn,
            loss_fn=trainer.loss_fn,
        )
    else:
        trainer.model_parts = [spec.parallelize_fn(model, **common)]
    materialize(trainer.model_parts, device, tensors, tie_weights)
    _attach_lm_head(trainer)
    with tensors:
        trainer.optimizers = config.optimizer.build(model_parts=trainer.model_parts)
    trainer.train_context = dist_utils.get_spmd_context(
        parallel_dims=dims, spmd_typechecking=False
    )
    trainer.fwd_bwd_fn = trainer._forward_backward_body
    return trainer


def tie_weights(part: Any) -> None:
    """What upstream's Decoder.init_states does before initializing."""
    if getattr(part, "enable_weight_tying", False):
        part.tok_embeddings.weight = part.lm_head.weight


def seq_len(trainer: Any) -> int:
    return sequence_batch(trainer.config)["training.seq_len"]


def batch(trainer: Any, batch_size: int) -> tuple[dict[str, torch.Tensor], Any]:
    """One microbatch of the configured shape: ``batch_size`` documents of
    ``seq_len`` tokens with their positions, as rows (0.3.0) or packed into
    one token row (upstream main's collator)."""
    length, vocab = seq_len(trainer), trainer.model_config.vocab_size
    tokens = torch.randint(0, vocab, (batch_size, length + 1), device=trainer.device)
    positions = torch.arange(length, device=trainer.device).expand(batch_size, -1)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    if counts_tokens():
        inputs, labels, positions = (t.reshape(-1) for t in (inputs, labels, positions))
    return {"input": inputs, "positions": positions}, labels


def microbatches(trainer: Any) -> tuple[int, int]:
    """(batch size of one forward, forwards per step) as upstream's Trainer
    splits the local batch."""
    shape = sequence_batch(trainer.config)
    local = shape["training.local_batch_size"]
    if trainer.parallel_dims.pp_enabled:
        size = shape["parallelism.pipeline_parallel_microbatch_size"]
        return size, local // size
    return local, 1


def forward_backward(trainer: Any, inputs: list, labels: list, tokens: Any) -> None:
    """Upstream's forward_backward_step on one step's microbatches."""
    pp = trainer.parallel_dims.pp_enabled
    trainer.forward_backward_step(
        input_dict=inputs if pp else inputs[0],
        labels=labels if pp else labels[0],
        global_valid_tokens=tokens,
    )


def clip_grad_norm(trainer: Any) -> None:
    from torchtitan.distributed import utils as dist_utils

    dims = trainer.parallel_dims
    dist_utils.clip_grad_norm_(
        [p for m in trainer.model_parts for p in m.parameters()],
        trainer.config.training.max_norm,
        foreach=True,
        pp_mesh=dims.get_optional_mesh("pp"),
        ep_enabled=dims.ep_enabled,
    )


def pipeline_degree(upstream_config: Any) -> int:
    return upstream_config.parallelism.pipeline_parallel_degree


def _attach_lm_head(trainer: Any) -> None:
    """A chunked loss computes the output projection itself, as upstream's
    Trainer sets it up: the (last stage's) lm_head moves into the loss."""
    from torchtitan.components.loss import ChunkedLossWrapper

    if not isinstance(trainer.loss_fn, ChunkedLossWrapper):
        return
    if trainer.parallel_dims.pp_enabled and not trainer.pp_has_last_stage:
        return
    last = trainer.model_parts[-1]
    trainer.loss_fn.set_lm_head(last.lm_head)
    last._skip_lm_head = True
