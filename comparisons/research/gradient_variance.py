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

    nice -n 10 python comparisons/research/gradient_variance.py --data-dir ../shared/datasets \
        --out results/gradient_variance.json
    nice -n 10 python comparisons/research/gradient_variance.py --step-times   # BBVI step time, start vs end

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
#: Wall-clock seconds at which the ELBO traces are compared.
CHECKPOINTS = (2.0, 5.0, 10.0, 20.0, 40.0, 80.0, 120.0)


def make_model(data: datasets.RegressionData, name: str) -> pyrobdl.BayesianMLP:
    tau_std = TAU[name] * data.y_std**2
    return pyrobdl.BayesianMLP(
        data.num_features, (50,), 1, prior=priors.Gaussian(1.0), likelihood=likelihoods.Gaussian(tau_std)
    )


def common_elbo(model, guide, x, y, num_samples: int = 2000, chunk: int = 250, seed: int = 1) -> dict:
    """ELBO of a mean-field guide, the same estimator for both methods.

    Analytic KL plus a ``num_samples``-draw estimate of the expected log-likelihood; also the
    KL itself and the median posterior sd, to see where an ELBO gap comes from.
    """
    mf = MeanField(model)
    mf.load_state_dict({k: v for k, v in guide.state_dict().items() if k in mf.state_dict()})
    loss = DirectELBO(model, mf, num_particles=chunk, analytic_kl=True)
    torch.manual_seed(seed)
    with torch.no_grad():
        elbo = -float(np.mean([float(loss(x, y)) for _ in range(num_samples // chunk)]))
        qs, ps = mf.variational_distributions(), model.prior_distributions()
        kl = float(sum(torch.distributions.kl_divergence(qs[k], ps[k]).sum() for k in qs))
        sds = torch.cat([q.base_dist.scale.reshape(-1) for q in qs.values()])
    return {"elbo": elbo, "kl": kl, "expected_log_lik": elbo + kl, "median_sd": float(sds.median())}


def test_metrics(posterior, data: datasets.RegressionData, tau_std: float, num_samples: int = 1000) -> dict:
    pred = posterior.predict(data.x_test, num_samples=num_samples, seed=0)
    rmse = float(((pred.mean.squeeze(-1) - data.y_test) ** 2).mean().sqrt()) * data.y_std
    ll = pred.log_likelihood(data.y_test)  # [S, N] on the standardised scale
    lpd = torch.logsumexp(ll, 0) - math.log(num_samples) - math.log(data.y_std)
    return {"rmse": rmse, "test_ll": float(lpd.mean())}


def elbo_trace(history: np.ndarray, wall: float) -> list[dict]:
    """Per-step ELBO estimates averaged over [0.9 t, t] for each checkpoint t (in seconds).

    Steps are taken as equally long (``wall / steps``); checkpoints past the run are left out.
    """
    steps = len(history)
    out = []
    for t in CHECKPOINTS:
        if t > wall:
            break
        end = max(1, int(round(t / wall * steps)))
        begin = min(end - 1, int(round(0.9 * t / wall * steps)))
        out.append({"seconds": t, "step": end, "elbo": float(history[begin:end].mean())})
    out.append({"seconds": wall, "step": steps, "elbo": float(history[int(0.9 * steps):].mean())})
    return out


def step_seconds(model, data, method: str, steps: int = 100) -> float:
    # Two short runs; the second excludes one-time costs (imports on the first optimizer step).
    for _ in range(2):
        post = pyrobdl.fit(model, data.x_train, data.y_train, method, num_steps=steps, seed=0, progress=False)
    return post.cost.wall_time_s / steps


def step_time_drift(num_steps: int = 2000, num_particles: int = 16) -> str:
    """Median step time at the start and the end of a BBVI run, per baseline (DESIGN.md trap).

    Pyro re-registers the decaying average in its parameter store every step; with pyro.optim
    that means a new optimizer per step and a growing step time.  pyrobdl's loop (one torch
    optimizer over ``guide.parameters()``, private store scope) should show no drift.
    """
    from pyrobdl.inference.elbo import make_elbo

    data = datasets.bayesian_linear_regression(50, 10, 2, seed=0)
    model = pyrobdl.BayesianMLP(2, (), 1)
    lines = [f"| baseline | median ms/step, steps 1-200 | steps {num_steps - 199}-{num_steps} | store entries after |",
             "|---|---|---|---|"]
    for baseline in ("decaying_average", "none"):
        pyro.set_rng_seed(0)
        guide = pyrobdl.guides.ScoreFunction(model, baseline=baseline)
        loss_fn = make_elbo(model, guide, elbo="trace_graph", kl="monte_carlo", num_particles=num_particles)
        optimizer = torch.optim.Adam(guide.parameters(), lr=1e-2)
        times = []
        with pyro.get_param_store().scope():
            for _ in range(num_steps):
                start = time.perf_counter()
                loss = loss_fn(data.x_train, data.y_train, None)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                times.append(time.perf_counter() - start)
            entries = len(pyro.get_param_store()._param_to_name)  # the tensor -> name map that grows
        t = 1e3 * np.array(times)
        lines.append(f"| {baseline} | {np.median(t[:200]):.1f} | {np.median(t[-200:]):.1f} | {entries} |")
    return "\n".join(lines)


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
    parser.add_argument("--step-times", action="store_true", help="only measure BBVI step-time drift")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.step_times:
        print(step_time_drift())
        return

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
            "common": common_elbo(model, post.guide, data.x_train, y),
            **test_metrics(post, data, tau_std),
        }
        print(json.dumps(result["fits"][method]["elbo_trace"][-1]), result["fits"][method]["common"], flush=True)

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
    lines += ["", f"### ELBO vs wall time, same budget (about {result['budget_s']:.0f} s per method)", "",
              "Per-step ELBO estimates averaged over [0.9 t, t]; the last row is each run's end.", "",
              "| wall time t (s) | " + " | ".join(f"{m} ELBO" for m in METHODS) + " |",
              "|---|" + "---|" * len(METHODS)]
    traces = {m: {p["seconds"]: p["elbo"] for p in result["fits"][m]["elbo_trace"][:-1]} for m in METHODS}
    for t in CHECKPOINTS:
        if any(t in traces[m] for m in METHODS):
            cells = [f"{traces[m][t]:.1f}" if t in traces[m] else "(ended)" for m in METHODS]
            lines.append(f"| {t:g} | " + " | ".join(cells) + " |")
    ends = [result["fits"][m]["elbo_trace"][-1] for m in METHODS]
    lines.append("| end | " + " | ".join(f"{e['elbo']:.1f} at {e['seconds']:.0f} s" for e in ends) + " |")
    lines += ["", "Final guides (Polyak-averaged), one estimator for both: ELBO = E_q[log lik] (2000 draws) "
              "- analytic KL; test metrics on the original scale (1000 draws).", "",
              "| method | steps | particles/step | wall s | ELBO | E log lik | KL | median sd | test RMSE | test LL |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for m in METHODS:
        f = result["fits"][m]
        c = f["common"]
        lines.append(f"| {m} | {f['steps']} | {f['settings']['num_particles']} | {f['wall_time_s']:.0f} | "
                     f"{c['elbo']:.1f} | {c['expected_log_lik']:.1f} | {c['kl']:.1f} | {c['median_sd']:.3g} | "
                     f"{f['rmse']:.2f} | {f['test_ll']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
