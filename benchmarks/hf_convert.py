"""HF checkpoint conversion: throughput and peak memory, side by side.

On one >= 1 GB checkpoint (qwen3 0.6B shapes, bf16, random weights, sharded
like HF), each step runs in a fresh interpreter (so peak RSS is its own):

- raw floor: read every tensor with safetensors, write it back unchanged
  (into the page cache: done before the bytes reach the disk); and the same
  with an fsync of each file, on disk as the conversions' O_DIRECT writes are
  when they return (on a VM whose page-cache writes are fast right after
  others and slow after an idle pause, the two bracket the disk);
- titan-npu from-hf (HF -> DCP) and to-hf (DCP -> HF);
- the same model in DeepSeek's block-wise FP8 (128 x 128 scales on every
  linear weight): its raw floor, and from-hf dequantizing it to bf16;
- upstream torchtitan's path: DCP with its HuggingFaceStorageReader / Writer
  and upstream's own Qwen3StateDictAdapter (what its conversion scripts do).

Input files are read once before each step (warm page cache for all) and
dirty pages are synced first. Best of 3 times, worst of 3 peak RSS.
Prints a markdown table: seconds, GB/s, peak RSS and RSS growth over the
interpreter's baseline after imports, against the largest tensor group.

Usage: uv run python benchmarks/hf_convert.py [WORKDIR]  (0.3.x upstream)
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL, FLAVOR = "qwen3", "0.6B"
REPEATS = 3  # best time, worst peak RSS
SHARD = "500MB"


def rss_mb(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field))
    return int(line.split()[1]) / 1024


def native_layout():
    import torch

    from torchtitan_npu.state_dict_adapters import convert
    from torchtitan_npu.state_dict_adapters import upstream_models as um
    from torchtitan_npu.state_dict_adapters.mapping import TensorInfo

    era = convert.current_era()
    args = um.model_args(MODEL, FLAVOR, era)
    layout = um.native_layout(MODEL, args, era)
    return (
        era,
        args,
        {k: TensorInfo(i.shape, torch.bfloat16) for k, i in layout.items()},
    )


def make_source(work: Path) -> None:
    """HF checkpoint via safetensors' own writer (the files HF would ship)."""
    import torch
    from safetensors.torch import save_file

    from torchtitan_npu.state_dict_adapters import get_adapter
    from torchtitan_npu.state_dict_adapters.safetensors_io import INDEX, parse_size

    era, args, layout = native_layout()
    adapter = get_adapter(MODEL)
    config = adapter.hf_config(args, era, layout)
    config["torch_dtype"] = "bfloat16"
    groups = adapter.keymap(era, config).plan_to_hf(
        layout, tied=config["tie_word_embeddings"]
    )
    src = work / "hf"
    src.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    shards, current, size, limit = [], {}, 0, parse_size(SHARD)
    for g in groups:
        for key, info in zip(g.hf, g.hf_infos):
            if current and size + info.nbytes > limit:
                shards.append(current)
                current, size = {}, 0
            current[key] = torch.randn(info.shape, generator=gen).to(info.dtype)
            size += info.nbytes
    shards.append(current)
    weight_map = {}
    for i, tensors in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, src / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    total = sum(t.nbytes for s in shards for t in s.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (src / INDEX).write_text(json.dumps(index))
    (src / "config.json").write_text(json.dumps(config))


def make_fp8_source(work: Path) -> None:
    """The bf16 source with its 2-D linear weights in block-wise FP8."""
    from safetensors.torch import load_file, save_file

    from torchtitan_npu.state_dict_adapters import quantization

    src, out = work / "hf", work / "hf-fp8"
    out.mkdir()
    for file in sorted(src.glob("*.safetensors")):
        tensors = {}
        for key, tensor in load_file(file).items():
            if key.endswith("_proj.weight"):
                values, scale = quantization.quantize(tensor, (128, 128))
                tensors[key], tensors[key + quantization.SCALE_SUFFIX] = values, scale
            else:
                tensors[key] = tensor
        save_file(tensors, out / file.name, metadata={"format": "pt"})
    index = json.loads((src / "model.safetensors.index.json").read_text())
    for key, name in list(index["weight_map"].items()):
        if key.endswith("_proj.weight"):
            index["weight_map"][key + quantization.SCALE_SUFFIX] = name
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }
    (out / "config.json").write_text(json.dumps(config))


