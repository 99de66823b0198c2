"""Which upstream is installed, whether it is tested, and which era it is."""

import os
from dataclasses import dataclass

from torchtitan_npu.compat.detect import (
    InstalledUpstream,
    UpstreamNotInstalled,
    detect_era,
    installed_upstream,
)
from torchtitan_npu.compat.era import Era, era_module, parse_era
from torchtitan_npu.compat.lock import (
    LockError,
    UpstreamEntry,
    default_entry,
    lock_path,
    read_lock,
    write_lock,
)
from torchtitan_npu.errors import UntestedUpstreamError

ALLOW_UNTESTED_ENV = "TITAN_NPU_ALLOW_UNTESTED"


@dataclass(frozen=True)
class Upstream:
    """The running upstream: what is installed and what the lock says of it."""

    installed: InstalledUpstream
    era: Era
    entry: UpstreamEntry | None  # None: untested, running by opt-in

    @property
    def tested(self) -> bool:
        return self.entry is not None

    @property
    def fingerprints(self) -> dict[str, str]:
        return self.entry.fingerprints if self.entry else {}


def find_entry(
    installed: InstalledUpstream, entries: list[UpstreamEntry]
) -> UpstreamEntry | None:
    for entry in entries:
        if entry.version != installed.version:
            continue
        # A git install must be the locked commit, not any commit of that version.
        if installed.commit and installed.commit != entry.commit:
            continue
        return entry
    return None


def resolve_upstream(
    installed: InstalledUpstream | None = None,
    entries: list[UpstreamEntry] | None = None,
) -> Upstream:
    """Identify the installed upstream; refuse it unless tested or opted in."""
    installed = installed or installed_upstream()
    entries = read_lock() if entries is None else entries
    entry = find_entry(installed, entries)
    if entry is not None:
        return Upstream(installed, parse_era(entry.era), entry)
    if os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        return Upstream(installed, detect_era(), None)
    tested = ", ".join(f"{e.version} ({e.era}, torch {e.torch})" for e in entries)
    what = installed.version + (f" @ {installed.commit}" if installed.commit else "")
    raise UntestedUpstreamError(
        f"torchtitan {what} is not a tested upstream of titan-npu (tested, in "
        f"{lock_path()}: {tested}); install one of them, or set "
        f"{ALLOW_UNTESTED_ENV}=1 to run anyway (the era is then feature-detected "
        "and every patch-target drift is a warning)"
    )


__all__ = [
    "Era",
    "era_module",
    "parse_era",
    "ALLOW_UNTESTED_ENV",
    "InstalledUpstream",
    "LockError",
    "Upstream",
    "UpstreamEntry",
    "UpstreamNotInstalled",
    "UntestedUpstreamError",
    "default_entry",
    "detect_era",
    "find_entry",
    "installed_upstream",
    "lock_path",
    "read_lock",
    "resolve_upstream",
    "write_lock",
]
