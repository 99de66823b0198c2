"""One rank's memory over a training step, measured by PyTorch's memory
tracker on fake tensors (no storage) under a fake process group.

The run is the one upstream would build for the config (the era's
``plan/<era>.py``): the model on meta, parallelized by upstream's own
functions, its optimizer; then two steps (the second holds optimizer states)
of upstream's forward_backward_step, gradient clipping and optimizer step.

A deep model is not stepped whole: memory grows by the same bytes with each
repetition of its layers, so the plan steps the model cut to 2, 3 and 4
repetitions of its longest run of identical layers and extends the line to
the real count (``Repeats``); where the three are not on one line, it steps
every layer.
"""

import contextlib
import logging
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from torchtitan_npu.errors import PlanError
from torchtitan_npu.plan import pipeline
from torchtitan_npu.plan.attention import attention_for
from torchtitan_npu.plan.collectives import collectives_for

# The memory tracker's categories -> the plan's. What a layout gathers or
# sends (FSDP's unsharded parameters, TP's gathered activations) is counted
# where it is made: in the forward as activations, in the backward as
# temporaries, as are the optimizer step's own intermediates.
CATEGORIES = {
    "Parameter": "parameters",
    "Gradient": "gradients",
    "Optstate": "optimizer",
    "Activation": "activations",
    "Temp": "temporary",
    "Buffer": "other",
    "Other": "other",
}
PARTS = ("parameters", "gradients", "optimizer", "activations", "temporary", "other")


@dataclass
class RankMemory:
    """One rank's peak (bytes), its parts at that moment, and the model
    state it holds throughout (bytes of its local shards)."""

    rank: int
    peak: int
    parts: dict[str, int]
    model_state: dict[str, int] = field(default_factory=dict)
    # the tracker's peak of each phase of the step (forward and backward,
    # gradient clipping, optimizer step), by its categories
    phases: list[dict[str, int]] = field(default_factory=list)
    # how the layers were stepped, where not all of them were
    sampled: str = ""


