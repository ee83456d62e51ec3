"""Shared pieces of the per-call kernel benchmarks (``flat_kernel_pair.py``, ``inference_mode.py``):
the benchmark shapes, their flat log joints, and the timing loop."""

from __future__ import annotations

import time
from typing import Callable

import torch

import pyrobdl
from pyrobdl.flat import FlatLogJoint

#: name -> (N, D, hidden): the quickstart's gap and blr, wine's reference shape, a two-layer net
SHAPES = {"gap": (80, 1, (10,)), "blr": (100, 3, ()), "wine": (1439, 11, (50,)), "2x20": (200, 4, (20, 20))}


def log_joint(n: int, d: int, hidden: tuple, seed: int = 0) -> tuple[FlatLogJoint, torch.Generator]:
    """A tanh network's flat log joint on random data of shape ``n x d``, and the generator after it."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, d, generator=g), torch.randn(n, 1, generator=g)
    model = pyrobdl.BayesianMLP(d, list(hidden), 1, activation="tanh", prior=pyrobdl.priors.Gaussian(1.0),
                                likelihood=pyrobdl.likelihoods.Gaussian(precision=100.0))
    return FlatLogJoint(model, x, y, chunk_size="auto"), g


def cpu_us_per_call(fn: Callable[[], object], calls: int, warmup: int) -> float:
    """Process CPU microseconds per call of ``fn`` over ``calls`` calls, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    start = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - start) / calls * 1e6
