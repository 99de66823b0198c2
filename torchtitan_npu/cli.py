"""``titan-npu``: train | plan | convert | checkpoint | models | doctor | compat
| loss-compare.

Importing this module (and ``titan-npu --help``) must not import torch.
"""

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from torchtitan_npu.errors import UsageError, UserError


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    return _interruptible(
        lambda: _launch(args, overrides), "train", "nothing was launched"
    )


def _launch(args: argparse.Namespace, overrides: list[str]) -> int:
    from torchtitan_npu import launcher
    from torchtitan_npu.distributed import (
        DEVICE_ENV,
        check_torch_loads,
        select_device_type,
    )
    from torchtitan_npu.distributed.hccl import deterministic_env

    world_size = launcher.world_size(args.nproc_per_node, args.nnodes)
    if args.nnodes != "1" and not args.rdzv_endpoint:
        raise launcher.LaunchError("--nnodes other than 1 needs --rdzv-endpoint")
    if args.device:
        os.environ[DEVICE_ENV] = args.device
    if args.detect_nonfinite:
        from torchtitan_npu.numerics import ENV

        spec = json.loads(os.environ.get(ENV) or "{}")
        os.environ[ENV] = json.dumps({**spec, "nonfinite": True})

    from torchtitan_npu.config import preflight, resolve

    config = resolve(args.config, overrides)  # no torch yet: TOML errors are instant
    launch = f"--nproc-per-node {args.nproc_per_node} x --nnodes {args.nnodes}"
    preflight.check_early(config, world_size=world_size, launch=launch)
    launch_id = time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"
    metrics = config.setdefault("metrics", {})
    # One TensorBoard folder per launch (upstream's is per minute).
    metrics["save_tb_folder"] = f"{metrics.get('save_tb_folder', 'tb')}/{launch_id}"
    dump_folder = Path(config.get("job", {}).get("dump_folder", "./outputs"))
    lock = launcher.DumpFolderLock(dump_folder, per_host=args.nnodes != "1")
    lock.acquire()  # before the slow checks: a busy folder fails at once
    result = None
    try:
        check_torch_loads()  # torch_npu without CANN: one line, not a traceback
        preflight.check(config, world_size=world_size, launch=launch)
        if done := preflight.already_trained(config):
            print(f"titan-npu: {done}", flush=True)
            return 0
        if args.plan:
            _plan_before_training(config, world_size)
        run_dir = dump_folder / "logs" / launch_id
        run_dir.mkdir(parents=True)
        resolved = dump_folder / "titan_npu_config.json"
        resolved.write_text(json.dumps(config, indent=2))
        command = [sys.executable, "-m", "torch.distributed.run"]
        shown = shown_local_rank(config, args)
        flags = torchrun_args(args, shown, log_dir=run_dir / launcher.RANKS_DIR)
        command += [*flags, "-m", "torchtitan_npu.entry", str(resolved)]
        print(f"titan-npu: training, log in {run_dir / 'launcher.log'}", flush=True)
        assert lock.fd is not None  # held until the run ends
        env = launcher.worker_env(run_dir)
        env.update(deterministic_env(config, select_device_type(), env))
        result = launcher.supervise(
            command,
            env,
            log=run_dir / "launcher.log",
            verbose=args.verbose,
            keep_fds=(lock.fd,),
        )
    finally:
        lock.release(started=result is not None)
    tb_folder = dump_folder / metrics["save_tb_folder"]
    if result.stopped_by is not None:  # Ctrl-C or SIGTERM, passed on to the run
        print(launcher.run_summary(result, dump_folder, tb_folder), flush=True)
        return 128 + result.stopped_by
    if result.returncode != 0:
        alone = None if args.log_all_ranks else shown
        line, code = launcher.failure_line(result, run_dir, shown_rank=alone)
        print(f"titan-npu: error: {line}", file=sys.stderr, flush=True)
        return code
    print(launcher.run_summary(result, dump_folder, tb_folder), flush=True)
    return 0


