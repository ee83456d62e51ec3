"""Certified reference posteriors, stored compactly, to score any approximation against.

Users of any library score draws of their network's output at a reference's test inputs without
running MCMC (``docs/references.md``)::

    import pyrobdl
    pyrobdl.references.available()            # [("blr", 0), ("gap", 0), ...]
    ref = pyrobdl.references.load("gap", 0)   # quantiles, mean/sd, certification, protocol
    pyrobdl.references.score("gap", 0, f_draws)  # {"w2_function": ..., "mean_error": ...}

Each store holds per test input the reference's quantile function of f on the original target
scale (100 levels), its mean and sd, the noise sd's quantiles, hashes of the test inputs and
targets (never the UCI data themselves), the certification record and the exact protocol, under a
SHA-256 checked on every load.  :func:`convert` makes a store from a draws file.
"""

from ._score import check_inputs, mixture_test_ll, score
from ._store import (
    DEFAULT_LEVELS,
    FORMAT_VERSION,
    Reference,
    array_sha256,
    available,
    convert,
    default_root,
    empirical_quantiles,
    levels,
    load,
    read_draws,
    store_path,
)

__all__ = [
    "DEFAULT_LEVELS",
    "FORMAT_VERSION",
    "Reference",
    "array_sha256",
    "available",
    "check_inputs",
    "convert",
    "default_root",
    "empirical_quantiles",
    "levels",
    "load",
    "mixture_test_ll",
    "read_draws",
    "score",
    "store_path",
]
