"""``titan-npu compat check | record``: patch targets vs upstream.lock."""

import dataclasses

from torchtitan_npu import bootstrap
from torchtitan_npu.compat import (
    UpstreamEntry,
    detect_era,
    find_entry,
    installed_upstream,
    lock_path,
    parse_era,
    read_lock,
    write_lock,
)
from torchtitan_npu.overlay import PatchContext, check, patches_for
from torchtitan_npu.overlay.registry import PatchStatus
from torchtitan_npu.reporting.table import format_table


def _inspect_installed():
    """(installed, entry or None, era, status rows) without applying patches."""
    bootstrap.remove_hook()  # inspect upstream as it is, unpatched
    from torchtitan_npu.distributed import (
        backend_for,
        load_torch_npu,
        select_device_type,
    )

    load_torch_npu()
    installed = installed_upstream()
    entry = find_entry(installed, read_lock())
    era = parse_era(entry.era) if entry else detect_era()
    device = select_device_type()
    ctx = PatchContext(installed.version, era, device, backend_for(device), True)
    rows = check(patches_for(era), ctx, entry.fingerprints if entry else {})
    return installed, entry, era, rows


def status_table(rows: list[PatchStatus], *, pending: str = "pending") -> str:
    """The records' table; ``pending`` names the state of verified records
    not applied yet (``compat check`` applies nothing)."""
    return format_table(
        ["patch", "kind", "target", "lock", "installed", "state"],
        [
            [
                r.patch.name,
                r.patch.kind,
                r.patch.target,
                r.expected or "-",
                r.found or "-",
                (pending if r.state == "pending" else r.state)
                + (f" ({r.detail})" if r.detail else ""),
            ]
            for r in rows
        ],
    )


def check_installed() -> int:
    installed, entry, era, rows = _inspect_installed()
    locked = f"locked ({entry.status})" if entry else "NOT IN upstream.lock"
    print(f"torchtitan {installed.version}: {locked}, era {era}")
    # "pending"/"not needed" both mean: target present and fingerprint matches.
    print(status_table(rows, pending="ok"))
    bad = [r for r in rows if r.state in ("missing", "drifted")]
    if bad:
        print(f"\n{len(bad)} patch target(s) drifted or missing: re-verify them.")
    return 1 if bad or entry is None else 0


def record_installed() -> int:
    installed, entry, era, rows = _inspect_installed()
    missing = [r for r in rows if r.state == "missing"]
    if missing:
        print(status_table(rows))
        print("\nCannot record: some targets are missing; fix those patches first.")
        return 1
    fingerprints = {r.patch.target: r.found for r in rows if r.found}
    entries = read_lock()
    if entry is None:
        entry = UpstreamEntry(
            version=installed.version,
            commit=installed.commit or "unknown",
            wheel_sha256="",
            torch="",
            era=era,
            status="experimental",
            notes="" if installed.commit else "compat record: not a git install",
        )
        entries.append(entry)
        print(
            f"added torchtitan {installed.version} as experimental: fill in "
            "wheel_sha256 and torch, then mark it tested once the matrix passes"
        )
    updated = dataclasses.replace(entry, fingerprints=fingerprints)
    entries = [updated if e.version == entry.version else e for e in entries]
    write_lock(entries)
    changed = {
        t: (entry.fingerprints.get(t), f)
        for t, f in fingerprints.items()
        if entry.fingerprints.get(t) != f
    }
    print(f"recorded {len(fingerprints)} fingerprints in {lock_path()}")
    for target, (old, new) in changed.items():
        print(f"  {target}: {old} -> {new}")
    return 0
