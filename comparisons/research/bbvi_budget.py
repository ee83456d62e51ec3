r"""Measured: score-function BBVI with each baseline against mean-field VI at matched gradient budgets.

For Bayesian linear regression and the 1-D gap data (the quickstart's settings) and UCI boston
(split 0 only, 1x50 ReLU, Gal & Ghahramani's precision), this script fits

* ``"mean_field"`` (reparameterized gradients) with the quickstart's settings: G = 3000 steps of
  one particle, Adam 1e-2, cosine decay — G gradient evaluations;
* ``"bbvi"`` with each baseline (``none``, ``decaying_average``, ``leave_one_out``,
  ``vargrad``; 4 particles, and ``leave_one_out`` also with 16) at budgets of 1x, 3x and 10x G
  gradient evaluations (particles x steps), same learning rate and schedule, so only the
  gradient estimator and the number of steps differ,

and records for each fit a common ELBO estimate (analytic KL + 2000-draw expected
log-likelihood, the same estimator for every method), the test log-likelihood per point
(log of the 1000-draw predictive mean density, original target scale), the median posterior
sd, gradient evaluations and CPU seconds.  BBVI runs on the trace-free fast path
(``elbo="direct_score_function"``), proven equal to Pyro's ``TraceGraph_ELBO`` path on the same
draws (tests/test_bbvi.py), so CPU time is comparable with mean-field's.

Usage (from the repository root; ``--datasets`` picks a subset, ``--seeds`` the fit seeds;
the extra seeds run only mean-field and leave-one-out at the largest budget)::

    nice -n 10 python comparisons/research/bbvi_budget.py --data-dir /work/shared/datasets \
        --datasets blr gap --seeds 0 1 2 --out results/bbvi_budget_synthetic.json
    nice -n 10 python comparisons/research/bbvi_budget.py --data-dir /work/shared/datasets \
        --datasets boston --seeds 0 --budgets 1 10 --variance --out results/bbvi_budget_boston.json
    python comparisons/research/bbvi_budget.py --figure docs/methods/bbvi_budget.png \
        results/bbvi_budget_synthetic.json results/bbvi_budget_boston.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch

import pyrobdl
from pyrobdl import datasets, likelihoods, priors
from pyrobdl.diagnostics import gradient_variance
from pyrobdl.guides import MeanField
from pyrobdl.inference import DirectELBO

MF_STEPS = 3000
LR = 1e-2
BUDGETS = (1, 3, 10)
#: (label, baseline, particles, KL treatment)
VARIANTS = (
    ("none", "none", 4, "monte_carlo"),
    ("decaying_average", "decaying_average", 4, "monte_carlo"),
    ("leave_one_out", "leave_one_out", 4, "monte_carlo"),
    ("vargrad", "vargrad", 4, "monte_carlo"),
    ("leave_one_out P=16", "leave_one_out", 16, "monte_carlo"),
    ("leave_one_out analytic KL", "leave_one_out", 4, "analytic"),
)
ESTIMATORS = ("reparameterization", "local_reparameterization", "score_function", "score_function+baseline",
              "score_function+leave_one_out", "score_function+vargrad")
BOSTON_TAU = 0.1597  # Gal & Ghahramani's precision on the original scale (REFERENCES.md section 1)


def problem(name: str, data_dir: str | None):
    """(data, model) with the quickstart's settings (blr, gap) or boston split 0."""
    if name == "blr":
        data = datasets.bayesian_linear_regression(100, 100, 3, prior_scale=1.0, precision=10.0, seed=0)
        model = pyrobdl.BayesianMLP(3, (), 1, prior=priors.Gaussian(1.0), likelihood=likelihoods.Gaussian(10.0))
    elif name == "gap":
        data = datasets.gap_regression(80, 200, noise_sd=0.1, seed=0)
        model = pyrobdl.BayesianMLP(1, (10,), 1, activation="tanh", prior=priors.Gaussian(1.0),
                                    likelihood=likelihoods.Gaussian(100.0))
    elif name == "boston":
        data = datasets.load_uci("boston", 0, data_dir=data_dir)
        tau = BOSTON_TAU * data.y_std**2
        model = pyrobdl.BayesianMLP(data.num_features, (50,), 1, prior=priors.Gaussian(1.0),
                                    likelihood=likelihoods.Gaussian(tau))
    else:
        raise ValueError(f"unknown dataset {name!r}; valid: blr, gap, boston")
    return data, model


