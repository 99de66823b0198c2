"""`titan-npu plan`: the estimate (fake tensors, fake process group) against
the same steps on real tensors under torchrun (gloo), and the user errors.

The validation the planner is held to: the model state each rank holds
(parameters, gradients, optimizer states: bytes of its local shards) is
predicted exactly, and the peak within PEAK_RTOL of the real steps' peak as
PyTorch's memory tracker sees it."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support import (
    FULL_SUITE,
    full_suite_only,
    requires_default_upstream,
    requires_era,
    requires_newest_of_era,
)

from torchtitan_npu.cli import main
from torchtitan_npu.compat import resolve_upstream
from torchtitan_npu.config import resolve
from torchtitan_npu.plan import devices

PEAK_RTOL = 0.10


@pytest.fixture(autouse=True)
def overlay_off_after():
    """The planner activates the overlay (as `titan-npu plan` does); other
    tests in this process expect it off."""
    yield
    from torchtitan_npu.bootstrap import deactivate

    deactivate()


# name -> (processes, overrides): four of the matrix's layouts, the last two
# in the full suite only (CI time; every layout on both eras: benchmarks/plan.py
# accuracy, the table in docs/plan.md).
LAYOUTS = {
    "fsdp_ac_full": (2, ["--activation_checkpoint.mode", "full"]),
    # llama3's debugmodel interleaves two stages per rank unless told
    "pp_1f1b": (
        2,
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "1",
            "--parallelism.pipeline_parallel_schedule",
            "1F1B",
        ],
    ),
    # flex attention's CP needs whole 128-token blocks per load-balanced half
    "cp": (
        2,
        [
            "--parallelism.context_parallel_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "1",
            "--training.seq_len",
            "512",
        ],
    ),
    "tp": (
        2,
        [
            "--parallelism.tensor_parallel_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "1",
        ],
    ),
    # 0.2.x: DDP, planned as its gradient buckets beside an unwrapped model
    "ddp": (
        2,
        [
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "1",
        ],
    ),
}  # fmt: skip


def measured(overrides: list[str], nproc: int, tmp_path: Path) -> list[dict]:
    """Each rank's tracker figures from the real steps (torchrun, gloo)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(resolve(None, overrides)))
    env = {**os.environ, "TITAN_NPU_DEVICE": "cpu"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(nproc),
        "-m", "torchtitan_npu.plan.measure", str(config), str(tmp_path),
    ]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank-*.json"))]


# Each layout planned apart, in a fresh process: a plan forks a process per
# simulated rank, which torch refuses where autograd has run (as in a test
# process that trained).
PLANNED_APART = """
import dataclasses, json, sys
from torchtitan_npu.config import resolve
from torchtitan_npu.errors import PlanError
from torchtitan_npu.plan.estimate import estimate
for overrides, ranks, all_layers in json.loads(sys.argv[1]):
    try:
        planned = estimate(resolve(None, overrides), ranks, "cpu", all_layers)
    except PlanError as e:
        print(json.dumps({"error": str(e)}))
        continue
    ranks = [dataclasses.asdict(r) for r in planned.ranks]
    print(json.dumps({**dataclasses.asdict(planned.worst), "ranks": ranks}))
"""


def planned_apart(*layouts: tuple[list[str], int, bool]) -> list[dict]:
    """Each layout's worst rank's memory (and "ranks": every simulated
    rank's), or its one-line "error"."""
    command = [sys.executable, "-c", PLANNED_APART, json.dumps(layouts)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines()]


