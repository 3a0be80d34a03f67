"""The default path: which route a call takes ("auto"), never how long it took.

A call never waits for a compile: the auto tier compiles in a background
thread and switches to the compiled kernel at a row block once it is ready;
a pass uses only the cores other processes leave free; eager tiles compute
small-D squared distances feature by feature (exact, no (n, m, D) tensor).
"""
import math
import os
import threading
import warnings

import pytest
import torch

import lazytensor as lt
from lazytensor import compile, engine, plan, threads


def _fake_compile(compiled_on: list):
    """torch.compile that records the thread it compiles on (at the first call) and returns the function."""
    def compile_(fn, **kwargs):
        def run(*args):
            if not run.traced:
                compiled_on.append(threading.current_thread())
                run.traced = True
            return fn(*args)
        run.traced = False
        return run
    return compile_


def _formula(x, y, scale):
    return (lt.Vi(x).sqdist(lt.Vj(y)) * (lt.Vj(y).sqnorm2() + 1) * scale).exp()  # formulas no other test runs


def _reference(x, y, b, scale):
    return torch.exp(((x[:, None] - y[None]) ** 2).sum(-1) * ((y**2).sum(1) + 1) * scale) @ b


def test_a_cheap_formula_never_compiles_and_a_worthwhile_one_compiles_aside(monkeypatch):
    compiled_on = []
    monkeypatch.setattr(torch, "compile", _fake_compile(compiled_on))
    monkeypatch.setattr(compile, "AUTO_COMPILE_MIN_PAIRS", 1)
    x, y, b = torch.randn(40, 3), torch.randn(30, 3), torch.randn(30, 2)
    monkeypatch.setattr(compile, "COMPILE_AFTER_SECONDS", math.inf)
    for _ in range(3):
        torch.testing.assert_close(_formula(x, y, -0.31) @ b, _reference(x, y, b, -0.31))
    assert not compiled_on  # its projected cost never reaches the threshold: eager only
    monkeypatch.setattr(compile, "COMPILE_AFTER_SECONDS", 0.0)
    routes = dict(engine.routes)
    torch.testing.assert_close(_formula(x, y, -0.31) @ b, _reference(x, y, b, -0.31))
    assert compile.wait_for_background_compiles(60)
    assert len(compiled_on) == 1 and compiled_on[0] is not threading.main_thread()  # compiled aside, not in the call
    assert engine.routes["eager"] == routes.get("eager", 0) + 1  # that call answered from eager tiles
    torch.testing.assert_close(_formula(x, y, -0.31) @ b, _reference(x, y, b, -0.31))
    assert engine.routes["compiled"] == routes.get("compiled", 0) + 1 and len(compiled_on) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_pass_switches_to_the_compiled_kernel_at_a_row_block(monkeypatch, dtype):
    """Eager row blocks first, the compiled kernel for the rest once ready: the same values and gradients."""
    monkeypatch.setattr(torch, "compile", _fake_compile([]))
    monkeypatch.setattr(compile, "AUTO_COMPILE_MIN_PAIRS", 1)
    monkeypatch.setattr(compile, "COMPILE_AFTER_SECONDS", 0.0)
    monkeypatch.setattr(plan, "TILE_BUDGET_BYTES", 4096)  # many eager row blocks
    # the compile finishes at once (inline), so the pass switches after its first row block
    monkeypatch.setattr(compile.CompiledKernel, "compile_in_background", lambda self, args: self(*args))
    x = torch.randn(203, 3, dtype=dtype, requires_grad=True)
    y, b = torch.randn(97, 3, dtype=dtype), torch.randn(97, 5, dtype=dtype)
    routes = dict(engine.routes)
    out = _formula(x, y, -0.23) @ b
    assert engine.routes["eager, then compiled"] == routes.get("eager, then compiled", 0) + 1
    x_ref = x.detach().clone().requires_grad_()
    ref = _reference(x_ref, y, b, -0.23)
    torch.testing.assert_close(out, ref)
    weight = torch.randn_like(ref)
    (g,), (g_ref,) = torch.autograd.grad((out * weight).sum(), [x]), torch.autograd.grad((ref * weight).sum(), [x_ref])
    torch.testing.assert_close(g, g_ref)


