"""Have the optimisation-based methods of a suite converged at their budgets?  (issue 38)

For every optimisation-based method of ``comparisons/quickstart.toml`` (the gap problem) or
``comparisons/uci_fast.toml`` (one UCI split), fit at the suite's budget times each factor of
``--factors`` (the whole schedule stretched, as a longer budget in the TOML would run) and print
the objective at the end of training (mean of the last 10% of the recorded history: ELBO, or
log joint for MAP/ensemble/Laplace's MAP; minibatch estimates scaled to the full data), the
report's "still improving" test (``pyrobdl.report.verdicts.still_improving``: the rise over the
final quarter of the learning-rate schedule, its standard error, and whether it is flagged), the test
log-likelihood (original scale) and the CPU seconds.  A budget has converged when a longer one
gains nothing beyond the spread between seeds.

    nice -n 10 python comparisons/vi_budgets.py --suite quickstart --factors 1 3 --seeds 0 1
    nice -n 10 python comparisons/vi_budgets.py --suite uci_fast --dataset boston --factors 1 3
    nice -n 10 python comparisons/vi_budgets.py --suite quickstart --dataset blr --factors 0.1 0.3 1
    nice -n 10 python comparisons/vi_budgets.py --suite quickstart --methods mean_field --lrs 0.01 0.03 --factors 0.33 1

``--lrs``: each learning rate with each factor (a budget that converges sooner at a larger step).

``--dataset blr`` (quickstart): the suite's Bayesian linear regression, with the budget the
dataset's ``overrides`` give (else ``[methods]``'s), and two more columns: the distance to the
exact posterior (``exact_mean_error_sd`` and ``exact_sd_ratio`` of
``pyrobdl.compare.artifacts.exact_posterior_metrics``, 1,000 draws: Monte Carlo error ~0.03).
"""

from __future__ import annotations

import argparse
import os
import time
import tomllib
import warnings
from pathlib import Path

import numpy as np
import torch

import pyrobdl
from pyrobdl.compare.artifacts import exact_posterior_metrics
from pyrobdl.datasets import bayesian_linear_regression, gap_regression, load_uci
from pyrobdl.diagnostics import evaluate
from pyrobdl.report.verdicts import still_improving

ROOT = Path(__file__).resolve().parent
OPTIMISED = ("map", "mean_field", "bbvi", "dropout", "gaussian_dropout", "variational_dropout", "ensemble", "laplace")


def problem(suite: str, dataset: str):
    if suite == "quickstart" and dataset == "blr":
        data = bayesian_linear_regression(100, 100, 3, prior_scale=1.0, precision=10.0, seed=0)

        def model(prior=None):
            return pyrobdl.BayesianMLP(3, (), 1, prior=prior or pyrobdl.priors.Gaussian(1.0),
                                       likelihood=pyrobdl.likelihoods.Gaussian(10.0))
        return data, model
    if suite == "quickstart":
        data = gap_regression(80, 200, noise_sd=0.1, seed=0)

        def model(prior=None):
            return pyrobdl.BayesianMLP(1, (10,), 1, activation="tanh", prior=prior or pyrobdl.priors.Gaussian(1.0),
                                       likelihood=pyrobdl.likelihoods.Gaussian(100.0))
        return data, model
    data = load_uci(dataset, 0)
    hidden = (100,) if dataset == "protein" else (50,)

    def model(prior=None):
        return pyrobdl.BayesianMLP(data.x_train.shape[1], hidden, 1, prior=prior or pyrobdl.priors.Gaussian(1.0),
                                   likelihood=pyrobdl.likelihoods.GaussianLearnedPrecision(1.0, 0.01))
    return data, model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=("quickstart", "uci_fast"), default="quickstart")
    p.add_argument("--dataset", default=None, help="uci_fast: the UCI dataset (split 0, default boston); "
                   "quickstart: gap (default) or blr")
    p.add_argument("--methods", nargs="*", default=None)
    p.add_argument("--factors", nargs="*", type=float, default=[1.0, 3.0])
    p.add_argument("--seeds", nargs="*", type=int, default=[0])
    p.add_argument("--lrs", nargs="*", type=float, default=None,
                   help="learning rates to try instead of the suite's (each with every factor)")
    a = p.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", UserWarning)
    a.dataset = a.dataset or ("gap" if a.suite == "quickstart" else "boston")
    cfg = tomllib.loads((ROOT / f"{a.suite}.toml").read_text())
    data, make_model = problem(a.suite, a.dataset)
    methods = [m for m in (a.methods or OPTIMISED) if m in cfg["methods"]]
    if a.suite == "uci_fast":
        methods = [m for m in methods if m in cfg["datasets"].get(a.dataset, {}).get("methods", methods)]
    exact = a.dataset == "blr"
    print(f"{'method':<20} {'lr':>6} {'steps':>6} {'seed':>4} {'objective':>10} {'rise':>8} {'± s.e.':>7} {'flag':>4} "
          f"{'test LL':>8} {'CPU s':>6}" + (f" {'mean err':>8} {'sd ratio':>8}" if exact else ""))
    for m in methods:
        own = cfg["datasets"].get(a.dataset, {}).get("overrides", {}).get(m, {}) if a.suite == "quickstart" else {}
        settings = {k: v for k, v in {**cfg["methods"][m], **own}.items()
                    if k not in ("published", "gradient_variance", "model")}
        prior = pyrobdl.priors.LogUniform() if m == "variational_dropout" else None
        for lr, factor in [(lr, f) for lr in (a.lrs or [settings.get("lr")]) for f in a.factors]:
            steps = int(round(settings["num_steps"] * factor))
            for seed in a.seeds:
                c0 = time.process_time()
                post = pyrobdl.fit(make_model(prior), data.x_train, data.y_train, m, seed=seed, progress=False,
                                   **{**settings, "num_steps": steps, **({"lr": lr} if lr is not None else {})})
                cpu = time.process_time() - c0
                h = np.asarray(post.history, dtype=float)
                tail = float(np.mean(h[-max(len(h) // 10, 1):]))
                trend = still_improving(h, post.settings.get("lr_schedule"))
                rise = (trend.gain, trend.se, "yes" if trend.flagged else "no") if trend else (float("nan"),) * 2 + ("-",)
                t = evaluate(post, data.x_test, data.y_test, num_samples=200, seed=0, y_mean=data.y_mean,
                             y_std=data.y_std)
                extra = ""
                if exact:
                    e = exact_posterior_metrics(post.model, post, data, 1000, 0)
                    extra = f" {e.get('exact_mean_error_sd', float('nan')):>8.3f} {e.get('exact_sd_ratio', float('nan')):>8.3f}"
                print(f"{m:<20} {lr if lr is not None else '-':>6} {steps:>6} {seed:>4} {tail:>10.2f} {rise[0]:>8.3g} {rise[1]:>7.2g} {rise[2]:>4} "
                      f"{t['test_ll']:>8.3f} {cpu:>6.1f}" + extra, flush=True)


if __name__ == "__main__":
    if "PYROBDL_DATA_DIR" not in os.environ:
        os.environ["PYROBDL_DATA_DIR"] = str(ROOT.parent.parent / "shared" / "datasets")
    main()
