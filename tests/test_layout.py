"""The house rules of docs/architecture.md, checked: dependencies point downward, modules stay small.

Layers, lowest first: ``lazytensor`` (torch and sympy only), then ``solvers`` (on
lazytensor) and ``polytope`` (on neither), then ``harness`` (on all). The one
deliberate exception is named here and in DESIGN section 2: ``LazyTensor.solve``
calls the Krylov methods of ``solvers`` through one late import in
``lazytensor/solve.py``.
"""
import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAY_IMPORT = {
    "lazytensor": set(),
    "solvers": {"lazytensor"},
    "polytope": set(),
    "harness": {"lazytensor", "solvers", "polytope"},
}
LATE_IMPORTS = {("lazytensor/solve.py", "solvers")}  # the one named exception, inside a function
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 60
SHORT_FUNCTIONS = ["lazytensor", "polytope/optimizer.py"]


def _modules(package: str):
    return sorted((ROOT / package).rglob("*.py"))


def _imports(tree: ast.AST):
    """(imported top-level package, whether the import sits at module level) for each import."""
    top_level = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            yield name.split(".")[0], id(node) in top_level


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_imports_point_downward(package):
    wrong = []
    for path in _modules(package):
        relative = path.relative_to(ROOT).as_posix()
        for target, module_level in _imports(ast.parse(path.read_text())):
            if target in MAY_IMPORT and target != package and target not in MAY_IMPORT[package]:
                if module_level or (relative, target) not in LATE_IMPORTS:
                    wrong.append(f"{relative} imports {target}")
    assert not wrong, wrong


@pytest.mark.parametrize("package", ["lazytensor", "solvers", "polytope"])
def test_every_module_imports_with_the_layers_above_blocked(package):
    blocked = sorted(set(MAY_IMPORT) - MAY_IMPORT[package] - {package})
    script = f"""
import importlib, pkgutil, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError("blocked layer: " + name)
sys.meta_path.insert(0, Block())
import {package}
for info in pkgutil.walk_packages({package}.__path__, "{package}."):
    importlib.import_module(info.name)
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_files_and_functions_stay_small():
    too_long = []
    for package in MAY_IMPORT:
        for path in _modules(package):
            lines = len(path.read_text().splitlines())
            if lines > MAX_FILE_LINES:
                too_long.append(f"{path.relative_to(ROOT)}: {lines} lines")
    for target in SHORT_FUNCTIONS:
        paths = [ROOT / target] if target.endswith(".py") else _modules(target)
        for path in paths:
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = node.end_lineno - node.lineno + 1
                    if length > MAX_FUNCTION_LINES:
                        too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines")
    assert not too_long, too_long
