"""Every exported callable shows how to call it: a runnable ``>>>`` example in its own docstring.

The exported names are each package's ``__all__`` (or, for a module without one, the public names it
defines). Classes need an example in the class docstring and a docstring on every public method,
property and class method they define. The examples themselves run under ``--doctest-modules``; this
file only checks that they exist, and says where the missing ones live.

``python tests/test_docs.py`` prints what is missing, one ``module.name (file)`` a line.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

#: the packages and modules whose exported names are the public API
MODULES = (
    "napkin_cat",
    "napkin_cat.library",
    "napkin_cat.hardware",
    "napkin_cat.optimize",
    "rewrites",
    "rewrites.testing",
    "lowering",
)


def exported(module_name: str) -> dict[str, object]:
    """The callables ``module_name`` exports, by name: its ``__all__``, else the public names it defines."""
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    if names is None:
        defined_here = lambda v: getattr(v, "__module__", None) == module_name  # noqa: E731
        names = [n for n, v in vars(module).items() if not n.startswith("_") and defined_here(v)]
    found = {n: getattr(module, n) for n in names}
    return {n: v for n, v in found.items() if inspect.isclass(v) or inspect.isroutine(v)}


def has_example(doc: str | None) -> bool:
    return bool(doc) and ">>>" in doc


def own_doc(obj) -> str | None:
    """The docstring written on ``obj`` itself, not one a class inherits from its base."""
    if inspect.isclass(obj):
        return vars(obj).get("__doc__")
    return getattr(obj, "__doc__", None)


def where(obj) -> str:
    try:
        return str(Path(inspect.getsourcefile(obj)).relative_to(ROOT))
    except (TypeError, ValueError):
        return getattr(obj, "__module__", "?")


def undocumented_methods(cls: type) -> list[str]:
    """Public methods, properties and class methods ``cls`` defines without a docstring (its own or,
    for an override, the one of the method it overrides)."""
    missing = []
    for name, member in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(member, property):
            doc = member.__doc__ if member.fget is None else (member.fget.__doc__ or member.__doc__)
        elif isinstance(member, classmethod | staticmethod) or inspect.isfunction(member):
            doc = inspect.getdoc(getattr(cls, name))
        else:
            continue
        if not doc:
            missing.append(f"{cls.__name__}.{name}")
    return missing


def missing(module_name: str) -> list[str]:
    """``module.name (file)`` for each exported callable of ``module_name`` lacking an example, and
    ``module.Class.method (file)`` for each undocumented public method of an exported class."""
    out = []
    for name, obj in sorted(exported(module_name).items()):
        if not has_example(own_doc(obj)):
            out.append(f"{module_name}.{name} ({where(obj)})")
        if inspect.isclass(obj):
            out += [f"{module_name}.{m} ({where(obj)})" for m in undocumented_methods(obj)]
    return out


@pytest.mark.parametrize("module_name", MODULES)
def test_every_export_has_an_example(module_name):
    gaps = missing(module_name)
    assert not gaps, f"{len(gaps)} exported callables of {module_name} lack a >>> example or a docstring:\n" + (
        "\n".join(gaps)
    )


def test_checker_sees_a_missing_example():
    class Bare:
        def method(self):
            return 1

    assert not has_example(own_doc(Bare))
    assert undocumented_methods(Bare) == ["Bare.method"]
    assert has_example(own_doc(exported)) is False  # a docstring without >>> is not an example
    assert has_example(own_doc(missing)) is False


if __name__ == "__main__":
    for module_name in MODULES:
        for line in missing(module_name):
            print(line)
