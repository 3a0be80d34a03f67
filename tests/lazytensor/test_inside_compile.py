"""Formulas inside a caller's torch.compile(fullgraph=True) and torch.export (lazytensor.library, issue 44).

Each reduction is one ``lazytensor::reduce`` node: values and first gradients equal eager, no graph break,
and an exported program with dynamic N and M runs on new sizes. Small sizes, one compile per test.
"""
import pytest
import torch

import lazytensor as lt
import lazytensor.aot
from lazytensor import engine, library
from lazytensor.keops import Genred

torch.manual_seed(0)
X, Y, B = (torch.randn(n, d, dtype=torch.float64) for n, d in ((30, 3), (40, 3), (40, 2)))
G = torch.tensor(0.7, dtype=torch.float64)


def _reductions(x, y, b, g):
    K = (-0.5 * lt.Vi(x).sqdist(lt.Vj(y))).exp()
    D = lt.Vi(x).sqdist(lt.Vj(y))
    low, index = D.min_argmin(1)
    return (K @ b, K.T @ x, (K * lt.Vi(x)).sum(0), (-lt.Pm(g) * D).logsumexp(1) * 2, (-D).softmax_weighted_sum(b, 1),
            low, index, D.argkmin(3, 1), D.kmin(3, dim=1), D.quantile(0.3, 1), (lt.Vi(x) - lt.Vj(y)).abs().sum(-1).sum(1),
            lt.where(D < 1.0, 1.0, lt.Vj(b).sum(-1)).sum(1), K @ b[:, 0], g * D @ b,
            (-0.5 * lt.Vi(x).sqdist(lt.Vj(x))).exp().solve(b[:30], alpha=0.5))


def _named(x, y, b, g):
    q = torch.stack([x[:16].reshape(2, 8, 3)] * 2, 1)
    return (lt.rbf_matmul(x, y, b, 0.5), lt.rbf_matmul(x, y, b, g), lt.kernel_regression(x, y, b, 0.5),
            lt.knn_regression(x, y, b, 3), lt.distance_sum(x, y), lt.distance_quantile(x, y, 0.3),
            lt.attention(q, q.flip(2), q * 2, is_causal=True))


def _keops(x, y, b, g):
    """pykeops's spellings and defaults (``lazytensor.keops``): axes count batch dimensions, sum(-1) is a formula."""
    from lazytensor.keops import LazyTensor, Pm, Vi, Vj

    x_i, y_j = LazyTensor(x[:, None, :]), LazyTensor(y[None, :, :])
    D = ((x_i - y_j) ** 2).sum(-1)
    K = (-D * Pm(g)).exp()
    xb, yb = x.expand(2, *x.shape)[:, :, None, :], y.expand(2, *y.shape)[:, None, :, :]
    return (K @ b, K.sum(dim=1), K.sum_reduction(axis=0), (-D).logsumexp(dim=1), (-D).logsumexp_reduction(axis=0),
            D.argKmin(3, dim=1), D.Kmin(2, axis=0), D.min(dim=0), D.min_argmin(axis=1)[0], (-D).sumsoftmaxweight(Vj(b), axis=1),
            Vi(x).sqdist(Vj(y)).sum(1), (-LazyTensor(xb).sqdist(LazyTensor(yb))).exp().sum(2),
            (-x_i.sqdist(LazyTensor(x[None]))).exp().solve(Vi(x), alpha=0.5, eps=1e-12),
            x_i.matvecmult(LazyTensor([1.0, 2.0, 3.0])).sum(dim=0))


def _strings(x, y, b, g):
    """Formulas from text: ``lt.formula``, and KeOps's ``Genred`` built once outside (its call is traced)."""
    return (lt.formula("exp(-sqdist(x, y)) * b", x=lt.Vi(x), y=lt.Vj(y), b=lt.Vj(b)).sum(1), _LSE(x, y, g.reshape(1)),
            _LSE_INLINE(x, y).sum(-1))


_LSE = Genred("-SqDist(X, Y) * G", ["X = Vi(3)", "Y = Vj(3)", "G = Pm(1)"], reduction_op="LogSumExp", axis=1)
_LSE_INLINE = Genred("-SqDist(Vi(0, 3), Vj(1, 3))", [], reduction_op="LogSumExp", axis=0)


def _sinkhorn(x, y, b, g):
    """Reductions fed by reductions: log-domain Sinkhorn iterations on one cost matrix, at temperature g."""
    C = lt.Vi(x).sqdist(lt.Vj(y)) / 2
    f, h = None, b[:, :1]
    for _ in range(2):
        f = -g * ((lt.Vj(h) - C) / lt.Pm(g)).logsumexp(1)
        h = -g * ((lt.Vi(f) - C) / lt.Pm(g)).logsumexp(0)
    return f, h


