"""Fast matrix launches: torchrun's elastic launcher forking the ranks.

A `titan-npu train` launch spends ~25 s importing torch and upstream in every
rank before its first step; the matrix makes ~40 launches per upstream. This
launcher imports upstream once, in the pytest process, then starts every run
with ``elastic_launch`` (the engine behind torchrun: c10d rendezvous, one
process per rank, gloo) using the ``fork`` start method, so each rank begins
with upstream already imported. Each run is still a fresh set of processes;
the same translation and overlay code as `titan-npu train` runs in them.
(Fresh `titan-npu train` launches are covered by tests/test_train_e2e.py.)
"""

import os
import uuid
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from torchtitan_npu.bootstrap import activate
from torchtitan_npu.config import resolve
from torchtitan_npu.entry import prepare_upstream, run_upstream
from torchtitan_npu.tools.scalars import read_scalars


def _rank_main(num_threads: int | None) -> None:
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    run_upstream()


class WarmLauncher:
    """Imports upstream once; ``train`` forks a fresh process group per run."""

    def __init__(self, workdir: Path) -> None:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.job_file = workdir / "upstream-job"
        self.translator = prepare_upstream(str(self.job_file))
        self.version = activate().upstream.installed.version
        import torchtitan.train  # noqa: F401  (the import every rank inherits)

    def train(
        self, dump_folder: Path, args: list[str], *, nproc: int, scalars: bool = True
    ) -> dict | None:
        """Train with `titan-npu train` overrides; return TensorBoard scalars."""
        config = resolve(None, [*args, "--job.dump_folder", str(dump_folder)])
        self.translator.write_upstream_config(
            config, version=self.version, path=str(self.job_file)
        )
        logs = dump_folder / "rank-logs"
        launch = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=nproc,
            run_id=uuid.uuid4().hex,
            rdzv_backend="c10d",
            rdzv_endpoint="127.0.0.1:0",
            max_restarts=0,
            start_method="fork",
            logs_specs=DefaultLogsSpecs(log_dir=str(logs), redirects=Std.ALL),
        )
        # As torchrun: one thread per rank when several share the machine. (The
        # parent must not start OpenMP itself: its pool would not survive fork.)
        threads = 1 if nproc > 1 else None
        try:
            elastic_launch(launch, _rank_main)(threads)
        except ChildFailedError as e:
            raise AssertionError(f"training failed; rank logs under {logs}\n{e}") from e
        return read_scalars(dump_folder) if scalars else None
