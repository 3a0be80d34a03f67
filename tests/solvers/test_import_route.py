"""``import solvers`` and ``LazyTensor.solve`` (KeOps's KernelSolve) leave scikit-learn unimported (issue 42: it
was ~1.6 s of a KernelSolve script): the estimators load on first access, still scikit-learn estimators. Routes."""
import subprocess
import sys
import warnings

import pytest
import torch

import lazytensor as lt


def _run(code: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def test_solvers_and_a_kernel_solve_leave_sklearn_unimported_until_an_estimator_is_asked_for():
    pytest.importorskip("sklearn")
    code = """
import sys
import torch
import lazytensor as lt
import solvers, solvers.formula_solve
from solvers import RBF, StreamedKernel, cg, AUTO_DIRECT_MAX_N
print("sklearn" in sys.modules)
x = torch.randn(40, 2, dtype=torch.float64)
b = torch.randn(40, 1, dtype=torch.float64)
K = (-lt.Vi(x).sqdist(lt.Vj(x)) / 2).exp()
K.solve(b, alpha=0.1)
K.solve(b, alpha=0.1, source="streamed")
print(solvers.formula_solve.last_solve.route, "sklearn" in sys.modules)
print(sorted(set(solvers.__all__) - set(dir(solvers))))
from solvers import KernelRidge, ConvergenceWarning, NotFittedError
import sklearn.base, sklearn.exceptions
print(issubclass(KernelRidge, sklearn.base.BaseEstimator), issubclass(KernelRidge, sklearn.base.RegressorMixin),
      issubclass(ConvergenceWarning, sklearn.exceptions.ConvergenceWarning),
      issubclass(NotFittedError, sklearn.exceptions.NotFittedError), ConvergenceWarning is solvers.base.ConvergenceWarning)
"""
    assert _run(code) == ["False", "streamed", "False", "[]", "True", "True", "True", "True", "True"]


def test_an_unconverged_kernel_solve_warns_with_the_one_convergence_warning():
    import solvers

    g = torch.Generator().manual_seed(0)
    x, b = torch.randn(200, 2, generator=g, dtype=torch.float64), torch.randn(200, 1, generator=g, dtype=torch.float64)
    K = (-lt.Vi(x).sqdist(lt.Vj(x)) * 4).exp()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        K.solve(b, alpha=1e-6, source="streamed", maxiter=1)
    assert [w.category for w in caught if "did not converge" in str(w.message)] == [solvers.ConvergenceWarning]
