"""Does each chain hold its own log-likelihood level?  A probe of the untempered chees sampler.

Runs ``fit(method="chees")`` on one UCI split with the reference protocol's model
(``uci_references.make_model``) and reports, from the draws, the log-likelihood ℓ of every draw:
its spread within chains against the spread of the chains' means, its R-hat and ESS, and the same
for log τ (the learned noise precision) with the correlation of the chains' mean ℓ and mean log τ.
Replica exchange can move a state along its ladder only as fast as the local sampler changes the
state's ℓ (docs/results/narrow_posteriors.md, "Round trips"); this measures how fast that is.

    python comparisons/research/likelihood_levels.py --data-dir ../shared/datasets --dataset yacht --split 0 \
        --chains 32 --warmup 300 --samples 300 --compile
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # comparisons/: uci_references
from uci_references import make_model  # noqa: E402

import pyrobdl  # noqa: E402
from pyrobdl import datasets  # noqa: E402
from pyrobdl.diagnostics import convergence  # noqa: E402
from pyrobdl.flat import FlatLogJoint  # noqa: E402


def summary(values: np.ndarray) -> dict:
    """Spread within and between chains of one scalar ``[chains, draws]``, with R-hat and ESS."""
    conv = convergence(values[..., None])
    means = values.mean(1)
    # each chain alone (ArviZ computes a one-chain ESS, logging that it expected two chains)
    per_chain = [float(convergence(values[i : i + 1, :, None])["ess_bulk"][0]) for i in range(values.shape[0])]
    return {"sd_within_chain_median": float(np.median(values.std(1))), "sd_of_chain_means": float(means.std()),
            "ess_bulk_per_chain_median": float(np.median(per_chain)),
            "chain_means_min_max": [float(means.min()), float(means.max())],
            "rhat": float(conv["rhat"][0]), "ess_bulk": float(conv["ess_bulk"][0])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--dataset", default="yacht")
    parser.add_argument("--split", type=int, default=0)
    parser.add_argument("--chains", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_const", const=True, default="auto")
    args = parser.parse_args()

    data = datasets.load_uci(args.dataset, args.split, data_dir=args.data_dir)
    model = make_model(data.x_train.shape[1])
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning)
        post = pyrobdl.fit(model, data.x_train, data.y_train, method="chees", num_chains=args.chains,
                           num_warmup=args.warmup, num_samples=args.samples, seed=args.seed, progress=False,
                           compile=args.compile, chunk_size=None)
    lj = FlatLogJoint(model, data.x_train, data.y_train, chunk_size=None)
    c, d = post.num_chains, post.num_draws
    theta = lj.layout.pack({name: v.reshape(c * d, *v.shape[2:]) for name, v in post.samples.items()})
    with torch.no_grad():
        ell = lj.value_and_grad(theta, prior=False)[0].view(c, d).double().numpy()
    log_tau = post.samples["precision"].reshape(c, d).double().log().numpy()
    print(json.dumps({
        "dataset": args.dataset, "split": args.split, "num_train": int(data.x_train.shape[0]),
        "chains": c, "draws": d, "step_size": post.diagnostics["step_size"],
        "function_space_rhat_max": post.diagnostics["function_space"]["rhat_max"],
        "log_likelihood": summary(ell), "log_tau": summary(log_tau),
        "corr_chain_mean_ell_log_tau": float(np.corrcoef(ell.mean(1), log_tau.mean(1))[0, 1]),
        "cpu_s": post.cost.cpu_time_s, "wall_s": post.cost.wall_time_s, "script_wall_s": time.perf_counter() - start,
        "load_average": os.getloadavg(),
    }, indent=1))


if __name__ == "__main__":
    main()