def _plan_before_training(config: dict, world_size: int | None) -> None:
    """`train --plan`: the estimate, one line; a warning (the run still
    starts) when it exceeds this machine's device memory."""
    from torchtitan_npu.distributed import select_device_type
    from torchtitan_npu.plan import devices, report
    from torchtitan_npu.plan.estimate import estimate

    if world_size is None:
        print("titan-npu: plan: skipped (elastic --nnodes MIN:MAX)", flush=True)
        return
    device_type = select_device_type()
    worst = estimate(config, world_size, device_type).worst
    memory = devices.local_device_memory(device_type)
    fit = report.verdict(worst.peak, memory) if memory else f"{device_type}: no limit"
    print(
        f"titan-npu: plan: peak {report.size(worst.peak)} per rank; {fit}", flush=True
    )
    if memory is not None and worst.peak > memory:
        print(
            "titan-npu: warning: the plan's peak exceeds the device memory; "
            "training anyway (see `titan-npu plan --search`)",
            file=sys.stderr,
            flush=True,
        )


def _plan(args: argparse.Namespace, overrides: list[str]) -> int:
    return _interruptible(
        lambda: _make_plan(args, overrides), "plan", "no plan was made"
    )


def _make_plan(args: argparse.Namespace, overrides: list[str]) -> int:
    from torchtitan_npu import launcher
    from torchtitan_npu.config import parse_overrides, preflight, resolve
    from torchtitan_npu.distributed import check_torch_loads
    from torchtitan_npu.plan import devices

    world_size = launcher.world_size(args.nproc_per_node, args.nnodes)
    if world_size is None:
        raise launcher.LaunchError("plan needs a fixed --nnodes (not MIN:MAX)")
    memory = None
    if args.device_memory:
        memory = devices.parse_memory(args.device_memory)
    elif args.device_name:
        memory = devices.device_memory(args.device_name)
    if args.search and memory is None:
        raise devices.PlanError("--search needs --device-memory or --device-name")
    config = resolve(args.config, overrides)
    launch = f"--nproc-per-node {args.nproc_per_node} x --nnodes {args.nnodes}"
    early = None if args.search else world_size
    preflight.check_early(config, world_size=early, launch=launch)
    check_torch_loads()
    from torchtitan_npu.distributed import select_device_type

    target = args.device or (
        devices.device_type_of(args.device_name)
        if args.device_name
        else select_device_type()
    )
    preflight.check(
        config,
        world_size=None if args.search else world_size,
        launch=launch,
        device_type=target,
        layout=not args.search,
    )
    from torchtitan_npu.plan import report
    from torchtitan_npu.plan.estimate import estimate
    from torchtitan_npu.plan.search import kept, search

    model = config.get("model", {})
    training = config.get("training", {})
    print(
        f"titan-npu plan: {model.get('name')} {model.get('flavor')}, seq_len "
        f"{training.get('seq_len')}, local batch {training.get('local_batch_size')}, "
        f"on {world_size} {target} devices",
        file=sys.stderr,
        flush=True,
    )
    if args.search:
        assert memory is not None  # checked above
        per_node = int(args.nproc_per_node)
        ranked = search(
            config,
            world_size,
            per_node,
            memory,
            target,
            all_layers=args.all_layers,
            fixed=kept(parse_overrides(overrides)),
        )
        print(report.ranking(ranked, memory))
        planned = report.bars(ranked)
    else:
        result = estimate(
            config,
            world_size,
            target,
            all_layers=args.all_layers,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
        print(report.describe(result, memory))
        planned = [(report.layout_name(result.degrees), result.worst)]
        if args.measure:
            print(report.measured(_measure(config, args), result))
    if args.plot:
        report.plot(planned, memory, Path(args.plot))
        print(f"plot: {args.plot}")
    return 0


def _measure(config: dict, args: argparse.Namespace) -> list[dict]:
    """The plan's steps on real tensors on this machine (torchrun)."""
    import subprocess
    import tempfile

    if args.nnodes != "1":
        raise UsageError("--measure runs on this machine: --nnodes 1")
    with tempfile.TemporaryDirectory(prefix="titan-npu-measure-") as tmp:
        config_file = Path(tmp) / "config.json"
        config_file.write_text(json.dumps(config))
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", args.nproc_per_node,
            "-m", "torchtitan_npu.plan.measure", str(config_file), tmp,
        ]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"--measure failed:\n{result.stderr[-3000:]}")
        ranks = sorted(Path(tmp).glob("rank-*.json"))
        return [json.loads(p.read_text()) for p in ranks]