def evaluate(model, post, data) -> dict:
    """Common ELBO (analytic KL + 2000-draw E log lik), median sd, test LL per point."""
    mf = MeanField(model)
    mf.load_state_dict({k: v for k, v in post.guide.state_dict().items() if k in mf.state_dict()})
    loss = DirectELBO(model, mf, num_particles=250, analytic_kl=True)
    y = model.likelihood.prepare_targets(data.y_train, 1)
    torch.manual_seed(1)
    with torch.no_grad():
        elbo = -float(np.mean([float(loss(data.x_train, y)) for _ in range(8)]))
        sds = torch.cat([q.base_dist.scale.reshape(-1) for q in mf.variational_distributions().values()])
    pred = post.predict(data.x_test, num_samples=1000, seed=0)
    ll = pred.log_likelihood(data.y_test)
    y_std = float(getattr(data, "y_std", 1.0))
    lpd = torch.logsumexp(ll, 0) - math.log(1000) - math.log(y_std)
    return {"elbo": elbo, "median_sd": float(sds.median()), "test_ll": float(lpd.mean())}


def run_fit(model, data, method: str, seed: int, **options) -> dict:
    start, cpu = time.perf_counter(), time.process_time()
    post = pyrobdl.fit(model, data.x_train, data.y_train, method, seed=seed, progress=False,
                       lr=LR, lr_schedule="cosine", **options)
    out = {"method": method, "seed": seed, **{k: v for k, v in options.items()},
           "gradient_evaluations": post.cost.gradient_evaluations,
           "wall_s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu}
    out.update(evaluate(model, post, data))
    return out, post


def measure(names, seeds, data_dir, variance: bool, budgets=BUDGETS, variants=None, mean_field=True) -> dict:
    result = {"torch": torch.__version__, "pyro": __import__("pyro").__version__, "fits": [], "variance": {}}
    for name in names:
        data, model = problem(name, data_dir)
        for seed in seeds:
            if mean_field or variance:
                rec, mf_post = run_fit(model, data, "mean_field", seed, num_steps=MF_STEPS)
                rec["dataset"] = name
                result["fits"].append(rec)
                print(json.dumps(rec), flush=True)
            # extra seeds: the largest budget of leave-one-out only (the run-to-run spread)
            chosen = [v for v in VARIANTS if variants is None or v[0] in variants]
            if seed != seeds[0]:
                chosen = [v for v in chosen if v[0] == "leave_one_out"]
            for label, baseline, particles, kl in chosen:
                for mult in (budgets if seed == seeds[0] else budgets[-1:]):
                    steps = mult * MF_STEPS // particles
                    rec, _ = run_fit(model, data, "bbvi", seed, num_steps=steps, num_particles=particles,
                                     baseline=baseline, elbo="direct_score_function", kl=kl)
                    rec.update(dataset=name, variant=label, budget=mult)
                    result["fits"].append(rec)
                    print(json.dumps(rec), flush=True)
            if variance and seed == seeds[0]:
                torch.manual_seed(seed)
                __import__("pyro").set_rng_seed(seed)
                initial = MeanField(model)
                for label, guide in (("initial", initial), ("trained", mf_post.guide)):
                    start, cpu = time.perf_counter(), time.process_time()
                    table = gradient_variance(model, data.x_train, data.y_train, guide, ESTIMATORS,
                                              num_draws=300, num_particles=4, baseline_warmup=200, seed=seed)
                    result["variance"][f"{name}/{label}"] = {
                        "rows": table.to_records(), "markdown": table.to_markdown(),
                        "wall_s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu}
                    print(table.to_markdown(), flush=True)
    return result


def figure(paths, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fits = [f for p in paths for f in json.loads(Path(p).read_text())["fits"]]
    names = list(dict.fromkeys(f["dataset"] for f in fits))
    fig, axes = plt.subplots(1, len(names), figsize=(3.6 * len(names), 3.0), squeeze=False)
    for ax, name in zip(axes[0], names):
        seed0 = min(f["seed"] for f in fits if f["dataset"] == name)
        mf = [f for f in fits if f["dataset"] == name and f["method"] == "mean_field" and f["seed"] == seed0][0]
        ax.axhline(mf["test_ll"], color="k", lw=1, ls="--", label="mean_field")
        for label, *_ in VARIANTS:
            pts = sorted((f["gradient_evaluations"] / mf["gradient_evaluations"], f["test_ll"]) for f in fits
                         if f["dataset"] == name and f.get("variant") == label and f["seed"] == seed0)
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3, lw=1, label=f"bbvi {label}")
        ax.set_xscale("log")
        ax.set_xticks(BUDGETS, [f"{b}x" for b in BUDGETS])
        ax.minorticks_off()
        ax.set_title(f"{name} (seed {seed0})", fontsize=9)
        ax.set_xlabel(f"gradient evaluations / mean-field's ({mf['gradient_evaluations']})", fontsize=8)
        ax.set_ylabel("test log-likelihood per point", fontsize=8)
        ax.tick_params(labelsize=7)
        lo = min(mf["test_ll"] - 3, min(f["test_ll"] for f in fits if f["dataset"] == name))
        ax.set_ylim(max(lo, mf["test_ll"] - 15), mf["test_ll"] + 1.5)
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out, dpi=80)


def tables(paths) -> str:
    """Markdown: per dataset, test LL / ELBO / median sd / CPU s per variant and budget."""
    fits = [f for p in paths for f in json.loads(Path(p).read_text())["fits"]]
    out = []
    for name in dict.fromkeys(f["dataset"] for f in fits):
        rows = [f for f in fits if f["dataset"] == name]
        out += [f"#### {name}", "",
                "| method | baseline (particles) | seed | gradient evals (x G) | steps | ELBO | median sd | test LL | CPU s |",
                "|---|---|---|---|---|---|---|---|---|"]
        rows.sort(key=lambda f: (f["method"] != "mean_field", f.get("variant", ""), f["seed"], f["gradient_evaluations"]))
        for f in rows:
            label = "—" if f["method"] == "mean_field" else f"{f['variant']} ({f['num_particles']})"
            out.append(f"| {f['method']} | {label} | {f['seed']} | {f['gradient_evaluations']} "
                       f"({f['gradient_evaluations'] / MF_STEPS:g}) | {f['num_steps']} | {f['elbo']:.1f} | "
                       f"{f['median_sd']:.3g} | {f['test_ll']:.3f} | {f['cpu_s']:.1f} |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", default=os.environ.get("PYROBDL_DATA_DIR"))
    parser.add_argument("--datasets", nargs="+", default=["blr", "gap", "boston"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--variants", nargs="+", default=None, help="subset of the BBVI variant labels")
    parser.add_argument("--no-mean-field", action="store_true", help="skip the mean-field fits")
    parser.add_argument("--budgets", nargs="+", type=int, default=list(BUDGETS), help="multiples of G")
    parser.add_argument("--variance", action="store_true", help="also gradient variance at initial/trained guides")
    parser.add_argument("--out", type=Path, default=Path("results/bbvi_budget.json"))
    parser.add_argument("--figure", type=Path, default=None, help="only draw the figure from result files")
    parser.add_argument("--tables", action="store_true", help="only print Markdown tables from result files")
    parser.add_argument("results", nargs="*")
    args = parser.parse_args()
    if args.figure is not None:
        figure(args.results, args.figure)
        return
    if args.tables:
        print(tables(args.results))
        return
    torch.set_num_threads(1)
    result = measure(args.datasets, args.seeds, args.data_dir, args.variance, tuple(args.budgets),
                     args.variants, not args.no_mean_field)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(args.out)


if __name__ == "__main__":
    main()
