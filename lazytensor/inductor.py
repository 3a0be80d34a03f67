"""What lazytensor asks of ``torch._inductor``, in one place: the options its kernels compile with,
the one-per-machine probe of the vector ISA (the only module that touches Inductor's internals) and
the exponential its CPU tiles use in float32."""
from __future__ import annotations

import json
import math
import os
import platform
import tempfile

import torch

from .opaque import tracing

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


# exp(x) = 2^k exp(r), k = round(x / ln 2), r = x - k ln 2 in two parts (Cody-Waite); exp(r) on
# |r| <= ln(2) / 2 by Cephes's degree-7 polynomial (within 1 ulp of the exact value, measured).
_LOG2E, _LN2_HI, _LN2_LO = 1.4426950408889634, 0.693359375, -2.12194440e-4
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)
_LN_FLT_MIN = -87.33654475  # ln 2^-126: smaller arguments give 0 (flushed, not subnormal)
_EXP_OVERFLOW = 88.8  # from here exp is inf in float32 (ln FLT_MAX = 88.72284; above it the product overflows itself)


def tile_exp(t: torch.Tensor) -> torch.Tensor:
    """``torch.exp``, but in compiled float32 CPU tiles a polynomial that Inductor inlines into the tile loop.

    Inductor calls Sleef's vector exp there, an out-of-line function that
    also forms subnormal intermediates for every argument below -87 (each a
    microcode assist): log-sum-exp and Gaussian tiles, where most arguments
    are that small, ran 1.8x faster on this (the tile of the sinkhorn
    log-sum-exp, 256 x 1024, one thread: 660 us -> 366 us). Within 1 ulp of
    the exact value like Sleef's, except that results below 2^-126
    (1.2e-38, x < -87.34) are 0 instead of subnormal, as under flush-to-zero.
    Elsewhere (float64, GPU, eager tiles): ``torch.exp``.
    """
    if not (tracing() and t.dtype == torch.float32 and t.device.type == "cpu"):
        return torch.exp(t)
    k = torch.floor(t * _LOG2E + 0.5)
    r = t - k * _LN2_HI - k * _LN2_LO
    p = _EXP_POLY[0]
    for c in _EXP_POLY[1:]:
        p = p * r + c
    p = p * r * r + r + 1.0
    p = torch.where(k > 127, p + p, p)  # 2^128 p (x just under the overflow) as 2^127 (2 p)
    scale = ((k.clamp(-127, 127).to(torch.int32) + 127) << 23).view(torch.float32)  # 2^k; 0 for k = -127
    return torch.where(t < _LN_FLT_MIN, 0.0, torch.where(t > _EXP_OVERFLOW, math.inf, p * scale))