def shown_local_rank(config: dict, args: argparse.Namespace) -> int:
    """The local rank whose output a launch shows: 0, or under pipeline
    parallelism the node's last (the last stage's ranks come last, and only
    they compute the loss)."""
    pp = config.get("parallelism", {}).get("pipeline_parallel_degree", 1)
    if pp == 1 or not args.nproc_per_node.isdigit():
        return 0
    return int(args.nproc_per_node) - 1


def torchrun_args(
    args: argparse.Namespace, shown_rank: int = 0, log_dir: Path | None = None
) -> list[str]:
    """torchrun flags: standalone on one node, c10d rendezvous across nodes;
    the output of local rank ``shown_rank`` only, unless all are asked for.
    With ``log_dir``, torchrun keeps its files there, the hidden ranks'
    output among them (``launcher.rank_output`` finds it) instead of
    dropping it."""
    from torchtitan_npu import launcher

    flags = [f"--nproc-per-node={args.nproc_per_node}"]
    if args.nnodes == "1" and not args.rdzv_endpoint:
        flags.append("--standalone")
    else:
        flags += [
            f"--nnodes={args.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={args.rdzv_endpoint}",
            f"--rdzv-id={args.rdzv_id}",
        ]
    if log_dir is not None:  # torchrun's files there, not in a /tmp folder
        flags.append(f"--log-dir={log_dir}")
    if not args.log_all_ranks:
        flags.append(f"--local-ranks-filter={shown_rank}")
        hidden = launcher.hidden_local_ranks(args.nproc_per_node, shown_rank)
        if log_dir is not None and hidden:
            flags.append("--redirects=" + ",".join(f"{r}:3" for r in hidden))
    return flags


def _doctor(args: argparse.Namespace, rest: list[str]) -> int:
    from torchtitan_npu.tools.doctor import run

    return run()


def _models(args: argparse.Namespace, rest: list[str]) -> int:
    from torchtitan_npu.tools.models import main

    return main()


def _compat_check(args: argparse.Namespace, rest: list[str]) -> int:
    from torchtitan_npu.tools.compat_tool import check_installed

    return check_installed()


def _compat_record(args: argparse.Namespace, rest: list[str]) -> int:
    from torchtitan_npu.tools.compat_tool import record_installed

    return record_installed()


def _compat_sync(args: argparse.Namespace, rest: list[str]) -> int:
    from torchtitan_npu.tools.compat_sync import main

    return main(args.candidate, quick=args.quick, write=args.record, out=args.report)


def _compat_docs(args: argparse.Namespace, rest: list[str]) -> int:
    from torchtitan_npu.tools.versioning import write_docs

    for path in write_docs():
        print(f"wrote {path}")
    return 0


def _numerics_locate(args: argparse.Namespace, rest: list[str]) -> int:
    from torchtitan_npu.numerics.locate import locate, parse_setup, setup_words

    setups = []
    for label, text in (("A", args.a), ("B", args.b)):
        words = [*rest, *setup_words(label, text)]  # the setup's own win
        try:
            flags, overrides = build_parser().parse_known_args(["train", *words])
        except SystemExit:  # argparse has said what it could not read
            raise UsageError(
                f"--{label.lower()} {text!r} is not a list of titan-npu train arguments"
            ) from None
        python = getattr(args, f"{label.lower()}_python")
        setups.append(parse_setup(label, text, flags, overrides, python))
    return _interruptible(
        lambda: locate(args, *setups),
        "numerics locate",
        "the comparison is incomplete",
    )


def _loss_compare(args: argparse.Namespace, rest: list[str]) -> int:
    from torchtitan_npu.tools.loss_compare import main

    return main(args)


def _convert(args: argparse.Namespace, rest: list[str]) -> int:
    return _interruptible(
        lambda: _run_convert(args), "convert", f"{args.out} was not written"
    )


