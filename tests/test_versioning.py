"""docs/versioning_policy.md and docs/patches.md stay generated from their sources."""

from torchtitan_npu.compat import read_lock
from torchtitan_npu.tools import patch_manifest
from torchtitan_npu.tools.versioning import policy_path, render


def test_versioning_policy_matches_the_lock():
    entries = read_lock()
    expected = render(entries)
    assert policy_path().read_text() == expected, "run `titan-npu compat docs`"
    for entry in entries:
        assert f"| {entry.version}" in expected


def test_patch_manifest_matches_the_registry():
    assert patch_manifest.manifest_path().read_text() == patch_manifest.render(), (
        "run `titan-npu compat docs`"
    )


def test_every_patch_names_its_upstream_reference_and_removal_condition():
    patches = patch_manifest.all_patches()
    assert len({p.name for p in patches}) >= 15
    for patch in patches:
        for text in (patch.upstream_ref, patch.remove_when, patch.reason):
            assert len(text.split()) >= 3, (patch.name, text)
    page = patch_manifest.render()
    assert (
        "[pytorch/pytorch#155915](https://github.com/pytorch/pytorch/issues/155915)"
        in page
    )
