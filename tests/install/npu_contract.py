"""titan-npu's torch_npu calls against the torch_npu it is locked to, read
from the installed package's files (nothing is imported: no CANN needed).

- Fused ops: every ``torch_npu.<op>(...)`` / ``torch_npu().<op>(...)`` call in
  the package against the op's schema in ``torch_npu/_op_plugin_docs.py``
  (each docstring's prototype line, e.g. ``torch_npu.npu_rms_norm(Tensor
  self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)``): the op
  exists, no more positional arguments than it takes, every keyword is one of
  its parameters, every required parameter is given, and an index into the
  result (``[0]``) or an unpacking fits the returned tuple.
- The profiler: every attribute titan-npu reads from ``torch_npu.profiler``
  (through ``reporting/npu_profiler.py``'s accessor) is exported there, and
  every keyword it passes to ``profile`` and ``schedule`` is a parameter of
  the class behind it.

``python npu_contract.py TORCH_NPU_DIR [PACKAGE_DIR]`` prints each problem and
exits 1 when there is one. The nox session ``npu_without_cann`` runs it on
the locked wheel; tests/test_npu_contract.py checks the checker.
"""

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "torchtitan_npu"
PROFILER_ACCESSOR = "_torch_npu_profiler"  # reporting/npu_profiler.py

_SIGNATURE = re.compile(r"^(?:torch_npu\.)?(\w+)\((.*)\)\s*->\s*(.+?)\s*$")


@dataclass(frozen=True)
class Schema:
    name: str
    positional: tuple[str, ...]  # may be passed by position
    keyword_only: tuple[str, ...]
    required: frozenset[str]
    returns: int | None  # tuple arity; None: one value, or a list
    listed: bool = False  # returns a list: any index may be taken

    @property
    def names(self) -> set[str]:
        return {*self.positional, *self.keyword_only}


def _split(arguments: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in arguments:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    if current.strip():
        parts.append(current.strip())
    return parts


def _returns(text: str) -> int | None:
    if text.startswith("(") and text.endswith(")"):
        arity = len(_split(text[1:-1]))
        return arity if arity > 1 else None
    return None


def parse_schema(line: str) -> Schema | None:
    match = _SIGNATURE.match(line.strip())
    if not match:
        return None
    name, arguments, returns = match.groups()
    positional, keyword_only, required = [], [], set()
    star = False
    for part in _split(arguments):
        if part == "*":
            star = True
            continue
        declaration, has_default, _ = part.partition("=")
        *kind, argument = declaration.split()
        (keyword_only if star else positional).append(argument)
        optional = bool(kind) and kind[0].endswith("?")  # "int[]? x": None
        if not has_default and not optional:
            required.add(argument)
    listed = returns.startswith(("List[", "Tensor[]", "list["))
    return Schema(
        name, tuple(positional), tuple(keyword_only), frozenset(required),
        _returns(returns), listed,
    )  # fmt: skip


def schemas(docs: str) -> dict[str, list[Schema]]:
    """Every op's schemas in ``_op_plugin_docs.py``'s text (an op may be
    documented more than once)."""
    found: dict[str, list[Schema]] = {}
    for node in ast.walk(ast.parse(docs)):
        if not (isinstance(node, ast.Call) and len(node.args) == 2):
            continue
        name, doc = node.args
        if not all(isinstance(a, ast.Constant) and isinstance(a.value, str)
                   for a in (name, doc)):  # fmt: skip
            continue
        for line in str(doc.value).splitlines():  # the prototype line
            schema = parse_schema(line)
            if schema is not None and schema.name == name.value:
                found.setdefault(schema.name, []).append(schema)
                break
    return found


@dataclass(frozen=True)
class CallSite:
    where: str  # path:line
    op: str
    positional: int
    keywords: tuple[str, ...]
    index: int | None  # result[index]
    unpacked: int | None  # a, b = result


def _is_torch_npu(node: ast.expr) -> bool:
    """``torch_npu`` or ``torch_npu()`` (the converters' accessor)."""
    if isinstance(node, ast.Call):
        node = node.func
    return isinstance(node, ast.Name) and node.id == "torch_npu"


def call_sites(package: Path) -> list[CallSite]:
    sites = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text())
        parents = {
            child: node
            for node in ast.walk(tree)
            for child in ast.iter_child_nodes(node)
        }
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and _is_torch_npu(node.func.value)
            ):
                continue
            parent = parents.get(node)
            index = unpacked = None
            if isinstance(parent, ast.Subscript) and isinstance(
                parent.slice, ast.Constant
            ):
                index = parent.slice.value
            if isinstance(parent, ast.Assign) and isinstance(
                parent.targets[0], ast.Tuple
            ):
                unpacked = len(parent.targets[0].elts)
            sites.append(
                CallSite(
                    f"{path.relative_to(package.parent)}:{node.lineno}",
                    node.func.attr,
                    len(node.args),
                    tuple(k.arg for k in node.keywords if k.arg is not None),
                    index,
                    unpacked,
                )
            )
    return sites


