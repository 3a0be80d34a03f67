"""Validated, reproducible benchmarks: ``python -m harness <command> ...``.

Every command validates values (and first gradients where asked) against a
reference before it times anything, separates first-call / compilation time
from steady state, shuffles variant order, and writes JSON with the
configuration, raw samples, validation errors, environment and checksums.
A failure is an error with a nonzero exit, never a timing.
"""
