"""Property tests: random formulas, random sizes, streamed == dense (eager lowering).

Formulas mix variables of feature size D and 1 (torch broadcasting, also
inside contractions), sizes include 1 and non-multiples of the tile, and
values, first and second gradients are compared in float64.
"""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from .dense import dense_reduce, pm, vi, vj

UNARY = {
    "exp": lambda p: (p * 0.3).unary("exp"),
    "tanh": lambda p: p.unary("tanh"),
    "sin": lambda p: p.unary("sin"),
    "sigmoid": lambda p: p.unary("sigmoid", torch.sigmoid),
    "square": lambda p: p.unary("square"),
    "abs1": lambda p: p.unary("abs") + 1.0,
}


@st.composite
def formulas(draw):
    n, m = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    d = draw(st.sampled_from([1, 2, 3]))
    batch = draw(st.sampled_from([None, 2]))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()

    x = rand(batch, n, d) if batch else rand(n, d)
    y = rand(batch, m, d) if batch else rand(m, d)
    x1, y1 = rand(n, 1), rand(m, 1)  # size-1 features broadcast against D
    p = rand(d)
    leaves = [vi(x), vj(y), pm(p), vi(x1), vj(y1)]
    expr = draw(st.sampled_from(leaves[:2]))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["add", "mul", "sub", "unary", "sqdist", "dot"]))
        other = draw(st.sampled_from(leaves))
        if op == "add":
            expr = expr + other
        elif op == "sub":
            expr = expr - other
        elif op == "mul":
            expr = expr * other
        elif op == "unary":
            expr = UNARY[draw(st.sampled_from(sorted(UNARY)))](expr)
        elif op == "sqdist":
            expr = expr.sqdist(other)
        else:
            expr = expr.dot(other)
    expr = expr + vi(x).dot(vj(y)) * 0.0 + vi(x) * 0.0  # always both axes
    kind = draw(st.sampled_from(["sum", "lse", "min", "max"]))
    axis = draw(st.sampled_from(["i", "j"]))
    chunk = (draw(st.integers(1, 8)), draw(st.integers(1, 8)))
    return expr, kind, axis, chunk, batch is not None, [x, y, p, x1, y1]


@settings(max_examples=60, deadline=None)
@given(formulas())
def test_random_formulas_match_dense(case):
    pair, kind, axis, chunk, batched, inputs = case
    lazy = pair.lazy
    method = {"sum": lazy.sum, "lse": lazy.logsumexp, "min": lazy.min, "max": lazy.max}[kind]
    out = method(axis, backend="eager", chunk_size=chunk)
    ref = dense_reduce(pair.dense(), kind, axis, batched)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    w = torch.randn_like(ref)
    gl = torch.autograd.grad((out * w).sum(), inputs, allow_unused=True, create_graph=True)
    gd = torch.autograd.grad((ref * w).sum(), inputs, allow_unused=True, create_graph=True)
    for a, b in zip(gl, gd):
        if b is None:
            assert a is None or a.abs().max() == 0
        else:
            assert a is not None
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-8)
    # second order: the gradient of a random projection of the first gradients
    pairs = [(a, b) for a, b in zip(gl, gd) if a is not None and b is not None and b.requires_grad]
    if not pairs:
        return
    vs = [torch.randn_like(b) for _, b in pairs]
    streamed_terms = [(a * v).sum() for (a, _), v in zip(pairs, vs) if a.requires_grad]  # else a constant 0
    if not streamed_terms:
        streamed_terms = [sum(t.sum() * 0 for t in inputs)]
    hl = torch.autograd.grad(sum(streamed_terms), inputs, allow_unused=True)
    hd = torch.autograd.grad(sum((b * v).sum() for (_, b), v in zip(pairs, vs)), inputs, allow_unused=True)
    for a, b in zip(hl, hd):
        if b is None:
            assert a is None or a.abs().max() == 0
        else:
            torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-7)