@contextlib.contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """A process group of ``world_size`` whose collectives move nothing."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def materialize(
    parts: list[Any],
    device: torch.device,
    tensors: contextlib.AbstractContextManager,
    tie_weights: Callable[[Any], None],
) -> None:
    """Model parts built on meta, allocated on ``device`` under ``tensors``
    (fake or real) and set to train; real weights initialized (fake ones
    would compute nothing, and initializers ask for values). ``to_empty``
    unties tied embeddings, which upstream's init_weights ties again first:
    on fake tensors ``tie_weights`` (the era's) does that part."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with tensors:
        for part in parts:
            part.to_empty(device=device)
            if isinstance(tensors, FakeTensorMode):
                tie_weights(part)
            else:
                with torch.no_grad():
                    part.init_weights(buffer_device=None)
            part.train()


def local_bytes(tensors: Iterator[Any]) -> int:
    """Bytes of the local shards of ``tensors`` (DTensors: their local part)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
    return total


def model_state(trainer: Any) -> dict[str, int]:
    """Bytes of the local shards of parameters, gradients, optimizer states."""
    params = [p for m in trainer.model_parts for p in m.parameters()]
    states = [
        value
        for optimizer in trainer.optimizers.optimizers
        for state in optimizer.state.values()
        for name, value in state.items()
        if name != "step"  # a 0-dim step counter per parameter
    ]
    return {
        "parameters": local_bytes(iter(params)),
        "gradients": local_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": local_bytes(iter(states)),
    }


def tracker(trainer: Any) -> Any:
    """PyTorch's memory tracker over the run's parts and optimizers, by
    category and without per-module statistics."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class StepMemTracker(MemTracker):
        """Its module hooks keep per-module snapshots and refuse a module
        called again outside the model in one step (a chunked loss calls the
        output projection per chunk, with a backward each): the plan needs
        the categories only, which the tracker keeps without them."""

        def _pre_fw_hook(self, module: Any, inputs: Any) -> None:
            pass

        def _post_fw_hook(self, module: Any, inputs: Any, outputs: Any) -> None:
            pass

        def _pre_bw_hook(self, module: Any, args: Any) -> None:
            pass

        def _post_bw_hook(self, module: Any, args: Any) -> None:
            pass

        def reset_peak(self) -> None:
            """Forget the peak so far (the tracker keeps one per device)."""
            self._peak_mem.clear()
            self._peak_mem_snap.clear()

    memory = StepMemTracker()
    memory.track_external(*trainer.model_parts, *trainer.optimizers.optimizers)
    # Gradients by their hooks, which only trainable parameters take (qwen3_5
    # trains its text model only: its vision encoder is frozen).
    trainable = torch.nn.ParameterList(
        p for part in trainer.model_parts for p in part.parameters() if p.requires_grad
    )
    memory._track_module_params_and_buffers(trainable, install_grad_hooks=True)
    # Higher-order ops (flex attention) run through the tracker like any op:
    # it counts their outputs.
    memory.supports_higher_order_operators = True
    return memory


def run_steps(trainer: Any, era_plan: Any, target: str) -> RankMemory:
    """Two training steps under the tracker, attention and collectives as the
    ``target`` device type runs them: the second step's peak and its parts."""
    size, count = era_plan.microbatches(trainer)
    memory = tracker(trainer)
    peaks: list[dict[str, int]] = []

    def phase_peak() -> None:
        """The peak since the last phase's (the tracker keeps one)."""
        peaks.append(dict(next(iter(memory.get_tracker_snapshot("peak").values()))))
        memory.reset_peak()

    def step() -> None:
        trainer.optimizers.zero_grad()
        batches = [era_plan.batch(trainer, size) for _ in range(count)]
        inputs, labels = [b[0] for b in batches], [b[1] for b in batches]
        tokens = torch.tensor(size * count * era_plan.seq_len(trainer))
        era_plan.forward_backward(trainer, inputs, labels, tokens.to(trainer.device))
        phase_peak()
        era_plan.clip_grad_norm(trainer)
        memory.track_external(*trainer.model_parts)  # gradients FSDP assigned
        phase_peak()
        trainer.optimizers.step()
        phase_peak()

    with memory, attention_for(target), collectives_for(target), _quiet():
        step()
        # The first step creates the optimizer states; on fake tensors it also
        # counts DTensor's sharding propagation (global shapes, under the same
        # fake mode), which is cached for every later step.
        peaks.clear()
        step()
    return rank_memory(torch.distributed.get_rank(), peaks, model_state(trainer))


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torch's warnings about the simulated step (CPU autocast asked for
    float32 by every MoE router, FSDP wrappers returning views, DTensor
    redistributions in several collectives): the plan computes nothing, and
    the real run still says them."""
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def rank_memory(
    rank: int, phases: list[dict[str, int]], state: dict[str, int]
) -> RankMemory:
    """A rank's memory from the tracker's peak of each phase of a step (by
    its categories) and its model state: the peak of the phase that reaches
    the highest first, in the plan's parts."""
    snapshot = max(phases, key=lambda p: p["Total"])
    parts = dict.fromkeys(PARTS, 0)
    for key, value in snapshot.items():
        if key != "Total":
            parts[CATEGORIES.get(key, "other")] += value
    # The tracker counts the optimizer step's own temporaries as its state.
    step_temporaries = max(0, parts["optimizer"] - state["optimizer"])
    parts["optimizer"] -= step_temporaries
    parts["temporary"] += step_temporaries
    return RankMemory(rank, snapshot["Total"], parts, state, phases)


# A run of repeated layers (a layer, or a block of up to 4) covering this many
# layers or more is not stepped whole: the model is stepped cut to SAMPLES
# consecutive repetition counts of it, one after the other, until the last
# three lie on one line, and the line extended. The first sample holds
# FIRST_SAMPLE layers at least (the first repetitions can differ: FSDP
# overlaps a few layers' gradient reductions): 3, 4, 5 single layers, or 1,
# 2, 3 blocks of four (qwen3_5). Three samples of single layers step 12 in
# all, each sample also the layers around them: it pays from 16 on.
EXTRAPOLATE_FROM = 16
FIRST_SAMPLE = 3
SAMPLES = 4
# Bytes by which the samples' steps may differ and still be on one line (the
# tracker rounds small tensors: a few bytes per layer).
ON_A_LINE = 2**16


