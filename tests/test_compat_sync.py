"""compat sync: what a candidate upstream is, the release it is compared
with, and how its probe reads against that release's (the install and the
probe themselves run in `titan-npu compat sync`, minutes; see
docs/versioning_policy.md)."""

import subprocess
import sys

import pytest

from torchtitan_npu.compat import read_lock
from torchtitan_npu.errors import UserError
from torchtitan_npu.tools.compat_sync import (
    compare,
    field_changes,
    nearest,
    parse_candidate,
)

COMMIT = "b5bcd76c66d0acb1a08b176d9639425bc55e0b2a"


def test_a_candidate_is_a_version_a_wheel_or_a_pinned_git_source(tmp_path):
    assert parse_candidate("0.3.1").requirement == "torchtitan==0.3.1"
    assert parse_candidate("0.3.1.dev20260821").kind == "pypi"
    wheel = tmp_path / "torchtitan-0.3.1-py3-none-any.whl"
    wheel.write_bytes(b"")
    assert parse_candidate(str(wheel)).wheel == wheel
    source = f"git+https://github.com/pytorch/torchtitan@{COMMIT}"
    git = parse_candidate(source)
    assert (git.kind, git.commit) == ("git", COMMIT)
    assert git.requirement == f"torchtitan @ {source}"


@pytest.mark.parametrize(
    "text, says",
    [
        ("/nowhere/torchtitan-0.3.1-py3-none-any.whl", "does not exist"),
        ("https://github.com/pytorch/torchtitan", "names no commit; add @<commit>"),
        ("git+https://github.com/pytorch/torchtitan@main", "names no commit"),
        ("latest", "neither a PyPI version"),
    ],
)
def test_a_bad_candidate_is_one_line_exit_2(text, says):
    with pytest.raises(UserError, match=says):
        parse_candidate(text)
    result = subprocess.run(
        [sys.executable, "-m", "torchtitan_npu.cli", "compat", "sync", text],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2, result.stderr
    assert says.split(";")[0] in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_the_reference_is_the_newest_tested_release_not_after_it():
    entries = read_lock()
    assert nearest(entries, "0.3.1.dev20260821").version == "0.3.0"  # not tracked
    assert nearest(entries, "0.3.0").version == "0.3.0"
    assert nearest(entries, "0.2.3").version == "0.2.2"
    assert nearest(entries, "0.4.0").version == "0.3.0"
    with pytest.raises(UserError, match="older than the oldest era"):
        nearest(entries, "0.1.0")


def test_renamed_fields_are_told_from_added_and_removed_ones():
    """A removed field and an added one of one section, alike in type and
    default and each the other's only such match, read as a rename."""
    old = {
        "training.seq_len": {"type": "int", "default": 2048},
        "training.steps": {"type": "int", "default": 10000},
        "training.dtype": {"type": "str", "default": "float32"},
        "parallelism.a": {"type": "int", "default": 1},
        "parallelism.b": {"type": "int", "default": 1},
    }
    new = {
        "training.max_context_length": {"type": "int", "default": 2048},
        "training.steps": {"type": "int", "default": 10000},
        "training.warmup": {"type": "int", "default": 0},
        "parallelism.c": {"type": "int", "default": 1},  # a or b: no guess
    }
    changes = field_changes(new, old)
    assert changes["renamed"] == [("training.seq_len", "training.max_context_length")]
    assert changes["added"] == ["parallelism.c", "training.warmup"]
    assert changes["removed"] == ["parallelism.a", "parallelism.b", "training.dtype"]


def probe(version: str, targets: dict, records: dict) -> dict:
    return {
        "version": version,
        "targets": targets,
        "records": records,
        "config_fields": {},
        "models": {"llama3": ["debugmodel"]},
    }


def test_each_record_reads_unchanged_changed_missing_or_new():
    records = {"same": "m:f", "edited": "m:g", "gone": "m:h", "fresh": "m:k"}
    reference = probe(
        "0.3.0",
        {
            "m:f": {"fingerprint": "1" * 16, "source": "def f(): pass"},
            "m:g": {"fingerprint": "2" * 16, "source": "def g():\n    return 1"},
            "m:h": {"fingerprint": "3" * 16, "source": "def h(): pass"},
        },
        records,
    )
    candidate = probe(
        "0.3.1",
        {
            "m:f": {"fingerprint": "1" * 16, "source": "def f(): pass"},
            "m:g": {"fingerprint": "4" * 16, "source": "def g():\n    return 2"},
            "m:h": {"missing": "no attribute h", "defined_in": ["m.other"]},
            "m:k": {"fingerprint": "5" * 16, "source": "def k(): pass"},
        },
        records,
    )
    rows = {row["record"]: row for row in compare(candidate, reference)["records"]}
    assert {name: row["state"] for name, row in rows.items()} == {
        "same": "unchanged",
        "edited": "changed",
        "gone": "missing",
        "fresh": "new",
    }
    assert "-    return 1\n+    return 2" in rows["edited"]["detail"]
    assert "defined now in m.other" in rows["gone"]["detail"]
