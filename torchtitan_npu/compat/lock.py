"""Read and write upstream.lock: the tested upstream torchtitan snapshots."""

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

LOCK_NAME = "upstream.lock"
LOCK_HEADER = """\
# upstream.lock: the upstream torchtitan snapshots titan-npu is tested against.
# One [[upstream]] table per snapshot. `fingerprints` holds, per overlay patch
# target, the sha256 (16 hex) of its source in that snapshot; refresh them with
# `titan-npu compat record` after verifying the patches against a new release.
# docs/versioning_policy.md is generated from this file (`nox -s docs`).
"""
STATUSES = ("tested", "experimental")


@dataclass(frozen=True)
class UpstreamEntry:
    """One tested upstream snapshot."""

    version: str
    commit: str
    wheel_sha256: str
    torch: str  # the paired torch pin
    era: str
    status: str
    default: bool = False
    notes: str = ""
    fingerprints: dict[str, str] = field(default_factory=dict)

    def to_toml(self) -> dict:
        return {
            "version": self.version,
            "commit": self.commit,
            "wheel_sha256": self.wheel_sha256,
            "torch": self.torch,
            "era": self.era,
            "status": self.status,
            "default": self.default,
            "notes": self.notes,
            "fingerprints": dict(sorted(self.fingerprints.items())),
        }


def lock_path() -> Path:
    """upstream.lock inside the wheel, or at the repo root of a source checkout."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / LOCK_NAME, here.parent / LOCK_NAME):
        if candidate.exists():
            return candidate
    raise FileNotFoundError(f"{LOCK_NAME} not found next to {here}")


def read_lock(path: Path | None = None) -> list[UpstreamEntry]:
    data = tomllib.loads((path or lock_path()).read_text())
    entries = [UpstreamEntry(**raw) for raw in data.get("upstream", [])]
    _validate(entries)
    return entries


def write_lock(entries: list[UpstreamEntry], path: Path | None = None) -> None:
    import tomli_w

    _validate(entries)
    body = tomli_w.dumps({"upstream": [e.to_toml() for e in entries]})
    (path or lock_path()).write_text(LOCK_HEADER + "\n" + body)


def default_entry(entries: list[UpstreamEntry]) -> UpstreamEntry:
    return next(e for e in entries if e.default)


def _validate(entries: list[UpstreamEntry]) -> None:
    from torchtitan_npu.overlay import ERAS

    defaults = [e.version for e in entries if e.default]
    if len(defaults) != 1:
        raise ValueError(f"{LOCK_NAME}: exactly one default entry, found {defaults}")
    versions = [e.version for e in entries]
    if len(set(versions)) != len(versions):
        raise ValueError(f"{LOCK_NAME}: duplicate versions in {versions}")
    for e in entries:
        if e.era not in ERAS:
            raise ValueError(f"{LOCK_NAME}: {e.version} has unknown era {e.era!r}")
        if e.status not in STATUSES:
            raise ValueError(f"{LOCK_NAME}: {e.version} has status {e.status!r}")
