"""The era convention: only compat/era.py spells an era, nothing branches on
one, and docs/architecture.md lists every era-specific site."""

import ast
import re
from pathlib import Path

import pytest

from torchtitan_npu.compat.era import Era, era_module, parse_era
from torchtitan_npu.errors import LockError

PACKAGE = Path(__file__).resolve().parents[1] / "torchtitan_npu"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
ERA_VALUES = {era.value for era in Era}


def modules() -> dict[str, ast.Module]:
    return {
        path.relative_to(PACKAGE).as_posix(): ast.parse(path.read_text())
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def era_members(tree: ast.Module) -> set[str]:
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "Era"
        and node.attr in Era.__members__
    }


def era_sites() -> list[str]:
    """Modules named after an era, and modules naming an Era member."""
    return sorted(
        name
        for name, tree in modules().items()
        if Path(name).stem in ERA_VALUES or era_members(tree)
    )


def documented_sites() -> list[str]:
    section = ARCHITECTURE.read_text().split("### Era sites", 1)[1]
    section = section.split("\n## ", 1)[0]
    return sorted(re.findall(r"^- `([\w/.]+\.py)`", section, flags=re.MULTILINE))


def test_only_compat_era_spells_an_era():
    spelled = [
        f"{name}:{node.lineno}"
        for name, tree in modules().items()
        if name != "compat/era.py"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in ERA_VALUES
    ]
    assert not spelled, f"era spelled as a string (use Era): {spelled}"


def test_nothing_branches_on_an_era():
    """Era differences are modules or Era-keyed tables, never comparisons."""
    branches = [
        f"{name}:{node.lineno}"
        for name, tree in modules().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare)
        and any(
            isinstance(side, ast.Attribute)
            and isinstance(side.value, ast.Name)
            and side.value.id == "Era"
            for side in (node.left, *node.comparators)
        )
    ]
    assert not branches, f"comparisons with an Era member: {branches}"


def test_architecture_lists_every_era_site():
    assert era_sites() == documented_sites()


def test_every_era_has_its_modules():
    """Each per-era subsystem has a module for every era, and the running
    era's loads."""
    for package in ("overlay", "config", "converters", "models/qwen2"):
        for era in Era:
            assert (PACKAGE / package / f"{era.value}.py").is_file(), (package, era)


def test_the_running_eras_modules_load(upstream):
    for package in ("overlay", "config", "converters"):
        module = era_module(f"torchtitan_npu.{package}", upstream.era)
        assert module.__name__ == f"torchtitan_npu.{package}.{upstream.era.value}"


def test_an_unknown_era_is_one_line():
    with pytest.raises(LockError) as info:
        parse_era("trainspec2")
    assert str(info.value) == (
        "unknown upstream API era 'trainspec2'; known: ['trainspec', 'config_registry']"
    )
