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
    yield
    from lazytensor import compile

    compile.wait_for_background_compiles(300)  # a test's background compile never runs into the next test
