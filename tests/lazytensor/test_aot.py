"""Kernels built aside in a child process (``lazytensor.aot``): the default route of the auto tier.

The rest of the suite compiles in-process (conftest sets
``LAZYTENSOR_COMPILE_ASIDE=thread``: one package build takes tens of seconds);
these tests run the process route in fresh interpreters, as a user's script
would, and check which route ran, never how long it took.
"""
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import torch

import lazytensor as lt
from lazytensor import aot, compile, lower

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = """
import json, torch, lazytensor as lt
from lazytensor import aot, compile, engine
torch.manual_seed(0)
x, y, b = (torch.randn(n, d, dtype=torch.float64) for n, d in ((300, 3), (257, 3), (257, 2)))
compile.set_compile_after(0)
out = (-lt.Vi(x).sqdist(lt.Vj(y)) / 8).exp() @ b
waited = compile.wait_for_background_compiles(600)
again = (-lt.Vi(x).sqdist(lt.Vj(y)) / 8).exp() @ b
dense = torch.exp(-torch.cdist(x, y) ** 2 / 8) @ b
kernels = [k for k in compile._CACHE.values() if isinstance(k, compile.CompiledKernel)]
print(json.dumps({"waited": waited, "routes": dict(engine.routes), "errors": [(out - dense).abs().max().item(),
                  (again - dense).abs().max().item()], "packaged": [isinstance(k.fn, aot.Package) for k in kernels],
                  "dynamo_frames": torch._dynamo.utils.counters["stats"]["unique_graphs"]}))
"""


def _fresh_process(cache: Path) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "LAZYTENSOR_COMPILE_ASIDE": "process",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_kernel_built_aside_is_found_on_disk_by_the_next_process_at_its_first_call(tmp_path):
    first = _fresh_process(tmp_path)
    assert first["waited"] and first["routes"] == {"eager": 1, "compiled": 1}  # call 1 eager while the child built
    assert first["packaged"] == [True] and first["dynamo_frames"] == 0  # nothing compiled in this process
    assert len(list((tmp_path / "lazytensor-aot").glob("*.pt2"))) == 1
    second = _fresh_process(tmp_path)
    assert second["routes"] == {"compiled": 2} and second["packaged"] == [True] and second["dynamo_frames"] == 0
    assert max(first["errors"] + second["errors"]) < 1e-12


def _tile_and_args(source: str | None = None):
    x, y, b = torch.randn(5, 3), torch.randn(7, 3), torch.randn(7, 2)
    from lazytensor import engine, plan
    seen = {}
    original = engine._TileLoop.run

    def run(self, tile_plan, compiled, **kw):
        seen["loop"], seen["plan"] = self, tile_plan
        return original(self, tile_plan, compiled, **kw)

    engine._TileLoop.run = run
    try:
        (-lt.Vi(x).sqdist(lt.Vj(y))).exp().__matmul__(b)
    finally:
        engine._TileLoop.run = original
    loop = seen["loop"]
    compiled_plan = plan.plan_tiles(loop.problem, loop.consumers, None, True)
    kernel = loop.kernel(compiled_plan, True)
    return kernel, loop.example_arguments(compiled_plan)


def test_a_package_called_on_other_tiles_runs_the_eager_function(monkeypatch):
    kernel, args = _tile_and_args()
    leaves, outputs = torch.utils._pytree.tree_flatten(kernel.eager(*args))
    ran = []

    class Loader:  # AOTInductor's loader, on a package that returns the eager outputs
        def __init__(self, *a):
            pass

        def get_call_spec(self):
            return ["", torch.utils._pytree.treespec_dumps(outputs)]

        def run(self, inputs):
            ran.append(len(inputs))
            return leaves

    monkeypatch.setattr(torch._C._aoti, "AOTIModelPackageLoader", Loader)
    package = aot.load(Path(__file__), args, kernel.eager)  # any existing file stands for a package
    assert torch.utils._pytree.tree_structure(package(*args)) == outputs and ran == [len(aot._tensors(args))]
    rows, cols, params, states, mask, rowmask = args
    other = ([r[:, :-1].contiguous() for r in rows], cols, params, states, mask, rowmask)
    package(*other)
    assert len(ran) == 1  # 1 row fewer: not the tiles it was built for, so the eager function ran


def test_a_build_that_fails_is_marked_and_not_tried_again(tmp_path, monkeypatch):
    kernel, args = _tile_and_args()
    broken = kernel.source.replace("return (", "undefined_name()\n    return (")
    path = tmp_path / "broken.pt2"
    assert aot.build(path, broken, kernel.consumers, args, {}, kernel.eager) is None
    assert path.with_suffix(".failed").exists() and "undefined_name" in path.with_suffix(".failed").read_text()
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: (_ for _ in ()).throw(AssertionError("built again")))
    assert aot.build(path, broken, kernel.consumers, args, {}, kernel.eager) is None


