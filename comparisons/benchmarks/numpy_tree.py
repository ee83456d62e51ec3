"""Pyro's NUTS and HMC on the flat site: the numpy tree against the torch tree, CPU s per fit (issue 41).

One chain pair of each sampler on the quickstart's gap network (80 points, 1 x 10 tanh, precision
100; 150 warm-up and 150 draws per chain, NUTS at tree depth 5, HMC at 20 steps), with
``potential="flat"`` and the numpy tree (``pyrobdl.inference.numpy_mcmc``) on and off
(``_FlatSiteKernel.numpy_tree``), in alternating rounds in one process: process CPU seconds of each
``pyrobdl.fit``, its gradient evaluations and CPU µs per gradient, medians over the rounds and their
ratio.  Both trees use the numpy potential (``pyrobdl.flat.numpy_kernel``), so the ratio is the
tree's own operations.  Each fit includes its certification (the first one pays its imports; the
first round is dropped from the medians for that reason).

    python comparisons/benchmarks/numpy_tree.py [--rounds 4]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import pyro
import torch

import pyrobdl
from pyrobdl.inference.flat_mcmc import _FlatSiteKernel


def _fit(method: str, numpy_tree: bool) -> tuple[float, int]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(80, 1, generator=g)
    y = torch.sin(3 * x[:, 0]) + 0.1 * torch.randn(80, generator=g)
    model = pyrobdl.BayesianMLP(1, (10,), 1, activation="tanh", likelihood=pyrobdl.likelihoods.Gaussian(100.0),
                                prior=pyrobdl.priors.Gaussian(1.0))
    options = dict(max_tree_depth=5) if method == "nuts" else dict(num_steps=20)
    _FlatSiteKernel.numpy_tree = numpy_tree
    pyro.set_rng_seed(1)
    start = time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # short chains: the certification's warnings
        post = pyrobdl.fit(model, x, y, method=method, num_warmup=150, num_samples=150, num_chains=2,
                           potential="flat", progress=False, **options)
    return time.process_time() - start, post.cost.gradient_evaluations


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    pyrobdl.retain_freed_memory()
    times: dict[tuple[str, bool], list[tuple[float, int]]] = {}
    for rnd in range(args.rounds):
        for method in ("nuts", "hmc"):
            for numpy_tree in ((True, False) if rnd % 2 == 0 else (False, True)):
                times.setdefault((method, numpy_tree), []).append(_fit(method, numpy_tree))
    _FlatSiteKernel.numpy_tree = True
    print("| sampler | tree | CPU s (median) | gradients | CPU µs / gradient | numpy / torch |")
    print("|---|---|---|---|---|---|")
    for method in ("nuts", "hmc"):
        med = {}
        for numpy_tree in (True, False):
            runs = times[(method, numpy_tree)][1:] or times[(method, numpy_tree)]
            cpu = statistics.median(r[0] for r in runs)
            grads = statistics.median(r[1] for r in runs)
            med[numpy_tree] = cpu
            ratio = f"{med[True] / med[False]:.2f}x" if not numpy_tree else ""
            print(f"| {method} | {'numpy' if numpy_tree else 'torch'} | {cpu:.2f} | {grads:.0f} | "
                  f"{cpu / grads * 1e6:.0f} | {ratio} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
