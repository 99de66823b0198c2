"""NPU wiring that runs without an NPU: HCCL environment, SUM-only mean, peak FLOPs.

The patches are applied to the real upstream functions with an npu/hccl
context; only the collectives run on gloo.
"""

import os
import sys
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torchtitan_npu.distributed.hccl import mean_by_sum, translate_nccl_env
from torchtitan_npu.overlay import common
from torchtitan_npu.overlay.registry import Overlay, PatchContext, resolve_target
from torchtitan_npu.reporting.flops import PEAK_FLOPS_ENV, ascend_peak_flops, describe


def npu_context(upstream) -> PatchContext:
    return PatchContext(upstream.installed.version, upstream.era, "npu", "hccl", True)


def patched(patch, upstream):
    """The function a patch would install, built against the real target."""
    (change,) = patch.apply(resolve_target(patch.target), npu_context(upstream))
    return change.value


def test_flight_recorder_variables_are_translated():
    env = {
        "TORCH_FR_BUFFER_SIZE": "2000",  # 0.3.x names
        "TORCH_FR_DUMP_TEMP_FILE": "/out/comm_traces/rank_",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "HCCL_ASYNC_ERROR_HANDLING": "1",  # the user's own value wins
    }
    added = translate_nccl_env(env)
    assert added == {
        "TORCH_HCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_HCCL_DEBUG_INFO_TEMP_FILE": "/out/comm_traces/rank_",
        "TORCH_HCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_HCCL_ENABLE_MONITORING": "1",
    }
    assert env["HCCL_ASYNC_ERROR_HANDLING"] == "1"
    env = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}  # 0.2.x name, recorder off
    assert translate_nccl_env(env) == {"TORCH_HCCL_TRACE_BUFFER_SIZE": "0"}


def test_hccl_env_patch_translates_before_the_process_group(
    upstream, monkeypatch, tmp_path
):
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    monkeypatch.delenv("TORCH_HCCL_DUMP_ON_TIMEOUT", raising=False)
    init_process_group = patched(common.HCCL_ENV, upstream)
    init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        assert os.environ["TORCH_HCCL_DUMP_ON_TIMEOUT"] == "1"
    finally:
        dist.destroy_process_group()
        monkeypatch.delenv("TORCH_HCCL_DUMP_ON_TIMEOUT")


def _mean_on_two_ranks(rank: int, store: str, results) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed import utils as dist_utils

    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2
    )
    mesh = init_device_mesh("cpu", (2,))
    dist_mean = mean_by_sum(dist_utils.dist_sum)
    results[rank] = float(dist_mean(torch.tensor(float(rank + 1)), mesh))
    dist.destroy_process_group()


@pytest.mark.heavy
def test_mean_by_sum_on_two_ranks(tmp_path):
    results = mp.Manager().dict()
    mp.spawn(_mean_on_two_ranks, args=(str(tmp_path / "store"), results), nprocs=2)
    assert dict(results) == {0: 1.5, 1: 1.5}


def test_ascend_peak_flops(upstream, monkeypatch):
    monkeypatch.delenv(PEAK_FLOPS_ENV, raising=False)
    assert ascend_peak_flops("Ascend910B3") == 313e12
    assert ascend_peak_flops("Ascend910B1") == 414e12  # not "Ascend910"
    assert ascend_peak_flops("Ascend910") == 256e12
    assert ascend_peak_flops("NVIDIA H100") is None
    # Atlas A3: each die is a device and a rank, with its own (cube) peak
    assert ascend_peak_flops("Ascend910_9392") == ascend_peak_flops("Ascend910_9362")
    assert ascend_peak_flops("Ascend910_9392") == 353.9e12
    assert describe("npu", "Ascend910_9382").startswith(
        "353.9 TFLOPs per device, cube (Ascend910_9382: one A3 die"
    )
    assert describe("npu", "Ascend910B3").startswith("313 TFLOPs per device, total")
    assert describe("cpu", None).startswith("none: MFU reads 0 on cpu")
    get_peak_flops = patched(common.PEAK_FLOPS, upstream)
    assert get_peak_flops("Ascend910B2") == 376e12
    assert get_peak_flops("NVIDIA A100") == 312e12  # upstream's own answer
    monkeypatch.setenv(PEAK_FLOPS_ENV, "1e15")
    assert get_peak_flops("Ascend910B2") == 1e15


