"""The patch registry against the real installed upstream."""

import warnings
from typing import get_args

import pytest
import torch

from torchtitan_npu.compat import Era
from torchtitan_npu.distributed import backend_for, cpu_device_module
from torchtitan_npu.overlay import (
    Overlay,
    PatchContext,
    PatchTargetError,
    patches_for,
)
from torchtitan_npu.overlay.registry import PatchKind, fingerprint, resolve_target


def cpu_context(upstream, *, tested=True) -> PatchContext:
    return PatchContext(
        upstream_version=upstream.installed.version,
        era=upstream.era,
        device_type="cpu",
        backend=backend_for("cpu"),
        tested=tested,
    )


def states(rows) -> dict[str, str]:
    return {r.patch.name: r.state for r in rows}


def test_apply_sets_device_rebinds_copies_and_reverts(upstream):
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tools_utils

    before_type, before_module = tools_utils.device_type, tools_utils.device_module
    assert dist_utils.device_type is before_type  # a by-value copy
    overlay = Overlay()
    patches = patches_for(upstream.era)
    with overlay.applied(patches, cpu_context(upstream), upstream.fingerprints) as rows:
        assert states(rows)["device"] == "applied"
        assert tools_utils.device_type == "cpu"
        assert dist_utils.device_type == "cpu"  # rebound
        assert dist_utils.device_module is cpu_device_module
        assert tools_utils.get_device_info() == ("cpu", cpu_device_module)
    assert tools_utils.device_type is before_type
    assert dist_utils.device_type is before_type
    assert dist_utils.device_module is before_module


def test_apply_is_idempotent_and_revert_restores_originals(upstream):
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    original = _fsdp_collectives._get_gradient_divide_factors
    overlay = Overlay()
    patches = patches_for(upstream.era)
    ctx = cpu_context(upstream)
    first = overlay.apply(patches, ctx, upstream.fingerprints)
    wrapped = _fsdp_collectives._get_gradient_divide_factors
    second = overlay.apply(patches, ctx, upstream.fingerprints)
    assert second is first
    assert _fsdp_collectives._get_gradient_divide_factors is wrapped  # not re-wrapped
    overlay.revert()
    assert _fsdp_collectives._get_gradient_divide_factors is original


def test_sum_reduction_patch_changes_fsdp_reduce_ops(upstream):
    import torch.distributed as dist
    from torch.distributed import ReduceOp
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def ops(group):
        return _fsdp_collectives._get_gradient_divide_factors(
            group, None, torch.float32, "cpu", 2.0
        )

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        two_ranks = dist.group.WORLD
        # Unpatched: PREMUL_SUM(1/2) for the reduce-scatter, which gloo rejects.
        assert ops(two_ranks)[2] != ReduceOp.SUM and ops(two_ranks)[:2] == (None, None)
        with Overlay().applied(
            patches_for(upstream.era), cpu_context(upstream), upstream.fingerprints
        ):
            pre, post, reduce_scatter_op, all_reduce_op = ops(two_ranks)
            assert reduce_scatter_op == ReduceOp.SUM and all_reduce_op == ReduceOp.SUM
            assert (pre or 1.0) * (post or 1.0) == pytest.approx(
                2.0
            )  # a separate divide
            # One rank: foreach_reduce divides by the factor itself.
            assert ops(None)[:2] == (None, None)
        assert ops(two_ranks)[2] != ReduceOp.SUM
    finally:
        dist.destroy_process_group()


