"""compat: lock reading, snapshot matching, refusal and opt-in."""

import dataclasses
import re

import pytest

from torchtitan_npu.compat import (
    ALLOW_UNTESTED_ENV,
    InstalledUpstream,
    LockError,
    UntestedUpstreamError,
    default_entry,
    find_entry,
    installed_upstream,
    read_lock,
    resolve_upstream,
    write_lock,
)
from torchtitan_npu.compat.lock import lock_path


def test_lock_has_one_default_and_known_eras():
    entries = read_lock()
    assert default_entry(entries).version == "0.3.0"
    assert {e.era for e in entries} == {"trainspec", "config_registry"}
    assert all(len(e.wheel_sha256) == 64 for e in entries)
    commits = {e.version: e.commit for e in entries}
    assert commits["0.2.2"] == "73a0e6979dd10b6b1904098eb3c8f62c18ab87ce"
    assert commits["0.2.1"] == "81af8833ddeff9b5f1874dc7e20594aa17da6b86"
    assert commits["0.2.0"] == "29624e37fa6dd319fd671b009338651b5c665da2"
    assert commits["0.3.0"] == "unknown"  # notes say why


SOUND = lock_path().read_text()
FIRST_TABLE = "\n[[upstream]]\n"


@pytest.mark.parametrize(
    "text, problem",
    [
        (SOUND.replace(FIRST_TABLE, "\n[[upstream]\n", 1), "not valid TOML"),
        (SOUND.replace("default = false", "default = true", 1), "exactly one default"),
        (SOUND.replace('era = "trainspec"', 'era = "jobconfig"', 1), "unknown era"),
        (SOUND.replace('wheel_sha256 = "c95c', 'wheel_sha256 = "', 1), "wheel_sha256"),
        (SOUND.replace('"73a0e6979dd10b6b', '"73a0e697', 1), "commit '73a0e697"),
        (SOUND.replace('torch = "2.13.0"', "torch = 2.13", 1), "torch must be a str"),
        (SOUND.replace('status = "tested"', 'state = "tested"', 1), "unknown field"),
        (SOUND.replace('= "387c88a407094fa7"', '= "387c"', 1), "16 hex digits"),
        (re.sub(r'notes = "the config-registry.*', 'notes = ""', SOUND), "in notes"),
        (
            re.sub(r'\nsource = "torchtitan @ git[^\n]*', "", SOUND),
            "needs its commit and source",
        ),
        (
            SOUND.replace("default = true", "default = false").replace(
                'status = "tracked"\ndefault = false',
                'status = "tracked"\ndefault = true',
            ),
            "the default entry must be tested (tracked)",
        ),
        ("# nothing\n", "no [[upstream]] entries"),
        (b"\xff\xfe", "not valid TOML"),
    ],
)
def test_malformed_lock_is_one_line_naming_the_file(tmp_path, text, problem):
    path = tmp_path / "upstream.lock"
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    with pytest.raises(LockError) as info:
        read_lock(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and problem in message, message
    assert "\n" not in message


def test_missing_lock_is_an_error_naming_where_it_looked(tmp_path):
    with pytest.raises(LockError, match="unreadable"):
        read_lock(tmp_path / "upstream.lock")


def test_installed_upstream_is_locked(upstream):
    assert upstream.tested
    assert upstream.entry.version == installed_upstream().version


def test_untested_version_is_refused_with_tested_list():
    with pytest.raises(UntestedUpstreamError) as info:
        resolve_upstream(InstalledUpstream("9.9.9", None))
    message = str(info.value)
    assert "torchtitan 9.9.9 is not a tested upstream" in message
    for entry in read_lock():
        assert entry.version in message
    assert ALLOW_UNTESTED_ENV in message


def test_untested_version_runs_by_opt_in(monkeypatch, upstream):
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    resolved = resolve_upstream(InstalledUpstream("9.9.9", None))
    assert not resolved.tested
    assert resolved.era == upstream.era  # feature-detected from what is installed
    assert resolved.fingerprints == {}


def test_git_install_must_match_the_locked_commit():
    entries = read_lock()
    entry = next(e for e in entries if e.commit != "unknown")
    assert len(entry.commit) == 40
    assert find_entry(InstalledUpstream(entry.version, entry.commit), entries) == entry
    assert find_entry(InstalledUpstream(entry.version, "f" * 40), entries) is None
    assert find_entry(InstalledUpstream(entry.version, None), entries) == entry


def test_lock_round_trips_and_rejects_two_defaults(tmp_path):
    entries = read_lock()
    path = tmp_path / "upstream.lock"
    write_lock(entries, path)
    assert read_lock(path) == entries
    two_defaults = [dataclasses.replace(e, default=True) for e in entries]
    with pytest.raises(LockError, match="exactly one default"):
        write_lock(two_defaults, path)
