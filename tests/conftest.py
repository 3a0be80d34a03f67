"""Suite-wide settings: deterministic seeds, bounded threads, loud recompiles, compiles in-process."""
import os

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "inductor"))
# Background compiles stay in-process here: a package build in a child (the default, lazytensor.aot) takes tens
# of seconds, and every test waits for its compiles; tests/lazytensor/test_aot.py runs that route.
os.environ.setdefault("LAZYTENSOR_COMPILE_ASIDE", "thread")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

# CI replays the same property examples every run (a new random example there is a flaky
# submission, not a finding); locally hypothesis keeps exploring and remembers what failed.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

torch._dynamo.config.fail_on_recompile_limit_hit = True


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _then_wait_for_background_compiles(item):
    """Each test phase ends when its background compiles have (one never runs into the next phase or test).

    The wait sits at the end of the phase, not in a fixture's teardown: each phase begins with pytest's
    log capture walking ``logging``'s logger dict unlocked, and a compile in a thread of this process
    (the suite's ``LAZYTENSOR_COMPILE_ASIDE=thread``) imports Dynamo and Inductor modules, adding loggers
    to that dict: CI failed with "dictionary changed size during iteration" at a teardown.
    """
    try:
        return (yield)
    finally:
        from lazytensor import compile

        compile.wait_for_background_compiles(300)


pytest_runtest_setup = pytest_runtest_call = pytest_runtest_teardown = pytest.hookimpl(wrapper=True)(
    _then_wait_for_background_compiles)
