"""Seconds of one certification and of one convergence summary at the size of a UCI wine
reference: K chains x D draws of the 1 x 50 ReLU network on 11 inputs (652 parameters), certified
at 50 inputs (``chees`` with ``max_num_samples`` certifies once per extension; the convergence
summary, with its R-hat and ESS of every weight, runs once at the end of a fit).

Only shapes matter for the timing, so the draws are Gaussian noise and the trace is synthetic.
Each is timed ``--repeats`` times, interleaved; medians of process CPU and wall seconds.

    python comparisons/benchmarks/certification_cost.py --draws 300 1000
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

import pyrobdl
from pyrobdl.diagnostics import CertificationCriteria, certify
from pyrobdl.flat import FlatLogJoint
from pyrobdl.inference import MCMCPosterior, SamplerTrace
from pyrobdl.posterior import Cost


def synthetic_posterior(model: pyrobdl.BayesianMLP, lj: FlatLogJoint, chains: int, draws: int,
                        superchain: int, gen: torch.Generator) -> MCMCPosterior:
    """Noise draws of the flat parameter vector and a trace of the right shapes."""
    samples = 0.1 * torch.randn(draws, chains, lj.size, generator=gen)
    sites = {name: v.transpose(0, 1).contiguous() for name, v in lj.layout.unpack(samples).items()}
    rng = np.random.default_rng(0)
    zeros = np.zeros((chains, draws))
    trace = SamplerTrace(num_warmup=0, num_steps=zeros.astype(np.int64) + 1, step_size=zeros + 0.01,
                         accept_prob=zeros + 0.8, diverging=zeros.astype(bool), tree_depth=None,
                         log_joint=rng.standard_normal((chains, draws)), energy=rng.standard_normal((chains, draws)),
                         superchain_size=superchain)
    return MCMCPosterior(model, sites, trace, method="chees", settings={}, cost=Cost(0.0, 0, 0.0, 0, "cpu"))


def timed(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.process_time() - cpu, time.perf_counter() - wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, nargs="+", default=[300, 1000], help="draws per chain")
    parser.add_argument("--chains", type=int, default=64)
    parser.add_argument("--superchain", type=int, default=8)
    parser.add_argument("--points", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    model = pyrobdl.BayesianMLP(11, (50,), 1, activation="relu",
                                likelihood=pyrobdl.likelihoods.GaussianLearnedPrecision())
    x, y = torch.randn(1439, 11, generator=gen), torch.randn(1439, generator=gen)
    lj = FlatLogJoint(model, x, y)
    points = x[: args.points]
    criteria = CertificationCriteria(rhat="nested")
    print("| chains x draws | certification: CPU s / wall s | convergence summary: CPU s / wall s |")
    print("|---|---|---|")
    for draws in args.draws:
        post = synthetic_posterior(model, lj, args.chains, draws, args.superchain, gen)
        cert, summary = [], []
        for _ in range(args.repeats):
            cert.append(timed(lambda: certify(post, points, criteria)))
            summary.append(timed(lambda: post.convergence_summary(points)))
        med = [statistics.median(t[i] for t in rows) for rows in (cert, summary) for i in (0, 1)]
        print(f"| {args.chains} x {draws} | {med[0]:.2f} / {med[1]:.2f} | {med[2]:.2f} / {med[3]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
