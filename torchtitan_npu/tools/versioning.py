"""docs/versioning_policy.md, generated from upstream.lock (`titan-npu compat docs`)."""

from pathlib import Path

from torchtitan_npu.compat import Era, UpstreamEntry, read_lock
from torchtitan_npu.errors import UsageError
from torchtitan_npu.reporting.table import format_markdown_table


def render(entries: list[UpstreamEntry]) -> str:
    rows = [
        [
            e.version + (" (default)" if e.default else ""),
            e.era,
            e.torch,
            e.status,
            f"`{e.commit[:12]}`",
            f"`{e.wheel_sha256[:16]}…`",
            str(len(e.fingerprints)),
        ]
        for e in entries
    ]
    table = format_markdown_table(
        ["torchtitan", "era", "torch", "status", "commit", "wheel sha256", "patches"],
        rows,
    )
    eras = "\n".join(f"- `{era}`: {era.description}" for era in Era)
    notes = "\n".join(f"- {e.version}: {e.notes}" for e in entries if e.notes)
    return f"""# Versioning policy and upstream sync table

<!-- Generated from upstream.lock by `titan-npu compat docs`; do not edit. -->

titan-npu runs only on the upstream torchtitan snapshots below. Any other
version is refused at import with the list of tested ones; set
`TITAN_NPU_ALLOW_UNTESTED=1` to run anyway (the era is feature-detected and
every patch-target drift becomes a loud warning).

{table}

API eras:
{eras}

Notes:
{notes}

Statuses: `tested` — a release the whole suite and matrix pass on (one is the
default, the one `uv sync` installs); `tracked` — an upstream main snapshot
(its commit, the wheel built from it, the git `source` it installs from):
CI runs the unit tests and the core matrix cells on it (`nox -s tracked`),
`nox -s full` everything; never the default; `experimental` — recorded, not
yet tested.

## Syncing to a new upstream

1. `titan-npu compat sync CANDIDATE` (a PyPI version, a wheel file, or
   `git+https://github.com/pytorch/torchtitan@<commit>`): installs it into a
   throwaway env (its hash recorded) and reports, against the nearest tested
   release, every patch target unchanged / changed (with the diff) / missing
   (and where the name went), the train config fields added, removed and
   renamed, the models and flavors; then activation, `compat check`, a
   2-step train, the unit tests and the core matrix cells there (`--quick`:
   the first three). `--report PATH` writes the markdown too.
2. Adapt what changed: a record bounded to releases, a shape read from
   upstream's config classes (docs/architecture.md).
3. `titan-npu compat sync CANDIDATE --record` — writes its entry (fingerprints,
   commit, hash) into upstream.lock and regenerates this page; a snapshot
   with a commit (git, or a wheel built from one) enters as `tracked`, a
   PyPI release as `experimental`.
4. `nox -s "upstream(version='VERSION')"` and `nox -s matrix -- --upstream
   VERSION` on the new entry; mark a release `tested`.
5. `titan-npu compat docs` — regenerates this page.
"""


def docs_dir() -> Path:
    """docs/ of the source checkout this package runs from (not of an install)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "pyproject.toml").is_file() or not (root / "docs").is_dir():
        raise UsageError(
            "the generated docs live in a source checkout of titan-npu; this is an "
            f"installed package ({root}): run the command from a checkout"
        )
    return root / "docs"


def policy_path() -> Path:
    return docs_dir() / "versioning_policy.md"


def write_docs() -> list[Path]:
    """Regenerate docs/versioning_policy.md and docs/patches.md."""
    from torchtitan_npu.tools import patch_manifest

    written = []
    for path, text in [
        (policy_path(), render(read_lock())),
        (patch_manifest.manifest_path(), patch_manifest.render()),
    ]:
        path.write_text(text)
        written.append(path)
    return written
