"""What lazytensor asks of ``torch._inductor``, in one place: the options its kernels compile with
and the one-per-machine probe of the vector ISA (the only module that touches Inductor's internals)."""
from __future__ import annotations

import json
import os
import platform
import tempfile

import torch

# Kernels read the thread count when they run, not when they were compiled: a pass on a busy
# machine uses fewer threads (threads.pass_threads) without a recompile.
COMPILE_OPTIONS = {"cpp.dynamic_threads": True}
_ISA_SETTLED: list[bool] = []  # non-empty once this process has settled Inductor's vector ISA


def settle_vector_isa() -> None:
    """Probes the one vector ISA Inductor will use, once per machine instead of every ISA in every process.

    Inductor checks each vector ISA the CPU claims by compiling a test
    library (~1 s each) and loading it in a child Python (~0.15 s each), in
    every process: 6.8 s of a cold first call here and 1 s (40%) of a
    warm-cache one. It then uses the first that passed (or the one
    ``ATEN_CPU_CAPABILITY`` names). The first process probes just that ISA;
    when it passes, that is recorded beside the inductor cache, and this and
    later processes set ``config.cpp.vec_isa_ok`` (Inductor's own override:
    the same choice, and one setting, so compiled graphs' cache keys agree
    between processes). Anything unexpected leaves Inductor's probe in charge.
    """
    if _ISA_SETTLED:
        return
    _ISA_SETTLED.append(True)
    try:
        from torch._inductor import config, cpu_vec_isa
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        if platform.machine() not in ("x86_64", "AMD64") or config.cpp.vec_isa_ok is not None or config.cpp.simdlen is not None:
            return
        flags = cpu_vec_isa.x86_isa_checker()
        claimed = [isa for isa in cpu_vec_isa.supported_vec_isa_list if all(f in flags for f in str(isa).split())]
        if not claimed:
            return
        chosen = cpu_vec_isa.get_isa_from_cpu_capability(os.getenv("ATEN_CPU_CAPABILITY"), claimed,
                                                         cpu_vec_isa.invalid_vec_isa)
        facts = {"torch": torch.__version__, "claimed": [str(isa) for isa in claimed], "chosen": str(chosen),
                 "cxx": [str(config.cpp.cxx), os.environ.get("CXX", "")]}
        path = os.path.join(cache_dir(), "lazytensor-vec-isa.json")
        if not _recorded(path, facts):
            if not chosen:  # Inductor's own probe, of this ISA only
                return
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(path), delete=False) as f:
                json.dump(facts, f)
            os.replace(f.name, path)  # atomic: a concurrent reader sees the old record or the new one
        config.cpp.vec_isa_ok = True
    except Exception:  # noqa: BLE001 - torch internals moved: Inductor probes as before
        return


def _recorded(path: str, facts: dict) -> bool:
    try:
        with open(path) as f:
            return json.load(f) == facts
    except (OSError, ValueError):
        return False