@dataclass(frozen=True)
class Repeats:
    """Layers ``start`` to ``start + period * count``: one block of ``period``
    layers, ``count`` times."""

    start: int
    period: int
    count: int

    def kept(self, layers: int, blocks: int) -> list[int]:
        """The layers of a model of ``layers`` cut to ``blocks`` repetitions."""
        end = self.start + self.period * self.count
        return [*range(self.start + self.period * blocks), *range(end, layers)]

    def __str__(self) -> str:
        if self.period == 1:
            return f"{self.count} identical layers"
        return f"{self.count} repetitions of a block of {self.period} layers"


def layer_kind(layer: torch.nn.Module) -> tuple:
    """What a layer's memory depends on: its modules' types, its parameters'
    and buffers' shapes and dtypes (not their initializers)."""
    modules = tuple((n, type(m).__name__) for n, m in layer.named_modules())
    tensors = tuple(
        (n, tuple(t.shape), t.dtype)
        for n, t in [*layer.named_parameters(), *layer.named_buffers()]
    )
    return modules, tensors


def longest_repeats(kinds: list[tuple], max_period: int = 4) -> Repeats:
    """The run of one repeated block that covers the most layers (the
    shortest block among equals)."""
    best = Repeats(0, 1, 1 if kinds else 0)
    for period in range(1, max_period + 1):
        for start in range(len(kinds) - period + 1):
            block, end = kinds[start : start + period], start + period
            while kinds[end : end + period] == block:
                end += period
            count = (end - start) // period
            if count * period > best.count * best.period:
                best = Repeats(start, period, count)
    return best


