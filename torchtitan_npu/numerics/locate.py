"""``titan-npu numerics locate``: two setups, one seed, one batch; the first
module whose numbers part.

Each setup is a ``titan-npu train`` argument string (``--a "--nproc-per-node
2 --parallelism.tensor_parallel_degree 2"``); arguments after the options are
shared by both. Both setups start from one seed checkpoint (setup A's model,
one process) and read the same batch: when their data-parallel degrees
differ, a local corpus is repeated so that every data-parallel rank's shard
starts with the same records (a dp=2 batch is then two copies of the dp=1
one). Gradient clipping is off in both runs (``training.max_norm`` inf) so
gradients are compared as backward made them. At step N every module's
outputs and every parameter's gradient are captured (``hooks``), then compared
record by record (``compare``).
"""

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchtitan_npu.errors import UsageError
from torchtitan_npu.numerics import ENV

_PARALLELISM = "--parallelism."


@dataclass
class Setup:
    label: str  # "A" or "B"
    text: str  # as given
    flags: argparse.Namespace  # train's own options (--nproc-per-node, --device)
    overrides: list[str]  # --section.key value pairs
    config: dict[str, Any]  # resolved
    world_size: int
    python: str = sys.executable  # the environment it trains in (its upstream)

    @property
    def option(self) -> str:
        return f"--{self.label.lower()}"

    def flag_args(self, *, single: bool = False) -> list[str]:
        args = []
        if self.flags.config:
            args += ["--config", self.flags.config]
        if self.flags.device:
            args += ["--device", self.flags.device]
        if not single:
            args += ["--nproc-per-node", str(self.flags.nproc_per_node)]
        for switch in ("detect_nonfinite", "verbose", "log_all_ranks"):
            if getattr(self.flags, switch, False):
                args.append(f"--{switch.replace('_', '-')}")
        return args


def setup_words(label: str, text: str) -> list[str]:
    """A setup's ``train`` arguments, split as a shell would."""
    try:
        return shlex.split(text)
    except ValueError as e:
        raise UsageError(f"--{label.lower()} {text!r}: {e}") from None


def parse_setup(
    label: str,
    text: str,
    flags: argparse.Namespace,
    overrides: list[str],
    python: str | None = None,
) -> Setup:
    """A setup from its text and train's reading of it (``flags``: train's
    own options; ``overrides``: the rest), trained by ``python`` (another
    environment, e.g. another upstream; default: this one)."""
    from torchtitan_npu import launcher
    from torchtitan_npu.config import resolve

    option = f"--{label.lower()}"
    if flags.nnodes != "1":
        raise UsageError(f"{option}: locate runs on this machine (drop --nnodes)")
    if python is not None and not os.access(python, os.X_OK):
        raise UsageError(f"{option}-python {python}: not an executable Python")
    config = resolve(flags.config, overrides)
    world_size = launcher.world_size(flags.nproc_per_node, "1")
    assert world_size is not None  # --nnodes 1
    return Setup(
        label, text, flags, overrides, config, world_size, python or sys.executable
    )


def _step_within(setup: Setup, step: int) -> None:
    steps = setup.config.get("training", {}).get("steps")
    if step < 1:
        raise UsageError(f"--step {step}: steps count from 1")
    if isinstance(steps, int) and step > steps:
        raise UsageError(
            f"--step {step} is beyond setup {setup.label}'s training.steps "
            f"{steps}: pick a step it trains, or raise --training.steps"
        )