def _raw_copy(source: Path, out: Path, on_disk: bool = False) -> None:
    from safetensors.torch import load_file, save_file

    out.mkdir()
    for file in sorted(source.glob("*.safetensors")):
        save_file(load_file(file), out / file.name, metadata={"format": "pt"})
        if on_disk:  # as the conversions' O_DIRECT writes are when they return
            with open(out / file.name, "rb") as f:
                os.fsync(f.fileno())


def step_raw(work: Path) -> None:
    _raw_copy(work / "hf", work / "raw")


def step_raw_on_disk(work: Path) -> None:
    _raw_copy(work / "hf", work / "raw", on_disk=True)


def step_raw_fp8(work: Path) -> None:
    _raw_copy(work / "hf-fp8", work / "raw-fp8")


def step_from_hf_fp8(work: Path) -> None:
    import torch

    from torchtitan_npu.state_dict_adapters import convert

    convert.from_hf(
        work / "hf-fp8", work / "ours-dcp-fp8", MODEL, FLAVOR,
        dtype=torch.bfloat16, progress=False,
    )  # fmt: skip


def step_from_hf(work: Path) -> None:
    from torchtitan_npu.state_dict_adapters import convert

    convert.from_hf(work / "hf", work / "ours-dcp", MODEL, FLAVOR, progress=False)


def step_to_hf(work: Path) -> None:
    from torchtitan_npu.state_dict_adapters import convert

    convert.to_hf(work / "ours-dcp", work / "ours-hf", MODEL, FLAVOR, progress=False)


def _upstream_adapter(args):
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    return Qwen3StateDictAdapter(args, None)