def test_one_rank_fsdp_group_divides_its_gradient_once(upstream, tmp_path):
    """0.2.0/0.2.1 give EP's experts an FSDP group of one rank (FSDP degree =
    EP degree) and a divide factor; with SUM forced, torch divided twice."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    plain, x = torch.nn.Linear(4, 4), torch.randn(3, 4)
    sharded = copy.deepcopy(plain)
    plain(x).sum().backward()
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        with Overlay().applied(
            patches_for(upstream.era), cpu_context(upstream), upstream.fingerprints
        ):
            fully_shard(sharded, mesh=init_device_mesh("cpu", (1,)))
            sharded.set_gradient_divide_factor(2.0)
            sharded(x).sum().backward()
        for p, q in zip(plain.parameters(), sharded.parameters(), strict=True):
            assert torch.equal(q.grad.full_tensor(), p.grad / 2)
    finally:
        dist.destroy_process_group()


def test_drifted_target_is_an_error_before_anything_changes(upstream, monkeypatch):
    import torchtitan.tools.utils as tools_utils

    def get_device_info():  # upstream "changed" this function
        return "cuda", torch.cuda

    monkeypatch.setattr(tools_utils, "get_device_info", get_device_info)
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    original = _fsdp_collectives._get_gradient_divide_factors
    with pytest.raises(PatchTargetError) as info:
        Overlay().apply(
            patches_for(upstream.era), cpu_context(upstream), upstream.fingerprints
        )
    message = str(info.value)
    assert "'device'" in message
    assert "torchtitan.tools.utils:get_device_info" in message
    assert f"torchtitan {upstream.installed.version}" in message
    assert "drifted" in message
    assert _fsdp_collectives._get_gradient_divide_factors is original


def test_missing_target_is_an_error(upstream, monkeypatch):
    patch = patches_for(upstream.era)[-1]  # one of the era's own patches
    target = resolve_target(patch.target)
    monkeypatch.delattr(target.owner, target.attr)
    with pytest.raises(PatchTargetError, match=f"{patch.name}.*is missing"):
        Overlay().apply(
            patches_for(upstream.era), cpu_context(upstream), upstream.fingerprints
        )


def test_untested_upstream_drift_is_a_loud_warning(upstream, monkeypatch):
    import torchtitan.tools.utils as tools_utils

    monkeypatch.setattr(tools_utils, "get_device_info", lambda: ("cuda", torch.cuda))
    overlay = Overlay()
    with pytest.warns(UserWarning, match="UNTESTED UPSTREAM.*'device'"):
        rows = overlay.apply(
            patches_for(upstream.era),
            cpu_context(upstream, tested=False),
            upstream.fingerprints,
        )
    try:
        assert states(rows)["device"] == "drifted"
        assert tools_utils.device_type == "cpu"  # applied anyway, by opt-in
    finally:
        overlay.revert()


def test_not_needed_patches_are_reported_not_applied(upstream):
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    original = _fsdp_collectives._get_gradient_divide_factors
    ctx = PatchContext(upstream.installed.version, upstream.era, "cpu", "nccl", True)
    with Overlay().applied(
        patches_for(upstream.era), ctx, upstream.fingerprints
    ) as rows:
        assert states(rows)["fsdp_sum_reduction"] == "not needed"
        assert _fsdp_collectives._get_gradient_divide_factors is original


@pytest.mark.parametrize("era", list(Era))
def test_patch_sets_have_unique_names_and_targets(era):
    patches = patches_for(era)
    assert len({p.name for p in patches}) == len(patches)
    assert len({p.target for p in patches}) == len(patches)
    assert all(p.kind in get_args(PatchKind) for p in patches)
    assert all(p.reason for p in patches)


def test_every_patch_target_of_installed_upstream_matches_lock(upstream):
    for patch in patches_for(upstream.era):
        if not patch.for_release(upstream.installed.version):
            continue  # bounded to other releases: its target may not exist here
        found = fingerprint(resolve_target(patch.target).obj)
        assert upstream.fingerprints[patch.target] == found, patch.name


def test_cpu_device_module_fills_the_cuda_shaped_api():
    assert cpu_device_module.current_device() == 0
    stats = cpu_device_module.memory_stats()
    assert stats["active_bytes.all.peak"] > 0
    assert cpu_device_module.get_device_properties().total_memory > 2**30
    assert cpu_device_module.is_available() is True  # forwarded to torch.cpu
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cpu_device_module.reset_peak_memory_stats()
        cpu_device_module.empty_cache()


def test_disabled_patch_is_reported_and_left_off(upstream):
    import torchtitan.tools.utils as tools_utils

    before = tools_utils.device_type
    ctx = PatchContext(
        upstream.installed.version,
        upstream.era,
        "cpu",
        "gloo",
        True,
        disabled=frozenset({"device"}),
    )
    with Overlay().applied(
        patches_for(upstream.era), ctx, upstream.fingerprints
    ) as rows:
        assert states(rows)["device"] == "disabled"
        assert states(rows)["fsdp_sum_reduction"] == "applied"
        assert tools_utils.device_type is before


def test_missing_target_message_shows_the_lock_fingerprint(upstream, monkeypatch):
    patch = patches_for(upstream.era)[-1]
    target = resolve_target(patch.target)
    monkeypatch.delattr(target.owner, target.attr)
    with pytest.raises(PatchTargetError) as info:
        Overlay().apply(
            patches_for(upstream.era), cpu_context(upstream), upstream.fingerprints
        )
    assert f"upstream.lock has {upstream.fingerprints[patch.target]}" in str(info.value)
    assert "found -" in str(info.value)


def test_untested_drifted_patch_that_is_not_needed_stays_off(upstream, monkeypatch):
    import torchtitan.distributed.utils as dist_utils

    monkeypatch.setattr(dist_utils, "dist_mean", lambda *a, **k: None)  # "changed"
    drifted = dist_utils.dist_mean
    overlay = Overlay()
    with pytest.warns(UserWarning, match="UNTESTED UPSTREAM.*'hccl_sum_only'"):
        rows = overlay.apply(
            patches_for(upstream.era),
            cpu_context(upstream, tested=False),
            upstream.fingerprints,
        )
    try:
        assert states(rows)["hccl_sum_only"] == "not needed"
        assert dist_utils.dist_mean is drifted
    finally:
        overlay.revert()


def npu_only_sum_patches(upstream, *, tested):
    """An npu/hccl context with only the two SUM patches left to apply."""
    others = {
        "device",
        "hccl_env",
        "peak_flops",
        "npu_profiler",
        "npu_profiler_schedule",
    }
    return PatchContext(
        upstream.installed.version,
        upstream.era,
        "npu",
        "hccl",
        tested,
        frozenset(others),
    )


def test_untested_patch_that_fails_to_apply_is_skipped(upstream, monkeypatch):
    import torchtitan.distributed.utils as dist_utils
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    monkeypatch.delattr(dist_utils, "dist_sum")  # what torchtitan 0.1.0 lacks
    original = _fsdp_collectives._get_gradient_divide_factors
    overlay = Overlay()
    with pytest.warns(UserWarning, match="'hccl_sum_only' failed to apply.*dist_sum"):
        rows = overlay.apply(
            patches_for(upstream.era),
            npu_only_sum_patches(upstream, tested=False),
            upstream.fingerprints,
        )
    try:
        assert states(rows)["hccl_sum_only"] == "failed"
        assert states(rows)["fsdp_sum_reduction"] == "applied"
        assert _fsdp_collectives._get_gradient_divide_factors is not original
    finally:
        overlay.revert()
    assert _fsdp_collectives._get_gradient_divide_factors is original


def test_a_failing_patch_leaves_nothing_applied(upstream, monkeypatch):
    import torchtitan.distributed.utils as dist_utils
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    monkeypatch.delattr(dist_utils, "dist_sum")
    original = _fsdp_collectives._get_gradient_divide_factors
    overlay = Overlay()
    ctx = npu_only_sum_patches(upstream, tested=True)
    for _ in range(2):  # a retry fails the same way, it does not report success
        with pytest.raises(PatchTargetError, match="'hccl_sum_only' failed to apply"):
            overlay.apply(patches_for(upstream.era), ctx, upstream.fingerprints)
        assert _fsdp_collectives._get_gradient_divide_factors is original
        assert not overlay.active


def test_converter_records_are_verified_then_applied_on_request(upstream):
    overlay = Overlay()
    rows = overlay.apply(
        patches_for(upstream.era), cpu_context(upstream), upstream.fingerprints
    )
    try:
        version = upstream.installed.version
        records = [
            r.patch
            for r in rows
            if r.patch.kind == "convert" and r.patch.for_release(version)
        ]
        assert records and all(states(rows)[p.name] == "on request" for p in records)
        others = [r for r in rows if not r.patch.for_release(version)]
        assert all(r.state == "not needed" for r in others)  # e.g. 0.2.0's rope
        for patch in records:
            overlay.apply_on_request(patch.name)
            assert states(overlay.status)[patch.name] == "applied"
        overlay.revert_on_request()
        assert all(states(overlay.status)[p.name] == "on request" for p in records)
        with pytest.raises(PatchTargetError, match="'nope' is not in the active"):
            overlay.apply_on_request("nope")
    finally:
        overlay.revert()
    # every record's target is as it was: functions put back, classes untouched
    for patch in records:
        target = resolve_target(patch.target)
        assert fingerprint(target.obj) == upstream.fingerprints[patch.target]


def test_a_change_to_a_missing_attribute_is_refused(upstream):
    import torchtitan.tools.utils as tools_utils

    from torchtitan_npu.overlay.registry import Change, _set

    with pytest.raises(AttributeError, match="has no attribute 'renamed_upstream'"):
        _set(Change(tools_utils, "renamed_upstream", 1))
    assert not hasattr(tools_utils, "renamed_upstream")


def test_fingerprint_cache_follows_the_source_file(tmp_path, monkeypatch):
    """A cached fingerprint is recomputed when its file changes."""
    import importlib
    import sys

    from torchtitan_npu.overlay import registry

    monkeypatch.setenv("TITAN_NPU_CACHE", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = tmp_path / "drifting_upstream.py"
    module.write_text("def target():\n    return 1\n")
    first = fingerprint(importlib.import_module("drifting_upstream").target)
    registry.save_fingerprints()
    assert (tmp_path / "cache" / "fingerprints.json").is_file()
    module.write_text("def target():\n    return 22\n")
    del sys.modules["drifting_upstream"]
    second = fingerprint(importlib.import_module("drifting_upstream").target)
    assert first != second
    assert second == registry._source_fingerprint(
        sys.modules["drifting_upstream"].target
    )


def test_fingerprint_of_a_wrapped_function_is_its_source(tmp_path, monkeypatch):
    """functools.cache / wraps targets (0.2.0's get_peak_flops) hash their
    wrapped function's source."""
    import importlib
    import sys

    from torchtitan_npu.overlay import registry

    monkeypatch.setenv("TITAN_NPU_CACHE", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "cached_upstream.py").write_text(
        "import functools\n\n\n@functools.cache\ndef target():\n    return 1\n"
    )
    module = importlib.import_module("cached_upstream")
    assert fingerprint(module.target) == registry._source_fingerprint(module.target)
    del sys.modules["cached_upstream"]
