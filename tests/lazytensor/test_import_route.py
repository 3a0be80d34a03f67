"""``import lazytensor`` leaves Dynamo and Inductor unimported (issue 42: they were 1.4 s of its 2.15 s after torch),
and formulas stay opaque to a caller's torch.compile all the same (``lazytensor.opaque``). Routes, not timings."""
import subprocess
import sys

import torch

import lazytensor as lt
from lazytensor.opaque import opaque

_REPORT = """
import sys
print(sorted({m for m in sys.modules if m.split(".")[:2] in (["torch", "_dynamo"], ["torch", "_inductor"])}))
"""


def _compiler_modules_after(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code + _REPORT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def test_importing_the_packages_and_an_eager_reduction_leave_dynamo_and_inductor_unimported():
    code = """
import torch
import lazytensor as lt
import lazytensor.keops
import polytope
import solvers
x, y = torch.randn(20, 3), torch.randn(30, 3)
(lt.Vi(x) * lt.Vj(y)).sum(-1).sum(1, backend="eager")
lazytensor.keops.torch.LazyTensor(x[:, None, :]).clamp(-0.5, lazytensor.keops.torch.LazyTensor(y[None])).sum(1, backend="eager")
"""
    assert _compiler_modules_after(code) == "[]"


def test_an_opaque_call_is_a_graph_break_run_eagerly_with_what_it_calls():
    seen = []

    def deeper(t):
        seen.append(torch.compiler.is_compiling())  # True had Dynamo traced this frame
        return t.sin()

    @opaque
    def step(t):
        seen.append(torch.compiler.is_compiling())
        return deeper(t) * 3

    def user(t):
        return step(t * 2) + 1

    torch._dynamo.reset()
    t = torch.randn(5, dtype=torch.float64)
    torch.testing.assert_close(torch.compile(user, backend="eager")(t), (t * 2).sin() * 3 + 1)
    assert seen == [False, False]
    assert step.__name__ == "step" and not torch._C._dynamo.eval_frame._debug_get_cache_entry_list(step.__code__)
    torch.testing.assert_close(step(t), t.sin() * 3)  # and a plain call outside torch.compile


def test_a_keops_layout_formula_inside_torch_compile_gives_dense_values_and_gradients():
    torch._dynamo.reset()
    x, y = torch.randn(40, 3, dtype=torch.float64), torch.randn(50, 3, dtype=torch.float64)
    b = torch.randn(50, 2, dtype=torch.float64, requires_grad=True)

    def user(x, y, b):
        d = ((lt.LazyTensor(x[:, None, :]) - lt.LazyTensor(y[None, :, :])) ** 2).sum(-1)
        return ((-0.5 * d).exp() @ b).sum() * 2

    value = torch.compile(user, backend="eager")(x, y, b)
    dense = (torch.exp(-0.5 * ((x[:, None] - y[None]) ** 2).sum(-1)) @ b).sum() * 2
    torch.testing.assert_close(value, dense)
    torch.testing.assert_close(torch.autograd.grad(value, b)[0], torch.autograd.grad(dense, b)[0])
