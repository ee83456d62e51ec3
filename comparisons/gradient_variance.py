r"""Measured: score-function (BBVI) vs reparameterization (Bayes by Backprop) gradients on UCI.

On one UCI split with a 1x50 ReLU network this script

1. fits ``"mean_field"`` and ``"bbvi"`` (registry defaults, same seed, hence the same initial
   guide) for the same wall-clock budget each, and tabulates the ELBO against wall time, plus a
   common high-precision ELBO estimate and test RMSE / log-likelihood of the final guides;
2. measures gradient variance per parameter group with
   :func:`pyrobdl.diagnostics.gradient_variance` at the initial guide and at the trained
   mean-field guide, for the reparameterization, local reparameterization, score-function and
   score-function + decaying-average-baseline estimators, and reports the variance ratios
   score-function / reparameterization.

Model: prior N(0, 1) on every weight and bias; Gaussian likelihood with Gal & Ghahramani's
precision for the dataset (REFERENCES.md section 1; boston tau = 0.1597 on the original scale,
so tau_std = tau * sigma_y^2 on the standardised targets).

Usage (from the repository root)::

    nice -n 10 python comparisons/gradient_variance.py --data-dir ../shared/datasets \
        --out results/gradient_variance.json

The Markdown tables are printed and written next to ``--out`` (``.md``).  The step budget of each
method is calibrated from a short timing run, so the number of steps depends on the machine;
the JSON records both steps and seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import pyro
import torch

import pyrobdl
from pyrobdl import datasets, likelihoods, priors
from pyrobdl.diagnostics import gradient_variance
from pyrobdl.guides import MeanField
from pyrobdl.inference import DirectELBO

#: Gal & Ghahramani's model precision on the original target scale (REFERENCES.md section 1).
TAU = {"boston": 0.1597, "concrete": 0.05573, "energy": 0.4271, "wine": 2.958, "yacht": 0.5419}
METHODS = ("mean_field", "bbvi")
ESTIMATORS = ("reparameterization", "local_reparameterization", "score_function", "score_function+baseline")
#: Points of the budget at which the ELBO trace is reported.
CHECKPOINTS = (0.05, 0.1, 0.25, 0.5, 1.0)


def make_model(data: datasets.RegressionData, name: str) -> pyrobdl.BayesianMLP:
    tau_std = TAU[name] * data.y_std**2
    return pyrobdl.BayesianMLP(
        data.num_features, (50,), 1, prior=priors.Gaussian(1.0), likelihood=likelihoods.Gaussian(tau_std)
    )


def common_elbo(model, guide, x, y, num_samples: int = 2000, chunk: int = 250, seed: int = 1) -> float:
    """ELBO of a mean-field guide: analytic KL + many-sample expected log-likelihood (same for both)."""
    mf = MeanField(model)
    mf.load_state_dict({k: v for k, v in guide.state_dict().items() if k in mf.state_dict()})
    loss = DirectELBO(model, mf, num_particles=chunk, analytic_kl=True)
    torch.manual_seed(seed)
    with torch.no_grad():
        values = [float(loss(x, y)) for _ in range(num_samples // chunk)]
    return -float(np.mean(values))


def test_metrics(posterior, data: datasets.RegressionData, tau_std: float, num_samples: int = 1000) -> dict:
    pred = posterior.predict(data.x_test, num_samples=num_samples, seed=0)
    rmse = float(((pred.mean.squeeze(-1) - data.y_test) ** 2).mean().sqrt()) * data.y_std
    ll = pred.log_likelihood(data.y_test)  # [S, N] on the standardised scale
    lpd = torch.logsumexp(ll, 0) - math.log(num_samples) - math.log(data.y_std)
    return {"rmse": rmse, "test_ll": float(lpd.mean())}


def elbo_trace(history: np.ndarray, wall: float) -> list[dict]:
    """ELBO averaged over the last 5% of steps before each checkpoint (steps assumed equally long)."""
    steps = len(history)
    out = []
    for c in CHECKPOINTS:
        end = max(1, int(round(c * steps)))
        window = max(1, int(round(0.05 * steps)))
        out.append({"fraction": c, "seconds": c * wall, "step": end, "elbo": float(history[max(0, end - window):end].mean())})
    return out


def step_seconds(model, data, method: str, steps: int = 30) -> float:
    # Two short runs; the second excludes one-time costs (imports on the first optimizer step).
    for _ in range(2):
        post = pyrobdl.fit(model, data.x_train, data.y_train, method, num_steps=steps, seed=0, progress=False)
    return post.cost.wall_time_s / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", default=None, help="datasets root (default: $PYROBDL_DATA_DIR)")
    parser.add_argument("--dataset", default="boston", choices=sorted(TAU))
    parser.add_argument("--split", type=int, default=0)
    parser.add_argument("--budget-s", type=float, default=120.0, help="wall-clock seconds per method")
    parser.add_argument("--num-draws", type=int, default=300, help="gradient draws per estimator")
    parser.add_argument("--baseline-warmup", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results/gradient_variance.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)

    data = datasets.load_uci(args.dataset, args.split, data_dir=args.data_dir)
    model = make_model(data, args.dataset)
    tau_std = TAU[args.dataset] * data.y_std**2
    result: dict = {"dataset": args.dataset, "split": args.split, "tau_std": tau_std, "budget_s": args.budget_s,
                    "torch": torch.__version__, "pyro": pyro.__version__, "fits": {}, "variance": {}}

    # 1. ELBO vs wall time under the same budget.
    posteriors = {}
    for method in METHODS:
        per_step = step_seconds(model, data, method)
        steps = max(50, int(args.budget_s / per_step))
        print(f"{method}: {1e3 * per_step:.1f} ms/step -> {steps} steps", flush=True)
        post = pyrobdl.fit(model, data.x_train, data.y_train, method, num_steps=steps, seed=args.seed, progress=False)
        posteriors[method] = post
        y = model.likelihood.prepare_targets(data.y_train, 1)
        result["fits"][method] = {
            "settings": {k: v for k, v in post.settings.items() if isinstance(v, (int, float, str, type(None)))},
            "steps": steps,
            "wall_time_s": post.cost.wall_time_s,
            "gradient_evaluations": post.cost.gradient_evaluations,
            "elbo_trace": elbo_trace(post.history, post.cost.wall_time_s),
            "final_elbo_common": common_elbo(model, post.guide, data.x_train, y),
            **test_metrics(post, data, tau_std),
        }
        print(json.dumps(result["fits"][method]["elbo_trace"][-1]), result["fits"][method]["final_elbo_common"], flush=True)

    # 2. Gradient variance at the initial and at the trained guide.
    pyro.set_rng_seed(args.seed)
    initial = MeanField(model)  # what both fits started from (same seed, same init options)
    tables = {}
    for label, guide in (("initial", initial), ("trained", posteriors["mean_field"].guide)):
        start = time.perf_counter()
        table = gradient_variance(
            model, data.x_train, data.y_train, guide, estimators=ESTIMATORS,
            num_draws=args.num_draws, baseline_warmup=args.baseline_warmup, seed=args.seed,
        )
        tables[label] = table
        result["variance"][label] = {
            "rows": table.to_records(),
            "ratio_score_function": table.variance_ratio("score_function", "reparameterization"),
            "ratio_score_function+baseline": table.variance_ratio("score_function+baseline", "reparameterization"),
            "ratio_local_reparameterization": table.variance_ratio("local_reparameterization", "reparameterization"),
            "seconds": time.perf_counter() - start,
        }
        print(f"variance at the {label} guide: {time.perf_counter() - start:.0f}s", flush=True)

    md = markdown(result, tables, args)
    print(md)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    args.out.with_suffix(".md").write_text(md + "\n")


def markdown(result: dict, tables: dict, args: argparse.Namespace) -> str:
    lines = [f"### Variance ratio to reparameterization, {result['dataset']} split {result['split']}, 1x50 ReLU",
             f"({args.num_draws} single-particle full-batch draws per estimator; baseline warmed up for "
             f"{args.baseline_warmup} draws)", "",
             "| group | d | SF / rep. (initial) | SF+baseline / rep. (initial) | SF / rep. (trained) "
             "| SF+baseline / rep. (trained) | local rep. / rep. (trained) |", "|---|---|---|---|---|---|---|"]
    init, trained = result["variance"]["initial"], result["variance"]["trained"]
    for group in tables["initial"].groups:
        d = tables["initial"].row("reparameterization", group).num_elements
        lines.append(
            f"| `{group}` | {d} | {init['ratio_score_function'][group]:.3g} | "
            f"{init['ratio_score_function+baseline'][group]:.3g} | {trained['ratio_score_function'][group]:.3g} | "
            f"{trained['ratio_score_function+baseline'][group]:.3g} | "
            f"{trained['ratio_local_reparameterization'][group]:.3g} |"
        )
    lines += ["", "Wall time per draw (ms), trained guide: " + ", ".join(
        f"{e} {1e3 * tables['trained'].row(e, tables['trained'].groups[0]).seconds_per_draw:.1f}"
        for e in tables["trained"].estimators)]
    lines += ["", f"### ELBO vs wall time, same budget ({result['budget_s']:.0f} s per method)", "",
              "| budget fraction | " + " | ".join(f"{m} ELBO (s)" for m in METHODS) + " |",
              "|---|" + "---|" * len(METHODS)]
    for i, c in enumerate(CHECKPOINTS):
        cells = [f"{result['fits'][m]['elbo_trace'][i]['elbo']:.1f} ({result['fits'][m]['elbo_trace'][i]['seconds']:.0f})"
                 for m in METHODS]
        lines.append(f"| {c:g} | " + " | ".join(cells) + " |")
    lines += ["", "| method | steps | particles/step | wall s | common ELBO | test RMSE | test LL |",
              "|---|---|---|---|---|---|---|"]
    for m in METHODS:
        f = result["fits"][m]
        lines.append(f"| {m} | {f['steps']} | {f['settings']['num_particles']} | {f['wall_time_s']:.0f} | "
                     f"{f['final_elbo_common']:.1f} | {f['rmse']:.2f} | {f['test_ll']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
