"""Warm-up needed to certify many-chain HMC, with chains started from prior draws or from a deep
ensemble (``init_strategy="ensemble"``), on the quickstart's 1-D gap problem or a UCI split.

``--dataset gap`` (default): model and data as ``comparisons/quickstart.toml``'s gap cell: 80
training points, one hidden layer of 10 tanh units, N(0, 1) priors, Gaussian likelihood with
precision 100; certification at the first 50 training inputs.  ``--dataset NAME --split S`` for a
UCI dataset: the model of ``comparisons/uci_references.py`` (1 x 50 ReLU, N(0, 1) priors, learned
noise precision with a Gamma(1, 0.01) prior, standardised data); certification on the split's
first 50 *test* inputs (held back from the sampler).  chees with ``--chains`` chains (64),
``--samples`` sampling iterations (150) and ``--max-num-steps`` (256).  For each ``num_warmup`` in
the grid, each start and each seed, one run; reported: whether the run is certified
(function-space R-hat/ESS, divergences, E-BFMI), its worst function-space R-hat and bulk ESS, the
adapted step size, the chain-gradients and its process CPU seconds (which include the ensemble's
training for the ensemble start).

    nice -n 10 python comparisons/benchmarks/chees_ensemble_init.py --seeds 0 1 --warmup 25 50 100 150
    nice -n 10 python comparisons/benchmarks/chees_ensemble_init.py --dataset boston --split 0 \
        --data-dir ../shared/datasets --seeds 0 --warmup 100 300

One torch thread.  The table goes to stdout as Markdown.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

import pyrobdl
from pyrobdl.datasets import gap_regression, load_uci
from pyrobdl.diagnostics import certify


def gap_problem():
    """The gap cell's model factory, data and certification inputs."""
    data = gap_regression(80, 200, noise_sd=0.1, seed=0)

    def model():
        return pyrobdl.BayesianMLP(1, (10,), 1, activation="tanh", prior=pyrobdl.priors.Gaussian(1.0),
                                   likelihood=pyrobdl.likelihoods.Gaussian(100.0))
    return model, data.x_train, data.y_train, data.x_train[:50]


def uci_problem(name: str, split: int, data_dir: str | None):
    """A UCI split with uci_references.py's model; certification on held-back test inputs."""
    data = load_uci(name, split, data_dir=data_dir)

    def model():
        return pyrobdl.BayesianMLP(data.x_train.shape[1], (50,), 1, activation="relu",
                                   prior=pyrobdl.priors.Gaussian(1.0),
                                   likelihood=pyrobdl.likelihoods.GaussianLearnedPrecision(1.0, 0.01))
    return model, data.x_train, data.y_train, data.x_test[:50]


def run(init: str, warmup: int, seed: int, problem, args) -> dict:
    make_model, x, y, x_cert = problem
    cpu = time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        post = pyrobdl.fit(make_model(), x, y, "chees", num_chains=args.chains, num_warmup=warmup,
                           num_samples=args.samples, max_num_steps=args.max_num_steps, init_strategy=init,
                           seed=seed, progress=False)
    cpu = time.process_time() - cpu
    cert = certify(post, x_cert)
    return {"certified": bool(cert.passed), "rhat": cert.rhat_max, "ess": cert.ess_bulk_min, "cpu_s": cpu,
            "gradients": post.cost.gradient_evaluations, "step": post.diagnostics["step_size"],
            "failures": "; ".join(cert.failures)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--warmup", type=int, nargs="+", default=[25, 50, 100, 150])
    ap.add_argument("--starts", nargs="+", default=["prior", "ensemble"], choices=["prior", "ensemble"])
    ap.add_argument("--dataset", default="gap", help="'gap' or a UCI dataset name")
    ap.add_argument("--split", type=int, default=0)
    ap.add_argument("--data-dir", default=None, help="UCI data directory (default: PYROBDL_DATA_DIR)")
    ap.add_argument("--chains", type=int, default=64)
    ap.add_argument("--samples", type=int, default=150)
    ap.add_argument("--max-num-steps", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(1)
    problem = gap_problem() if args.dataset == "gap" else uci_problem(args.dataset, args.split, args.data_dir)
    print("| start | num_warmup | seed | certified | max function-space R-hat | min bulk ESS | step size | chain-gradients | CPU s | failures |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for init in args.starts:
        for warmup in args.warmup:
            for seed in args.seeds:
                r = run(init, warmup, seed, problem, args)
                print(f"| {init} | {warmup} | {seed} | {r['certified']} | {r['rhat']:.3f} | {r['ess']:.0f} | "
                      f"{r['step']:.3g} | {r['gradients']} | {r['cpu_s']:.1f} | {r['failures']} |", flush=True)


if __name__ == "__main__":
    main()
