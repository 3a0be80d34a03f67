"""A build belongs to its process: a script that ends, or dies, during a kernel build leaves nothing running.

Each test runs a user's script in a fresh interpreter with its own inductor cache directory, starts a
build with the auto tier's defaults (``compile.set_compile_after(0)``: the first large call compiles),
and ends the script while the build runs. Every process the script started carries the cache directory
in its environment, so a scan of ``/proc`` finds whatever it left behind.
"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = """
import sys, time, torch, lazytensor as lt
from lazytensor import aot, compile
compile.set_compile_after(0)
x, y, b = torch.randn(3000, 3), torch.randn(3000, 3), torch.randn(3000, 4)
out = (-lt.Vi(x).sqdist(lt.Vj(y))).exp() @ b
deadline = time.monotonic() + 120
building = lambda: aot._CHILDREN if sys.argv[1] == "process" else compile._BACKGROUND.here
while not building() and time.monotonic() < deadline:
    time.sleep(0.02)
print("building" if building() else "not building", flush=True)
if sys.argv[1] == "process":  # the build leads its own group (its compilers) in this session (one autogroup)
    import os
    child = next(iter(aot._CHILDREN)).pid
    deadline = time.monotonic() + 60
    while os.getpgid(child) != child and time.monotonic() < deadline:  # it makes its group first thing
        time.sleep(0.02)
    print(os.getsid(child) == os.getsid(0), os.getpgid(child) == child, flush=True)
if sys.argv[2] == "wait":
    time.sleep(600)
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _left_behind(cache: Path) -> list[int]:
    """Processes (other than this one) whose environment names ``cache``."""
    mark = f"TORCHINDUCTOR_CACHE_DIR={cache}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if mark in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") and int(pid) != os.getpid():
                found.append(int(pid))
        except OSError:
            continue
    return found


def _start(cache: Path, route: str, ending: str) -> subprocess.Popen:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "LAZYTENSOR_COMPILE_ASIDE": route,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, "-c", _SCRIPT, route, ending], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _gone(cache: Path, within: float) -> list[int]:
    deadline = time.monotonic() + within
    while _left_behind(cache) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _left_behind(cache)


@pytest.mark.slow
def test_a_script_that_ends_during_a_build_exits_cleanly_and_leaves_no_process(tmp_path):
    script = _start(tmp_path, "process", "end")
    out, err = script.communicate(timeout=300)
    assert script.returncode == 0, err[-3000:]
    # the script did end while its build ran; the build shares the caller's session (a session of its own is a
    # scheduling group of its own under Linux's autogroup: eager passes ran 5x slower beside it) in a group of its own
    assert out.split("\n")[:2] == ["building", "True True"]
    assert _gone(tmp_path, within=10) == []
    assert not list((tmp_path / "lazytensor-aot").glob("*.pt2"))  # the build was stopped, not finished


@pytest.mark.slow
def test_a_script_killed_during_a_build_takes_its_build_along(tmp_path):
    script = _start(tmp_path, "process", "wait")
    assert script.stdout.readline().strip() == "building"
    script.send_signal(signal.SIGKILL)  # no exit handler runs: the kernel's parent-death signal ends the build
    script.communicate(timeout=60)
    assert _gone(tmp_path, within=20) == []


@pytest.mark.slow
def test_a_script_that_ends_during_an_in_process_compile_exits_zero(tmp_path):
    script = _start(tmp_path, "thread", "end")
    out, err = script.communicate(timeout=600)
    assert script.returncode == 0, err[-3000:]  # the interpreter waited for the compile instead of crashing under it
    assert out.strip() == "building"
    assert _gone(tmp_path, within=10) == []
