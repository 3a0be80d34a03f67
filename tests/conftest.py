"""Suite-wide settings: deterministic seeds, bounded threads, loud recompiles."""
import os

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "inductor"))

import pytest  # noqa: E402
import torch  # noqa: E402

torch._dynamo.config.fail_on_recompile_limit_hit = True


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
    from lazytensor import kernels

    kernels.wait_for_background_compiles(300)  # a test's background compile never runs into the next test