def test_a_failed_build_falls_back_to_compiling_in_process(monkeypatch):
    monkeypatch.setenv("LAZYTENSOR_COMPILE_ASIDE", "process")
    monkeypatch.setattr(aot, "build", lambda *a, **k: None)
    compiled_in_process = []
    monkeypatch.setattr(compile.CompiledKernel, "_compiled_call", lambda self, args: compiled_in_process.append(1))
    kernel, args = _tile_and_args()
    kernel.compile_in_background(args)
    assert compile.wait_for_background_compiles(60) and compiled_in_process == [1]


def test_the_tile_function_rebuilt_from_its_source_computes_the_same():
    kernel, args = _tile_and_args()
    rebuilt = lower.tile_function(kernel.source, kernel.consumers, "again")
    for a, b in zip(torch.utils._pytree.tree_leaves(rebuilt(*args)), torch.utils._pytree.tree_leaves(kernel.eager(*args))):
        torch.testing.assert_close(a, b)


def test_the_most_wanted_build_goes_next_and_outranks_a_one_off_running_one():
    turns, order = aot._Turns(), []

    def wait_for_turn(priority):
        with turns.turn(lambda: priority):
            order.append(priority)

    mine = [1.0]
    with turns.turn(lambda: mine[0]) as outranked:
        assert not outranked()
        waiters = [threading.Thread(target=wait_for_turn, args=(p,)) for p in (1.5, 3.0)]
        for t in waiters:
            t.start()
        while len(turns.waiting) < 2:
            threading.Event().wait(0.01)
        assert outranked()  # 3.0 waits: more than twice this build's 1.0, which nobody waited for since
        mine[0] = 1.2
        assert not outranked()  # its formula ran again: passes are waiting for it too
    for t in waiters:
        t.join(60)
    assert order == [3.0, 1.5]


def test_an_outranked_build_child_is_stopped(tmp_path, monkeypatch):
    monkeypatch.setattr(aot, "_CHILD", "import time; time.sleep(600)")
    assert aot._run_child(tmp_path / "job", lambda: True) is aot._OUTRANKED
    monkeypatch.setattr(aot, "BUILD_TIMEOUT_SECONDS", 0)
    assert aot._run_child(tmp_path / "job", lambda: False) is None  # out of time


def test_cuda_kernels_are_built_aside_and_loaded_on_their_device(monkeypatch):
    """The route a GPU takes, checked on the CPU: which devices build aside, the accelerator's compile rule,
    and the device index a package is loaded for (the loader is a stand-in)."""
    monkeypatch.setenv("LAZYTENSOR_COMPILE_ASIDE", "process")
    monkeypatch.setattr(compile, "COMPILE_AFTER_SECONDS", 1.0)  # the default (tests before may have set another)
    assert aot.available(torch.device("cuda")) and aot.available(torch.device("cpu"))
    assert not aot.available(torch.device("mps"))
    assert compile.compile_after(torch.device("cuda", 0)) == compile.ACCELERATOR_COMPILE_AFTER_SECONDS == 0.0
    assert compile.compile_after(torch.device("cpu")) == compile.COMPILE_AFTER_SECONDS
    key, large = ("formula", "for", "the", "rule"), compile.AUTO_COMPILE_MIN_PAIRS
    assert compile.worth_compiling(key, large, 0.0, torch.device("cuda"))  # the first large call builds
    assert not compile.worth_compiling(key, large, 0.0, torch.device("cpu"))  # the CPU waits for 1 s of eager time
    monkeypatch.setenv("LAZYTENSOR_COMPILE_ASIDE", "thread")  # a compile in this process: the CPU's rule everywhere
    assert compile.compile_after(torch.device("cuda")) == compile.COMPILE_AFTER_SECONDS

    loaded = []

    class Loader:
        def __init__(self, *args):
            loaded.append(args)

        def get_call_spec(self):
            return ["", torch.utils._pytree.treespec_dumps(torch.utils._pytree.tree_structure([None]))]

    class OnDevice:  # a tile argument on another device (only its device is read)
        def __init__(self, device):
            self.device = torch.device(device)

    monkeypatch.setattr(torch._C._aoti, "AOTIModelPackageLoader", Loader)
    aot.Package(Path("p.pt2"), (torch.zeros(2), OnDevice("cuda:1")), None)
    aot.Package(Path("p.pt2"), (torch.zeros(2), OnDevice("cpu")), None)
    assert [args[-1] for args in loaded] == [1, -1]
