"""CPU µs per chain-gradient of ``FlatLogJoint.value_and_grad`` for each ``chunk_size``, at the
UCI reference shapes (1 x 50 ReLU, learned noise precision; yacht, concrete, wine training sizes)
and the 1 x 50 tanh benchmark shape, K chains at once (eager kernel, one torch thread).

Only shapes matter for the timing, so the data are Gaussian noise and the states prior draws
scaled by 0.3.  Each chunk size is timed once per round (loops of ``--seconds`` of process CPU
time), in alternating order, for ``--rounds`` rounds; medians are printed, with the size
``chunk_size="auto"`` picks.  Use it to choose ``chunk_size`` for long runs on a new machine.

    python comparisons/benchmarks/flat_chunk_size.py --chains 64
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import pyrobdl
from pyrobdl.flat import FlatLogJoint, auto_chunk_size

#: (label, N, D, activation): yacht, concrete and wine training splits; the chees benchmark
SHAPES = [("yacht", 277, 6, "relu"), ("concrete", 927, 8, "relu"), ("wine", 1439, 11, "relu"),
          ("benchmark", 500, 8, "tanh")]


def probe(n: int, d: int, act: str, k: int, sizes: list, rounds: int, seconds: float) -> dict:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, d, generator=g), torch.randn(n, generator=g)
    model = pyrobdl.BayesianMLP(d, (50,), 1, activation=act,
                                likelihood=pyrobdl.likelihoods.GaussianLearnedPrecision(1.0, 0.01))
    ljs = {c: FlatLogJoint(model, x, y, chunk_size=c) for c in sizes}
    theta = ljs[sizes[0]].sample_prior(k, generator=g) * 0.3
    return {c: statistics.median(v) for c, v in interleaved_cpu_us(ljs, theta, rounds, seconds).items()}


def interleaved_cpu_us(ljs: dict, theta: torch.Tensor, rounds: int, seconds: float) -> dict:
    """CPU µs per chain-gradient of each log joint's ``value_and_grad(theta)``, one list per variant:
    ``rounds`` rounds, variants in alternating order, each for ``seconds`` of process CPU time."""
    names = list(ljs)
    times: dict = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            lj = ljs[name]
            lj.value_and_grad(theta)
            reps, start = 0, time.process_time()
            while time.process_time() - start < seconds:
                lj.value_and_grad(theta)
                reps += 1
            times[name].append((time.process_time() - start) / reps / theta.shape[0] * 1e6)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chains", type=int, default=64)
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=0.3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    sizes = [*args.sizes, None]
    print(f"# K = {args.chains}, load average {os.getloadavg()}")
    print("| shape | N x D | auto | " + " | ".join(str(c) for c in sizes) + " |")
    print("|---|---|---|" + "---|" * len(sizes))
    for label, n, d, act in SHAPES:
        med = probe(n, d, act, args.chains, sizes, args.rounds, args.seconds)
        print(f"| {label} ({act}) | {n} x {d} | {auto_chunk_size(n, 50)} | "
              + " | ".join(f"{med[c]:.1f}" for c in sizes) + " |", flush=True)
    print(f"# load average after {os.getloadavg()}")


if __name__ == "__main__":
    main()
