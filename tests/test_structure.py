"""The package's shape: no import cycles between its packages, and the
modules everything depends on (errors, eras) are leaves."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "torchtitan_npu"


def module_imports(path: Path) -> set[str]:
    """torchtitan_npu modules imported when ``path`` loads (not in functions,
    not under ``if TYPE_CHECKING``)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("torchtitan_npu")}


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "torchtitan_npu"


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        source = package_of(".".join(path.relative_to(PACKAGE.parent).parts))
        for module in module_imports(path):
            if package_of(module) != source:
                graph.setdefault(source, set()).add(package_of(module))
    return graph


def test_no_import_cycles_between_packages():
    graph = package_graph()
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                raise AssertionError(f"import cycle: {' -> '.join([*path, nxt])}")
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert graph  # the graph was read


def test_errors_and_eras_are_leaves():
    """errors.py imports nothing of titan-npu; era.py nothing but errors."""
    assert module_imports(PACKAGE / "errors.py") == set()
    assert module_imports(PACKAGE / "compat/era.py") <= {"torchtitan_npu.errors"}


def test_every_user_error_lives_in_errors():
    """Error classes are defined once, in errors.py."""
    defined = {
        f"{path.relative_to(PACKAGE)}:{node.name}"
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
        and (node.name.endswith("Error") or node.name == "UpstreamNotInstalled")
    }
    assert defined and all(name.startswith("errors.py:") for name in defined), defined


def test_every_error_class_is_a_user_error():
    from torchtitan_npu import errors

    classes = [
        value
        for value in vars(errors).values()
        if isinstance(value, type) and issubclass(value, BaseException)
    ]
    assert errors.UserError in classes
    assert {c for c in classes if not issubclass(c, errors.UserError)} == {
        errors.Interrupted  # a signal, reported by the command it stopped
    }


# The only built-in exceptions titan-npu raises on purpose: programmer
# invariants, never a user's doing (a user's is a UserError).
INTERNAL_RAISES = {
    "converters/registry.py": "a converter registered twice",
    "overlay/trainspec.py": "a TrainSpec or model converter registered twice",
    "overlay/fla_standin.py": "a causal_conv1d activation upstream never passes",
    "plan/pipeline.py": "a pipeline stage simulated before the one feeding it",
    "cli.py": "plan --measure's own torchrun failing (its stderr is the report)",
    "overlay/registry.py": "a target lookup (made a PatchTargetError by its caller)"
    " and a record changing an attribute it did not declare new",
    "state_dict_adapters/safetensors_io.py": "a writer fed out of its planned order",
}


def test_deliberate_raises_are_user_errors():
    """A built-in exception (ValueError, OSError...) raised in titan-npu is shown as a
    bug (its traceback); one meant for the user must be a UserError."""
    import builtins

    built_in = {
        name
        for name, value in vars(builtins).items()
        if isinstance(value, type) and issubclass(value, Exception)
    } - {"NotImplementedError", "StopIteration"}  # abstract methods, iterators
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            call = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(call, ast.Name) and call.id in built_in:
                found.add(str(path.relative_to(PACKAGE)))
    assert found == set(INTERNAL_RAISES), found - set(INTERNAL_RAISES)


def test_public_functions_are_annotated():
    """Module-level and class-level public functions annotate every parameter
    (ruff's ANN201 checks their return types; nested closures are exempt)."""
    missing = []

    def visit(body, where: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                visit(node.body, f"{where}{node.name}.")
            if not isinstance(node, ast.FunctionDef):
                continue
            if node.name.startswith("_") and node.name != "__init__":
                continue
            arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            missing.extend(
                f"{where}{node.name}({a.arg})"
                for a in arguments
                if a.annotation is None and a.arg not in ("self", "cls")
            )

    for path in sorted(PACKAGE.rglob("*.py")):
        visit(ast.parse(path.read_text()).body, f"{path.relative_to(PACKAGE)}:")
    assert not missing, missing