def _interruptible(run: Callable[[], int], what: str, undone: str) -> int:
    """run() with Ctrl-C / SIGTERM as one line (`what` stopped by SIGINT;
    `undone`); a writer stops at its next tensor and leaves no OUT
    (atomic_dir). A launched run forwards them instead (``supervise``)."""
    from torchtitan_npu import interrupts
    from torchtitan_npu.errors import Interrupted

    def stop(signum, frame):
        raise Interrupted(signum, what)

    try:
        with interrupts.handled(stop):
            return run()
    except Interrupted as e:
        print(f"titan-npu: error: {e}; {undone}", file=sys.stderr)
        return 128 + e.signum


def _run_convert(args: argparse.Namespace) -> int:
    from torchtitan_npu.models import HF_FLAVOR
    from torchtitan_npu.state_dict_adapters import convert

    dtype = convert.DTYPE_ARGS.get(args.dtype) if args.dtype else None
    if args.model is None and args.direction == "from-hf":
        args.model = convert.model_of(args.source)  # the one config.json names
    elif args.model is None:  # to-hf: the one the checkpoint's run recorded
        args.model = convert.recorded_model(Path(args.source))[0]
        if args.model is None:
            raise convert.ConversionError(
                f"native checkpoint {args.source}",
                [
                    "its model is not recorded (no from-hf record, no training "
                    "run config beside it); pass --model (titan-npu models lists them)"
                ],
            )
    common = dict(model=args.model, flavor=args.flavor, dtype=dtype)
    if args.direction == "from-hf":
        result = convert.from_hf(
            args.source, args.out, skip_mtp=args.skip_mtp, **common
        )
        model = f"--model.name {args.model} --model.flavor {result.flavor}"
        if result.flavor == HF_FLAVOR:  # the architecture is config.json's
            model += f" --model.hf_assets_path {args.source}"
        hint = f"train from it: {model} --checkpoint.initial_load_path {result.out}"
    else:
        result = convert.to_hf(
            args.source,
            args.out,
            fp8_like_source=args.dtype == "fp8-like-source",
            max_shard_size=args.max_shard_size,
            tokenizer=args.tokenizer,
            hf_config=args.hf_config,
            **common,
        )
        hint = "load it with transformers' from_pretrained"
    print(
        f"titan-npu convert: wrote {result.out} ({args.model} {result.flavor}, "
        f"{result.tensors} tensors, {result.nbytes / 1e9:.3f} GB, "
        f"{result.seconds:.1f} s); {hint}"
    )
    return 0


def _checkpoint_migrate(args: argparse.Namespace, _: list[str]) -> int:
    from torchtitan_npu.state_dict_adapters.migrate import migrate

    def run() -> int:
        result = migrate(args.source, args.out, args.to)
        resume = f"--checkpoint.initial_load_path {result.out}"
        if result.model_only:
            resume = f"train from it (model only: no optimizer state saved): {resume}"
        else:
            resume = (
                f"resume from it: {resume} --checkpoint.initial_load_model_only false"
            )
        print(
            f"titan-npu checkpoint migrate: wrote {result.out} (era "
            f"{result.source_era} -> torchtitan {args.to}'s names, {result.tensors} "
            f"tensors, {result.nbytes / 1e9:.3f} GB, {result.seconds:.1f} s); data "
            f"position: {result.data}; {resume}"
        )
        return 0

    return _interruptible(run, "checkpoint migrate", f"{args.out} was not written")


