"""The layers of docs/ARCHITECTURE.md, checked on the source: ``napkin_cat`` imports neither ``rewrites`` nor
``lowering`` (its ``__main__``, the application, may, and ``nc.attention`` is resolved lazily); ``lowering`` uses
only ``rewrites``' public names; no package reaches into another's private modules; in ``lowering`` no backend (a
folder: triton, mosaic, xla) imports another, and the shared modules below them import none."""

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


#: the backends of lowering/, each a folder (one line in lowering/_registry.py registers it)
BACKENDS = ("triton", "mosaic", "xla")
#: the modules below every backend: the plan, the shared block machinery, the streamed loop, where a kernel runs
SHARED = ("lowering/_plan.py", "lowering/_blocks.py", "lowering/_loop.py", "lowering/_target.py", "lowering/_source.py")


def _backend_of(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if parts[0] == "lowering" and len(parts) > 1 and parts[1] in BACKENDS else None


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_backend_imports_another(backend):
    """A backend imports the shared modules and its own, never another backend's (the seam of lowering/_registry)."""
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in sorted((ROOT / "lowering" / backend).rglob("*.py"))
        for line, name in imports(path)
        if _backend_of(name) not in (None, backend)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_shared_modules_import_no_backend():
    wrong = [
        f"{path}:{line} imports {name}"
        for path in SHARED
        for line, name in imports(ROOT / path)
        if _backend_of(name) is not None or name in ("lowering._api", "lowering._registry")
    ]
    assert not wrong, "\n".join(wrong)


def test_backends_are_folders():
    """Each backend is a package of its own; no module of lowering/ is named after one (``_triton.py``)."""
    assert all((ROOT / "lowering" / b / "__init__.py").exists() for b in BACKENDS)
    assert not [p.name for p in (ROOT / "lowering").glob("*.py") if p.stem.lstrip("_") in BACKENDS]
