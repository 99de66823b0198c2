"""Read and write upstream.lock: the tested upstream torchtitan snapshots.

The lock ships inside the wheel (``torchtitan_npu/upstream.lock``, packaged
from the repository root's file); a source checkout reads the root file.
"""

import dataclasses
import re
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path

from torchtitan_npu.errors import LockError

LOCK_NAME = "upstream.lock"
LOCK_HEADER = """\
# upstream.lock: the upstream torchtitan snapshots titan-npu is tested against.
# One [[upstream]] table per snapshot. `fingerprints` holds, per overlay patch
# target, the sha256 (16 hex) of its source in that snapshot; refresh them with
# `titan-npu compat record` after verifying the patches against a new release.
# `commit` is the release tag's full git commit, or "unknown" (then `notes`
# says why, and the wheel sha256 is the snapshot's identity).
# docs/versioning_policy.md is generated from this file (`titan-npu compat docs`).
"""
# tested: a release the whole matrix passed on; tracked: an upstream main
# snapshot followed ahead of its release (CI runs a share; never the default);
# experimental: a new entry `compat record` added, not verified yet.
STATUSES = ("tested", "tracked", "experimental")
UNKNOWN_COMMIT = "unknown"
_HEX = re.compile(r"[0-9a-f]+")


@dataclass(frozen=True)
class UpstreamEntry:
    """One tested upstream snapshot."""

    version: str
    commit: str  # 40-hex release-tag commit, or "unknown"
    wheel_sha256: str
    torch: str  # the paired torch pin
    era: str
    status: str
    default: bool = False
    notes: str = ""
    # How a user installs a snapshot PyPI does not have: a pip requirement
    # (``torchtitan @ git+https://...@<commit>``); empty for PyPI releases.
    source: str = ""
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
            **({"source": self.source} if self.source else {}),
            "fingerprints": dict(sorted(self.fingerprints.items())),
        }


def lock_candidates() -> list[Path]:
    """Where the lock may be: inside the installed package, or a checkout's root."""
    package = Path(__file__).resolve().parent.parent
    return [package / LOCK_NAME, package.parent / LOCK_NAME]


def lock_path() -> Path:
    """upstream.lock inside the wheel, or at the repo root of a source checkout."""
    candidates = lock_candidates()
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise LockError(
        f"{LOCK_NAME} not found (looked at {', '.join(map(str, candidates))}): "
        "the titan-npu install is incomplete; reinstall it"
    )


def read_lock(path: Path | None = None) -> list[UpstreamEntry]:
    """Every entry of the lock; a ``LockError`` names the file and each problem."""
    path = path or lock_path()
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise LockError(f"{path}: unreadable ({e.strerror or e})") from e
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise LockError(f"{path}: not valid TOML ({e})") from e
    raw_entries = data.get("upstream")
    if not isinstance(raw_entries, list) or not raw_entries:
        raise LockError(f"{path}: no [[upstream]] entries")
    entries, problems = [], []
    for index, raw in enumerate(raw_entries):
        entry, entry_problems = _parse_entry(raw)
        name = raw.get("version", f"#{index + 1}") if isinstance(raw, dict) else index
        problems += [f"entry {name}: {p}" for p in entry_problems]
        if entry is not None:
            entries.append(entry)
    problems += validate(entries) if not problems else []
    if problems:
        raise LockError(f"{path}: " + "; ".join(problems))
    return entries


def write_lock(entries: list[UpstreamEntry], path: Path | None = None) -> None:
    import tomli_w

    path = path or lock_path()
    problems = validate(entries)
    if problems:
        raise LockError(f"{path}: not written: " + "; ".join(problems))
    body = tomli_w.dumps({"upstream": [e.to_toml() for e in entries]})
    path.write_text(LOCK_HEADER + "\n" + body)


def default_entry(entries: list[UpstreamEntry]) -> UpstreamEntry:
    return next(e for e in entries if e.default)


_FIELD_TYPES: dict[str, type] = {
    f.name: (dict if f.name == "fingerprints" else typing.cast(type, f.type))
    for f in dataclasses.fields(UpstreamEntry)
}
_REQUIRED = [
    f.name
    for f in dataclasses.fields(UpstreamEntry)
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
]


def _parse_entry(raw: object) -> tuple[UpstreamEntry | None, list[str]]:
    """Field names and types of one ``[[upstream]]`` table."""
    if not isinstance(raw, dict):
        return None, ["not a table"]
    problems = []
    unknown = sorted(set(raw) - set(_FIELD_TYPES))
    if unknown:
        problems.append(f"unknown field(s) {unknown}")
    missing = [name for name in _REQUIRED if name not in raw]
    if missing:
        problems.append(f"missing field(s) {missing}")
    for name, kind in _FIELD_TYPES.items():
        if name in raw and not isinstance(raw[name], kind):
            problems.append(f"{name} must be a {kind.__name__}, not {raw[name]!r}")
    if problems:
        return None, problems
    return UpstreamEntry(**raw), []


def _is_hex(text: str, length: int) -> bool:
    return len(text) == length and _HEX.fullmatch(text) is not None


def validate(entries: list[UpstreamEntry]) -> list[str]:
    """Every problem of a list of entries (empty when the lock is sound)."""
    from torchtitan_npu.compat.era import Era

    problems = []
    defaults = [e.version for e in entries if e.default]
    if len(defaults) != 1:
        problems.append(f"exactly one default entry is needed, found {defaults}")
    versions = [e.version for e in entries]
    duplicated = sorted({v for v in versions if versions.count(v) > 1})
    if duplicated:
        problems.append(f"duplicate versions {duplicated}")
    for e in entries:
        where = f"entry {e.version}"
        if e.era not in list(Era):
            known = [era.value for era in Era]
            problems.append(f"{where}: unknown era {e.era!r} (known: {known})")
        if e.default and e.status != "tested":
            problems.append(f"{where}: the default entry must be tested ({e.status})")
        if e.status == "tracked" and (e.commit == UNKNOWN_COMMIT or not e.source):
            problems.append(f"{where}: a tracked snapshot needs its commit and source")
        if e.status not in STATUSES:
            problems.append(f"{where}: status {e.status!r} (known: {list(STATUSES)})")
        if e.commit != UNKNOWN_COMMIT and not _is_hex(e.commit, 40):
            problems.append(
                f"{where}: commit {e.commit!r} is neither 40 lowercase hex digits "
                f"nor {UNKNOWN_COMMIT!r}"
            )
        if e.commit == UNKNOWN_COMMIT and not e.notes:
            problems.append(f"{where}: commit is unknown; say why in notes")
        # A new entry from `compat record` is experimental until its hash is set.
        if not (e.status == "experimental" and not e.wheel_sha256) and not _is_hex(
            e.wheel_sha256, 64
        ):
            problems.append(
                f"{where}: wheel_sha256 {e.wheel_sha256!r} is not 64 lowercase hex "
                "digits"
            )
        bad = sorted(t for t, f in e.fingerprints.items() if not _is_hex(str(f), 16))
        if bad:
            problems.append(f"{where}: fingerprints not 16 hex digits for {bad}")
    return problems