def test_a_kernel_compiled_aside_is_not_recompiled_for_the_callers_grad_mode_or_thread_count(monkeypatch):
    """The background thread traces with grad mode on and whatever thread count the pass left; the pass
    calls with grad off and its own count. Dynamo's global-state guard made each difference a recompile."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(compile, "AUTO_COMPILE_MIN_PAIRS", 1)
    monkeypatch.setattr(compile, "COMPILE_AFTER_SECONDS", 0.0)
    x, y = torch.randn(50, 3), torch.randn(40, 3)
    ref = torch.exp(-0.41 * torch.cdist(x, y) ** 2 + (x**2).sum(1, keepdim=True)).sum(1, keepdim=True)
    graphs, count = counters["stats"]["unique_graphs"], torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with torch.no_grad():
            (-0.41 * lt.Vi(x).sqdist(lt.Vj(y)) + lt.Vi(x).sqnorm2()).exp().sum(1)  # eager; compiles aside
        assert compile.wait_for_background_compiles(300)
        for threads_ in (1, 2, 1):
            torch.set_num_threads(threads_)
            routes = dict(engine.routes)
            torch.testing.assert_close((-0.41 * lt.Vi(x).sqdist(lt.Vj(y)) + lt.Vi(x).sqnorm2()).exp().sum(1), ref)
            assert engine.routes["compiled"] == routes.get("compiled", 0) + 1
    finally:
        torch.set_num_threads(count)
    assert counters["stats"]["unique_graphs"] == graphs + 1


def test_column_sums_survive_a_switch(monkeypatch):
    """Sums over i keep one state across every column: it must span both tiers of a switched pass."""
    monkeypatch.setattr(torch, "compile", _fake_compile([]))
    monkeypatch.setattr(compile, "AUTO_COMPILE_MIN_PAIRS", 1)
    monkeypatch.setattr(compile, "COMPILE_AFTER_SECONDS", 0.0)
    monkeypatch.setattr(plan, "TILE_BUDGET_BYTES", 4096)
    monkeypatch.setattr(compile.CompiledKernel, "compile_in_background", lambda self, args: self(*args))
    x, y = torch.randn(150, 2, dtype=torch.float64), torch.randn(61, 2, dtype=torch.float64)
    out = (-lt.Vi(x).sqdist(lt.Vj(y)) * 0.7).exp().sum(0)
    torch.testing.assert_close(out, torch.exp(-0.7 * torch.cdist(x, y) ** 2).sum(0)[:, None])


def test_a_background_compile_failure_warns_on_the_callers_thread(monkeypatch):
    def broken(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no compiler here")
        return run

    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.setattr(compile, "AUTO_COMPILE_MIN_PAIRS", 1)
    monkeypatch.setattr(compile, "COMPILE_AFTER_SECONDS", 0.0)
    x, y, b = torch.randn(20, 3), torch.randn(25, 3), torch.randn(25, 2)
    with pytest.warns(compile.CompileFallbackWarning, match="no compiler here") as caught:
        torch.testing.assert_close(_formula(x, y, -0.17) @ b, _reference(x, y, b, -0.17))
        assert compile.wait_for_background_compiles(60)
        torch.testing.assert_close(_formula(x, y, -0.17) @ b, _reference(x, y, b, -0.17))
    assert len(caught) == 1  # once, from this thread, during one of the calls
    routes = dict(engine.routes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(_formula(x, y, -0.17) @ b, _reference(x, y, b, -0.17))
    assert engine.routes["eager"] == routes.get("eager", 0) + 1  # the failed kernel is never switched to


@pytest.mark.parametrize("wanted, cores, others, expected", [
    (2, 2, 0, 2),  # a quiet machine: every thread
    (2, 2, 1, 1),  # one core busy: one thread, no parallel region waits for a descheduled thread
    (2, 2, 5, 1),  # a crowded machine: still one
    (4, 8, 3, 4),  # enough cores left
    (8, 8, 3, 5),
    (1, 2, 0, 1),
])
def test_threads_left(wanted, cores, others, expected):
    assert threads.threads_left(wanted, cores, others) == expected


def test_a_pass_restores_the_callers_thread_count(monkeypatch):
    monkeypatch.setattr(threads, "free_threads", lambda wanted: 1)
    before = torch.get_num_threads()
    x, y = torch.randn(30, 3), torch.randn(20, 3)
    seen = []
    original = engine._TileLoop.run
    def run(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(engine._TileLoop, "run", run)
    lt.Vi(x).sqdist(lt.Vj(y)).sum(1)
    assert seen == [1] and torch.get_num_threads() == before


def test_background_compiles_count_as_load(monkeypatch):
    """Our own compiler thread takes a core: a pass beside it must not wait on a descheduled thread."""
    monkeypatch.setattr(threads, "background_compiles", 1)
    threads.forget()
    cores = len(os.sched_getaffinity(0))
    assert threads.free_threads(cores) <= max(1, cores - 1)
    threads.forget()


def test_repeated_medium_passes_add_up_to_a_compile_and_tiny_ones_never_do(monkeypatch):
    """Many passes of one formula (sinkhorn's iterations) compile once their eager time adds up, at any size
    from AUTO_COMPILE_MIN_PAIRS pairs on; smaller passes never count, however often they run."""
    compiled_on = []
    monkeypatch.setattr(torch, "compile", _fake_compile(compiled_on))
    monkeypatch.setattr(compile, "COMPILE_AFTER_SECONDS", math.inf)
    side = math.isqrt(compile.AUTO_COMPILE_MIN_PAIRS)
    x, y, b = torch.randn(side, 2), torch.randn(side, 2), torch.randn(side, 1)
    small = x[: side // 2]

    def spent():
        return sum(compile._EAGER_SECONDS.values())

    def call(rows):
        torch.testing.assert_close(_formula(rows, y, -0.27) @ b, _reference(rows, y, b, -0.27))

    before = spent()
    for _ in range(3):
        call(small)
    assert spent() == before  # below the floor: no eager time counted
    for _ in range(2):
        call(x)
    medium = spent() - before
    assert medium > 0 and not compiled_on  # counted, not yet worth a compile
    monkeypatch.setattr(compile, "COMPILE_AFTER_SECONDS", medium)  # two passes spent + the next one's projection
    call(x)
    assert compile.wait_for_background_compiles(60) and len(compiled_on) == 1
    monkeypatch.setattr(compile, "COMPILE_AFTER_SECONDS", 0.0)
    call(small)
    assert compile.wait_for_background_compiles(60) and len(compiled_on) == 1  # the small tile shape never compiles


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_eager_tiles_compute_small_d_distances_feature_by_feature_exactly(dtype):
    """Zero distances stay exactly zero (no expansion), with no (n, m, D) intermediate in the eager tile."""
    x = torch.randn(37, 3, dtype=dtype) + 100  # far from the origin: an expansion would cancel
    y = x[5:6]  # one column: each row's sum is one term, so rounding order cannot differ
    d = (lt.Vi(x).sqdist(lt.Vj(y)) + 1e-30).sqrt().sum(1, backend="eager")
    expected = (((x - y) ** 2).sum(-1, keepdim=True) + 1e-30).sqrt()
    assert d[5].item() == expected[5].item()  # the zero distance: 1e-15 exactly (an expansion leaves ~1e-6 here)
    eps = torch.finfo(dtype).eps  # the others up to rounding (the sum of squares may be fused: d * d + total)
    torch.testing.assert_close(d, expected, rtol=4 * eps, atol=0)
    sources = [fn.source for (key, compiled), fn in compile._CACHE.items() if not compiled]
    assert any("squares_by_feature(" in src and ".sum(-1" not in src for src in sources)


def test_set_compile_after_is_the_auto_tiers_threshold(monkeypatch):
    monkeypatch.setattr(compile, "COMPILE_AFTER_SECONDS", compile.COMPILE_AFTER_SECONDS)  # restored after the test
    key, large = ("a formula no pass ran",), compile.AUTO_COMPILE_MIN_PAIRS
    compile.set_compile_after(0)
    assert compile.worth_compiling(key, large, 0.0) and not compile.worth_compiling(key, large - 1, 0.0)
    compile.set_compile_after(2.5)
    assert not compile.worth_compiling(key, large, 2.0) and compile.worth_compiling(key, large, 2.5)
    for bad in (-1, True, "1", math.nan):
        with pytest.raises(ValueError, match="seconds"):
            compile.set_compile_after(bad)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE") or not os.path.exists("/proc/self/stat"), reason="Linux scheduling classes")
@pytest.mark.parametrize("idle", [False, True])
def test_idle_class_tasks_do_not_count_as_load(idle):
    """A busy task at SCHED_IDLE (a kernel build, ours or another process's) takes no core from a pass."""
    import subprocess
    import sys
    import time

    code = "while True: pass"
    if idle:
        code = "import os; os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n" + code
    spinner = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 30
        while True:
            time.sleep(0.2)
            with open(f"/proc/{spinner.pid}/stat") as fh:
                stat = fh.read()
            policy_set = stat.rsplit(")", 1)[1].split()[38] == ("5" if idle else "0")
            if policy_set or time.monotonic() > deadline:
                break
        assert policy_set and stat.rsplit(")", 1)[1].split()[0] == "R"  # a busy loop is always runnable
        assert threads.counts_as_load(stat) is (not idle)
    finally:
        spinner.kill()
        spinner.wait()


def test_an_eager_pass_leaves_a_core_only_while_it_says_so():
    with compile.eager_pass() as leave_core:
        leave_core(True)
        assert threads.background_compiles == 1
        leave_core(False)
        assert threads.background_compiles == 0
        leave_core(True)
    assert threads.background_compiles == 0  # compiled passes, and code between passes, keep every core


@pytest.mark.parametrize("after", [0.0, math.inf])
def test_an_eager_pass_leaves_its_pending_build_a_core_once_its_formula_cost_enough(monkeypatch, after):
    """A build runs at SCHED_IDLE: eager passes that keep every core busy would starve it to the end of a fit."""
    monkeypatch.setattr(compile, "BUILD_CORE_AFTER_SECONDS", after)
    monkeypatch.setattr(compile, "COMPILE_AFTER_SECONDS", 0.0)
    monkeypatch.setattr(compile.CompiledKernel, "compile_in_background",
                        lambda self, args: setattr(self, "background", "pending"))  # a build that never ends
    left = []
    monkeypatch.setattr(compile._BACKGROUND, "_leave_core", left.append)
    g = torch.Generator().manual_seed(0)
    x, y, b = torch.randn(700, 3, generator=g), torch.randn(600, 3, generator=g), torch.randn(600, 2, generator=g)
    out = _formula(x, y, -0.375).matmul(b, chunk_size=(128, 600))
    torch.testing.assert_close(out, _reference(x, y, b, -0.375), rtol=1e-5, atol=1e-5)
    assert len(left) >= 5 and left[-1] is False  # looked at each row block; the core is back when the pass ends
    assert any(left) == (after == 0.0)