@pytest.mark.e2e
@requires_newest_of_era("one validation per era (CI time)")
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(
            "fsdp_ac_full",
            marks=pytest.mark.skipif(
                resolve_upstream().era == "trainspec" and not FULL_SUITE,
                reason="0.2.x: pp_1f1b (CI time)",
            ),
        ),
        "pp_1f1b",
        *(
            pytest.param(layout, marks=full_suite_only("fsdp_ac_full, pp_1f1b: CI's"))
            for layout in ("cp", "tp", "ddp")
        ),
    ],
)
def test_estimate_matches_the_real_steps(layout, tmp_path):

    nproc, overrides = LAYOUTS[layout]
    if layout == "cp" and resolve_upstream().era == "trainspec":  # 0.2.x: SDPA
        overrides = [*overrides, "--model.flavor", "debugmodel_flex_attn"]
    (planned,) = planned_apart((overrides, nproc, False))
    real = {r["rank"]: r for r in measured(overrides, nproc, tmp_path)}
    ranks = planned["ranks"]
    assert len(ranks) == (2 if layout.startswith("pp") else 1)  # one per stage
    for predicted in ranks:
        rank = real[predicted["rank"]]
        state = predicted["model_state"]
        assert state == rank["model_state"]
        assert state["optimizer"] == 2 * state["parameters"]
        error = predicted["peak"] / rank["peak"] - 1
        assert abs(error) <= PEAK_RTOL, (layout, predicted["peak"], rank["peak"])
        assert sum(predicted["parts"].values()) == predicted["peak"]


@requires_era("trainspec")
@requires_newest_of_era("one per era (CI time)")
def test_ddp_holds_its_gradient_buckets_beside_a_single_devices_memory():
    """0.2.x's DDP keeps every gradient again in its reducer's buckets: its
    plan is the single device's plus the gradients' bytes, held from the
    first forward (a real run measured the same: full suite, above)."""
    nproc, overrides = LAYOUTS["ddp"]
    single, ddp = planned_apart(([], 1, False), (overrides, nproc, False))
    gradients = single["model_state"]["gradients"]
    assert ddp["model_state"] == single["model_state"]
    assert ddp["peak"] == single["peak"] + gradients
    assert ddp["parts"]["activations"] == single["parts"]["activations"] + gradients


def test_sharding_divides_the_model_state():
    """FSDP over 4 holds a quarter of the single device's model state."""
    overrides = ["--activation_checkpoint.mode", "full"]
    single, sharded = planned_apart(([], 1, False), (overrides, 4, False))
    single, sharded = single["model_state"], sharded["model_state"]
    for part, value in single.items():
        assert abs(sharded[part] - value / 4) <= 0.01 * value, part


MOE = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"]
EP_2 = ["--parallelism.expert_parallel_degree", "2"]


def test_longest_repeats_finds_the_repeated_block():
    """The run of identical layers a deep model is extrapolated along: after
    dense layers (deepseek_v3), a hybrid block (qwen3_5's three linear- and
    one full-attention layers), before a distinct last layer."""
    from torchtitan_npu.plan.estimate import Repeats, longest_repeats

    deepseek = ["dense"] * 3 + ["moe"] * 58
    assert longest_repeats(deepseek) == Repeats(start=3, period=1, count=58)
    assert Repeats(3, 1, 58).kept(61, blocks=3) == [0, 1, 2, 3, 4, 5]
    hybrid = ["linear", "linear", "linear", "full"] * 12
    assert longest_repeats(hybrid) == Repeats(start=0, period=4, count=12)
    assert longest_repeats(["a"] * 20 + ["last"]) == Repeats(0, 1, 20)
    assert Repeats(0, 1, 20).kept(21, blocks=3) == [0, 1, 2, 20]
    assert longest_repeats(["a", "b", "c"]).count == 1


def test_a_hybrid_models_blocks_are_sampled_from_one_block():
    """A model of repeated 4-layer blocks (qwen3_5: three linear-attention
    layers, one full) is cut to 1, 2, 3 blocks (3 layers or more in the
    first sample), not to the 3, 4, 5 single layers need."""
    from torch import nn

    from torchtitan_npu.plan.estimate import LayerCut, Repeats

    def hybrid(layers: int) -> nn.Module:
        model = nn.Module()
        kinds = [nn.Linear(2, 3 if i % 4 == 3 else 2) for i in range(layers)]
        model.layers = nn.ModuleDict({str(i): k for i, k in enumerate(kinds)})
        return model

    for sample in range(3):
        model, cut = hybrid(48), LayerCut(sample)
        cut(model)
        assert cut.repeats == Repeats(start=0, period=4, count=12)
        assert cut.blocks == 1 + sample and len(model.layers) == 4 * cut.blocks
    short, cut = hybrid(12), LayerCut(0)  # 12 layers: stepped whole
    cut(short)
    assert cut.repeats is None and len(short.layers) == 12


