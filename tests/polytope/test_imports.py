"""polytope stands beside lazytensor: it imports none of lazytensor, solvers or harness (DESIGN section 2)."""
import subprocess
import sys

BLOCKED = """
import sys
for name in ("lazytensor", "solvers", "harness"):
    sys.modules[name] = None  # any import of them now raises ImportError
import polytope, polytope.distributed, polytope.evaluators, polytope.train  # noqa: E401
import torch
from torch import nn
model = nn.Linear(2, 1)
polytope.train(model, nn.functional.mse_loss, (torch.randn(4, 2), torch.randn(4, 1)), steps=1, seed=0, progress=False)
try:  # the group path too: without torch.distributed it must say so, not reach for another package
    polytope.NNCostEvaluator(model, nn.functional.mse_loss, group=object())
except RuntimeError as exc:
    assert "not initialised" in str(exc)
print("ok")
"""


def test_polytope_imports_and_trains_with_the_other_packages_blocked():
    done = subprocess.run([sys.executable, "-c", BLOCKED], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