class LayerCut:
    """Cuts a model built on meta to the ``sample``-th (from 0) of SAMPLES
    repetition counts of its longest run of repeated layers, where that run
    is long enough to extrapolate; ``blocks`` is then the count kept."""

    def __init__(self, sample: int) -> None:
        self.sample, self.blocks = sample, 0
        self.repeats: Repeats | None = None

    def __call__(self, model: torch.nn.Module) -> None:
        blocks: Any = model.layers  # a ModuleDict in every upstream decoder
        layers = list(blocks.values())
        repeats = longest_repeats([layer_kind(layer) for layer in layers])
        first = -(-FIRST_SAMPLE // repeats.period)  # repetitions, rounded up
        long_enough = repeats.count * repeats.period >= EXTRAPOLATE_FROM
        if not long_enough or repeats.count < first + SAMPLES:
            return
        self.repeats, self.blocks = repeats, first + self.sample
        kept = repeats.kept(len(layers), self.blocks)
        for name in list(blocks.keys()):
            del blocks[name]
        for i, index in enumerate(kept):  # renumbered: upstream counts them
            blocks[str(i)] = layers[index]


def extrapolate(
    samples: list[RankMemory], last: int, repeats: Repeats
) -> RankMemory | None:
    """The memory of the model's ``repeats`` from samples of consecutive
    repetitions up to ``last``, phase by phase and part by part; None where
    the samples are not on one line."""
    blocks = repeats.count

    def line(values: list[int]) -> int | None:
        steps = [b - a for a, b in zip(values, values[1:])]
        if max(steps) - min(steps) > ON_A_LINE:
            return None
        return values[-1] + steps[-1] * (blocks - last)

    def extend(dicts: list[dict[str, int]]) -> dict[str, int] | None:
        extended = {k: line([d.get(k, 0) for d in dicts]) for k in dicts[-1]}
        if any(v is None for v in extended.values()):
            return None
        return extended  # pyrefly: ignore[bad-return]

    phases = [extend([s.phases[i] for s in samples]) for i in range(3)]
    state = extend([s.model_state for s in samples])
    if state is None or any(p is None for p in phases):
        return None
    memory = rank_memory(samples[0].rank, phases, state)  # pyrefly: ignore[bad-argument-type]
    stepped = ", ".join(str(n) for n in range(last - len(samples) + 1, last + 1))
    memory.sampled = (
        f"{repeats}: {stepped} of them stepped, the line through them extended "
        "(--all-layers steps every layer)"
    )
    return memory


def simulate(
    plan: ModuleType,
    upstream: Any,
    dims: Any,
    target: str,
    all_layers: bool,
    progress: Callable[[str], None],
) -> RankMemory:
    """One rank of the run on fake tensors: every layer stepped, or a run of
    repeated layers extrapolated from samples of it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def step(cut: Callable[[torch.nn.Module], None]) -> RankMemory:
        # Small real tensors (device meshes) become fake where they meet.
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        trainer = plan.build(upstream, dims, torch.device("cpu"), fake, cut)
        with fake:
            return run_steps(trainer, plan, target)

    if all_layers or dims.pp_enabled:  # stages split the layers themselves
        return step(lambda model: None)
    samples = []
    for sample in range(SAMPLES):
        cut = LayerCut(sample)
        samples.append(step(cut))
        if cut.repeats is None:  # too few layers to cut: stepped whole
            return samples[-1]
        progress(f"{cut.repeats}: {cut.blocks} of them stepped")
        if len(samples) >= 3:
            extended = extrapolate(samples[-3:], cut.blocks, cut.repeats)
            if extended is not None:
                return extended
    progress("the samples are not on one line: stepping every layer")
    return step(lambda model: None)


@dataclass
class Estimate:
    """The plan of one layout: every simulated rank's memory (one per
    pipeline stage; the others mirror them) and how long it took."""

    degrees: dict[str, int]
    ranks: list[RankMemory]
    seconds: float

    @property
    def worst(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.peak)


def era_plan() -> ModuleType:
    """``plan/<era>.py`` of the installed upstream."""
    from torchtitan_npu.compat import resolve_upstream
    from torchtitan_npu.compat.era import era_module

    return era_module("torchtitan_npu.plan", resolve_upstream().era)


def estimate(
    config: dict[str, Any],
    world_size: int,
    target: str,
    all_layers: bool = False,
    progress: Callable[[str], None] = lambda line: None,
) -> Estimate:
    """Plan a resolved project config on ``world_size`` devices of type
    ``target``: the first rank of every pipeline stage, on fake tensors, in
    stage order (``all_layers``: step every layer, extrapolate none;
    ``progress``: a line per step of a deep model sampled).

    Each rank is simulated in a forked child of this process: upstream keeps
    per-process state of a built run (meshes, caches) that the next rank or
    layout would inherit. The children start with everything imported and
    hand back, beside their memory, what their pipeline stages sent."""
    from torchtitan_npu.bootstrap import activate
    from torchtitan_npu.overlay import OVERLAY

    activate()  # the overlay trains on CPU: planning runs there
    plan = era_plan()
    for record in (*SIMULATION_RECORDS, *plan.SIMULATION_RECORDS):
        OVERLAY.apply_on_request(record)
    pipeline.MESSAGES.clear()
    start = time.perf_counter()
    ranks, layout = [], {}
    pp = plan.pipeline_degree(upstream_config(plan, config))
    for rank in [stage * (world_size // pp) for stage in range(pp)]:
        args = (plan, config, world_size, rank, target, all_layers, progress)
        memory, layout, messages = in_child(simulate_rank, *args)
        ranks.append(memory)
        pipeline.MESSAGES.update(messages)
    return Estimate(layout, ranks, time.perf_counter() - start)


def upstream_config(plan: ModuleType, config: dict[str, Any]) -> Any:
    """The era's upstream config of a resolved project config."""
    from torchtitan_npu.compat import resolve_upstream

    return plan.upstream_config(config, resolve_upstream().installed.version)


