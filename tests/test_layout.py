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


def _run_blocked(blocked, code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter where importing any package of ``blocked`` raises ImportError."""
    prelude = f"import sys\nfor name in {sorted(blocked)!r}:\n    sys.modules[name] = None\n"
    return subprocess.run([sys.executable, "-c", prelude + code], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("package", ["lazytensor", "solvers", "polytope"])
def test_every_module_imports_with_the_layers_above_blocked(package):
    code = f"""
import importlib, pkgutil, {package}
for info in pkgutil.walk_packages({package}.__path__, "{package}."):
    importlib.import_module(info.name)
"""
    done = _run_blocked(set(MAY_IMPORT) - MAY_IMPORT[package] - {package}, code)
    assert done.returncode == 0, done.stderr[-2000:]


def test_lazytensor_runs_without_solvers_and_solve_says_what_it_needs():
    code = """
import torch, lazytensor as lt
x = torch.rand(20, 2, dtype=torch.float64)
K = (-lt.Vi(x).sqdist(lt.Vj(x))).exp()
print(float((K @ torch.ones(20, 1, dtype=torch.float64)).sum()) > 0)
try:
    K.solve(torch.ones(20, 1, dtype=torch.float64))
except ImportError as exc:
    print("ImportError:", exc)
"""
    done = _run_blocked({"solvers", "polytope", "harness"}, code)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["True", "ImportError: LazyTensor.solve runs the conjugate gradient of the "
                                        "'solvers' package: it is not importable"]


def test_solvers_fit_without_the_packages_above():
    code = """
import torch, solvers
X = torch.rand(30, 2, dtype=torch.float64)
print(solvers.KernelRidge(solvers.RBF(1.0), 0.1, source="streamed").fit(X, X[:, 0]).info_.converged)
"""
    done = _run_blocked({"polytope", "harness"}, code)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-2000:]


def test_polytope_trains_with_the_other_packages_blocked():
    code = """
import polytope, torch
from torch import nn
model = nn.Linear(2, 1)
polytope.train(model, nn.functional.mse_loss, (torch.randn(4, 2), torch.randn(4, 1)), steps=1, seed=0, progress=False)
try:  # the group path too: without torch.distributed it must say so, not reach for another package
    polytope.NNCostEvaluator(model, nn.functional.mse_loss, group=object())
except RuntimeError as exc:
    assert "not initialised" in str(exc)
print("ok")
"""
    done = _run_blocked({"lazytensor", "solvers", "harness"}, code)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


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
