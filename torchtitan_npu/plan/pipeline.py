"""Pipeline parallelism in a plan.

At their first step torch's pipeline stages learn what they pass each other:
each stage runs its forward and backward once and sends the shapes of its
outputs (and of its inputs' gradients) to its neighbours over the process
group, which a fake one cannot carry (and torch >= 2.14 refuses to let
stages vote over it whether they need to). A plan simulates the first rank
of each stage one after the other, in stage order, each in a forked child
that hands back what its stages sent; the messages are kept here: what a
stage sends is what its neighbour receives when that one is simulated.

A stage whose sender is simulated later (under an interleaved schedule rank 0
holds stage ``pp`` as well, fed by the last rank) receives what the pipeline
sends at every boundary of an upstream decoder: the residual stream, as the
earlier stages sent it; a gradient sent back has its activation's shape.

The stages infer their shapes by a forward and a gradient (``autograd.grad``)
of fresh inputs; the memory tracker's module hooks cannot follow such a
gradient, and the first step is not the one a plan reports, so they are
suspended while the stages infer, also when a plan is measured on real
tensors.

A real process group's work holds the tensors it sends and receives until
it is dropped (the schedules drop a send's work at a later step of the
pipeline); a fake group's holds nothing, which left a plan short of a
stage's sent activations. A plan's point-to-point works hold them too.

Used by the overlay's on-request records ``plan_pipeline_inference``,
``plan_pipeline_untracked_inference``, ``plan_pipeline_send``,
``plan_pipeline_receive`` and ``plan_pipeline_p2p_held``, applied only while a
plan is computed.
"""

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

# (direction, boundary) -> the message a stage sent over it, boundary k lying
# between stages k and k + 1; cleared when a plan starts.
MESSAGES: dict[tuple[str, int], Any] = {}
FORWARD, BACKWARD = "forward", "backward"


def on_fake_group(holder: Any) -> bool:
    """Whether a stage's or an operation's group is a fake one."""
    return dist.get_backend(holder.group) == "fake"


def inference_without_vote(warmup: Callable[..., Any]) -> Callable[..., Any]:
    """The schedule's warm-up, which has its stages vote whether their
    metadata is complete; over a fake group every stage infers it instead."""
    from torch.distributed.pipelining._utils import InferenceMode
    from torch.distributed.pipelining.stage import PipelineStage

    def planned_warmup(
        self: Any, stages: list[Any], has_backward: bool, p2p_done: bool
    ) -> None:
        if not all(isinstance(s, PipelineStage) and on_fake_group(s) for s in stages):
            return warmup(self, stages, has_backward, p2p_done)
        for stage in stages:
            stage._inference_mode = InferenceMode.DYNAMIC

    return planned_warmup


def untracked(initialize: Callable[..., Any]) -> Callable[..., Any]:
    """The schedule's first-step initialization (the stages' shape
    inference) without global module hooks: the memory tracker's, in a plan
    and in its measurement alike."""

    def planned_initialize(self: Any, *args: Any, **kwargs: Any) -> Any:
        with global_module_hooks_suspended():
            return initialize(self, *args, **kwargs)

    return planned_initialize


@contextlib.contextmanager
def global_module_hooks_suspended() -> Iterator[None]:
    """No global forward hooks (the memory tracker's) for a while."""
    from torch.nn.modules import module

    hooks = (module._global_forward_pre_hooks, module._global_forward_hooks)
    saved = [dict(h) for h in hooks]
    for h in hooks:
        h.clear()
    try:
        yield
    finally:
        for h, kept in zip(hooks, saved):
            h.update(kept)


def keeping_sent(send: Callable[..., Any]) -> Callable[..., Any]:
    """A stage's ``_send_meta`` that keeps the message for its receiver."""

    def planned_send(self: Any, meta: Any, dst_stage: int) -> None:
        if not on_fake_group(self):
            return send(self, meta, dst_stage)
        direction = FORWARD if dst_stage > self.stage_index else BACKWARD
        MESSAGES[direction, min(dst_stage, self.stage_index)] = meta

    return planned_send


def receiving_kept(receive: Callable[..., Any]) -> Callable[..., Any]:
    """A stage's ``_recv_meta`` that reads the kept message."""

    def planned_receive(self: Any, src_stage: int) -> Any:
        if not on_fake_group(self):
            return receive(self, src_stage)
        return kept_message(src_stage, self.stage_index)

    return planned_receive


def kept_message(src_stage: int, dst_stage: int) -> Any:
    """What ``src_stage`` sent ``dst_stage``, or where that is not simulated
    yet what the pipeline sends over every boundary."""
    from torch.distributed.pipelining._utils import _StageBackwardMeta

    boundary = min(src_stage, dst_stage)
    if src_stage < dst_stage:
        sent = MESSAGES.get((FORWARD, boundary))
        earlier = [m for (d, _), m in MESSAGES.items() if d == FORWARD]
        if sent is None and not earlier:
            raise RuntimeError(
                f"stage {dst_stage} was simulated before any stage sent it an "
                "activation"
            )
        return sent if sent is not None else earlier[-1]
    sent = MESSAGES.get((BACKWARD, boundary))
    if sent is not None:
        return sent
    activations = MESSAGES[FORWARD, boundary].forward_metas  # this rank sent it
    return _StageBackwardMeta(backward_metas=tuple(map(gradient_meta, activations)))


def gradient_meta(activation: Any) -> Any:
    """The metadata of an activation's gradient: its own, without grad."""
    if not activation.requires_grad:
        return None
    return dataclasses.replace(activation, requires_grad=False)


def holding_p2p(batch_p2p: Callable[..., Any]) -> Callable[..., Any]:
    """The schedules' ``_batch_p2p`` whose works, over a fake group, hold
    the tensors of their operations until dropped."""

    def planned_batch_p2p(p2p_ops: list[Any], *args: Any, **kwargs: Any) -> Any:
        works = batch_p2p(p2p_ops, *args, **kwargs)
        if not p2p_ops or not on_fake_group(p2p_ops[0]):
            return works
        tensors = [op.tensor for op in p2p_ops]
        return [HeldWork(work, tensors) for work in works]

    return planned_batch_p2p


class HeldWork:
    """A work that holds its tensors, as a real process group's does."""

    def __init__(self, work: Any, tensors: list[Any]) -> None:
        self.work, self.tensors = work, tensors

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)
