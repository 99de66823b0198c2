"""docs/versioning_policy.md stays generated from upstream.lock."""

from torchtitan_npu.compat import read_lock
from torchtitan_npu.tools.versioning import policy_path, render


def test_versioning_policy_matches_the_lock():
    entries = read_lock()
    expected = render(entries)
    assert policy_path().read_text() == expected, "run `titan-npu compat docs`"
    for entry in entries:
        assert f"| {entry.version}" in expected
