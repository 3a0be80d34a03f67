"""The import graph points down (harness -> solvers / polytope -> lazytensor): each package imports and
runs with the packages above it blocked; ``LazyTensor.solve`` is the one call that reaches up, late."""
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(blocked, code):
    """``code`` in a fresh interpreter where importing any of ``blocked`` raises ImportError."""
    prelude = f"import sys\nfor name in {list(blocked)!r}:\n    sys.modules[name] = None\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "LAZYTENSOR_DISABLE_COMPILE": "1"}
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=300)


def test_polytope_imports_beside_solvers_below_harness():
    done = _run(("solvers", "harness"), "import polytope\nprint('ok')")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


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
    done = _run(("solvers", "polytope", "harness"), code)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["True", "ImportError: LazyTensor.solve runs the conjugate gradient of the "
                                        "'solvers' package: it is not importable"]


def test_solvers_fit_without_the_packages_above():
    code = """
import torch, solvers
X = torch.rand(30, 2, dtype=torch.float64)
print(solvers.KernelRidge(solvers.RBF(1.0), 0.1, source="streamed").fit(X, X[:, 0]).info_.converged)
"""
    done = _run(("polytope", "harness"), code)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-2000:]
