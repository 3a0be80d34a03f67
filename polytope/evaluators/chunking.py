"""How many candidates to hold at once, and retrying smaller after running out of memory."""
from __future__ import annotations

import warnings

import torch

DEFAULT_CPU_BUDGET = 256 * 2**20  # bytes of candidate storage per chunk on the CPU


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def memory_budget(device: torch.device) -> int:
    """Bytes one chunk may use: a quarter of free GPU memory, or a fixed CPU budget."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 4
    return DEFAULT_CPU_BUDGET


def estimate_chunk(count: int, bytes_per_candidate: int, budget: int) -> int:
    """Largest chunk whose parameter + activation storage fits ``budget``."""
    return max(1, min(count, budget // max(bytes_per_candidate, 1)))


class ChunkRunner:
    """Runs ``fn(start, stop)`` over chunks, halving the chunk after an out-of-memory error.

    The reduced size is remembered (``cap``) so later calls start from it.
    """

    def __init__(self):
        self.cap: int | None = None

    def run(self, count: int, chunk: int, fn) -> torch.Tensor:
        if self.cap is not None:
            chunk = min(chunk, self.cap)
        parts, start = [], 0
        while start < count:
            stop = min(start + chunk, count)
            try:
                parts.append(fn(start, stop))
            except Exception as exc:  # noqa: BLE001 - only memory errors are retried
                if not is_out_of_memory(exc) or chunk == 1:
                    raise
                smaller = max(1, chunk // 2)
                warnings.warn(
                    f"candidate evaluation ran out of memory with chunk_size={chunk}; retrying with chunk_size={smaller}",
                    stacklevel=3,
                )
                chunk = self.cap = smaller
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                continue
            start = stop
        return torch.cat(parts) if parts else torch.empty(0)
