"""Rank-side numerics, through torch's global module and optimizer hooks only
(nothing of upstream is touched). ``TITAN_NPU_NUMERICS`` holds a JSON spec,
written by the command that launched the run:

- ``{"capture": DIR, "step": N, "degrees": {...}}`` (``numerics locate``): at
  step N every module's forward outputs and every parameter's gradient, as the
  optimizer receives it, stream to ``DIR/rank-R/`` (DTensors gathered first);
- ``{"nonfinite": true}`` (``train --detect-nonfinite``): the first module
  whose forward output, or the gradient arriving at that output, holds a NaN
  or an Inf stops the run with one line; the module's input, parameter and
  output statistics are written beside the log.

Names are the model's FQNs with wrapper infixes (activation checkpointing,
compile) dropped, so every layout and every pipeline stage speaks one
namespace. A step is counted at the first module forward after an optimizer
step; recomputation inside backward (activation checkpointing) is not a new
forward.
"""

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from torchtitan_npu.errors import UserError
from torchtitan_npu.numerics import ENV

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # upstream's order
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


class NonFiniteFound(UserError):
    """A NaN or Inf appeared in training (``--detect-nonfinite``)."""


def clean_name(name: str) -> str:
    for infix in _WRAPPERS:
        name = name.replace(infix, "")
    return name


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def compiling() -> bool:
    """Inside a region torch.compile or make_fx traces (a compiled model, the
    joint graph of flex attention's kernel): hooks step aside, for
    data-dependent checks cannot run there and counters would not count at
    run time."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return torch.compiler.is_compiling() or get_proxy_mode() is not None


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors holding data in a module's inputs or outputs (not the meta
    tensors of a pipeline stage's shape inference)."""
    leaves = tree_leaves(value)
    return [t for t in leaves if isinstance(t, torch.Tensor) and not t.is_meta]


def coordinates(rank: int, degrees: dict[str, int]) -> dict[str, int]:
    """This rank's place on upstream's device mesh (pp outermost, tp innermost)."""
    place = {}
    for dim in reversed(MESH_DIMS):
        size = degrees.get(dim, 1)
        place[dim], rank = rank % size, rank // size
    return place


class Tracker:
    """Module names, learnt from each root module a forward pass starts at,
    and the training step (1 + optimizer steps taken)."""

    def __init__(self) -> None:
        self.names: dict[int, str] = {}
        self.roots: list[torch.nn.Module] = []
        self.step = 1
        self._depth = 0
        self._stepped = False

    def enter(self, module: torch.nn.Module, *_: Any) -> None:
        if compiling():
            return
        if self._depth == 0 and not in_backward():
            if self._stepped:
                self.step, self._stepped = self.step + 1, False
            if id(module) not in self.names:
                self.roots.append(module)
                for name, child in module.named_modules(remove_duplicate=False):
                    self.names.setdefault(id(child), clean_name(name))
        self._depth += 1

    def leave(self, *_: Any) -> None:
        if not compiling():
            self._depth -= 1

    def stepped(self, *_: Any) -> None:
        self._stepped = True

    def name(self, module: torch.nn.Module) -> str:
        """The module's FQN; "" for a root or a module outside every root."""
        return self.names.get(id(module), "")

    def parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        seen, found = set(), []
        for root in self.roots:
            for name, param in root.named_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    found.append((clean_name(name), param))
        return found


def full(tensor: torch.Tensor) -> torch.Tensor | None:
    """A detached copy on the host, gathered when it is a DTensor (every rank
    of its mesh calls this in the same order: SPMD). None for a masked
    partial sum (a vocab-parallel embedding's output): its mask is used up by
    its first reduction, which belongs to the module's own output hook."""
    import warnings

    from torch.distributed.tensor import DTensor

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's own collectives
        if isinstance(tensor, DTensor):
            if any("MaskPartial" in type(p).__name__ for p in tensor.placements):
                return None
            tensor = tensor.full_tensor()
        return tensor.detach().to("cpu", copy=True)


def _kept(tensor: torch.Tensor, writes: bool) -> torch.Tensor | None:
    """``full(tensor)`` on a rank that writes it; elsewhere only a DTensor's
    gather is joined (its peers wait for it), and nothing is copied."""
    from torch.distributed.tensor import DTensor

    if not writes:
        if isinstance(tensor, DTensor):
            full(tensor)
        return None
    return full(tensor)


class Capture:
    """Streams step ``step``'s forward outputs and gradients to disk."""

    def __init__(self, tracker: Tracker, spec: dict[str, Any]) -> None:
        rank = int(os.environ.get("RANK", "0"))
        place = coordinates(rank, spec.get("degrees", {}))
        data_rank0 = place["dp_replicate"] == place["dp_shard"] == 0
        self.tracker, self.step = tracker, int(spec["step"])
        # Forward outputs: every rank holding data rank 0's batch (its local
        # shards may need merging); gradients: one rank per pipeline stage.
        self.write_forward = data_rank0
        self.write_grads = data_rank0 and place["tp"] == place["cp"] == 0
        self.folder = Path(spec["capture"]) / f"rank-{rank}"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.place = place
        self._index = (self.folder / "index.jsonl").open("a")
        self._seq = 0
        self._calls: Counter[str] = Counter()
        self._grads_taken = False

    def _save(
        self, kind: str, name: str, call: int, leaf: int, t: Any, cls: str = ""
    ) -> None:
        record = {"kind": kind, "name": name, "call": call, "leaf": leaf, "class": cls}
        record |= {"seq": self._seq, "pp": self.place["pp"]}
        if t is not None:
            file = f"{self._seq:06d}.pt"
            torch.save(t, self.folder / file)
            record |= {"file": file, "shape": list(t.shape), "dtype": str(t.dtype)}
        self._index.write(json.dumps(record) + "\n")
        self._index.flush()
        self._seq += 1

    def forward(self, module: torch.nn.Module, _inputs: Any, output: Any) -> None:
        if self.tracker.step != self.step or in_backward() or compiling():
            return
        name = self.tracker.name(module)
        outputs = tensors_of(output)
        if not name or not outputs:
            return
        call = self._calls[name]
        self._calls[name] += 1
        for leaf, tensor in enumerate(outputs):
            gathered = _kept(tensor, self.write_forward)
            if gathered is not None:
                self._save("forward", name, call, leaf, gathered, type(module).__name__)

    def gradients(self, *_: Any) -> None:
        if self.tracker.step != self.step or self._grads_taken:
            return
        self._grads_taken = True
        for name, param in self.tracker.parameters():
            grad = None if param.grad is None else _kept(param.grad, self.write_grads)
            if self.write_grads:
                self._save("grad", name, 0, 0, grad)