def simulate_rank(
    plan: ModuleType,
    config: dict[str, Any],
    world_size: int,
    rank: int,
    target: str,
    all_layers: bool,
    progress: Callable[[str], None],
) -> tuple[RankMemory, dict[str, int], dict]:
    """One rank in its fake world: its memory, the layout's degrees and the
    messages its pipeline stages sent."""
    upstream = upstream_config(plan, config)
    with fake_world(world_size, rank):
        dims = plan.parallel_dims(upstream, world_size)
        dims.build_mesh()
        try:
            memory = simulate(plan, upstream, dims, target, all_layers, progress)
        except PlanError:
            raise
        except NotImplementedError as e:
            if dims.cp_enabled and "attention_for_cpu" in str(e):
                raise PlanError(
                    f"{layout_name(degrees(dims))} cannot run SDPA on cpu: torch's "
                    "context parallelism has no rule for SDPA's CPU kernel; plan "
                    "for the device you will train on (--device npu or cuda) or "
                    "use a FlexAttention flavor"
                ) from e
            raise unexpected(dims, e) from e
        except Exception as e:
            raise unexpected(dims, e) from e
        return memory, degrees(dims), pipeline.MESSAGES


def unexpected(dims: Any, error: Exception) -> PlanError:
    """A simulation failure the planner has no explanation for."""
    return PlanError(
        f"{layout_name(degrees(dims))} could not be simulated "
        f"({summary(error)}); please report it with the command line"
    )


def summary(error: BaseException) -> str:
    """An exception as one line: its type and its message's first line."""
    first = str(error).splitlines()[0][:200] if str(error) else ""
    return f"{type(error).__name__}: {first}"


def in_child(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` in a forked child; its errors as a PlanError."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_call_into, args=(send, function, *args))
    child.start()
    send.close()
    try:
        kind, value = receive.recv()
    except EOFError:
        kind, value = "error", f"the planning process died (exit {child.exitcode})"
    child.join()
    if kind == "error" and _AUTOGRAD_FORK in value:
        raise PlanError(
            "this process has run autograd, and torch cannot fork it to plan in: "
            "plan from a fresh process (titan-npu plan)"
        )
    if kind == "error":
        raise PlanError(value)
    return value


_AUTOGRAD_FORK = "Unable to handle autograd's threading in combination with fork"


def _call_into(send: Any, function: Callable[..., Any], *args: Any) -> None:
    try:
        send.send(("ok", function(*args)))
    except Exception as e:  # noqa: BLE001 - reported by the parent
        send.send(("error", str(e) if isinstance(e, PlanError) else summary(e)))


def measure(config: dict[str, Any], device: torch.device) -> RankMemory:
    """The same steps on real tensors in this process's (torchrun) process
    group: what the estimate predicts, measured by the same tracker."""
    import torch.distributed as dist

    from torchtitan_npu.overlay import OVERLAY

    for record in TRACKER_RECORDS:
        OVERLAY.apply_on_request(record)
    plan = era_plan()
    upstream = upstream_config(plan, config)
    dims = plan.parallel_dims(upstream, dist.get_world_size())
    dims.build_mesh()
    trainer = plan.build(upstream, dims, device, contextlib.nullcontext())
    return run_steps(trainer, plan, device.type)


# Overlay records applied while the memory tracker follows a step, on real
# tensors as on fake ones: pipeline stages infer their shapes untracked; and
# those applied while a plan is computed on every era (plan/<era>.py's
# SIMULATION_RECORDS add the era's own): pipeline stages' first-step messages
# are kept in the planning process (plan/pipeline.py).
TRACKER_RECORDS = ("plan_pipeline_untracked_inference",)
SIMULATION_RECORDS = (
    *TRACKER_RECORDS,
    "plan_pipeline_inference",
    "plan_pipeline_send",
    "plan_pipeline_receive",
    "plan_pipeline_p2p_held",
)


def degrees(dims: Any) -> dict[str, int]:
    names = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")
    return {n: getattr(dims, n) for n in names}


def layout_name(degrees: dict[str, int]) -> str:
    used = [f"{k} {v}" for k, v in degrees.items() if v > 1]
    return " x ".join(used) or "single device"
