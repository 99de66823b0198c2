"""What a conversion does with a broken source or destination: one line
naming the problem, nothing written, nothing left behind (CPU, no download)."""

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hf_families import write_hf
from support import requires_default_upstream

from torchtitan_npu.state_dict_adapters import ConversionError, convert

pytestmark = requires_default_upstream("conversion I/O is era-independent (CI time)")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "llama"
    write_hf(path, "llama3")
    return path


@pytest.fixture(scope="module")
def native(hf_dir, tmp_path_factory):
    """A from-hf conversion (CRC-less records) and a training-style DCP save
    of the same tensors (torch.save records with CRC32s)."""
    ours = tmp_path_factory.mktemp("ours") / "dcp"
    convert.from_hf(hf_dir, ours, "llama3", progress=False)
    trained = tmp_path_factory.mktemp("trained") / "step-1"
    state = {}
    reader = convert.NativeCheckpoint(ours)
    for key in reader.layout:
        state[key] = reader.read(key)
    dcp.save(state, checkpoint_id=str(trained))
    return ours, trained


def copy_tree(source, target):
    import shutil

    shutil.copytree(source, target)
    return target


def refused(call, match, out):
    with pytest.raises(ConversionError, match=match) as error:
        call()
    assert "\n" not in str(error.value)
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.partial-*"))


def test_missing_or_truncated_data_files_are_refused_first(native, tmp_path):
    ours, _ = native
    missing = copy_tree(ours, tmp_path / "missing")
    victim = sorted(missing.glob("*.distcp"))[3]
    victim.unlink()
    out = tmp_path / "out"
    refused(
        lambda: convert.to_hf(missing, out, "llama3", progress=False),
        f"data file {victim.name} is missing",
        out,
    )
    truncated = copy_tree(ours, tmp_path / "truncated")
    victim = sorted(truncated.glob("*.distcp"))[3]
    os.truncate(victim, victim.stat().st_size // 2)
    refused(
        lambda: convert.to_hf(truncated, out, "llama3", progress=False),
        f"data file {victim.name} is truncated",
        out,
    )


def test_overwritten_bytes_fail_the_crc_of_a_training_checkpoint(
    hf_dir, native, tmp_path
):
    _, trained = native
    corrupt = copy_tree(trained, tmp_path / "corrupt")
    (data,) = corrupt.glob("*.distcp")
    raw = bytearray(data.read_bytes())
    middle = len(raw) // 2
    raw[middle : middle + 16] = b"\xff" * 16  # inside some tensor's bytes
    data.write_bytes(bytes(raw))
    out = tmp_path / "out"
    refused(
        lambda: convert.to_hf(corrupt, out, "llama3", hf_config=hf_dir, progress=False),
        "fails its CRC32 check",
        out,
    )
    # the untouched checkpoint exports
    convert.to_hf(
        trained, tmp_path / "fine", "llama3", hf_config=hf_dir, progress=False
    )


def test_overwritten_bytes_fail_the_checksums_of_a_conversion(hf_dir, native, tmp_path):
    """titan-npu's own writes carry no zip CRC32: the CRC32 of each tensor,
    recorded beside the data files, refuses a damaged one."""
    ours, _ = native
    corrupt = copy_tree(ours, tmp_path / "corrupt")
    victim = max(corrupt.glob("*.distcp"), key=lambda f: f.stat().st_size)
    raw = bytearray(victim.read_bytes())
    middle = len(raw) // 2
    raw[middle : middle + 16] = bytes(b ^ 0xFF for b in raw[middle : middle + 16])
    victim.write_bytes(bytes(raw))
    out = tmp_path / "out"
    refused(
        lambda: convert.to_hf(corrupt, out, "llama3", progress=False),
        "fail the CRC32 recorded in titan_npu_checksums.json",
        out,
    )
    convert.to_hf(ours, tmp_path / "fine", "llama3", progress=False)


@pytest.mark.parametrize("size", ["0", "0.1B", 0, -5])
def test_a_shard_size_below_one_byte_is_one_line(native, tmp_path, size):
    from torchtitan_npu.errors import UsageError

    ours, _ = native
    out = tmp_path / "out"
    with pytest.raises(UsageError, match="give a positive size") as error:
        convert.to_hf(ours, out, "llama3", max_shard_size=size, progress=False)
    assert "\n" not in str(error.value)
    assert not out.exists()


def test_destination_problems_are_one_line(hf_dir, native, tmp_path):
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "sub" / "out"
    with pytest.raises(ConversionError, match="cannot create"):
        convert.from_hf(hf_dir, out, "llama3", progress=False)
    out = tmp_path / "out"
    refused(
        lambda: convert.to_hf(
            native[0], out, "llama3", tokenizer=tmp_path / "nowhere", progress=False
        ),
        "--tokenizer .*nowhere: is not a directory",
        out,
    )


def test_a_dead_runs_temp_dir_is_removed_and_a_live_ones_refused(hf_dir, tmp_path):
    out = tmp_path / "out"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    abandoned = tmp_path / f".out.partial-{dead.stdout.strip()}"
    abandoned.mkdir()
    (abandoned / "half.distcp").write_bytes(b"\0" * 1024)
    convert.from_hf(hf_dir, out, "llama3", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    live = tmp_path / ".again.partial-1"  # pid 1 is always alive
    live.mkdir()
    with pytest.raises(ConversionError, match="another conversion .pid 1."):
        convert.from_hf(hf_dir, tmp_path / "again", "llama3", progress=False)
    assert live.is_dir()


def test_an_int_tensor_where_a_float_belongs_is_refused(hf_dir, native, tmp_path):
    ours, _ = native
    reader = convert.NativeCheckpoint(ours)
    state = {k: reader.read(k) for k in reader.layout}
    state["norm.weight"] = state["norm.weight"].to(torch.int32)
    dcp.save(state, checkpoint_id=str(tmp_path / "ints"))
    out = tmp_path / "out"
    refused(
        lambda: convert.to_hf(
            tmp_path / "ints", out, "llama3", hf_config=hf_dir, progress=False
        ),
        "not a float type",
        out,
    )
