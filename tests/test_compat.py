"""compat: lock reading, snapshot matching, refusal and opt-in."""

import dataclasses

import pytest

from torchtitan_npu.compat import (
    ALLOW_UNTESTED_ENV,
    InstalledUpstream,
    UntestedUpstreamError,
    default_entry,
    find_entry,
    installed_upstream,
    read_lock,
    resolve_upstream,
    write_lock,
)


def test_lock_has_one_default_and_known_eras():
    entries = read_lock()
    assert default_entry(entries).version == "0.3.0"
    assert {e.era for e in entries} == {"trainspec", "config_registry"}
    assert all(len(e.wheel_sha256) == 64 for e in entries)


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
    found = find_entry(
        InstalledUpstream(entry.version, entry.commit + "0" * 8), entries
    )
    assert found == entry
    assert find_entry(InstalledUpstream(entry.version, "f" * 40), entries) is None
    assert find_entry(InstalledUpstream(entry.version, None), entries) == entry


def test_lock_round_trips_and_rejects_two_defaults(tmp_path):
    entries = read_lock()
    path = tmp_path / "upstream.lock"
    write_lock(entries, path)
    assert read_lock(path) == entries
    two_defaults = [dataclasses.replace(e, default=True) for e in entries]
    with pytest.raises(ValueError, match="exactly one default"):
        write_lock(two_defaults, path)