def _empty_folder(out: Path) -> None:
    """``out`` exists, is empty and can be written; else one line."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(
            f"--out {out} already holds files: choose a new folder (nothing "
            "of an earlier locate is overwritten)"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-probe"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"--out {out} cannot be written: {e.strerror or e}") from None


def _train(setup: Setup, argv: list[str], env: dict[str, str], what: str) -> None:
    """``titan-npu train ARGV`` in the setup's environment; train's own
    one-line error when it fails."""
    print(f"numerics locate: {what}", flush=True)
    command = [setup.python, "-m", "torchtitan_npu.cli", "train", *argv]
    result = subprocess.run(command, env=env)
    if result.returncode != 0:
        raise LocateFailed(what, result.returncode)


class LocateFailed(Exception):
    """A run locate launched did not finish; train has said why."""

    def __init__(self, what: str, code: int) -> None:
        super().__init__(f"{what}: failed (exit {code}), see its message above")
        self.code = code


def _seed(setup: Setup, folder: Path, env: dict[str, str]) -> Path:
    """A step-0 checkpoint of the setup's model, made by one process."""
    overrides = [
        word
        for group in _groups(setup.overrides)
        if not group[0].startswith(_PARALLELISM)
        for word in group
    ]
    argv = [
        *setup.flag_args(single=True),
        *overrides,
        "--parallelism.data_parallel_shard_degree", "1",
        "--parallelism.data_parallel_replicate_degree", "1",
        "--parallelism.tensor_parallel_degree", "1",
        "--parallelism.pipeline_parallel_degree", "1",
        "--parallelism.context_parallel_degree", "1",
        "--checkpoint.enable", "true",
        "--checkpoint.create_seed_checkpoint", "true",
        "--training.steps", "1",
        "--job.dump_folder", str(folder),
    ]  # fmt: skip
    _train(setup, argv, env, f"seed checkpoint of setup {setup.label}'s model")
    return (
        folder
        / str(setup.config.get("checkpoint", {}).get("folder", "checkpoint"))
        / "step-0"
    )


def _groups(overrides: list[str]) -> list[list[str]]:
    """``--a.b value`` / ``--a.b=value`` / ``--flag`` words, one list per key."""
    groups: list[list[str]] = []
    for word in overrides:
        if word.startswith("--") or not groups:
            groups.append([word])
        else:
            groups[-1].append(word)
    return groups


def _parameters(checkpoint: Path) -> dict[str, list[int]]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(checkpoint)).read_metadata()
    return {
        name: list(item.size)
        for name, item in metadata.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata)
    }


def _same_model(a: dict[str, list[int]], b: dict[str, list[int]]) -> None:
    problems = [f"B has no {n}" for n in a if n not in b]
    problems += [f"A has no {n}" for n in b if n not in a]
    problems += [
        f"{n} is {a[n]} in A and {b[n]} in B" for n in a if n in b and a[n] != b[n]
    ]
    if problems:
        shown = "; ".join(problems[:3])
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise UsageError(
            f"setups A and B build different models: {shown}{more}; locate "
            "compares one model under two setups"
        )


def _model_settings(setup: Setup) -> Any:
    return setup.config.get("model", {})


def _dp_degree(degrees: dict[str, int]) -> int:
    return degrees["dp_replicate"] * degrees["dp_shard"]


def _shared_data(a: Setup, b: Setup, dp_a: int, dp_b: int, out: Path) -> list[str]:
    """Data settings under which both setups' data rank 0 reads one batch."""
    if dp_a == dp_b:
        return []
    from torchtitan_npu.assets import ensure_default_assets
    from torchtitan_npu.config.schema import EMBEDDED

    training = a.config.get("training", {})
    dataset, path = training.get("dataset"), training.get("dataset_path")
    if dataset == EMBEDDED or dataset is None:
        source = ensure_default_assets().dataset_path / "data.jsonl"
    elif path and (Path(path) / "data.jsonl").is_file():
        source = Path(path) / "data.jsonl"
    else:
        raise UsageError(
            f"setups A and B have data-parallel degrees {dp_a} and {dp_b}: locate "
            "gives both one batch only on a local corpus (the embedded one, or "
            "--training.dataset_path with a data.jsonl); use one data-parallel "
            "degree for both"
        )
    copies = math.lcm(dp_a, dp_b)
    folder = out / "data"
    folder.mkdir()
    (folder / "data.jsonl").write_text(source.read_text() * copies)
    return ["--training.dataset", "c4_test", "--training.dataset_path", str(folder)]


