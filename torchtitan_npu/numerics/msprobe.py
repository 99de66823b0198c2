"""A capture as an msprobe dump, for MindStudio and ``msprobe compare``.

msprobe (``mindstudio-probe``) is the Ascend field's dump and compare tool.
titan-npu does not run its dumper: it pulls in pandas, scikit-learn, ONNX
and more, patches triton at import, and hooks modules with full backward
hooks, which FSDP2's view outputs and in-place ops defeat. It writes msprobe's
format instead: per rank, ``step<S>/rank<R>/`` with ``dump.json`` (task
"tensor", level "L0": a module's forward outputs, a module's parameter
gradients, with msprobe's statistics), ``construct.json``, ``stack.json`` and
the tensors in ``dump_tensor_data/`` (hard links to the capture's files where
the file system allows). Each rank's records are its own (no merging):
``msprobe compare`` pairs ranks one to one, so compare setups of one layout
(a device against another) that way; ``numerics locate`` merges layouts.
"""

import json
import os
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from torchtitan_npu.numerics.compare import Capture, Record


def _stats(tensor: torch.Tensor, data_name: str) -> dict[str, Any]:
    t = tensor.detach().double()
    return {
        "type": "torch.Tensor",
        "dtype": str(tensor.dtype),
        "shape": list(tensor.shape),
        "Max": float(t.max()) if t.numel() else None,
        "Min": float(t.min()) if t.numel() else None,
        "Mean": float(t.mean()) if t.numel() else None,
        "Norm": float(t.norm()) if t.numel() else None,
        "requires_grad": False,
        "data_name": data_name,
    }


def _place(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system
        shutil.copyfile(source, target)


def export(capture: Capture, out: Path, step: int) -> list[Path]:
    """Write ``capture`` as msprobe dumps under ``out``; the rank folders."""
    by_rank: dict[int, list[Record]] = defaultdict(list)
    for ranks in capture.records.values():
        for record in ranks:
            by_rank[record.rank].append(record)
    written = []
    for rank, records in sorted(by_rank.items()):
        folder = out / f"step{step - 1}" / f"rank{rank}"
        tensors = folder / "dump_tensor_data"
        tensors.mkdir(parents=True)
        classes = {r.name: r.cls for r in records if r.kind == "forward"}
        data: dict[str, Any] = {}
        for r in sorted(records, key=lambda r: r.seq):
            if r.file is None:
                continue
            tensor = capture.load(r)
            if r.kind == "forward":
                key = f"Module.{r.name}.{r.cls}.forward.{r.call}"
                name = f"{key}.output.{r.leaf}.pt"
                entry = data.setdefault(key, {"input_args": [], "input_kwargs": {}})
                entry.setdefault("output", []).append(_stats(tensor, name))
            else:
                module, _, param = r.name.rpartition(".")
                owner = classes.get(module, "Module")
                key = f"Module.{module}.{owner}.parameters_grad.0"
                name = f"{key}.{param}.pt"
                data.setdefault(key, {})[param] = [_stats(tensor, name)]
            _place(capture.folder / f"rank-{rank}" / r.file, tensors / name)
        dump = {
            "task": "tensor",
            "level": "L0",
            "framework": "pytorch",
            "dump_data_dir": str(tensors),
            "data": data,
        }
        (folder / "dump.json").write_text(json.dumps(dump, indent=1))
        forward = [k for k in data if ".forward." in k]
        (folder / "construct.json").write_text(json.dumps(dict.fromkeys(forward)))
        (folder / "stack.json").write_text(json.dumps({"0": [forward, []]}))
        written.append(folder)
    return written
