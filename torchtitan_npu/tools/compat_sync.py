"""``titan-npu compat sync CANDIDATE``: what a new upstream breaks, before
anyone trains on it.

CANDIDATE is a PyPI version (``0.3.1``), a wheel file, or a git source with a
commit (``git+https://github.com/pytorch/torchtitan@<commit>``). It is
installed into a throwaway environment (with this torch and titan-npu), read
there by ``compat_probe`` and compared with the nearest locked release: per
patch target unchanged / changed (with the diff of its source) / missing (and
where the name went); upstream's config fields added, removed, renamed; models
and flavors added and removed. Then, in the candidate's environment:
activation, ``compat check``, a 2-step train, the quick suite and CI's matrix
cells (``--quick``: the first three). The report is markdown, printed and
written. ``--record`` writes the lock entry and regenerates the generated
docs. docs/versioning_policy.md says how to use it.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from torchtitan_npu.compat import (
    UpstreamEntry,
    read_lock,
    write_lock,
)
from torchtitan_npu.errors import LockError, SyncError, UsageError
from torchtitan_npu.overlay.registry import release

PROBE = "torchtitan_npu.tools.compat_probe"
# CI's matrix share on a tracked upstream (noxfile.py TRACKED_MATRIX).
MATRIX_CELLS = "single,fsdp,tp,resume_fsdp_to_single,hf_finetune"


@dataclasses.dataclass(frozen=True)
class Candidate:
    text: str  # as given
    kind: str  # "pypi" | "wheel" | "git"
    requirement: str  # what the installer gets
    commit: str | None = None
    wheel: Path | None = None

    @property
    def label(self) -> str:
        return re.sub(r"[^A-Za-z0-9._-]+", "_", self.text)[-80:]


def parse_candidate(text: str) -> Candidate:
    """A PyPI version, a wheel file or a git source pinned to a commit."""
    if text.endswith(".whl"):
        path = Path(text).expanduser().resolve()
        if not path.is_file():
            raise UsageError(f"compat sync: wheel {text} does not exist")
        return Candidate(text, "wheel", str(path), wheel=path)
    if "://" in text or text.startswith("git+"):
        url = text if text.startswith("git+") else f"git+{text}"
        commit = url.rsplit("@", 1)[1] if "@" in url.split("://", 1)[1] else ""
        if not re.fullmatch(r"[0-9a-f]{7,40}", commit):
            raise UsageError(
                f"compat sync: git source {text} names no commit; add @<commit> "
                "(a branch moves: the report and the lock need one snapshot)"
            )
        return Candidate(text, "git", f"torchtitan @ {url}", commit=commit)
    if re.fullmatch(r"\d+(\.\d+)*([a-z]+\d*)?(\.dev\d+)?", text):
        return Candidate(text, "pypi", f"torchtitan=={text}")
    raise UsageError(
        f"compat sync: {text!r} is neither a PyPI version (0.3.1), a wheel file "
        "(.whl) nor a git source with a commit (git+https://...@<commit>)"
    )


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class Env:
    """A throwaway venv with one upstream, this torch and titan-npu."""

    def __init__(self, root: Path):
        self.root = root
        self.python = root / "venv" / "bin" / "python"
        self.code = root / "titan-npu"  # titan-npu as this process runs it

    def run(
        self, args: list[str], *, cwd: Path | None = None, timeout: float = 3600
    ) -> subprocess.CompletedProcess:
        env = dict(os.environ, PYTHONPATH=str(self.code))
        env["TITAN_NPU_ALLOW_UNTESTED"] = "1"  # the candidate is untested by design
        env.pop("VIRTUAL_ENV", None)
        return subprocess.run(
            [str(self.python), *args],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def create(self, requirement: str, what: str) -> None:
        """The venv, ``requirement`` installed with this torch and titan-npu's
        own dependencies; a SyncError carries the installer's gist."""
        import torch

        import torchtitan_npu

        if not self.python.exists():
            _installer(["venv", str(self.root / "venv")], what)
        own = [
            r.split(";")[0]
            for r in importlib.metadata.requires("titan-npu") or []
            if "extra ==" not in r and not r.startswith(("torch", "torchtitan"))
        ]
        torch_pin = f"torch=={torch.__version__.split('+')[0]}"
        _installer(
            ["install", "--python", str(self.python), torch_pin, requirement, *own],
            what,
        )
        self.code.mkdir(parents=True, exist_ok=True)
        link = self.code / "torchtitan_npu"
        if not link.exists():
            link.symlink_to(Path(torchtitan_npu.__file__).parent)

    def probe(self, targets: list[str] | None = None) -> dict[str, Any]:
        out = self.root / "probe.json"
        args = ["-W", "ignore", "-m", PROBE, str(out)]
        if targets is not None:
            listed = self.root / "targets.json"
            listed.write_text(json.dumps(targets))
            args.append(str(listed))
        done = self.run(args)
        if done.returncode:
            raise SyncError(
                f"compat sync: titan-npu cannot read the upstream in {self.root} "
                f"({_gist(done.stderr)})"
            )
        return json.loads(out.read_text())


