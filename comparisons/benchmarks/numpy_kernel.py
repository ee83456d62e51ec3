"""The flat log joint's numpy kernel against its torch kernel, CPU µs per call (issue 41).

For each shape and number of rows K: ``FlatLogJoint.value_and_grad`` with ``numpy_kernel`` on and
off, in alternating rounds of ``--calls`` calls each (one process, one torch thread, inference
mode as the samplers and the SVI loop call it), medians of process CPU µs per call and their ratio.
The shapes: the quickstart's gap network (N = 80, 1 x 10 tanh) and a wine-sized one (N = 1,439,
11 inputs, 1 x 50 tanh).  The numpy kernel serves a call only when K x N x the widest layer is at
most ``pyrobdl.flat.numpy_kernel.MAX_NUMPY_ELEMENTS``; this script times both kernels regardless.

    python comparisons/benchmarks/numpy_kernel.py [--rounds 5] [--calls 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import pyrobdl
from pyrobdl.flat import FlatLogJoint
from pyrobdl.flat import numpy_kernel

SHAPES = {"gap (N=80, 1x10)": (80, 1, (10,)), "wine-sized (N=1439, 11 in, 1x50)": (1439, 11, (50,))}


def _log_joint(n: int, d: int, hidden: tuple[int, ...]) -> FlatLogJoint:
    g = torch.Generator().manual_seed(0)
    model = pyrobdl.BayesianMLP(d, hidden, 1, activation="tanh", likelihood=pyrobdl.likelihoods.Gaussian(100.0),
                                prior=pyrobdl.priors.Gaussian(1.0))
    return FlatLogJoint(model, torch.randn(n, d, generator=g), torch.randn(n, generator=g))


def _per_call(lj: FlatLogJoint, theta: torch.Tensor, use_numpy: bool, calls: int) -> float:
    lj.numpy_kernel = use_numpy
    original = numpy_kernel.MAX_NUMPY_ELEMENTS
    numpy_kernel.MAX_NUMPY_ELEMENTS = 1 << 62  # time it at every K
    try:
        with torch.inference_mode():
            start = time.process_time()
            for _ in range(calls):
                lj.value_and_grad(theta)
            return (time.process_time() - start) / calls * 1e6
    finally:
        numpy_kernel.MAX_NUMPY_ELEMENTS = original


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64])
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, one thread; MAX_NUMPY_ELEMENTS = {numpy_kernel.MAX_NUMPY_ELEMENTS}")
    print("| shape | K | K x N x widest | torch µs/call | numpy µs/call | numpy / torch |")
    print("|---|---|---|---|---|---|")
    for name, (n, d, hidden) in SHAPES.items():
        lj = _log_joint(n, d, hidden)
        for k in args.rows:
            theta = lj.sample_prior(k, generator=torch.Generator().manual_seed(1)) * 0.3
            calls = max(20, args.calls // max(1, k * n * max(hidden) // 4096))
            for use in (True, False):  # warm both
                _per_call(lj, theta, use, max(5, calls // 10))
            times: dict[bool, list[float]] = {True: [], False: []}
            for r in range(args.rounds):
                for use in ((True, False) if r % 2 == 0 else (False, True)):
                    times[use].append(_per_call(lj, theta, use, calls))
            t_torch, t_np = statistics.median(times[False]), statistics.median(times[True])
            print(f"| {name} | {k} | {k * n * max(hidden):,} | {t_torch:.1f} | {t_np:.1f} | {t_np / t_torch:.2f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
