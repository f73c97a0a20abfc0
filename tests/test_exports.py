"""Every name a package exports can be imported, a package's ``__init__.py`` only re-exports
(its logic lives in a module whose name says what it is), and no module defines a class or function
twice (the second silently replaces the first: ``bnrecal.errors`` once carried two
``CorruptBlobError`` classes, and ``bnrecal.workers`` exported twenty names from a module
that no longer existed)."""

from __future__ import annotations

import ast
import importlib
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
PACKAGES = [name for name in CONFIG["packages"] if not name.endswith((".static", ".templates"))]


def source_folder(package: str) -> Path:
    """Where a package's files are in this checkout (``pyproject.toml``'s package-dir)."""
    for prefix, folder in sorted(CONFIG["package-dir"].items(), key=lambda item: -len(item[0])):
        if package == prefix or package.startswith(prefix + "."):
            return ROOT / folder / Path(*package[len(prefix):].split(".")[1:])
    return ROOT / Path(*package.split("."))


MODULES = sorted({path for package in PACKAGES for path in source_folder(package).glob("*.py")})


@pytest.mark.parametrize("package", PACKAGES)
def test_every_exported_name_imports(package: str) -> None:
    module = importlib.import_module(package)
    for name in getattr(module, "__all__", ()):
        assert getattr(module, name) is not None, f"{package}.{name}"


def defined_twice(body: list[ast.stmt]) -> list[str]:
    """Names a block of statements defines more than once by ``def`` or ``class`` (an
    ``@overload`` or a property's setter and deleter reuse a name on purpose)."""
    seen: set[str] = set()
    twice = []
    for node in body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        decorators = {ast.unparse(d).split("(")[0] for d in node.decorator_list}
        if any(d.endswith((".setter", ".deleter", "overload")) for d in decorators):
            continue
        if node.name in seen:
            twice.append(f"{node.name} (line {node.lineno})")
        seen.add(node.name)
        if isinstance(node, ast.ClassDef):
            twice += [f"{node.name}.{name}" for name in defined_twice(node.body)]
    return twice


def test_the_check_finds_a_second_definition() -> None:
    assert defined_twice(ast.parse("class A: pass\ndef f(): pass\nclass A: pass\n").body) == ["A (line 3)"]
    assert defined_twice(ast.parse("class A:\n def f(self): pass\n def f(self): pass\n").body) == ["A.f (line 3)"]


@pytest.mark.parametrize("path", MODULES, ids=lambda path: str(path.relative_to(ROOT)))
def test_no_module_defines_a_name_twice(path: Path) -> None:
    assert defined_twice(ast.parse(path.read_text(encoding="utf-8")).body) == []


RE_EXPORTS = (ast.Import, ast.ImportFrom, ast.Assign, ast.If, ast.Try, ast.Expr)
"""What a package's ``__init__.py`` may hold: imports, ``__all__`` or a lazy-export table,
``if TYPE_CHECKING`` imports, the version lookup, its docstring."""


@pytest.mark.parametrize("package", PACKAGES)
def test_a_package_only_re_exports(package: str) -> None:
    tree = ast.parse((source_folder(package) / "__init__.py").read_text(encoding="utf-8"))
    logic = [f"{type(node).__name__} at line {node.lineno}" for node in tree.body if not isinstance(node, RE_EXPORTS)]
    logic += [f"{type(node).__name__} at line {node.lineno}" for node in ast.walk(tree)
              if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.For, ast.While, ast.Lambda))]
    assert logic == [], f"{package}/__init__.py holds logic: move it to a module"
