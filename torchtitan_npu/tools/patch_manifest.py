"""docs/patches.md, generated from the patch registry (`titan-npu compat docs`).

Each record says what it changes, why, which upstream issue/PR/commit stands
behind it and when it can go; the page cannot drift from the code because a
test regenerates it.
"""

import re
from pathlib import Path

from torchtitan_npu.compat.era import Era
from torchtitan_npu.overlay import Patch, patches_for
from torchtitan_npu.reporting.table import format_markdown_table


def all_patches() -> list[Patch]:
    """Every patch record of every era, each once, in application order."""
    seen: dict[tuple[str, str], Patch] = {}
    for era in Era:
        for patch in patches_for(era):
            seen.setdefault((patch.name, patch.target), patch)
    return list(seen.values())


_GITHUB_REF = re.compile(r"\b([\w.-]+/[\w.-]+)#(\d+)\b")


def linked(text: str) -> str:
    """``owner/repo#N`` as a Markdown link (GitHub redirects issues to PRs)."""
    return _GITHUB_REF.sub(r"[\1#\2](https://github.com/\1/issues/\2)", text)


def _section(p: Patch) -> str:
    releases = f"- releases: {p.releases}\n" if p.since or p.before else ""
    return (
        f"### {p.name} ({', '.join(p.eras)})\n\n"
        f"- target: `{p.target}` ({p.kind})\n{releases}"
        f"- why: {p.reason}\n"
        f"- upstream: {linked(p.upstream_ref)}\n"
        f"- remove when: {p.remove_when}"
    )


def render() -> str:
    patches = all_patches()
    summary = format_markdown_table(
        ["patch", "kind", "eras", "target"],
        [[p.name, p.kind, ", ".join(p.eras), f"`{p.target}`"] for p in patches],
    )
    sections = "\n\n".join(_section(p) for p in patches)
    return f"""# Patch manifest

<!-- Generated from the patch registry by `titan-npu compat docs`; do not edit. -->

Every change titan-npu makes to upstream torchtitan, torch or torch_npu is one
record in the overlay registry (`torchtitan_npu/overlay/`, and one `convert`
record per kernel-converter replacement): its target is fingerprinted in
`upstream.lock`, checked before anything changes, and reverted by
`deactivate()`. `depend` records change nothing: they pin upstream objects
titan-npu relies on. `titan-npu doctor` shows the records of the running
upstream with their state on this machine (applied, on request, checked, not
needed, disabled). See docs/architecture.md.

{summary}

## Records

{sections}
"""


def manifest_path() -> Path:
    from torchtitan_npu.tools.versioning import docs_dir

    return docs_dir() / "patches.md"