@pytest.mark.e2e
@requires_default_upstream("the sampling is era-independent (CI time)")
def test_a_deep_model_extrapolated_as_if_every_layer_were_stepped():
    """llama3 8B (32 identical layers) on FSDP 8: the plan steps 3, 4 and 5
    of them and extends the line; stepping all 32 gives the same model state
    to the byte and the same peak to within the tracker's rounding."""
    from torchtitan_npu.plan.estimate import ON_A_LINE

    overrides = [
        "--model.flavor", "8B", "--training.seq_len", "256",
        "--training.local_batch_size", "1",
    ]  # fmt: skip
    guess, truth = planned_apart((overrides, 8, False), (overrides, 8, True))
    assert guess["model_state"] == truth["model_state"]
    assert abs(guess["peak"] - truth["peak"]) <= ON_A_LINE, (guess, truth)
    for part, value in truth["parts"].items():
        assert abs(guess["parts"][part] - value) <= ON_A_LINE, part
    assert "32 identical layers: 3, 4, 5 of them stepped" in guess["sampled"]
    assert truth["sampled"] == ""


def test_expert_parallel_routes_evenly_and_divides_the_model_state():
    """deepseek_v3 over FSDP 4 x EP 2: experts split over EP and their FSDP,
    the rest over FSDP 4, so each rank holds a quarter of the model state;
    the token counts the all-to-all needs are the plan's even routing, which
    training never gets (on-request overlay records)."""
    from torchtitan_npu.bootstrap import activate
    from torchtitan_npu.compat.era import Era
    from torchtitan_npu.overlay import OVERLAY

    upstream = resolve_upstream()
    if upstream.installed.version == "0.2.0":  # its EP does not run on CPU either
        (refused,) = planned_apart((MOE + EP_2, 4, False))
        assert "dp_shard 4 x ep 2 could not be simulated" in refused["error"]
        return
    activate()
    planning = {r.patch.name: r.state for r in OVERLAY.status}
    even = ("plan_routed_tokens", "plan_even_splits")
    for name in (
        even if upstream.era == Era.CONFIG_REGISTRY else ("plan_even_ep_splits",)
    ):
        assert planning[name] == "on request", name
    single, planned = planned_apart((MOE, 1, False), (MOE + EP_2, 4, False))
    for part, value in single["model_state"].items():
        assert planned["model_state"][part] * 4 == value, part
    state = planned["model_state"]
    assert planned["peak"] > state["parameters"] + state["optimizer"]
    assert sum(planned["parts"].values()) == planned["peak"]


@pytest.mark.e2e
@requires_era("trainspec")
@requires_newest_of_era("one per era (CI time)")
def test_moe_models_plan_on_0_2_x_with_the_tokens_spread_over_the_experts():
    """0.2.x runs the experts off SM90 CUDA as a loop that reads its token
    counts (.tolist()), which fake tensors lack: a plan spreads the routed
    tokens evenly over the experts (on-request records, never in training).
    deepseek_v3 over FSDP 2 then holds half the single device's model state
    (measured against real runs: docs/plan.md)."""
    from torchtitan_npu.bootstrap import activate
    from torchtitan_npu.overlay import OVERLAY

    activate()
    even = [r for r in OVERLAY.status if r.patch.name.startswith("plan_even")]
    assert even and {r.state for r in even} <= {"on request", "not needed"}
    single, sharded = planned_apart((MOE, 1, False), (MOE, 2, False))
    for part, value in single["model_state"].items():
        assert sharded["model_state"][part] * 2 == value, part
    assert sum(sharded["parts"].values()) == sharded["peak"]
    assert sharded["peak"] < single["peak"]


@pytest.mark.e2e
@requires_era("config_registry")
def test_varlen_attention_plans_as_each_device_runs_it():
    """gpt_oss attends over packed documents (varlen), whose boundaries
    upstream reads from the positions' values, which fake tensors lack: a
    plan's batch is one document per row, so they come from its shape. On CPU
    the overlay's reference keeps each head's score matrix for backward; NPU
    and CUDA run a fused kernel, planned as such: less memory."""

    def peak(device: str) -> float:
        command = [
            sys.executable, "-m", "torchtitan_npu.cli", "plan",
            "--model.name", "gpt_oss", "--model.flavor", "debugmodel",
            "--nproc-per-node", "2", "--device", device,
        ]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-3000:]
        found = re.search(r"rank 0: peak ([0-9.]+) GiB", result.stdout)
        assert found, result.stdout
        return float(found.group(1))

    assert peak("npu") < peak("cpu")