def _capture_run(
    setup: Setup,
    seed: Path,
    data: list[str],
    step: int,
    degrees: dict[str, int],
    out: Path,
    env: dict[str, str],
) -> Path:
    folder = out / setup.label
    capture = folder / "capture"
    spec = {"capture": str(capture), "step": step, "degrees": degrees}
    argv = [
        *setup.flag_args(),
        *setup.overrides,
        *data,
        "--checkpoint.enable", "true",
        "--checkpoint.initial_load_path", str(seed),
        "--checkpoint.initial_load_model_only", "true",
        "--checkpoint.interval", str(step + 1),
        "--training.steps", str(step),
        "--training.max_norm", "inf",
        "--metrics.enable_tensorboard", "true",
        "--job.dump_folder", str(folder),
    ]  # fmt: skip
    _train(
        setup,
        argv,
        {**env, ENV: json.dumps(spec)},
        f"setup {setup.label} ({setup.text or 'defaults'}) to step {step}",
    )
    return capture


def _losses(out: Path, step: int) -> str:
    from torchtitan_npu.tools.scalars import GRAD_NORM, LOSS, read_scalars

    runs = [read_scalars(out / x, (LOSS, GRAD_NORM)) for x in "AB"]
    parts = []
    for tag in (LOSS, GRAD_NORM):
        a, b = (run[tag].get(step) for run in runs)
        if a is not None and b is not None:
            rel = abs(a - b) / abs(b) if b else 0.0
            parts.append(
                f"{tag.rsplit('/', 1)[-1]} A {a:.6g} B {b:.6g} (rel {rel:.1e})"
            )
    return "; ".join(parts)


def locate(args: argparse.Namespace, a: Setup, b: Setup) -> int:
    """Run both setups, compare, report; 0 when nothing departs, 1 when the
    setups part (a launch's own exit code when it fails)."""
    from torchtitan_npu.config import preflight
    from torchtitan_npu.config.preflight import mesh_degrees
    from torchtitan_npu.numerics import compare

    started = time.perf_counter()
    for setup in (a, b):
        _step_within(setup, args.step)
    out = Path(args.out or f"outputs/numerics/{time.strftime('%Y%m%d-%H%M%S')}")
    for setup in (a, b):  # a setup train would refuse: one line, nothing run
        launch = f"{setup.option} --nproc-per-node {setup.flags.nproc_per_node}"
        preflight.check_early(setup.config, world_size=setup.world_size, launch=launch)
        preflight.check(setup.config, world_size=setup.world_size, launch=launch)
    _empty_folder(out)
    degrees = {s.label: mesh_degrees(s.config, s.world_size) for s in (a, b)}
    dp_a, dp_b = (_dp_degree(degrees[s.label]) for s in (a, b))
    env = {k: v for k, v in os.environ.items() if k != ENV}
    try:
        data = _shared_data(a, b, dp_a, dp_b, out)
        seed = _seed(a, out / "seed-A", env)
        if _model_settings(a) != _model_settings(b) or a.python != b.python:
            _same_model(_parameters(seed), _parameters(_seed(b, out / "seed-B", env)))
        captures = [
            _capture_run(s, seed, data, args.step, degrees[s.label], out, env)
            for s in (a, b)
        ]
    except LocateFailed as e:
        print(f"titan-npu: error: numerics locate: {e}", file=sys.stderr)
        return e.code
    first, second = (compare.Capture(c) for c in captures)
    forward, backward = compare.compare(first, second)
    print(f"\nnumerics locate: step {args.step}, A = {a.text!r}, B = {b.text!r}")
    if losses := _losses(out, args.step):
        print(f"  {losses}")
    print(compare.summary(forward, backward, args.rtol, args.top))
    report = out / "report.json"
    report.write_text(json.dumps(compare.as_json(forward, backward), indent=1))
    picture = compare.plot(forward, backward, args.rtol, out / "locate.png")
    print(f"report: {report}" + (f"; picture: {picture}" if picture else ""))
    if args.msprobe:
        from torchtitan_npu.numerics import msprobe

        dumps = [out / x / "msprobe" for x in "AB"]
        for capture, dump in zip((first, second), dumps):
            msprobe.export(capture, dump, args.step)
        step = f"step{args.step - 1}"
        print(
            f"msprobe dumps: {dumps[0]}, {dumps[1]} (msprobe compare -tp "
            f"{dumps[1] / step} -gp {dumps[0] / step} -o {out / 'msprobe-compare'})"
        )
    print(f"({time.perf_counter() - started:.0f} s)")
    departed = compare.first_departure(forward, args.rtol) or compare.first_departure(
        backward, args.rtol
    )
    return 1 if departed else 0