def step_upstream_from_hf(work: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    era, args, layout = native_layout()
    adapter = _upstream_adapter(args)
    state = {k: torch.empty(i.shape, dtype=i.dtype) for k, i in layout.items()}
    hf_state = adapter.to_hf(state)
    dcp.load(hf_state, storage_reader=HuggingFaceStorageReader(str(work / "hf")))
    dcp.save(adapter.from_hf(hf_state), checkpoint_id=str(work / "upstream-dcp"))


def step_upstream_to_hf(work: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    era, args, layout = native_layout()
    adapter = _upstream_adapter(args)
    state = {k: torch.empty(i.shape, dtype=i.dtype) for k, i in layout.items()}
    dcp.load(state, checkpoint_id=str(work / "ours-dcp"))
    writer = HuggingFaceStorageWriter(
        str(work / "upstream-hf"), save_distributed=False, enable_consolidation=False
    )
    dcp.save(adapter.to_hf(state), storage_writer=writer)


FP8_STEP = "titan-npu from-hf, FP8 -> bf16 (dequantized)"
STEPS = {
    "raw floor (safetensors read + write)": (step_raw, "hf"),
    "raw floor on disk (read + write + fsync)": (step_raw_on_disk, "hf"),
    "titan-npu from-hf (HF -> DCP)": (step_from_hf, "hf"),
    "upstream from-hf (DCP + HF reader)": (step_upstream_from_hf, "hf"),
    "titan-npu to-hf (DCP -> HF)": (step_to_hf, "ours-dcp"),
    "upstream to-hf (DCP + HF writer)": (step_upstream_to_hf, "ours-dcp"),
    "raw floor, FP8 files (safetensors read + write)": (step_raw_fp8, "hf-fp8"),
    FP8_STEP: (step_from_hf_fp8, "hf-fp8"),
}
# Each step's raw floor (x floor): the bf16 copy, whose written bytes every
# conversion writes too (FP8 -> bf16 reads half of them); the FP8 copy
# against itself.
FLOOR = {name: "raw floor (safetensors read + write)" for name in STEPS}
FP8_FLOOR = "raw floor, FP8 files (safetensors read + write)"
DISK_FLOOR = "raw floor on disk (read + write + fsync)"
FLOOR[FP8_FLOOR] = FP8_FLOOR


def child(name: str, work: Path) -> None:
    """Run one step; print JSON (seconds, baseline and peak RSS)."""
    import warnings

    warnings.simplefilter("ignore")
    import torch  # noqa: F401  (imports are baseline, not conversion)
    import torchtitan.models.qwen3  # noqa: F401

    from torchtitan_npu.state_dict_adapters import convert  # noqa: F401

    native_layout()
    baseline = rss_mb()
    start = time.perf_counter()
    STEPS[name][0](work)
    seconds = time.perf_counter() - start
    peak = rss_mb("VmHWM")
    print(json.dumps({"seconds": seconds, "baseline": baseline, "peak": peak}))


def main() -> None:
    keep = len(sys.argv) > 1  # a given WORKDIR keeps the source checkpoint
    work = Path(sys.argv[1]) if keep else Path(tempfile.mkdtemp())
    sources = ("hf", "hf-fp8")
    for stale in work.glob("*"):
        if stale.name not in sources:
            shutil.rmtree(stale)
    if not (work / "hf").exists():
        make_source(work)
    if not (work / "hf-fp8").exists():
        make_fp8_source(work)
    total = sum(f.stat().st_size for f in (work / "hf").glob("*.safetensors"))
    _, _, layout = native_layout()
    largest = max(i.nbytes for i in layout.values()) / 2**20
    runs: dict[str, list[dict]] = {name: [] for name in STEPS}
    for _ in range(REPEATS):
        for name, (_, source) in STEPS.items():
            for f in (work / source).iterdir():  # warm the page cache
                if f.is_file():
                    f.read_bytes()
            os.sync()  # no step pays for an earlier step's dirty pages
            out = subprocess.run(
                [sys.executable, __file__, "--child", name, str(work)],
                capture_output=True,
                text=True,
                check=True,
            )
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            if not name.endswith("(HF -> DCP)"):  # ours-dcp feeds the to-hf steps
                for made in work.glob("*"):
                    if made.name not in (*sources, "ours-dcp"):
                        shutil.rmtree(made)
        shutil.rmtree(work / "ours-dcp")
    rows = [
        (name, min(r, key=lambda x: x["seconds"]) | {"peak": max(x["peak"] for x in r)})
        for name, r in runs.items()
    ]
    seconds = {name: r["seconds"] for name, r in rows}
    print(
        f"\ncheckpoint: {MODEL} {FLAVOR} bf16, {total / 1e9:.2f} GB, shards of {SHARD}"
    )
    print(f"largest tensor group: {largest:.0f} MiB\n")
    print(
        "| step | s | GB/s | x floor | x on-disk floor | peak RSS MiB "
        "| RSS growth MiB | growth / group |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows:
        gbs = total / 1e9 / r["seconds"]
        growth = r["peak"] - r["baseline"]
        floor = seconds[FLOOR[name]] / r["seconds"]
        on_disk = seconds[DISK_FLOOR] / r["seconds"]
        print(
            f"| {name} | {r['seconds']:.2f} | {gbs:.2f} | {floor:.2f} | "
            f"{on_disk:.2f} | "
            f"{r['peak']:.0f} | {growth:.0f} | {growth / largest:.2f} |"
        )
    fp8 = seconds[FP8_FLOOR] / seconds[FP8_STEP]
    print(f"\n(GB/s: of the bf16 model's bytes; FP8 -> bf16: {fp8:.2f}x the FP8 copy)")
    for out in work.glob("*"):
        if out.name not in sources or not keep:
            shutil.rmtree(out)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], Path(sys.argv[3]))
    else:
        main()