def test_cpu_peak_flops_is_quiet_and_mfu_reads_zero(upstream, monkeypatch, caplog):
    monkeypatch.delenv(PEAK_FLOPS_ENV, raising=False)
    ctx = PatchContext(upstream.installed.version, upstream.era, "cpu", "gloo", True)
    (change,) = common.PEAK_FLOPS.apply(resolve_target(common.PEAK_FLOPS.target), ctx)
    with caplog.at_level("WARNING"):
        assert change.value("x86_64") == float("inf")
    assert not caplog.records  # no lspci, no "fallback to A100"
    assert common.PEAK_FLOPS.skip(ctx) is None
    cuda = PatchContext(upstream.installed.version, upstream.era, "cuda", "nccl", True)
    assert common.PEAK_FLOPS.skip(cuda)


@pytest.mark.parametrize("patch", [common.HCCL_ENV])
def test_npu_patches_stay_off_elsewhere(patch, upstream):
    ctx = PatchContext(upstream.installed.version, upstream.era, "cpu", "gloo", True)
    assert patch.skip(ctx) == "not on npu (cpu)"
    assert patch.skip(npu_context(upstream)) is None


class RecordingNpuProfiler(types.ModuleType):
    """Stand-in ``torch_npu.profiler``: records how it is built and answers
    with torch's own CPU profiler, so upstream's profiling code runs through."""

    class ProfilerActivity:
        CPU, NPU = "CPU", "NPU"

    def __init__(self):
        super().__init__("torch_npu.profiler")
        self.calls = []
        self._profile, self._schedule = torch.profiler.profile, torch.profiler.schedule

    def profile(self, *, activities, **kwargs):
        self.calls.append(("profile", activities, kwargs))
        cpu = [torch.profiler.ProfilerActivity.CPU]
        return self._profile(activities=cpu, **kwargs)

    def schedule(self, **kwargs):
        self.calls.append(("schedule", None, kwargs))
        return self._schedule(**kwargs)


def _run_upstream_profiler(era: str, folder) -> None:
    """Upstream's own profiling entry point, two steps, tracing step 2."""
    if era == "trainspec":
        from torchtitan.config import JobConfig
        from torchtitan.tools.profiling import maybe_enable_profiling

        config = JobConfig().profiling
        config.enable_profiling, config.profile_freq = True, 2
        config.profiler_warmup, config.profiler_active = 0, 1
        with maybe_enable_profiling(config, base_folder=str(folder)) as profiler:
            for _ in range(2):
                torch.ones(4).sum()
                profiler.step()
        return
    from torchtitan.tools.profiler import Profiler

    config = Profiler.Config(
        enable_profiling=True, profile_freq=2, profiler_warmup=0, profiler_active=1
    )
    with Profiler(config, base_folder=str(folder)) as profiler:
        for _ in range(2):
            torch.ones(4).sum()
            profiler.step()


def test_upstream_profiling_builds_the_torch_npu_profiler(
    upstream, monkeypatch, tmp_path
):
    stand_in = RecordingNpuProfiler()
    torch_npu = types.ModuleType("torch_npu")
    torch_npu.profiler = stand_in
    monkeypatch.setitem(sys.modules, "torch_npu", torch_npu)
    patches = [common.NPU_PROFILER, common.NPU_PROFILER_SCHEDULE]
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        with Overlay().applied(patches, npu_context(upstream), upstream.fingerprints):
            _run_upstream_profiler(upstream.era, tmp_path / "out")
    finally:
        dist.destroy_process_group()
    (schedule, profile) = stand_in.calls
    assert schedule[2] == {
        "wait": 1,
        "warmup": 0,
        "active": 1,
        "repeat": 0,
        "skip_first": 0,
        "skip_first_wait": 0,
    }
    assert profile[1] == ["CPU", "NPU"] and profile[2]["record_shapes"] is True
    assert list((tmp_path / "out").rglob("rank0_trace.json*"))  # upstream's handler ran
    assert torch.profiler.profile is stand_in._profile  # reverted


def test_a_deterministic_run_on_npu_sets_what_ascend_needs_before_the_ranks():
    from torchtitan_npu.distributed.hccl import DETERMINISTIC_ENV, deterministic_env

    on = {"debug": {"deterministic": True}}
    assert deterministic_env(on, "npu", {}) == DETERMINISTIC_ENV
    assert DETERMINISTIC_ENV["HCCL_DETERMINISTIC"] == "true"
    assert DETERMINISTIC_ENV["CLOSE_MATMUL_K_SHIFT"] == "1"
    mine = deterministic_env(on, "npu", {"HCCL_DETERMINISTIC": "strict"})
    assert "HCCL_DETERMINISTIC" not in mine and len(mine) == 2  # the user's wins
    assert deterministic_env(on, "cuda", {}) == {} == deterministic_env(on, "cpu", {})
    assert deterministic_env({"debug": {"deterministic": False}}, "npu", {}) == {}
