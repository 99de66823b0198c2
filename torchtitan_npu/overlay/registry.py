"""The patch registry: declarative records, applied once, verified, revertible.

A patch names its target as ``"module:qualname"``. Before anything is changed,
every target of the active patch set is resolved and its source fingerprint is
compared with the one upstream.lock recorded for the installed upstream: a
missing target or a changed fingerprint is a ``PatchTargetError`` naming the
patch, the target and the upstream version — never a silent skip.

Kinds: ``wrap``/``replace``/``polyfill``/``inject`` change upstream at
activation; ``convert`` records (one per kernel-converter replacement) are
verified at activation and applied only when a model asks for the converter
(``Overlay.apply_on_request``); ``depend`` records change nothing and pin an
upstream object titan-npu relies on (a function reading a registry it writes,
a class whose attributes a replacement reads).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from torchtitan_npu.errors import PatchTargetError

if TYPE_CHECKING:  # compat costs ~40 ms of `import torchtitan_npu`
    from torchtitan_npu.compat.era import Era

PatchKind = Literal["wrap", "replace", "polyfill", "inject", "convert", "depend"]

# By-value copies (``from torchtitan.tools.utils import device_type``) are
# rebound only in modules under these prefixes.
REBIND_PREFIXES = ("torchtitan.", "torchtitan_npu.")


@dataclass(frozen=True)
class PatchContext:
    """What a patch may depend on: the running upstream and device."""

    upstream_version: str
    era: Era
    device_type: str
    backend: str
    tested: bool  # False when running an untested upstream by opt-in
    disabled: frozenset[str] = frozenset()  # patch names switched off (A/B runs)


@dataclass(frozen=True)
class Change:
    """Set ``owner.attr = value``; with ``rebind``, also in by-value importers.

    The attribute must exist on ``owner`` unless ``new`` says it is added.
    """

    owner: Any
    attr: str
    value: Any
    rebind: bool = False
    new: bool = False


@dataclass(frozen=True)
class Target:
    """A resolved patch target."""

    spec: str  # "module:qualname"
    owner: Any  # the module or class holding the attribute
    attr: str
    obj: Any  # the current (original) value


@dataclass(frozen=True)
class Patch:
    """One overlay patch.

    ``apply(target, ctx)`` returns the changes to make. ``skip(ctx)`` returns a
    reason when the patch is not needed in this context (e.g. "not on cpu"), or
    None when it must be applied. ``upstream_ref`` names the upstream issue, PR
    or commit behind the patch (or says why there is none); ``remove_when`` is
    the condition under which the patch can be deleted. Both are shown by
    ``titan-npu doctor`` and in docs/patches.md.
    """

    name: str
    target: str
    kind: PatchKind
    reason: str
    eras: tuple[Era, ...]
    upstream_ref: str
    remove_when: str
    apply: Callable[[Target, PatchContext], list[Change]]
    skip: Callable[[PatchContext], str | None] = field(default=lambda ctx: None)
    on_request: bool = False  # applied by apply_on_request, not at activation
    # The upstream releases it is for, within its eras: from ``since`` on,
    # before ``before`` (None: no bound). A target that drifted in a release
    # gets a second record for it: the old one ends where the new one starts.
    since: str | None = None
    before: str | None = None

    def for_release(self, version: str) -> bool:
        return in_releases(version, self.since, self.before)

    @property
    def releases(self) -> str:
        bounds = [f">= {self.since}" if self.since else "", ""]
        bounds[1] = f"< {self.before}" if self.before else ""
        return ", ".join(b for b in bounds if b) or "all"


def release(version: str) -> tuple[int, ...]:
    """``"0.2.1"`` (or ``"0.2.1.dev0+git..."``) as (0, 2, 1), for ordering."""
    parts = []
    for part in version.split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def in_releases(version: str | None, since: str | None, before: str | None) -> bool:
    """Whether ``version`` is in [since, before); None bounds are open, and a
    None version (any release) is in every range."""
    if version is None:
        return True
    v = release(version)
    return (since is None or v >= release(since)) and (
        before is None or v < release(before)
    )


def no_change(target: Target, ctx: PatchContext) -> list[Change]:
    """The ``apply`` of a ``depend`` record."""
    return []


def resolve_target(spec: str) -> Target:
    """Import the module and walk the qualname; raise AttributeError/ImportError."""
    module_name, _, qualname = spec.partition(":")
    owner: Any = importlib.import_module(module_name)
    *parents, attr = qualname.split(".")
    for part in parents:
        owner = getattr(owner, part)
    # The target must be defined on its owner itself: an inherited method is
    # not the one the patch was written against. Reading __dict__ also keeps
    # staticmethod/classmethod wrappers intact.
    if attr not in vars(owner):
        raise AttributeError(f"{qualname} is not defined in {module_name}")
    return Target(spec=spec, owner=owner, attr=attr, obj=vars(owner)[attr])


def fingerprint(obj: Any) -> str:
    """sha256 (16 hex) of the dedented source of a function, method or class.

    Cached per source file, keyed by a hash of the file's bytes (not its
    mtime: reproducible wheels give every release the same timestamps):
    finding a class's source parses its whole file, which made activation
    2-3 times slower."""
    import hashlib
    import inspect

    func = obj.__func__ if isinstance(obj, staticmethod | classmethod) else obj
    func = inspect.unwrap(func)  # functools.cache / wraps: the source is the wrapped
    path = inspect.getsourcefile(func)
    if path is None:
        return _source_fingerprint(func)
    with open(path, "rb") as f:
        stamp = hashlib.sha256(f.read()).hexdigest()
    entry = _FINGERPRINTS.setdefault(path, {"stamp": "", "objects": {}})
    if entry["stamp"] != stamp:
        entry["stamp"], entry["objects"] = stamp, {}
    name = f"{func.__module__}:{func.__qualname__}"
    if name not in entry["objects"]:
        entry["objects"][name] = _source_fingerprint(func)
        _FINGERPRINTS_CHANGED.append(path)
    return entry["objects"][name]


def _source_fingerprint(func: Any) -> str:
    import hashlib
    import inspect
    import textwrap

    source = textwrap.dedent(inspect.getsource(func))
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def _fingerprint_cache() -> str:
    from torchtitan_npu.assets.builder import cache_base

    return os.path.join(cache_base(), "fingerprints.json")


def _load_fingerprints() -> dict[str, dict[str, Any]]:
    try:
        with open(_fingerprint_cache()) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # no cache yet, or an unreadable one: recompute


def save_fingerprints() -> None:
    """Persist the fingerprint cache (atomically; a failure only costs time)."""
    if not _FINGERPRINTS_CHANGED:
        return
    import tempfile

    path = _fingerprint_cache()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".fingerprints.", dir=os.path.dirname(path))
        with os.fdopen(fd, "w") as f:
            json.dump(_FINGERPRINTS, f)
        os.replace(tmp, path)
        _FINGERPRINTS_CHANGED.clear()
    except OSError:
        pass


_FINGERPRINTS: dict[str, dict[str, Any]] = {}
_FINGERPRINTS_CHANGED: list[str] = []


@dataclass
class PatchStatus:
    """One row of the patch table."""

    patch: Patch
    state: Literal[
        "applied",
        "not needed",
        "disabled",
        "drifted",
        "missing",
        "failed",
        "pending",
        "on request",
        "checked",
    ]
    detail: str = ""
    found: str | None = None  # fingerprint found in the installed upstream
    expected: str | None = None  # fingerprint recorded in upstream.lock


def check(
    patches: list[Patch], ctx: PatchContext, expected: dict[str, str]
) -> list[PatchStatus]:
    """Resolve and fingerprint every target without changing anything (but
    the fla stand-in: upstream's Qwen3.5, a target, imports fla)."""
    from torchtitan_npu.kernels import fla_standin

    fla_standin.install()
    if not _FINGERPRINTS:
        _FINGERPRINTS.update(_load_fingerprints())
    rows = []
    for patch in patches:
        want = expected.get(patch.target)
        if not patch.for_release(ctx.upstream_version):
            detail = f"for torchtitan {patch.releases}"
            rows.append(PatchStatus(patch, "not needed", detail, None, want))
            continue
        try:
            target = resolve_target(patch.target)
        except (ImportError, AttributeError, KeyError) as e:
            detail = f"{type(e).__name__}: {e}"
            rows.append(PatchStatus(patch, "missing", detail, None, want))
            continue
        found = fingerprint(target.obj)
        if want is None:
            rows.append(PatchStatus(patch, "drifted", "no fingerprint in lock", found))
        elif found != want:
            rows.append(PatchStatus(patch, "drifted", "source changed", found, want))
        elif patch.name in ctx.disabled:
            rows.append(PatchStatus(patch, "disabled", "by request", found, want))
        elif patch.kind == "depend":
            rows.append(PatchStatus(patch, "checked", "", found, want))
        elif patch.on_request:
            rows.append(PatchStatus(patch, "on request", "", found, want))
        else:
            skip = patch.skip(ctx)
            state = "not needed" if skip else "pending"
            rows.append(PatchStatus(patch, state, skip or "", found, want))
    save_fingerprints()
    return rows


@dataclass
class _Applied:
    patch: Patch
    undo: list[tuple[Any, str, Any, bool]]  # (owner, attr, old, had_attr)


class Overlay:
    """Applies a patch set once, in declared order, and can revert it."""

    def __init__(self) -> None:
        self._applied: list[_Applied] = []
        self._ctx: PatchContext | None = None
        self.status: list[PatchStatus] = []

    @property
    def active(self) -> bool:
        return self._ctx is not None

    @property
    def context(self) -> PatchContext:
        """The context the active set was applied in."""
        if self._ctx is None:
            raise PatchTargetError(
                "the overlay is not active: import torchtitan_npu (or call "
                "torchtitan_npu.bootstrap.activate()) first"
            )
        return self._ctx

    def apply(
        self, patches: list[Patch], ctx: PatchContext, expected: dict[str, str]
    ) -> list[PatchStatus]:
        """Verify every target, then apply the needed patches: all or nothing
        (idempotent). Under the untested-upstream opt-in a missing, drifted or
        failing patch is skipped with one warning instead."""
        if self.active:
            return self.status
        names = [p.name for p in patches]
        duplicates = {n for n in names if names.count(n) > 1}
        assert not duplicates, f"duplicate patch names: {sorted(duplicates)}"
        rows = check(patches, ctx, expected)
        for row in rows:
            if row.state not in ("missing", "drifted"):
                continue
            message = (
                f"overlay patch {row.patch.name!r}: target {row.patch.target} is "
                f"{row.state} in torchtitan {ctx.upstream_version} ({row.detail}; "
                f"found {row.found or '-'}, upstream.lock has {row.expected or '-'})"
            )
            if ctx.tested:
                raise PatchTargetError(
                    message + ". Re-verify the patch against this upstream, then "
                    "run `titan-npu compat record`."
                )
            warnings.warn("UNTESTED UPSTREAM: " + message, stacklevel=2)
            if row.state == "drifted" and (skip := row.patch.skip(ctx)):
                row.state, row.detail = "not needed", f"{skip}; {row.detail}"
        done: list[_Applied] = []
        try:
            for row in rows:
                if row.state not in ("pending", "drifted"):
                    continue
                try:
                    done.append(_apply_one(row.patch, ctx))
                except Exception as e:
                    failure = (
                        f"overlay patch {row.patch.name!r} failed to apply on "
                        f"torchtitan {ctx.upstream_version}: {type(e).__name__}: {e}"
                    )
                    if ctx.tested:
                        raise PatchTargetError(failure) from e
                    warnings.warn(
                        f"UNTESTED UPSTREAM: {failure}; skipped", stacklevel=2
                    )
                    row.state, row.detail = "failed", f"{type(e).__name__}: {e}"
                    continue
                if row.state == "pending":
                    row.state = "applied"
                else:  # drifted but applied under the untested opt-in
                    row.detail += "; applied anyway (untested upstream)"
        except BaseException:
            for applied in reversed(done):
                _undo(applied.undo)
            raise
        self._applied, self._ctx, self.status = done, ctx, rows
        return rows

    def apply_on_request(self, name: str, device_type: str | None = None) -> None:
        """Apply an on-request record of the active set (idempotent; nothing
        for a record of other releases); for ``device_type`` when given (a
        converter built for another device)."""
        row = next((r for r in self.status if r.patch.name == name), None)
        if self._ctx is None or row is None:
            raise PatchTargetError(
                f"overlay record {name!r} is not in the active overlay; "
                "activate the overlay (import torchtitan_npu) before converting"
            )
        if row.state in ("applied", "not needed"):  # on request: other releases
            return
        if row.state != "on request":
            raise PatchTargetError(
                f"overlay record {name!r} cannot be applied: it is {row.state}"
            )
        ctx = self._ctx
        if device_type is not None:
            ctx = dataclasses.replace(ctx, device_type=device_type)
        self._applied.append(_apply_one(row.patch, ctx))
        row.state = "applied"

    def revert_on_request(self) -> None:
        """Undo the on-request records only (tests, A/B runs in one process)."""
        for applied in [a for a in self._applied if a.patch.on_request]:
            _undo(applied.undo)
            self._applied.remove(applied)
        for row in self.status:
            if row.patch.on_request and row.state == "applied":
                row.state = "on request"

    def revert(self) -> None:
        """Undo every change, newest first."""
        while self._applied:
            _undo(self._applied.pop().undo)
        self._ctx, self.status = None, []
        if "torchtitan_npu.kernels.fla_standin" in sys.modules:
            sys.modules["torchtitan_npu.kernels.fla_standin"].uninstall()

    @contextlib.contextmanager
    def applied(
        self, patches: list[Patch], ctx: PatchContext, expected: dict[str, str]
    ) -> Iterator[list[PatchStatus]]:
        """Apply for the duration of a block (tests, A/B runs)."""
        rows = self.apply(patches, ctx, expected)
        try:
            yield rows
        finally:
            self.revert()


def _apply_one(patch: Patch, ctx: PatchContext) -> _Applied:
    """Make one patch's changes; on failure undo the ones already made."""
    target = resolve_target(patch.target)
    undo: list[tuple[Any, str, Any, bool]] = []
    try:
        for change in patch.apply(target, ctx):
            undo += _set(change)
    except BaseException:
        _undo(undo)
        raise
    return _Applied(patch, undo)


def _undo(undo: list[tuple[Any, str, Any, bool]]) -> None:
    for owner, attr, old, had in reversed(undo):
        if had:
            setattr(owner, attr, old)
        else:
            delattr(owner, attr)


def _set(change: Change) -> list[tuple[Any, str, Any, bool]]:
    """Make one change; return how to undo it (including rebinding)."""
    owner, attr = change.owner, change.attr
    had = attr in vars(owner)
    if not had and not change.new:
        name = getattr(owner, "__name__", repr(owner))
        raise AttributeError(f"{name} has no attribute {attr!r} to change")
    old = vars(owner).get(attr)
    undo = [(owner, attr, old, had)]
    setattr(owner, attr, change.value)
    if change.rebind and had:
        for name, module in list(sys.modules.items()):
            if (
                module is None
                or module is owner
                or not name.startswith(REBIND_PREFIXES)
            ):
                continue
            if vars(module).get(attr, _MISSING) is old:
                undo.append((module, attr, old, True))
                setattr(module, attr, change.value)
    return undo


_MISSING = object()