def _checkpoint_inspect(args: argparse.Namespace, _: list[str]) -> int:
    from torchtitan_npu.tools import checkpoint_inspect

    return checkpoint_inspect.main(args.path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="titan-npu",
        description="Train upstream torchtitan on npu > cuda > cpu, fork-free.",
    )
    parser.add_argument(
        "--version",
        action="store_true",
        help="titan-npu, upstream torchtitan, torch, torch_npu and device",
    )
    commands = parser.add_subparsers(dest="command")

    train = commands.add_parser(
        "train",
        help="train (default: the embedded debug llama3)",
        description=(
            "Train with a titan-npu TOML config. Any other --section.key value "
            "overrides the config, e.g. --training.steps 50."
        ),
    )
    train.add_argument("--config", help="train-config TOML (default: llama3 debug)")
    train.add_argument("--nproc-per-node", default="1", help="processes per node")
    train.add_argument("--nnodes", default="1", help="nodes (torchrun syntax)")
    train.add_argument("--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous")
    train.add_argument("--rdzv-id", default="titan-npu", help="rendezvous job id")
    train.add_argument("--device", choices=["npu", "cuda", "cpu"], help="force one")
    train.add_argument(
        "--log-all-ranks", action="store_true", help="print every rank's log"
    )
    train.add_argument(
        "--plan",
        action="store_true",
        help="estimate per-rank memory first (titan-npu plan); warn if it "
        "exceeds the device",
    )
    train.add_argument(
        "--detect-nonfinite",
        action="store_true",
        help="stop at the first module and step whose forward output or "
        "backward gradient holds a NaN or Inf (one line; its input statistics "
        "beside the log)",
    )
    train.add_argument(
        "--verbose",
        action="store_true",
        help="show torchrun's own output and tracebacks (always in the log file)",
    )
    train.set_defaults(handler=_train, needs_upstream=True)

    convert = commands.add_parser(
        "convert", help="HF safetensors <-> native (DCP) checkpoints"
    )
    directions = convert.add_subparsers(dest="direction", required=True)
    for name, source, help_ in [
        ("from-hf", "HF_DIR", "HF checkpoint -> native checkpoint to train from"),
        ("to-hf", "CKPT", "native checkpoint -> HF safetensors + config.json"),
    ]:
        sub = directions.add_parser(name, help=help_, description=help_)
        sub.add_argument("source", metavar=source)
        sub.add_argument("out", metavar="OUT", help="new directory (atomic)")
        sub.add_argument(
            "--model",
            help="llama3, qwen3, ... (default: the one config.json names, for "
            "to-hf the one the checkpoint's run or from-hf recorded)",
        )
        sub.add_argument(
            "--flavor",
            help="default: the registered flavor config.json (from-hf) or the "
            "tensors (to-hf) describe, else 'hf': derived from config.json",
        )
        dtypes = ["bf16", "fp16", "fp32"]
        if name == "from-hf":
            sub.add_argument("--dtype", choices=dtypes, help="default: as stored")
            sub.add_argument(
                "--skip-mtp",
                action="store_true",
                help="leave out multi-token-prediction layers (deepseek_v3)",
            )
        else:
            sub.add_argument(
                "--dtype",
                choices=[*dtypes, "fp8-like-source"],
                help="default: the checkpoint's; fp8-like-source: the source's "
                "block-wise FP8",
            )
            sub.add_argument("--max-shard-size", default="5GB")
            sub.add_argument("--tokenizer", help="copy HF tokenizer files from DIR")
            sub.add_argument(
                "--hf-config",
                help="config.json (or HF directory) the checkpoint's architecture "
                "was derived from (found by itself for from-hf and hf runs)",
            )
        sub.set_defaults(handler=_convert, needs_upstream=True)

    checkpoint = commands.add_parser("checkpoint", help="native (DCP) checkpoints")
    checkpoint_commands = checkpoint.add_subparsers(
        dest="checkpoint_command", required=True
    )
    inspect = checkpoint_commands.add_parser(
        "inspect",
        help="era, model, step, layout, sizes and training state, from metadata",
    )
    inspect.add_argument("path", metavar="DIR", help="a DCP checkpoint directory")
    inspect.set_defaults(handler=_checkpoint_inspect, needs_upstream=True)
    migrate = checkpoint_commands.add_parser(
        "migrate",
        help="a checkpoint of one upstream version in another's names",
        description=(
            "Rename a DCP training checkpoint (model, optimizer, lr scheduler, "
            "data position) for another locked upstream, e.g. after upgrading "
            "0.2.2 -> 0.3.0; run it with that upstream installed."
        ),
    )
    migrate.add_argument("source", metavar="SRC", help="a DCP checkpoint directory")
    migrate.add_argument("out", metavar="OUT", help="new checkpoint directory")
    migrate.add_argument(
        "--to", required=True, metavar="VERSION", help="the installed upstream's"
    )
    migrate.set_defaults(handler=_checkpoint_migrate, needs_upstream=True)

    plan = commands.add_parser(
        "plan",
        help="per-rank device memory of a run, before launch (--search: layouts)",
        description=(
            "Estimate each rank's peak device memory for a train config and "
            "launch shape, on fake tensors (nothing is allocated). Takes the "
            "same --config and --section.key value overrides as train."
        ),
    )
    plan.add_argument("--config", help="train-config TOML (default: llama3 debug)")
    plan.add_argument("--nproc-per-node", default="1", help="devices per node")
    plan.add_argument("--nnodes", default="1", help="nodes")
    plan.add_argument(
        "--device",
        choices=["npu", "cuda", "cpu"],
        help="the device type to plan for (default: --device-name's, else this "
        "machine's); planning itself runs on the CPU",
    )
    memory = plan.add_mutually_exclusive_group()
    memory.add_argument("--device-memory", help="per-device memory, e.g. 64GiB")
    memory.add_argument(
        "--device-name", help="a known device, e.g. Ascend910B3, H100 (its memory)"
    )
    plan.add_argument(
        "--search",
        action="store_true",
        help="plan the layouts the device count allows (tp, ep, HSDP, "
        "activation checkpointing, local batch; pp and cp where nothing fits "
        "without), keeping those given as overrides; rank those that fit",
    )
    plan.add_argument(
        "--measure",
        action="store_true",
        help="also run the plan's steps on this machine's devices and compare",
    )
    plan.add_argument("--plot", help="write a stacked-bar PNG here")
    plan.add_argument(
        "--all-layers",
        action="store_true",
        help="step every layer (slower) instead of extending a deep model's "
        "repeated layers on a line from a few of them",
    )
    plan.set_defaults(handler=_plan, needs_upstream=True)

    doctor = commands.add_parser("doctor", help="versions, device, patch table")
    doctor.set_defaults(handler=_doctor)
    commands.add_parser(
        "models", help="models and flavors of the installed upstream, with sizes"
    ).set_defaults(handler=_models, needs_upstream=True)

    compat = commands.add_parser("compat", help="upstream.lock tools")
    compat_commands = compat.add_subparsers(dest="compat_command", required=True)
    compat_commands.add_parser(
        "check", help="verify every patch target of the installed upstream"
    ).set_defaults(handler=_compat_check)
    compat_commands.add_parser(
        "record", help="record the installed upstream's fingerprints in the lock"
    ).set_defaults(handler=_compat_record)
    sync = compat_commands.add_parser(
        "sync",
        help="what a new upstream breaks: install it into a throwaway env, compare "
        "every patch target, config field and model with the nearest locked "
        "release, then run the checks there",
    )
    sync.add_argument(
        "candidate",
        help="a PyPI version (0.3.1), a wheel file, or a git source with a commit "
        "(git+https://github.com/pytorch/torchtitan@<commit>)",
    )
    sync.add_argument(
        "--record", action="store_true", help="write its upstream.lock entry and docs"
    )
    sync.add_argument(
        "--quick",
        action="store_true",
        help="activation, compat check and a 2-step train only (no suite, no matrix)",
    )
    sync.add_argument("--report", help="where to write the markdown report")
    sync.set_defaults(handler=_compat_sync)
    compat_commands.add_parser(
        "docs",
        help="regenerate docs/versioning_policy.md (upstream.lock) and "
        "docs/patches.md (the patch registry)",
    ).set_defaults(handler=_compat_docs)

    numerics = commands.add_parser(
        "numerics", help="where two setups' numbers part (locate)"
    )
    numerics_commands = numerics.add_subparsers(dest="numerics_command", required=True)
    locate = numerics_commands.add_parser(
        "locate",
        help="two setups from one seed and batch: the first module that differs",
        description="Train two setups (each a string of `titan-npu train` "
        "arguments) from one seed checkpoint on one batch, capture every "
        "module's output and every gradient at --step, and name the first "
        "module whose numbers depart, forward and backward. Arguments after "
        "the options go to both setups. Exit 0: no departure; 1: they part.",
    )
    locate.add_argument("--a", default="", help='setup A, e.g. "--device cpu"')
    locate.add_argument(
        "--b",
        default="",
        help='setup B, e.g. "--nproc-per-node 2 '
        '--parallelism.tensor_parallel_degree 2"',
    )
    for label in "ab":
        locate.add_argument(
            f"--{label}-python",
            help=f"the Python of the environment setup {label.upper()} trains in "
            "(another upstream, say; titan-npu installed there too)",
        )
    locate.add_argument("--step", type=int, default=1, help="the step to compare")
    locate.add_argument(
        "--out",
        help="a new folder for the runs and the report (default: "
        "outputs/numerics/<time>)",
    )
    locate.add_argument(
        "--rtol",
        type=float,
        help="relative error (norm of the difference over B's) above which a "
        "record departs (default: 1e-5 for fp32, 2e-2 for bf16/fp16)",
    )
    locate.add_argument("--top", type=int, default=5, help="worst records shown")
    locate.add_argument(
        "--msprobe",
        action="store_true",
        help="also write each capture as an msprobe dump (OUT/A/msprobe, "
        "OUT/B/msprobe) for MindStudio and `msprobe compare`",
    )
    locate.set_defaults(handler=_numerics_locate, needs_upstream=True)

    compare = commands.add_parser(
        "loss-compare",
        help="compare two runs' loss/grad_norm from TensorBoard (exact)",
        description="Compare two runs' loss and grad_norm, bitwise by default. A "
        "dump folder is read over all its launches (a resumed run is one run).",
    )
    compare.add_argument("run_a", help="dump folder (or TensorBoard folder) of run A")
    compare.add_argument("run_b", help="dump folder (or TensorBoard folder) of run B")
    compare.add_argument("--rtol", type=float, default=0.0, help="0: bitwise")
    compare.add_argument("--atol", type=float, default=0.0, help="0: bitwise")
    compare.add_argument(
        "--mode",
        choices=("bitwise", "computational"),
        default="bitwise",
        help="bitwise (default; or --rtol/--atol): for changes that must not move "
        "the numbers; computational: the accuracy-debug thresholds (first-step "
        "loss abs < 0.005 and rel < 0.5%%, mean loss error abs < 0.01 and rel < "
        "1%%, mean grad_norm rel error <= 10%%) for a kernel or device change",
    )
    compare.add_argument("--steps", help="compare only steps A-B (e.g. 5-8)")
    compare.add_argument("--plot", help="write a PNG of both curves here")
    compare.set_defaults(handler=_loss_compare)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command not in ("train", "plan", "numerics"):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if not args.version and args.command is None:
        parser.error("a command is required (train, convert, doctor, ...)")
    try:
        if args.version:
            from torchtitan_npu.tools.doctor import version_report

            print(version_report())
            return 0
        if getattr(args, "needs_upstream", False):  # untested: one line, at once
            from torchtitan_npu.compat import resolve_upstream

            resolve_upstream()
        return args.handler(args, rest)
    except UserError as e:
        print(f"titan-npu: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a bug: its traceback, kept in a file to report
        report = internal_error_report(args.command or "--version")
        print(
            f"titan-npu: internal error in titan-npu {_version()}: "
            f"{type(e).__name__}: {e} -- please report it with {report}",
            file=sys.stderr,
        )
        return 1


def _version() -> str:
    from torchtitan_npu import __version__

    return __version__


def internal_error_report(command: str) -> Path:
    """Print the exception being handled and write it, with the command line
    and the versions, to a new file in titan-npu's cache folder; its path."""
    import platform
    import traceback

    from torchtitan_npu.assets.builder import cache_base

    text = traceback.format_exc()
    sys.stderr.write(text)
    folder = cache_base() / "error-reports"
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = folder / f"{command.replace(' ', '-')}-{stamp}-{os.getpid()}.txt"
    path.write_text(
        f"titan-npu {_version()}, Python {platform.python_version()}, "
        f"{platform.platform()}\ncommand: {' '.join(sys.argv)}\n\n{text}"
    )
    return path


if __name__ == "__main__":
    sys.exit(main())
