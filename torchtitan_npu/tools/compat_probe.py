"""What one installed upstream looks like to the overlay, as JSON: run inside
``compat sync``'s throwaway environments (the candidate's, the reference's).

``python -m torchtitan_npu.tools.compat_probe OUT.json [TARGETS.json]``:
the upstream's version and era; per patch target (the records that apply to
this version, or the targets listed in TARGETS.json) its fingerprint and
source, or why it is missing and which modules define the name now;
upstream's own config fields (type and default); its models and flavors.
The overlay is not applied: upstream is read as it is.
"""

import ast
import inspect
import json
import sys
import textwrap
from pathlib import Path
from typing import Any


def target_facts(spec: str) -> dict[str, Any]:
    """A target's fingerprint and source, or why it is missing and where its
    name is defined in the installed upstream now."""
    from torchtitan_npu.overlay.registry import fingerprint, resolve_target

    try:
        target = resolve_target(spec)
        obj = target.obj
        func = obj.__func__ if isinstance(obj, staticmethod | classmethod) else obj
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(func)))
        return {"fingerprint": fingerprint(obj), "source": source}
    except (ImportError, AttributeError, TypeError, OSError) as e:
        name = spec.partition(":")[2].split(".")[0]
        return {"missing": f"{type(e).__name__}: {e}", "defined_in": defined_in(name)}


def defined_in(name: str) -> list[str]:
    """The torchtitan modules defining ``name`` at their top level (read with
    ast: nothing imported)."""
    import importlib.util

    spec = importlib.util.find_spec("torchtitan")
    if spec is None or not spec.submodule_search_locations:
        return []
    root = Path(next(iter(spec.submodule_search_locations)))
    found = []
    for path in sorted(root.rglob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in tree.body:
            defined = node.name if hasattr(node, "name") else None
            assigned = [
                t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)
            ]
            if name == defined or name in assigned:
                parts = path.relative_to(root.parent).with_suffix("").parts
                found.append(".".join(p for p in parts if p != "__init__"))
    return found


def config_fields(era: Any) -> dict[str, Any]:
    """Upstream's own train config fields, ``path -> {type, default}``, as
    the era's ``upstream_defaults`` builds them."""
    from torchtitan_npu.config import era_config
    from torchtitan_npu.config.field_table import plain
    from torchtitan_npu.config.fields import describe, field_type, get_path, leaf_paths

    config = era_config(era).upstream_defaults()
    fields = {}
    for path in leaf_paths(config):
        if path.startswith("model_spec."):
            continue  # the model's own config, not a train config field
        kind = describe(field_type(config, path))
        fields[path] = {"type": kind, "default": plain(get_path(config, path))}
    return fields


def models(era: Any) -> dict[str, list[str]]:
    """Every model the upstream registers, with its flavors."""
    from torchtitan_npu.config import era_config

    config = era_config(era)
    out = {}
    for model in config.known_models():
        try:
            out[model] = sorted(config.flavors(model))
        except Exception as e:  # the model's package does not import here
            out[model] = [f"(cannot list: {type(e).__name__})"]
    return out


def guarded(what: str, fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as e:  # a candidate may break any reader: the report says so
        return {"error": f"{what}: {type(e).__name__}: {e}"}


def probe(targets: list[str] | None) -> dict[str, Any]:
    from torchtitan_npu import bootstrap
    from torchtitan_npu.compat import detect_era, installed_upstream
    from torchtitan_npu.overlay import patches_for

    bootstrap.remove_hook()
    from torchtitan_npu.kernels import fla_standin

    fla_standin.install()  # upstream's Qwen3.5 imports fla (as compat check does)
    installed = installed_upstream()
    era = detect_era()
    records = [p for p in patches_for(era) if p.for_release(installed.version)]
    if targets is None:
        targets = sorted({p.target for p in records})
    return {
        "version": installed.version,
        "commit": installed.commit,
        "era": era.value,
        "records": {p.name: p.target for p in records},
        "targets": {t: target_facts(t) for t in targets},
        "config_fields": guarded("config fields", config_fields, era),
        "models": guarded("models", models, era),
    }


def main(argv: list[str]) -> int:
    out, *rest = argv
    targets = json.loads(Path(rest[0]).read_text()) if rest else None
    Path(out).write_text(json.dumps(probe(targets), indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