def _installer(args: list[str], what: str) -> None:
    """``["venv", PATH]`` or ``["install", "--python", PY, *requirements]``
    with uv when it is on PATH, else the venv module and pip."""
    uv = shutil.which("uv")
    if args[0] == "venv":
        command = (
            [uv, "venv", "--quiet", "--python", sys.executable, args[1]]
            if uv
            else [sys.executable, "-m", "venv", args[1]]
        )
    elif uv:
        command = [uv, "pip", "install", "--quiet", *args[1:]]
    else:
        python, requirements = args[2], args[3:]
        command = [python, "-m", "pip", "install", "--quiet", *requirements]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SyncError(f"compat sync: {what} does not install: {_gist(done.stderr)}")


def _gist(text: str) -> str:
    """The installer's (or a traceback's) telling line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    telling = [
        line
        for line in lines
        if re.search(r"error|because|fatal|not found|No matching|unsatisf", line, re.I)
    ]
    return (telling or lines or ["no output"])[-1][:300]


def nearest(entries: list[UpstreamEntry], version: str) -> UpstreamEntry:
    """The newest tested release not after ``version`` (the oldest tested
    one is the floor)."""
    tested = sorted(
        (e for e in entries if e.status == "tested"), key=lambda e: release(e.version)
    )
    if release(version) < release(tested[0].version)[:2]:
        raise SyncError(
            f"compat sync: torchtitan {version} is older than the oldest era "
            f"titan-npu supports (torchtitan {tested[0].version}); nothing to sync"
        )
    before = [e for e in tested if release(e.version) <= release(version)]
    return (before or tested)[-1]


def compare(candidate: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """Per record: unchanged / changed (diff) / missing (where it went) /
    new (no reference); config fields and models added, removed, renamed."""
    rows = []
    for name, target in sorted(candidate["records"].items()):
        facts, old = candidate["targets"][target], reference["targets"].get(target, {})
        if "missing" in facts:
            state, detail = "missing", facts["missing"]
            if facts["defined_in"]:
                detail += f"; defined now in {', '.join(facts['defined_in'])}"
        elif "fingerprint" not in old:
            state, detail = "new", "not a target in the reference release"
        elif facts["fingerprint"] == old["fingerprint"]:
            state, detail = "unchanged", ""
        else:
            diff = difflib.unified_diff(
                old["source"].splitlines(),
                facts["source"].splitlines(),
                f"{reference['version']}/{target}",
                f"{candidate['version']}/{target}",
                lineterm="",
            )
            state, detail = "changed", "\n".join(diff)
        rows.append(
            {"record": name, "target": target, "state": state, "detail": detail}
        )
    return {
        "records": rows,
        "fields": field_changes(candidate["config_fields"], reference["config_fields"]),
        "models": model_changes(candidate["models"], reference["models"]),
    }


def field_changes(new: dict[str, Any], old: dict[str, Any]) -> dict[str, Any]:
    """Fields added, removed, and renamed: a removed and an added field of one
    section with the same type and default, each the other's only such match
    (a guess the report calls one)."""
    if "error" in new or "error" in old:
        return {"error": new.get("error") or old.get("error")}
    added = sorted(set(new) - set(old))
    removed = sorted(set(old) - set(new))

    def alike(gone: str, came: str) -> bool:
        return (
            gone.rpartition(".")[0] == came.rpartition(".")[0]
            and new[came]["type"] == old[gone]["type"]
            and new[came]["default"] == old[gone]["default"]
        )

    renamed = []
    for gone in removed:
        twins = [came for came in added if alike(gone, came)]
        if len(twins) == 1 and [g for g in removed if alike(g, twins[0])] == [gone]:
            renamed.append((gone, twins[0]))
    taken = {name for pair in renamed for name in pair}
    return {
        "added": [a for a in added if a not in taken],
        "removed": [r for r in removed if r not in taken],
        "renamed": renamed,
    }


def model_changes(new: dict[str, Any], old: dict[str, Any]) -> dict[str, Any]:
    if "error" in new or "error" in old:
        return {"error": new.get("error") or old.get("error")}
    flavors = {
        m: (sorted(set(new[m]) - set(old[m])), sorted(set(old[m]) - set(new[m])))
        for m in sorted(set(new) & set(old))
    }
    return {
        "added": sorted(set(new) - set(old)),
        "removed": sorted(set(old) - set(new)),
        "flavors": {m: c for m, c in flavors.items() if c[0] or c[1]},
    }


def run_checks(env: Env, work: Path, quick: bool) -> list[dict[str, Any]]:
    """Activation, compat check, a 2-step train; without ``quick`` also the
    quick suite and CI's matrix cells (from a source checkout's tests)."""
    cli = ["-c", "import sys; from torchtitan_npu.cli import main; sys.exit(main())"]
    checks = [
        ("activation", ["-c", "import torchtitan_npu.bootstrap as b; b.activate()"]),
        ("compat check", [*cli, "compat", "check"]),
        ("train 2 steps", [*cli, "train", "--training.steps", "2"]),
    ]
    tests = Path(__file__).resolve().parents[2] / "tests"
    if not quick and tests.is_dir():
        suite = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2"]
        checks.append(
            ("quick suite", [*suite, "-m", "not e2e and not heavy", str(tests)])
        )
        checks.append(
            (
                f"matrix ({MATRIX_CELLS})",
                ["-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests / "matrix"),
                 "-m", "matrix", "--layout", MATRIX_CELLS,
                 "--basetemp", str(work / "matrix")],
            )
        )  # fmt: skip
    results = []
    for name, args in checks:
        sys.stderr.write(f"compat sync: {name} ...\n")
        start = time.monotonic()
        done = env.run(args, cwd=work)
        last = _gist(done.stdout + done.stderr) if done.returncode else ""
        if not done.returncode:
            out = [ln for ln in done.stdout.strip().splitlines() if ln.strip()]
            last = out[-1][:120] if out else ""
        results.append(
            {
                "check": name,
                "passed": done.returncode == 0,
                "seconds": round(time.monotonic() - start),
                "last": last,
            }
        )
    return results


def report(
    candidate: Candidate,
    probed: dict[str, Any],
    reference: UpstreamEntry,
    changes: dict[str, Any],
    checks: list[dict[str, Any]],
    wheel_sha256: str,
) -> str:
    rows = changes["records"]
    commit = candidate.commit or probed["commit"]
    counts = {
        s: sum(r["state"] == s for r in rows)
        for s in ("unchanged", "changed", "missing", "new")
    }
    lines = [
        f"# compat sync: torchtitan {probed['version']} ({candidate.text})",
        "",
        f"- compared with: torchtitan {reference.version} (the nearest tested release)",
        f"- era: {probed['era']}; commit: {commit or 'unknown'}",
        f"- wheel sha256: {wheel_sha256 or 'none (built from git)'}",
        "",
        "## Patch records",
        "",
        f"{len(rows)} records: " + ", ".join(f"{n} {s}" for s, n in counts.items()),
        "",
        "| record | target | state |",
        "|---|---|---|",
    ]
    lines += [f"| {r['record']} | `{r['target']}` | {r['state']} |" for r in rows]
    for r in rows:
        if r["state"] in ("changed", "missing"):
            lines += ["", f"### {r['record']}: {r['state']}", ""]
            lines += (
                ["```diff", r["detail"], "```"]
                if r["state"] == "changed"
                else [r["detail"]]
            )
    lines += ["", "## Config fields (upstream's own config classes)", ""]
    fields = changes["fields"]
    if "error" in fields:
        lines.append(f"not read: {fields['error']}")
    else:
        lines += [
            f"- renamed (same section, type and default: a guess): `{a}` -> `{b}`"
            for a, b in fields["renamed"]
        ]
        lines += [f"- added: `{a}`" for a in fields["added"]]
        lines += [f"- removed: `{a}`" for a in fields["removed"]]
        if not any(fields.values()):
            lines.append("no change")
    lines += ["", "## Models and flavors", ""]
    models = changes["models"]
    if "error" in models:
        lines.append(f"not read: {models['error']}")
    else:
        lines += [f"- model added: {m}" for m in models["added"]]
        lines += [f"- model removed: {m}" for m in models["removed"]]
        for model, (plus, minus) in models["flavors"].items():
            lines += [f"- {model}: flavors added {plus}" if plus else ""]
            lines += [f"- {model}: flavors removed {minus}" if minus else ""]
        if not (models["added"] or models["removed"] or models["flavors"]):
            lines.append("no change")
    lines += [
        "",
        "## Checks in the candidate's environment",
        "",
        "| check | result | s | last line |",
        "|---|---|---|---|",
    ]
    for c in checks:
        result = "passed" if c["passed"] else "FAILED"
        last = c["last"].replace("|", "/")
        lines.append(f"| {c['check']} | {result} | {c['seconds']} | {last} |")
    return "\n".join(line for line in lines if line is not None) + "\n"


def record(
    candidate: Candidate,
    probed: dict[str, Any],
    wheel_sha256: str,
    reference: UpstreamEntry,
) -> UpstreamEntry:
    """The candidate's lock entry (tracked: a snapshot with a commit; else
    experimental until the matrix passes), fingerprints of its present targets."""
    entries = read_lock()
    fingerprints = {
        t: f["fingerprint"] for t, f in probed["targets"].items() if "fingerprint" in f
    }
    commit = candidate.commit or probed["commit"]
    if commit and len(commit) != 40:
        raise SyncError(
            f"compat sync --record: commit {commit} is abbreviated; give the full "
            "40-digit commit"
        )
    source = (
        f"torchtitan @ git+https://github.com/pytorch/torchtitan@{commit}"
        if commit
        else ""
    )
    existing = next((e for e in entries if e.version == probed["version"]), None)
    entry = UpstreamEntry(
        version=probed["version"],
        commit=commit or "unknown",
        wheel_sha256=wheel_sha256,
        torch=reference.torch,
        era=probed["era"],
        status="tracked" if commit and candidate.kind != "pypi" else "experimental",
        notes=existing.notes
        if existing
        else ("" if commit else "recorded by compat sync from a PyPI release"),
        source=source if candidate.kind != "pypi" else "",
        fingerprints=fingerprints,
    )
    entries = [e for e in entries if e.version != entry.version] + [entry]
    write_lock(entries)
    from torchtitan_npu.tools.versioning import write_docs

    write_docs()
    return entry


def main(text: str, *, quick: bool, write: bool, out: str | None) -> int:
    candidate = parse_candidate(text)
    from torchtitan_npu.assets.builder import cache_base

    root = cache_base() / "sync" / candidate.label
    root.mkdir(parents=True, exist_ok=True)
    env = Env(root / "candidate")
    wheel_sha256 = sha256(candidate.wheel) if candidate.wheel else ""
    requirement = candidate.requirement
    if candidate.kind == "pypi":
        wheel = _download(env, root, candidate)
        wheel_sha256, requirement = sha256(wheel), str(wheel)
    sys.stderr.write(f"compat sync: installing {candidate.text} into {env.root}\n")
    env.create(requirement, candidate.text)
    probed = env.probe()
    entries = read_lock()
    locked = next((e for e in entries if e.version == probed["version"]), None)
    if (
        locked
        and wheel_sha256
        and locked.wheel_sha256
        and locked.wheel_sha256 != wheel_sha256
    ):
        raise SyncError(
            f"compat sync: the wheel of torchtitan {probed['version']} has sha256 "
            f"{wheel_sha256[:12]}..., the lock's is {locked.wheel_sha256[:12]}...: "
            "not the locked snapshot (rebuilt or tampered); use the locked wheel"
        )
    reference = nearest(entries, probed["version"])
    reference_probe = _reference_probe(root, reference, list(probed["targets"]))
    changes = compare(probed, reference_probe)
    work = Path(tempfile.mkdtemp(prefix="sync-", dir=root))
    checks = run_checks(env, work, quick)
    text_report = report(candidate, probed, reference, changes, checks, wheel_sha256)
    path = Path(out) if out else root / "report.md"
    path.write_text(text_report)
    print(text_report)
    print(f"report: {path}")
    if write:
        entry = record(candidate, probed, wheel_sha256, reference)
        print(f"recorded torchtitan {entry.version} ({entry.status}) in upstream.lock")
    return 0 if all(c["passed"] for c in checks) else 1


def _download(env: Env, root: Path, candidate: Candidate) -> Path:
    """A PyPI release's wheel file (its hash is the snapshot's identity)."""
    folder = root / "wheel"
    wheels = list(folder.glob("torchtitan-*.whl"))
    if not wheels:
        command = [
            sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
            "--only-binary", ":all:", "-d", str(folder), candidate.requirement,
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise SyncError(
                f"compat sync: torchtitan {candidate.text} does not download from "
                f"PyPI: {_gist(done.stderr)}"
            )
        wheels = list(folder.glob("torchtitan-*.whl"))
    return wheels[0]


def _reference_probe(root: Path, reference: UpstreamEntry, targets: list[str]) -> dict:
    """The reference release read as the candidate is: here, when it is the
    installed upstream; else in a throwaway env of its locked wheel."""
    from torchtitan_npu.compat import installed_upstream

    if installed_upstream().version == reference.version:
        from torchtitan_npu.tools.compat_probe import probe

        return probe(targets)
    env = Env(root / f"reference-{reference.version}")
    requirement = f"torchtitan=={reference.version}"
    env.create(requirement, requirement)
    found = env.probe(targets)
    if found["version"] != reference.version:
        raise LockError(f"reference env holds torchtitan {found['version']}")
    return found