def _stats(tensor: torch.Tensor) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()  # no collective on the way out
    t = tensor.detach().float()
    finite = t[torch.isfinite(t)]
    return {
        "shape": list(tensor.shape),
        "dtype": str(tensor.dtype),
        "nan": int(torch.isnan(t).sum()),
        "inf": int(torch.isinf(t).sum()),
        "min": float(finite.min()) if finite.numel() else None,
        "max": float(finite.max()) if finite.numel() else None,
        "mean": float(finite.mean()) if finite.numel() else None,
        "absmax": float(finite.abs().max()) if finite.numel() else None,
    }


def nonfinite(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())


class NonFiniteWatch:
    """Stops at the first NaN or Inf: in forward, the first module whose
    output has one; in backward, the first module whose gradient towards its
    input has one (the model output's gradient: the loss), then any
    parameter's gradient before the optimizer step."""

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker

    def forward(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        if compiling():
            return
        name = self.tracker.name(module)
        outputs = tensors_of(output)
        if not name:  # a root: its output's gradient comes from the loss
            what = "the loss's gradient with respect to it"
            for t in outputs:
                if t.requires_grad:
                    t.register_hook(
                        self._grad_check(
                            "the model output", what, module, inputs, outputs
                        )
                    )
            return
        if not in_backward() and any(nonfinite(t) for t in outputs):
            self._stop(name, "forward", "its output", module, inputs, outputs)
        what = "the gradient it passes to its input"
        for t in tensors_of(inputs):
            if t.requires_grad:
                t.register_hook(self._grad_check(name, what, module, inputs, outputs))

    def _grad_check(self, name, what, module, inputs, outputs):
        step = self.tracker.step

        def check(grad: torch.Tensor) -> None:
            if not compiling() and nonfinite(grad):
                self._stop(name, "backward", what, module, inputs, [grad], step)

        return check

    def gradients(self, *_: Any) -> None:
        for name, param in self.tracker.parameters():
            if param.grad is not None and nonfinite(param.grad):
                raise NonFiniteFound(
                    f"non-finite values at step {self.tracker.step}, backward: "
                    f"the gradient of parameter {name} has NaN or Inf"
                )

    def _stop(self, name, phase, what, module, inputs, outputs, step=None) -> None:
        step = self.tracker.step if step is None else step
        saved = self._save(name, phase, step, module, inputs, outputs)
        where = f"; statistics in {saved}" if saved else ""
        raise NonFiniteFound(
            f"non-finite values at step {step}, {phase}: {name} "
            f"({type(module).__name__}): {what} has NaN or Inf{where}"
        )

    def _save(self, name, phase, step, module, inputs, outputs) -> Path | None:
        from torchtitan_npu.launcher import RUN_DIR_ENV

        run_dir = os.environ.get(RUN_DIR_ENV)
        if not run_dir:
            return None
        record = {
            "module": name,
            "class": type(module).__name__,
            "step": step,
            "phase": phase,
            "inputs": [_stats(t) for t in tensors_of(inputs)],
            "parameters": {
                n: _stats(p) for n, p in module.named_parameters(recurse=False)
            },
            "outputs": [_stats(t) for t in outputs],
        }
        path = Path(run_dir) / f"nonfinite-rank-{os.environ.get('RANK', '0')}.json"
        path.write_text(json.dumps(record, indent=2))
        return path


def install_from_env() -> None:
    """Install the hooks ``TITAN_NPU_NUMERICS`` asks for (none when unset)."""
    text = os.environ.get(ENV)
    if text:
        install(json.loads(text))


def install(spec: dict[str, Any]) -> list[Any]:
    """Install the hooks ``spec`` asks for; their handles (``.remove()``)."""
    from torch.nn.modules.module import (
        register_module_forward_hook,
        register_module_forward_pre_hook,
    )
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    tracker = Tracker()
    handles = [register_module_forward_pre_hook(tracker.enter)]
    if "capture" in spec:
        capture = Capture(tracker, spec)
        handles.append(register_module_forward_hook(capture.forward))
        handles.append(register_optimizer_step_pre_hook(capture.gradients))
    if spec.get("nonfinite"):
        watch = NonFiniteWatch(tracker)
        handles.append(register_module_forward_hook(watch.forward))
        handles.append(register_optimizer_step_pre_hook(watch.gradients))
    # Registered last, so it runs after the others for the same module.
    handles.append(register_module_forward_hook(tracker.leave))
    handles.append(register_optimizer_step_post_hook(tracker.stepped))
    return handles