def _recorded(t, axis):
    """``lt.LazyTensor(t, axis)`` as recorded while a compiler traces."""
    return library.Deferred.call("new", lt.LazyTensor, t, axis)


@pytest.fixture(params=["inlined", "operator"])
def route(request, monkeypatch):
    """Small static problems are traced into the caller's graph (``library.inlined``); with ``INLINE_MAX_BYTES`` 0
    every reduction is a ``lazytensor::reduce`` operator."""
    if request.param == "operator":
        monkeypatch.setattr(library, "INLINE_MAX_BYTES", 0)
    return request.param


def _check(fn, route):
    """Compiled with fullgraph=True: no graph break, outputs and gradients of every float input as eager; the
    engine's passes traced into the graph on the inlined route only."""
    torch._dynamo.reset()
    traced = engine.routes["traced"]
    eager_in = [t.clone().requires_grad_() for t in (X, Y, B, G)]
    compiled_in = [t.clone().requires_grad_() for t in (X, Y, B, G)]
    backend = "aot_eager" if route == "inlined" else "inductor"  # the traced graph as Inductor gets it, run by ATen:
    eager, compiled = fn(*eager_in), torch.compile(fn, fullgraph=True, backend=backend)(*compiled_in)  # 3x quicker
    assert len(compiled) == len(eager)
    for c, e in zip(compiled, eager):
        assert c.shape == e.shape and c.dtype == e.dtype
        torch.testing.assert_close(c, e)
    loss = [sum(o.sin().sum() for o in outs if o.requires_grad) for outs in (eager, compiled)]
    for c, e in zip(torch.autograd.grad(loss[1], compiled_in), torch.autograd.grad(loss[0], eager_in)):
        torch.testing.assert_close(c, e)
    assert (engine.routes["traced"] > traced) == (route == "inlined")
    assert torch._dynamo.explain(fn)(X, Y, B, G).graph_break_count == 0


def test_every_reduction_compiles_in_one_graph_with_eager_values_and_gradients(route):
    _check(_reductions, route)


def test_named_operators_and_attention_compile_in_one_graph(route):
    _check(_named, route)


def test_a_sinkhorn_loop_compiles_in_one_graph(route):
    _check(_sinkhorn, route)


def test_keops_lazytensors_compile_in_one_graph(monkeypatch):
    monkeypatch.setattr(library, "INLINE_MAX_BYTES", 0)  # inlined: the replay the other tests trace (25 s more)
    _check(_keops, "operator")


def test_keops_reductions_compile_as_a_fresh_process_first_traces_them():
    """KeOps's axis defaults are read at the first trace that reduces a KeOps formula. Traced by Dynamo, that read's
    side effects made Dynamo's restart of the trace (a Python float made a tensor) take another path, and a fresh
    process's first compile of them failed (``SpeculationLogDivergence``)."""
    import subprocess
    import sys

    script = ("import torch\nfrom tests.lazytensor.test_inside_compile import _keops, X, Y, B, G\n"
              "torch.compile(_keops, fullgraph=True, backend='aot_eager')(X, Y, B, G)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]


def test_formulas_from_text_compile_in_one_graph(route):
    _check(_strings, route)


def test_an_attribute_read_breaks_the_graph_and_reads_the_eager_formula():
    """Outside fullgraph, reading what a record cannot know (``shape``) is a graph break, after which the record
    is built as an eager LazyTensor; a record handed to eager code (after a break) is built the same way."""
    def f(x, y):
        D = lt.Vi(x).sqdist(lt.Vj(y))
        n, m = D.shape[:2]
        return D.sum(1) * n + (lt.LazyTensor(y, "j") * 0 + D).logsumexp(1) / m

    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(f)(X, Y), f(X, Y))
    assert torch._dynamo.explain(f)(X, Y).graph_break_count >= 1
    mixed = lt.Vi(X).sqdist(_recorded(Y, "j"))  # eager code meeting a record: it is built
    assert type(mixed) is lt.LazyTensor and _recorded(X, "i").shape == (30, 1, 3)
    torch.testing.assert_close(mixed.sum(1), lt.Vi(X).sqdist(lt.Vj(Y)).sum(1))


