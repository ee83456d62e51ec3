"""Warm-up needed to certify many-chain HMC, with chains started from prior draws or from a deep
ensemble (``init_strategy="ensemble"``), on the quickstart's 1-D gap problem.

Model and data as ``comparisons/quickstart.toml``'s gap cell: 80 training points, one hidden
layer of 10 tanh units, N(0, 1) priors, Gaussian likelihood with precision 100; chees with 64
chains, 150 sampling iterations, ``max_num_steps=256``.  For each ``num_warmup`` in the grid, each
start and each seed, one run; reported: whether the run is certified (function-space R-hat/ESS,
divergences, E-BFMI at the first 50 training inputs), its worst function-space R-hat and bulk ESS, the
adapted step size, the chain-gradients and its
process CPU seconds (which include the ensemble's training for the ensemble start).

    nice -n 10 python comparisons/benchmarks/chees_ensemble_init.py --seeds 0 1 --warmup 25 50 100 150

One torch thread.  The table goes to stdout as Markdown.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

import pyrobdl
from pyrobdl.datasets import gap_regression


def run(init: str, warmup: int, seed: int, data) -> dict:
    model = pyrobdl.BayesianMLP(1, (10,), 1, activation="tanh", prior=pyrobdl.priors.Gaussian(1.0),
                                likelihood=pyrobdl.likelihoods.Gaussian(100.0))
    cpu = time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        post = pyrobdl.fit(model, data.x_train, data.y_train, "chees", num_chains=64, num_warmup=warmup,
                           num_samples=150, max_num_steps=256, init_strategy=init, seed=seed, progress=False)
    cpu = time.process_time() - cpu
    cert = post.certification
    return {"certified": bool(cert.passed), "rhat": cert.rhat_max, "ess": cert.ess_bulk_min, "cpu_s": cpu,
            "gradients": post.cost.gradient_evaluations, "step": post.diagnostics["step_size"],
            "failures": "; ".join(cert.failures)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--warmup", type=int, nargs="+", default=[25, 50, 100, 150])
    ap.add_argument("--starts", nargs="+", default=["prior", "ensemble"], choices=["prior", "ensemble"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    data = gap_regression(80, 200, noise_sd=0.1, seed=0)
    print("| start | num_warmup | seed | certified | max function-space R-hat | min bulk ESS | step size | chain-gradients | CPU s | failures |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for init in args.starts:
        for warmup in args.warmup:
            for seed in args.seeds:
                r = run(init, warmup, seed, data)
                print(f"| {init} | {warmup} | {seed} | {r['certified']} | {r['rhat']:.3f} | {r['ess']:.0f} | "
                      f"{r['step']:.3g} | {r['gradients']} | {r['cpu_s']:.1f} | {r['failures']} |", flush=True)


if __name__ == "__main__":
    main()
