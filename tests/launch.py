"""Fast launches for tests: torchrun's elastic launcher with a warm fork server.

A `titan-npu train` launch spends ~30 s (2 CPU cores) importing torch and
upstream, in the launcher's checks and again in every rank, before its first
step. Tests of what a run does (the matrix, HF save/load, checkpoints) start
their runs here instead: ``elastic_launch`` (the engine behind torchrun: c10d
rendezvous, one process per rank, gloo) with the ``forkserver`` start method,
the server having preloaded upstream (``warm_upstream``): each rank is a fresh
process forked from a clean single-threaded interpreter that has already
imported upstream. (Forking the ranks straight from pytest, whose launcher
holds rendezvous threads, crashed ~1 launch in 70.) The ranks run the same
translation and overlay code as `titan-npu train`, after the launcher's checks
that need no upstream; fresh `titan-npu train` launches (the launcher itself,
its checks and supervision) are tests/test_train_e2e.py and
tests/test_launcher.py.
"""

import json
import multiprocessing
import os
import shutil
import sys
import uuid
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from torchtitan_npu.config import resolve
from torchtitan_npu.distributed import DEVICE_ENV
from torchtitan_npu.entry import hand_over, run_upstream
from torchtitan_npu.tools.scalars import read_scalars

JOB_FILE_ENV = "TITAN_NPU_TEST_JOB_FILE"  # read by warm_upstream


def _rank_main(config_file: str, num_threads: int | None) -> None:
    # multiprocessing ignores a preload module that fails to import.
    assert "warm_upstream" in sys.modules, "the fork server did not preload upstream"
    sys.argv = list(sys.modules["warm_upstream"].UPSTREAM_ARGV)
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    with open(config_file) as f:
        config = json.load(f)
    hand_over(config, os.environ[JOB_FILE_ENV])  # what titan-npu's entry does
    run_upstream()


class WarmLauncher:
    """Upstream imported once in a fork server; ``train`` starts fresh ranks."""

    def __init__(self, workdir: Path) -> None:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        # gloo on CPU, even on an accelerator host, unless a device is asked for.
        os.environ.setdefault(DEVICE_ENV, "cpu")
        self.job_file = workdir / "upstream-job"
        os.environ[JOB_FILE_ENV] = str(self.job_file)
        # The fork server is a new interpreter: it finds warm_upstream (and this
        # module) through PYTHONPATH, not through pytest's sys.path.
        here = Path(__file__).resolve().parent
        paths = [str(here), os.environ.get("PYTHONPATH", "")]
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        multiprocessing.set_forkserver_preload(["warm_upstream"])
        self.crashes: list[str] = []  # launches retried after a rank crashed

    def train(
        self,
        dump_folder: Path,
        args: list[str],
        *,
        nproc: int,
        scalars: bool = True,
        retried: bool = False,
    ) -> dict | None:
        """Train with `titan-npu train` overrides; return TensorBoard scalars."""
        config = resolve(None, [*args, "--job.dump_folder", str(dump_folder)])
        dump_folder.mkdir(parents=True, exist_ok=True)
        given = set(dump_folder.rglob("*"))  # e.g. a checkpoint to resume from
        config_file = dump_folder / "titan_npu_config.json"
        config_file.write_text(json.dumps(config))
        logs = dump_folder / "rank-logs"
        launch = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=nproc,
            run_id=uuid.uuid4().hex,
            rdzv_backend="c10d",
            rdzv_endpoint="127.0.0.1:0",
            max_restarts=0,
            start_method="forkserver",
            logs_specs=DefaultLogsSpecs(log_dir=str(logs), redirects=Std.ALL),
        )
        # As torchrun: one thread per rank when several share the machine.
        threads = 1 if nproc > 1 else None
        try:
            elastic_launch(launch, _rank_main)(str(config_file), threads)
        except ChildFailedError as e:
            rank, failure = e.get_first_failure()
            if failure.exitcode < 0 and not retried:  # killed by a signal
                # A crash of the process, not a wrong number: once, on a busy
                # machine, it is retried from scratch and reported.
                self.crashes.append(f"{dump_folder.name}: {_first_error(e)}")
                for path in sorted(set(dump_folder.rglob("*")) - given, reverse=True):
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
                return self.train(
                    dump_folder, args, nproc=nproc, scalars=scalars, retried=True
                )
            raise LaunchFailed(_first_error(e), logs) from e
        return read_scalars(dump_folder) if scalars else None


def rank_log(dump_folder: Path, rank: int = 0) -> str:
    """A rank's output (stdout, then stderr) over the launches into a folder."""
    files = sorted((dump_folder / "rank-logs").glob(f"*/attempt_*/{rank}/std*.log"))
    return "".join(path.read_text() for path in files)


class LaunchFailed(AssertionError):
    """A rank of a launch failed; ``cause`` is its error in one line."""

    def __init__(self, cause: str, logs: Path) -> None:
        super().__init__(f"training failed: {cause}; rank logs under {logs}")
        self.cause = cause


def _first_error(e: ChildFailedError) -> str:
    """The first failed rank's exception (or signal), on one line."""
    rank, failure = e.get_first_failure()
    message = failure.message  # the error file's {"message": ...} when there is one
    if isinstance(message, dict):
        message = message.get("message", message)
    lines = [line for line in str(message).splitlines() if line.strip()]
    first = lines[0] if lines else f"exit code {failure.exitcode}"
    return f"rank {rank}: {first}"[:300]