def call_problems(site: CallSite, schema: Schema) -> list[str]:
    problems = []
    if site.positional > len(schema.positional):
        problems.append(
            f"{site.positional} positional arguments; it takes {len(schema.positional)}"
        )
    problems += [f"no parameter {k!r}" for k in site.keywords if k not in schema.names]
    given = {*schema.positional[: site.positional], *site.keywords}
    problems += [f"required {r!r} not given" for r in sorted(schema.required - given)]
    arity = schema.returns
    if (
        site.index is not None
        and arity is not None
        and not -arity <= site.index < arity
    ):
        problems.append(f"[{site.index}] of a {arity}-tuple")
    if site.index is not None and arity is None and not schema.listed:
        problems.append(f"[{site.index}] of a single result")
    if site.unpacked is not None and site.unpacked != arity:
        problems.append(f"unpacked into {site.unpacked}; it returns {arity or 1}")
    return problems


def check_ops(docs: str, package: Path) -> list[str]:
    known = schemas(docs)
    problems = []
    for site in call_sites(package):
        if site.op not in known:
            problems.append(f"{site.where}: torch_npu.{site.op}: no such op")
            continue
        # an op documented twice must fit every one of its schemas
        for schema in known[site.op]:
            for problem in call_problems(site, schema):
                problems.append(f"{site.where}: torch_npu.{site.op}: {problem}")
    return sorted(set(problems))


def _init_parameters(source: str, cls: str) -> set[str] | None:
    """The parameters of ``cls.__init__`` in ``source`` (None: accepts **kw)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    a = item.args
                    if a.kwarg is not None:
                        return None
                    return {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]}
    raise LookupError(cls)


def check_profiler(torch_npu_dir: Path, package: Path) -> list[str]:
    """What reporting/npu_profiler.py takes from torch_npu.profiler."""
    init = (torch_npu_dir / "profiler" / "__init__.py").read_text()
    # name -> (the profiler package's module defining it, or "", its name)
    exported: dict[str, tuple[str, str]] = {}
    for node in ast.parse(init).body:
        if isinstance(node, ast.ImportFrom):
            local = node.module if node.level == 1 and node.module else ""
            for alias in node.names:
                exported[alias.asname or alias.name] = (local, alias.name)
    path = package / "reporting" / "npu_profiler.py"
    tree = ast.parse(path.read_text())
    bound = {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name)
        and node.value.func.id == PROFILER_ACCESSOR
        for target in node.targets
        if isinstance(target, ast.Name)
    }

    def is_profiler(node: ast.expr) -> bool:
        if isinstance(node, ast.Name):
            return node.id in bound
        return (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == PROFILER_ACCESSOR
        )

    problems = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and is_profiler(node.value)):
            continue
        where = f"{path.relative_to(package.parent)}:{node.lineno}"
        if node.attr not in exported:
            problems.append(f"{where}: torch_npu.profiler has no {node.attr!r}")
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and is_profiler(node.func.value)
            and node.func.attr in exported
        ):
            continue
        module, cls = exported[node.func.attr]
        source = torch_npu_dir / "profiler" / f"{module}.py"
        if not module or not source.is_file():
            continue  # from a C extension: its name was checked above
        parameters = _init_parameters(source.read_text(), cls)
        where = f"{path.relative_to(package.parent)}:{node.lineno}"
        for keyword in node.keywords:
            if (
                parameters is not None
                and keyword.arg is not None
                and keyword.arg not in parameters
            ):
                problems.append(
                    f"{where}: torch_npu.profiler.{node.func.attr} has no parameter "
                    f"{keyword.arg!r}"
                )
    return problems


def main(argv: list[str]) -> int:
    torch_npu_dir = Path(argv[0])
    package = Path(argv[1]) if len(argv) > 1 else PACKAGE
    docs = (torch_npu_dir / "_op_plugin_docs.py").read_text()
    problems = check_ops(docs, package) + check_profiler(torch_npu_dir, package)
    sites = call_sites(package)
    for problem in problems:
        print(f"npu contract: {problem}")
    ops = sorted({s.op for s in sites})
    print(
        f"npu contract: {len(sites)} torch_npu op calls ({', '.join(ops)}) and the "
        f"profiler checked against {torch_npu_dir}: {len(problems)} problems"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