def test_block_sparse_ranges_set_on_a_formula_are_part_of_the_record():
    """``K.ranges = ...`` inside the compiled function: the compiled reductions keep only the ranges' blocks, as
    eagerly (they summed every block, 1e-3 off, before the record kept them), values and gradients."""
    from lazytensor.keops import LazyTensor

    from .test_keops_ranges import setup

    x, y, ranges, _ = setup()

    def f(x, y, *ranges):
        K = (-((LazyTensor(x[:, None]) - LazyTensor(y[None])) ** 2).sum(-1)).exp()
        K.ranges = ranges
        C = (-lt.Vi(x).sqdist(lt.Vj(y))).exp()
        C.ranges = ranges
        return K.sum(dim=1), C.logsumexp(1)

    torch._dynamo.reset()
    eager, compiled = f(x, y, *ranges), torch.compile(f, fullgraph=True)(x, y, *ranges)
    for c, e in zip(compiled, eager):
        torch.testing.assert_close(c, e)
    for c, e in zip(torch.autograd.grad(sum(o.sum() for o in compiled), (x, y)),
                    torch.autograd.grad(sum(o.sum() for o in eager), (x, y))):
        torch.testing.assert_close(c, e)


@pytest.mark.parametrize("strict", [False, True])
def test_export_with_dynamic_sizes_holds_one_operator_per_reduction(strict):
    class Model(torch.nn.Module):
        def forward(self, x, y, b):
            K = (-0.5 * lt.Vi(x).sqdist(lt.Vj(y))).exp()
            return (K @ b).sin() + lt.Vi(x).sqdist(lt.Vj(y)).argkmin(2, 1).to(x.dtype).sum(-1, keepdim=True)

    n, m = torch.export.Dim("N"), torch.export.Dim("M")
    program = torch.export.export(Model(), (X, Y, B), dynamic_shapes=({0: n}, {0: m}, {0: m}), strict=strict)
    ops = [node.target for node in program.graph.nodes if node.op == "call_function"]
    assert ops.count(torch.ops.lazytensor.reduce.default) == 2
    x, y, b = torch.randn(70, 3, dtype=torch.float64), torch.randn(55, 3, dtype=torch.float64), torch.randn(55, 2,
                                                                                                           dtype=torch.float64)
    torch.testing.assert_close(program.module()(x, y, b), Model()(x, y, b))


def test_an_exported_keops_module_runs_on_new_sizes_and_compiles():
    """KeOps's spellings export like lazytensor's (the key names the class), and the exported program compiles."""
    from lazytensor.keops import LazyTensor

    class Model(torch.nn.Module):
        def forward(self, x, y, b):
            D = ((LazyTensor(x[:, None, :]) - LazyTensor(y[None, :, :])) ** 2).sum(-1)
            return (-D).exp() @ b + (-D).logsumexp(dim=1)

    n, m = torch.export.Dim("N"), torch.export.Dim("M")
    program = torch.export.export(Model(), (X, Y, B), dynamic_shapes=({0: n}, {0: m}, {0: m}))
    x, y, b = (torch.randn(k, d, dtype=torch.float64) for k, d in ((70, 3), (55, 3), (55, 2)))
    torch._dynamo.reset()
    for module in (program.module(), torch.compile(program.module())):
        torch.testing.assert_close(module(x, y, b), Model()(x, y, b))


def test_the_eager_path_builds_lazytensors_and_records_nothing():
    assert type(lt.Vi(X)) is lt.LazyTensor and not library.recording()
    key_tensors = []
    formula = _recorded(X, "i").sqdist(_recorded(Y, "j"))
    key = library.record_key(formula.exp(), None, key_tensors)
    assert key_tensors == [X, Y] or all(a is b for a, b in zip(key_tensors, [X, Y]))
    assert library.decode(key)[1][:3] == ("lazy", "call", "exp")


def test_an_attribute_a_record_lacks_names_itself():
    torch._dynamo.reset()
    with pytest.raises(Exception, match="not available while a compiler traces"):
        torch.compile(lambda x: lt.Vi(x).batch_shape, fullgraph=True)(X)


def test_a_compile_in_another_thread_records_nothing_here():
    """torch.compiler.is_compiling() is the process's flag, set while any thread compiles: a caller's eager
    formulas built meanwhile were recorded (a Deferred) and failed; ``opaque.tracing`` asks Dynamo itself."""
    import threading

    def compile_aside():
        torch.compile(lambda t: (t.sin() * 2).cos().exp().sum(), fullgraph=True, dynamic=False)(torch.randn(123))

    thread = threading.Thread(target=compile_aside)
    thread.start()
    built = []
    while True:  # at least once, then for as long as the other thread compiles
        built.append(type(lt.Vi(X)).__name__)
        K = (-0.5 * lt.Vi(X).sqdist(lt.Vj(Y))).exp()
        torch.testing.assert_close(K @ B, torch.exp(-0.5 * torch.cdist(X, Y) ** 2) @ B)
        if not thread.is_alive():
            break
    thread.join()
    assert built and set(built) == {"LazyTensor"}


