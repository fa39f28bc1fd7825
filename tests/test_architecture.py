"""The layout the import contracts cannot see: what hf/ holds, and who reads whose private state.

The layers themselves (which package may import which, nothing below hf/ importing transformers, no import
cycles) are import-linter contracts in pyproject.toml, run by the README's test command (`lint-imports`).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest
from transformers.cache_utils import Cache, CacheLayerMixin

import hf_kvgov

PACKAGE = Path(hf_kvgov.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


HF_MODULES = sorted(p for p in (PACKAGE / "hf").rglob("*.py") if p.name != "__init__.py")


@pytest.mark.parametrize("path", HF_MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_hf_holds_only_what_implements_transformers_interfaces(path: Path) -> None:
    """A module of hf/ talks to transformers itself or subclasses its `Cache` / layer classes; anything else
    is engine code and belongs below the boundary (`hf_kvgov.engine`)."""
    imported = _imports(ast.parse(path.read_text()))
    if any(name == "transformers" or name.startswith("transformers.") for name in imported):
        return
    if "hf_kvgov.hf.compat" in imported:
        return
    module = importlib.import_module(_module_name(path))
    adapters = [
        cls
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if cls.__module__ == module.__name__ and issubclass(cls, Cache | CacheLayerMixin)
    ]
    assert adapters, f"{path} neither imports transformers nor defines a Cache or layer subclass: move it below hf/"


def _private_names_defined(tree: ast.Module) -> set[str]:
    """Private names a module defines: functions, classes, and attributes it assigns (``x._name = ...``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name.startswith("_"):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr.startswith("_"):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id.startswith("_"):
            names.add(node.id)
    return names


def _private_reads(tree: ast.Module) -> list[tuple[str, int]]:
    """``obj._name`` where obj is not ``self`` / ``cls`` (dunder names are public protocol)."""
    reads = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        reads.append((f"{ast.unparse(node)}", node.lineno))
    return reads


def test_no_module_reads_another_modules_private_state() -> None:
    """An object exposes what its collaborators need: a private name is read only in the module defining it.

    Private names of other libraries (``argparse._SubParsersAction``) are theirs to answer for; a name counts
    as the project's when some module of hf_kvgov defines it.
    """
    trees = {path: ast.parse(path.read_text()) for path in PACKAGE.rglob("*.py")}
    defined_by = {path: _private_names_defined(tree) for path, tree in trees.items()}
    project_private = set().union(*defined_by.values())
    offences = [
        f"{path.relative_to(PACKAGE)}:{line}: {read}"
        for path, tree in trees.items()
        for read, line in _private_reads(tree)
        if (name := read.rsplit(".", 1)[1]) in project_private and name not in defined_by[path]
    ]
    assert not offences, "private state read from another module:\n" + "\n".join(offences)


MAX_MODULE_DOCSTRING_LINES = 12


def test_module_docstrings_are_at_most_12_lines() -> None:
    """A module docstring says what the module is and why, in a few lines; the detail of one class or function
    belongs in that class's or function's docstring, and history in git and eval/RESULTS.md."""
    offences = []
    for path in sorted(PACKAGE.rglob("*.py")):
        docstring = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        if docstring is None:
            continue
        lines = docstring.count("\n") + 1
        if lines > MAX_MODULE_DOCSTRING_LINES:
            offences.append(f"{path.relative_to(PACKAGE)}: {lines} lines")
    assert not offences, (
        f"module docstrings over {MAX_MODULE_DOCSTRING_LINES} lines (move the detail into the class or function it "
        "documents):\n" + "\n".join(offences)
    )


def _layer_of(module: str, layers: list[list[str]]) -> int | None:
    for index, siblings in enumerate(layers):
        if any(module == name or module.startswith(name + ".") for name in siblings):
            return index
    return None


def test_type_only_imports_respect_the_layers_too() -> None:
    """The layers contract (pyproject.toml) leaves out imports under TYPE_CHECKING, so that the cycle contract
    does not count a type named back; a type named from a layer above is still a dependency upwards (the engine
    typing its layers as hf/'s classes), so it is refused here."""
    pyproject = (PACKAGE.parent / "pyproject.toml").read_text()
    (listed,) = re.findall(r'^type = "layers"\nlayers = \[(.*?)\]', pyproject, flags=re.M | re.S)
    layers = [[name.strip() for name in layer.split("|")] for layer in re.findall(r'"([^"]+)"', listed)]
    assert len(layers) > 5, layers
    offences = []
    for path in sorted(PACKAGE.rglob("*.py")):
        own = _layer_of(_module_name(path), layers)
        if own is None:
            continue
        for imported in _imports(ast.parse(path.read_text())):
            other = _layer_of(imported, layers)
            if other is not None and other < own:
                offences.append(f"{path.relative_to(PACKAGE)} imports {imported}")
    assert not offences, "imports from a layer above:\n" + "\n".join(offences)
