"""The layers of docs/ARCHITECTURE.md, checked on the source: ``napkin_cat`` imports neither ``rewrites`` nor
``lowering`` (its ``__main__``, the application, may, and ``nc.attention`` is resolved lazily); ``lowering`` uses
only ``rewrites``' public names; no package reaches into another's private modules."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PACKAGES = ("napkin_cat", "rewrites", "lowering")
#: where a layer may import a higher one: the application, the lazy drop-in entry, and derive(verify="kernel"),
#: which checks a step on the lowered kernel (imported inside the function, so rewrites still loads without it)
ALLOWED = {
    ("napkin_cat/__main__.py", "rewrites"),
    ("napkin_cat/__main__.py", "lowering"),
    ("napkin_cat/__init__.py", "lowering"),
    ("rewrites/_derive.py", "lowering"),
}


def imports(path: Path) -> list[tuple[int, str]]:
    """Every module a file imports (line, dotted name), wherever the import sits in it.

    >>> [name for _, name in imports(ROOT / "rewrites" / "_tile.py")][:2]
    ['__future__', 'dataclasses']
    """
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
    return found


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_point_one_way(package):
    higher = {"napkin_cat": ("rewrites", "lowering"), "rewrites": ("lowering",), "lowering": ()}[package]
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in sources(package)
        for line, name in imports(path)
        if name.split(".")[0] in higher and (str(path.relative_to(ROOT)), name.split(".")[0]) not in ALLOWED
    ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_package_reaches_into_another_s_private_modules(package):
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in sources(package)
        for line, name in imports(path)
        if name.split(".")[0] in PACKAGES
        and name.split(".")[0] != package
        and any(part.startswith("_") for part in name.split(".")[1:])
    ]
    assert not wrong, "\n".join(wrong)