def _step_loss(x, y, b):
    K = (-0.5 * lt.Vi(x).sqdist(lt.Vj(y))).exp()
    return (K @ b).sin().sum() + (-lt.Vi(x).sqdist(lt.Vj(y))).logsumexp(1).sum()


def test_float32_gradients_of_a_compiled_reduction_are_float32_accurate(route):
    """The backward's replay turns autograd back on, and only autograd: with every excluded dispatch key
    back on, CPU autocast ran it in bfloat16 (gradients 4e-3 off)."""
    torch._dynamo.reset()
    x, y, b = (t.float() for t in (X, Y, B))
    x.requires_grad_()
    (got,) = torch.autograd.grad(torch.compile(_step_loss, fullgraph=True)(x, y, b), x)
    x64 = X.clone().requires_grad_()
    D = ((x64[:, None] - Y[None]) ** 2).sum(-1)
    (expected,) = torch.autograd.grad((torch.exp(-0.5 * D) @ B).sin().sum() + torch.logsumexp(-D, 1).sum(), x64)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def _passes_per_step(monkeypatch, fn, steps: int) -> list:
    """The engine passes each of ``steps`` calls of ``fn``'s value and gradient runs."""
    passes = []
    stream = engine.stream
    monkeypatch.setattr(engine, "stream", lambda *a, **k: passes.append(1) or stream(*a, **k))
    counts = []
    for _ in range(steps):
        x = X.clone().requires_grad_()
        passes.clear()
        torch.autograd.grad(fn(x, Y, B), x)
        counts.append(len(passes))
    return counts


def test_a_compiled_training_step_runs_the_passes_an_eager_one_does(monkeypatch):
    """The forward leaves its autograd graph on its outputs and the backward differentiates it, instead of
    replaying the forward (the first compiled call also runs each reduction once on one row, for its shapes)."""
    torch._dynamo.reset()
    monkeypatch.setattr(library, "INLINE_MAX_BYTES", 0)
    eager = _passes_per_step(monkeypatch, _step_loss, 1)
    assert eager == [4] and _passes_per_step(monkeypatch, torch.compile(_step_loss, fullgraph=True), 2)[1] == 4


def test_an_inlined_training_step_runs_no_pass_after_its_compile(monkeypatch):
    """Traced into the graph, the step's reductions are Inductor's code: after the compile (which traces the passes,
    forward and backward, on fake tensors) no engine pass runs, and the values are eager's."""
    torch._dynamo.reset()
    compiled = torch.compile(_step_loss, fullgraph=True)
    first, second = _passes_per_step(monkeypatch, compiled, 2)
    assert first >= 4 and second == 0
    x = X.clone().requires_grad_()
    x_eager = X.clone().requires_grad_()
    torch.testing.assert_close(torch.autograd.grad(compiled(x, Y, B), x), torch.autograd.grad(_step_loss(x_eager, Y, B), x_eager))


def test_an_inlined_graph_is_one_aotautograd_can_cache():
    """An inlined reduction is a ``lazytensor::replay`` node in Dynamo's graph, which AOTAutograd's cache accepts
    (as a Python call, ``nonstrict_trace``, it was refused: every fresh process traced the engine again); the
    node carries lazytensor's source digest, so a cached graph is never one another lazytensor traced."""
    from torch._functorch._aot_autograd.autograd_cache import check_node_safe

    graphs = []
    torch._dynamo.reset()
    torch.compile(_step_loss, fullgraph=True, backend=lambda gm, inputs: graphs.append(gm) or gm)(X, Y, B)
    (graph,) = graphs
    replays = [n for n in graph.graph.nodes if n.target is torch.ops.lazytensor.replay]
    assert len(replays) == 2 and all(n.args[1] == lazytensor.aot.code_version() for n in replays)
    for node in graph.graph.nodes:
        check_node_safe(node)  # raises where the cache would be bypassed


