"""direct_io: the bytes a buffered write would leave, at any size, on
filesystems with and without O_DIRECT; write errors reach the caller."""

from pathlib import Path

import pytest
import torch

from torchtitan_npu.state_dict_adapters import direct_io

SHM = Path("/dev/shm")  # tmpfs: no O_DIRECT there


def _pieces(sizes: list[int]) -> list[bytes]:
    gen = torch.Generator().manual_seed(sum(sizes))
    return [
        torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8).numpy().tobytes()
        for n in sizes
    ]


@pytest.mark.parametrize(
    "sizes",
    [
        [],
        [1],
        [4095],
        [4096],
        [3, 4096, 5],
        [direct_io.STAGING],  # exactly one staging buffer
        [direct_io.STAGING - 1, 2, direct_io.STAGING * 2 + 7],  # across buffers
    ],
    ids=lambda s: "+".join(map(str, s)) or "empty",
)
@pytest.mark.parametrize("where", ["disk", "tmpfs"])
def test_bytes_and_positions_match_a_buffered_write(tmp_path, sizes, where):
    if where == "tmpfs":
        if not SHM.is_dir():
            pytest.skip("no /dev/shm")
        tmp_path = Path(SHM / f"titan-npu-test-{tmp_path.name}")
        tmp_path.mkdir()
    try:
        pieces = _pieces(sizes)
        positions = []
        with direct_io.Writer() as files:
            f = files.create(tmp_path / "out")
            for piece in pieces:
                assert f.write(piece) == len(piece)
                positions.append(f.tell())
            f.close()
        expected = b"".join(pieces)
        assert (tmp_path / "out").read_bytes() == expected
        assert positions == [sum(sizes[: i + 1]) for i in range(len(sizes))]
    finally:
        if where == "tmpfs":
            for file in tmp_path.iterdir():
                file.unlink()
            tmp_path.rmdir()


def test_torch_save_into_it_loads_back(tmp_path):
    tensors = {"a": torch.arange(10_000, dtype=torch.float32), "b": torch.ones(3, 5)}
    with direct_io.Writer() as files:
        for name in ("t.pt", "u.pt"):  # the second while the first is written
            f = files.create(tmp_path / name)
            torch.save(tensors, f)
            f.close()
    for name in ("t.pt", "u.pt"):
        loaded = torch.load(tmp_path / name, weights_only=True)
        assert all(torch.equal(loaded[k], v) for k, v in tensors.items())


def test_a_failed_write_is_raised(tmp_path):
    full = Path("/dev/full")  # every write: ENOSPC
    if not full.exists():
        pytest.skip("no /dev/full")
    files = direct_io.Writer()
    f = files.create(full)
    f.write(b"x" * (direct_io.STAGING + 1))  # one buffer goes out
    f.close()
    with pytest.raises(OSError, match="No space left"):
        files.finish()


def test_abort_writes_nothing_more(tmp_path):
    files = direct_io.Writer()
    f = files.create(tmp_path / "out")
    f.write(b"x" * 10)
    files.abort()  # the open file is let go, its bytes not written
    assert f.closed
    assert (tmp_path / "out").stat().st_size == 0