@pytest.mark.e2e
@requires_default_upstream("the ranking is era-independent (CI time)")
def test_search_ranks_fits_then_misses(tmp_path):
    """`plan --search` on 2 one-device nodes (tp 1), keeping the command
    line's checkpointing mode: smaller batches only where the larger missed,
    each fitting FSDP layout replicated over the nodes (HSDP) too; fits first
    (larger batch first), then misses by excess. (Which modes and batches a
    layout is planned with: test_search_tries_heavier_checkpointing_...)"""
    plot = tmp_path / "search.png"
    command = [
        sys.executable, "-m", "torchtitan_npu.cli", "plan", "--search",
        "--nproc-per-node", "1", "--nnodes", "2", "--device-memory", "100MiB",
        "--activation_checkpoint.mode", "none", "--plot", str(plot),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [re.split(r"\s{2,}", line) for line in result.stdout.splitlines()]
    # layout, ac, batch, peak, status
    table = [(r[0], r[1], int(r[2]), r[4]) for r in rows if "fsdp" in r[0]]
    fits = [t for t in table if t[3].startswith("fits")]
    misses = [t for t in table if t[3].startswith("misses")]
    assert fits and misses and len(fits) + len(misses) == len(table)
    assert table[: len(fits)] == fits
    assert [t[2] for t in fits] == sorted((t[2] for t in fits), reverse=True)
    assert {t[1] for t in table} == {"none"}  # kept
    fsdp = [t for t in table if t[0] == "fsdp 2"]
    for _, ac, batch, status in fsdp:
        if batch < 4:  # tried because the batch twice as large missed
            assert ("fsdp 2", ac, 2 * batch) in [t[:3] for t in misses]
        if status.startswith("fits"):  # and then replicated over the nodes
            assert ("replicate 2 x fsdp 1", ac, batch) in [t[:3] for t in table]
    assert result.stderr.count("[1/1]") >= 1 and plot.stat().st_size > 0


def test_search_splits_the_model_further_only_where_nothing_fits():
    """Pipeline x context degrees by the split they make: each stage keeps a
    layer, each CP rank two equal chunks of the sequence; HSDP replicates
    over whole nodes."""
    from torchtitan_npu.plan.search import hsdp_degrees, layer_count, model_splits

    assert layer_count(resolve(None, [])) == 6  # llama3 debugmodel
    assert model_splits(1, layers=6, seq=256) == [(1, 1)]
    assert model_splits(4, layers=6, seq=256) == [(1, 4), (2, 2), (4, 1)]
    assert model_splits(8, layers=6, seq=256) == [(1, 8), (2, 4), (4, 2)]
    assert model_splits(4, layers=6, seq=6) == [(4, 1)]  # 6 is not 2 x 2 chunks
    assert model_splits(2, layers=0, seq=256) == [(1, 2)]  # no layers known
    assert hsdp_degrees(fsdp=8, nodes=4, ep=1) == [2, 4]
    assert hsdp_degrees(fsdp=8, nodes=4, ep=4) == [2]  # shards of 2 cannot hold EP 4
    assert hsdp_degrees(fsdp=8, nodes=1, ep=1) == []


def test_search_tries_heavier_checkpointing_only_for_a_larger_batch():
    """Per layout: the batch halved while it misses, the fitting one
    replicated over the nodes while that fits, the next checkpointing mode
    only while the lighter one needed a smaller batch; a refused layout once."""
    from torchtitan_npu.plan.search import Candidate, plan_layout

    per_sample = {"none": 10, "selective": 6, "full": 3}  # a toy memory model

    def planned(fixed: dict, refuse: bool = False) -> list[tuple]:
        tried = []

        def attempt(c: Candidate) -> bool:
            tried.append((c.name(), c.ac, c.local_batch))
            c.failure = "refused" if refuse else ""
            return not refuse and per_sample[c.ac] * c.local_batch + 8 / c.fsdp <= 30

        layout = Candidate(fsdp=2, tp=1, ac="none", local_batch=0)
        plan_layout(layout, batch=8, nodes=2, fixed=fixed, attempt=attempt)
        return tried

    hsdp = "replicate 2 x fsdp 1"
    assert planned({}) == [
        ("fsdp 2", "none", 8), ("fsdp 2", "none", 4), ("fsdp 2", "none", 2),
        (hsdp, "none", 2), ("fsdp 2", "selective", 8), ("fsdp 2", "selective", 4),
        (hsdp, "selective", 4), ("fsdp 2", "full", 8), (hsdp, "full", 8),
    ]  # fmt: skip
    assert planned({"local_batch": 8}) == [
        ("fsdp 2", "none", 8), ("fsdp 2", "selective", 8), ("fsdp 2", "full", 8),
        (hsdp, "full", 8),
    ]  # fmt: skip
    assert planned({"ac": "selective", "replicate": 1}) == [
        ("fsdp 2", "selective", 8), ("fsdp 2", "selective", 4),
    ]  # fmt: skip
    assert planned({}, refuse=True) == [("fsdp 2", "none", 8)]


def test_search_keeps_the_degrees_the_command_line_sets():
    """`--section.key` overrides of the layout fix those fields of every
    candidate; the rest varies (an FSDP degree of -1 fixes nothing)."""
    from torchtitan_npu.config import parse_overrides
    from torchtitan_npu.plan.search import groups, keep, kept

    argv = ["--parallelism.tensor_parallel_degree", "2", "--training.steps", "5"]
    argv += ["--parallelism.data_parallel_shard_degree", "-1"]
    argv += ["--activation_checkpoint.mode", "full"]
    assert kept(parse_overrides(argv)) == {"tp": 2, "ac": "full"}

    config = resolve(None, [])
    layouts = groups(config, world_size=8, per_node=8, split=1)
    assert {(c.fsdp, c.tp) for c in layouts} == {(8, 1), (4, 2), (2, 4), (1, 8)}
    for fixed, want in [
        ({"tp": 2}, [("fsdp 4 x tp 2")]),
        ({"replicate": 2, "tp": 2}, ["replicate 2 x fsdp 2 x tp 2"]),
        ({"fsdp": 2}, ["fsdp 2 x tp 4"]),
        ({"tp": 3}, []),
    ]:
        assert [k.name() for c in layouts if (k := keep(c, fixed))] == want, fixed


@pytest.mark.e2e
@full_suite_only("test_search_splits_the_model_further_only_where_nothing_fits")
def test_search_tries_pipeline_and_context_parallelism_when_nothing_fits():
    """Planned for npu: on cpu, 0.2.x's SDPA has no context-parallel rule."""
    command = [
        sys.executable, "-m", "torchtitan_npu.cli", "plan", "--search",
        "--nproc-per-node", "1", "--nnodes", "2", "--device-memory", "1MiB",
        "--training.local_batch_size", "1", "--device", "npu",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "no layout fits with pp x cp below 2: trying 2" in result.stderr
    rows = [re.split(r"\s{2,}", line) for line in result.stdout.splitlines()]
    rows = [r for r in rows if r[0].startswith("fsdp ")]
    names = ["fsdp 2", "fsdp 1 x cp 2", "fsdp 1 x pp 2 (1F1B)"]
    names.append("fsdp 1 x pp 2 (Interleaved1F1B)")
    ac = ("none", "selective", "full")
    refused = [("fsdp 1 x pp 2 (1F1B)", "none")]  # planned once
    want = {(n, a) for n in names[:2] + names[3:] for a in ac} | set(refused)
    assert {(r[0], r[1]) for r in rows} == want
    for r in rows:
        if r[0] == "fsdp 1 x pp 2 (1F1B)":  # one microbatch for two stages
            assert "cannot run: the 1F1B pipeline schedule needs" in r[-1]
        else:
            assert "misses" in r[-1]


def test_search_varies_expert_parallelism_for_moe_models_only():
    """The EP degrees a search plans: those dividing both the FSDP degree and
    the routed experts for a MoE model; the config's own for a dense one."""
    from torchtitan_npu.plan.search import expert_degrees, routed_experts

    moe = resolve(None, ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"])
    dense = resolve(None, ["--parallelism.expert_parallel_degree", "1"])
    assert routed_experts(moe) == 8 and routed_experts(dense) == 0
    assert expert_degrees(moe, 4, 8) == [1, 2, 4]
    assert expert_degrees(moe, 16, 8) == [1, 2, 4, 8]
    assert expert_degrees(dense, 4, 0) == [1]


@requires_era("config_registry")
@full_suite_only("test_search_varies_expert_parallelism_for_moe_models_only")
def test_search_plans_moe_layouts_with_and_without_expert_parallelism():
    command = [
        sys.executable, "-m", "torchtitan_npu.cli", "plan", "--search",
        "--nproc-per-node", "1", "--nnodes", "2", "--device-memory", "700MiB",
        "--model.name", "deepseek_v3", "--model.flavor", "debugmodel",
        "--training.local_batch_size", "2",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("fsdp 2")]
    layouts = {tuple(re.split(r"\s{2,}", line)[:2]) for line in rows}
    assert {name for name, _ in layouts} == {"fsdp 2", "fsdp 2 x ep 2"}
    assert {("fsdp 2", "none"), ("fsdp 2 x ep 2", "none")} <= layouts
    assert "[2/2] fsdp 2 x ep 2, ac none" in result.stderr
    assert "2 layout(s) to plan" in result.stderr


@pytest.mark.parametrize(
    "text, expected",
    [("64GiB", 64 * 2**30), ("80 GB", 80 * 10**9), ("65536MiB", 64 * 2**30),
     ("12g", 12 * 2**30), ("1024", 1024), ("1.5GiB", 3 * 2**29)],
)  # fmt: skip
def test_memory_sizes(text, expected):
    assert devices.parse_memory(text) == expected


def test_device_names():
    assert devices.device_memory("ascend910b4") == 32 * 2**30
    assert devices.device_memory("Ascend910_93") == 64 * 2**30
    assert devices.device_type_of("Ascend910B3") == "npu"
    assert devices.device_type_of("H200") == "cuda"


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--device-memory", "lots"], "--device-memory 'lots' is not a memory size"),
        (["--device-name", "Ascend999"], "unknown --device-name 'Ascend999'; known:"),
        (["--nproc-per-node", "3", "--parallelism.tensor_parallel_degree", "2"],
         "needs a multiple of 2 processes, but this launch has 3"),
        (["--search"], "--search needs --device-memory or --device-name"),
        (["--search", "--device-memory", "1GiB", "--nproc-per-node", "4",
          "--parallelism.tensor_parallel_degree", "3"],
         "no layout of 4 devices (4 per node) keeps "
         "--parallelism.tensor_parallel_degree 3; change or drop these overrides"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line(argv, says, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert says in err[-1] and err[-1].startswith("titan-npu: error:"), err


def test_plan_prints_the_breakdown_and_plots(tmp_path):
    plot = tmp_path / "plan.png"
    command = [
        sys.executable, "-m", "torchtitan_npu.cli", "plan",
        "--device-name", "Ascend910B4", "--plot", str(plot),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "fits in 32.00 GiB" in out and "model state held throughout" in out
    for part in ("parameters", "gradients", "optimizer", "activations"):
        assert part in out
    assert plot.stat().st_size > 0


@pytest.mark.e2e
@requires_default_upstream("era-independent: torch's FSDP and gloo (CI time)")
def test_a_plan_on_cpu_holds_gloos_reduce_scatter_copy():
    """gloo reduce-scatters through a copy of the whole input, NCCL and HCCL
    in place: planned for CPU, FSDP's backward peak is the real gloo run's to
    the byte."""
    script = str(Path(__file__).parent / "reduce_scatter_memory.py")

    def peak(*command: str) -> dict:
        env = {**os.environ, "TITAN_NPU_DEVICE": "cpu"}
        result = subprocess.run(command, env=env, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.splitlines()[-1])

    planned = peak(sys.executable, script, "fake")
    real = peak(
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", "2", script, "real",
    )  # fmt: skip
    assert planned == real
    gradient = 32768 * 64 * 4  # the embedding's whole fp32 gradient
    assert planned["Total"] >= 2 * gradient  # the reduce-scatter input and its copy