def test_what_is_not_inlined_stays_an_operator(monkeypatch):
    """Over ``INLINE_MAX_BYTES``, with dynamic sizes, or with an option that picks the engine's route, a reduction is
    called as the operator; eager calls after an inlined compile find no traced tensor in the engine's caches."""
    def f(x, y, b):
        D = lt.Vi(x).sqdist(lt.Vj(y))
        return (-D).exp() @ b, (-D).logsumexp(1, backend="eager"), (D * 0.5).min(1)

    before = f(X, Y, B)
    counts = []
    for limit, dynamic in ((library.INLINE_MAX_BYTES, False), (30 * 40 * 5 * 8 - 1, False), (library.INLINE_MAX_BYTES, True)):
        monkeypatch.setattr(library, "INLINE_MAX_BYTES", limit)
        torch._dynamo.reset()
        traced = engine.routes["traced"]
        compiled = torch.compile(f, fullgraph=True, dynamic=dynamic)(X, Y, B)
        counts.append(engine.routes["traced"] - traced)
        for c, e in zip(compiled, before):
            torch.testing.assert_close(c, e)
    assert counts[0] > 0 and counts[1:] == [0, 0]
    for e, b in zip(f(X, Y, B), before):
        torch.testing.assert_close(e, b)


def test_a_key_names_each_tensor_once_by_position_and_is_the_same_for_the_same_formula():
    """A record's literal is made at its construction (``Deferred.literal``, tensors as holes); the key numbers
    the tensors in order of first appearance, so equal formulas of other tensors share a key (one graph)."""
    keys = []
    for x, b in ((X, B), (Y, B.flip(0))):
        tensors = []
        D = _recorded(x, "i").sqdist(_recorded(x, "j"))
        keys.append(library.record_key(library.Deferred(("call", "matmul", (-D).exp() + D, (b,), {}), 0), "j", tensors))
        assert len(tensors) == 2 and tensors[0] is x and tensors[1] is b
    assert keys[0] == keys[1] and library.HOLE not in keys[0]
    assert keys[0].count("('tensor',0)") == 4 and keys[0].count("('tensor',1)") == 1


def test_a_reduction_reads_its_axis_wherever_the_call_gives_it():
    """``library.bound``: where each argument comes from is worked out once per call form, outside Dynamo's trace."""
    assert library.bound(lt.LazyTensor.kmin, (3,), {"dim": 0}) == {"k": 3, "dim": 0}
    assert library.bound(lt.LazyTensor.kmin, (3, 0), {}, defaults=True) == {"k": 3, "dim": 0}
    assert library.bound(lt.LazyTensor.sum, (), {"axis": "i"}, defaults=True) == {"dim": 1, "dtype_acc": None, "axis": "i"}
    assert [library.reduced_axis("sum", 0, args, kwargs) for args, kwargs in (((0,), {}), ((), {"dim": 0}), ((), {}),
                                                                              ((), {"axis": "i"}), ((-1,), {}))] == \
        ["i", "i", "j", "i", None]
    with pytest.raises(TypeError, match=r"LazyTensor.logsumexp\(\): too many positional"):
        library.bound(lt.LazyTensor.logsumexp, (1, None, 3), {})


def test_a_key_of_other_operators_is_refused():
    key = library.record_key(_recorded(X, "i").exp(), None, [])
    with pytest.raises(ValueError, match="version"):
        library.decode(key.replace(f"({library.KEY_VERSION},", f"({library.KEY_VERSION + 1},", 1))


def test_without_the_forward_graph_the_backward_replays_the_record(monkeypatch):
    """An operator called outside a compiled graph (an exported program run eagerly: autograd hands the backward
    new tensor objects for the saved outputs), or traced without gradients, finds no graph on its outputs: the
    backward replays the record first (one forward pass more). The gradient is the same."""
    passes = []
    stream = engine.stream
    monkeypatch.setattr(engine, "stream", lambda *a, **k: passes.append(1) or stream(*a, **k))
    x = X.clone().requires_grad_()
    tensors = []
    rec = (-0.5 * _recorded(x, "i").sqdist(_recorded(Y, "j"))).exp()
    key = library.record_key(library.Deferred(("call", "matmul", rec, (B,), {}), 0), "j", tensors)
    for needs in ([True, False, False], [False, False, False]):
        passes.clear()
        (out,) = torch.ops.lazytensor.reduce(key, tensors, needs)
        (got,) = torch.autograd.grad(out.sin().sum(), x)
        assert len(passes) == 3
        x_eager = X.clone().requires_grad_()
        (expected,) = torch.autograd.grad(((-0.5 * lt.Vi(x_eager).sqdist(lt.Vj(Y))).exp() @ B).sin().sum(), x_eager)
        torch.testing.assert_close(got, expected)
