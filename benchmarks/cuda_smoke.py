"""CUDA smoke check: every streamed operator, a reduction set, a fit and an evaluator on the GPU vs dense.

Run on a machine with a GPU: `PYTHONPATH=. python benchmarks/cuda_smoke.py` (or `... cpu`). Prints one line per
check (max relative error of values and gradients) and exits nonzero if any check fails.
"""
import sys
import time
import traceback

import torch

import lazytensor as lt

dev = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
torch.manual_seed(0)
failures = []


def rel(a, b):
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def check(name, fn, tol):
    start = time.perf_counter()
    try:
        err = fn()
        ok = err <= tol
        print(f"{'ok  ' if ok else 'FAIL'} {name}: max rel err {err:.2e} ({time.perf_counter() - start:.1f} s)", flush=True)
        if not ok:
            failures.append(name)
    except Exception:  # noqa: BLE001 - report every check
        failures.append(name)
        print(f"FAIL {name}: exception", flush=True)
        traceback.print_exc()


def grads_match(streamed, dense, inputs):
    out, ref = streamed(), dense()
    w = torch.randn_like(ref)
    g1 = torch.autograd.grad((out * w).sum(), inputs, allow_unused=True)
    g2 = torch.autograd.grad((ref * w).sum(), inputs, allow_unused=True)
    return max([rel(out, ref)] + [rel(a, b) for a, b in zip(g1, g2) if b is not None])


def leaf(*shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype, device=dev, requires_grad=True)


x, y, b = leaf(1000, 3), leaf(777, 3), leaf(777, 4)
check("rbf_matmul eager f64", lambda: grads_match(lambda: lt.rbf_matmul(x, y, b, 0.5, backend="eager"),
                                                 lambda: lt.rbf_matmul(x, y, b, 0.5, impl="dense"), [x, y, b]), 1e-9)
check("distance_sum f64", lambda: grads_match(lambda: lt.distance_sum(x, y, backend="eager"),
                                             lambda: lt.distance_sum(x, y, impl="dense"), [x, y]), 1e-8)
check("kernel_regression f64", lambda: grads_match(lambda: lt.kernel_regression(x, y, b, 2.0, backend="eager"),
                                                  lambda: lt.kernel_regression(x, y, b, 2.0, impl="dense"), [x, y, b]), 1e-8)
check("knn_regression f64", lambda: grads_match(lambda: lt.knn_regression(x, y, b, 5, backend="eager"),
                                               lambda: lt.knn_regression(x, y, b, 5, impl="dense"), [b]), 1e-9)
q = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64, device=dev)
check("distance_quantile f64", lambda: grads_match(lambda: lt.distance_quantile(x, y, q, backend="eager"),
                                                  lambda: lt.distance_quantile(x, y, q, impl="dense"), [x, y]), 1e-8)
Q, K, V = leaf(2, 4, 300, 32), leaf(2, 4, 300, 32), leaf(2, 4, 300, 32)
check("attention causal f64", lambda: grads_match(lambda: lt.attention(Q, K, V, is_causal=True, chunk_size=64),
                                                 lambda: lt.attention(Q, K, V, is_causal=True, impl="dense"), [Q, K, V]), 1e-9)
f = lt.Vi(x).sqdist(lt.Vj(y))
check("lse/min/kmin f64", lambda: max(
    rel((-f).logsumexp(1, backend="eager"), torch.logsumexp(-torch.cdist(x, y) ** 2, 1, keepdim=True)),
    rel(f.min(1, backend="eager").squeeze(-1), (torch.cdist(x, y) ** 2).min(1).values),
    rel(f.kmin(3, 1, backend="eager"), (torch.cdist(x, y) ** 2).topk(3, 1, largest=False).values)), 1e-9)


def second_order():
    """Gradient of a gradient norm and a torch.func Hessian (reverse over reverse), streamed vs dense."""
    xs, ys, bs = x[:50].detach().requires_grad_(), y[:60].detach(), b[:60].detach()
    outs = []
    for f in (lambda: lt.rbf_matmul(xs, ys, bs, 0.5, backend="eager"), lambda: lt.rbf_matmul(xs, ys, bs, 0.5, impl="dense")):
        (g,) = torch.autograd.grad(f().pow(2).sum(), xs, create_graph=True)
        outs.append(torch.autograd.grad(g.pow(2).sum(), xs)[0])
    h = [torch.func.jacrev(torch.func.grad(lambda z, impl=impl: lt.rbf_matmul(z, ys, bs, 0.5, impl=impl).sum()))(xs[:5].detach())
         for impl in ("streamed", "dense")]
    return max(rel(outs[0], outs[1]), rel(h[0], h[1]))


check("second order + torch.func f64", second_order, 1e-9)
x32, y32, b32 = (t.detach().float().requires_grad_() for t in (x, y, b))
check("rbf_matmul compiled f32", lambda: grads_match(lambda: lt.rbf_matmul(x32, y32, b32, 0.5, backend="compiled"),
                                                    lambda: lt.rbf_matmul(x32, y32, b32, 0.5, impl="dense"),
                                                    [x32, y32, b32]), 1e-4)


def ridge():
    from solvers import RBF, KernelRidge
    X, Y = torch.randn(600, 4, dtype=torch.float64, device=dev), torch.randn(600, 2, dtype=torch.float64, device=dev)
    a = KernelRidge(RBF(0.3), 0.5, source="streamed", rtol=1e-10).fit(X, Y).predict(X[:50])
    r = KernelRidge(RBF(0.3), 0.5, source="direct").fit(X, Y).predict(X[:50])
    return rel(a, r)


check("KernelRidge streamed f64", ridge, 1e-7)


def evaluator():
    import torch.nn.functional as F
    from torch import nn

    from polytope import NNCostEvaluator
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2)).to(dev, torch.float64)
    base = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    cands = base + 0.01 * torch.randn(20, base.numel(), dtype=torch.float64, device=dev)
    xs, ys = torch.randn(16, 8, dtype=torch.float64, device=dev), torch.randn(16, 2, dtype=torch.float64, device=dev)
    got = NNCostEvaluator(model, F.mse_loss).evaluate(cands, xs, ys)
    ref = []
    for c in cands:
        torch.nn.utils.vector_to_parameters(c, model.parameters())
        ref.append(F.mse_loss(model(xs), ys))
    torch.nn.utils.vector_to_parameters(base, model.parameters())
    return rel(got, torch.stack(ref).detach())


check("NNCostEvaluator f64", evaluator, 1e-10)
print("failures:", failures)
sys.exit(1 if failures else 0)
