"""Sequential Monte Carlo from the prior to the posterior: do independent runs agree on yacht?  A probe.

Every MCMC lever measured on the narrow UCI datasets (docs/results/narrow_posteriors.md) failed for the same reason:
chains stay in the function-space mode they first fall into, so chains from different starts
disagree (split R-hat 1.3-1.6, and nested R-hat 1.02-1.10 over superchains) and no budget tried
made them cross.  A tempered SMC sampler does not need any particle to cross: K particles drawn
from the prior are moved through the tempered targets

    π_β(θ) ∝ p(θ) p(y | θ)^β,    0 = β_0 < β_1 < ... < β_T = 1,

each step reweighting by p(y | θ)^(β_{t+1} - β_t), resampling, and moving every particle with
HMC that leaves π_{β_{t+1}} invariant (Del Moral, Doucet & Jasra 2006; HMC moves tuned from the
particles as in Buchholz, Chopin & Jacob 2021).  The share of particles in each mode is set by the
weights while the modes separate, not by crossings at β = 1.  The next β is the one that keeps the
weights' effective sample size at ``--ess`` times K (bisection; Jasra et al. 2011); the HMC metric
is the particles' weighted variance (diagonal), the step size of each temperature is the last one
times exp(``--step-gain`` (acceptance - 0.65)) (within 0.5-1.5x), the number of leapfrog steps is jittered uniformly on 0.5-1.5
times ``--steps``, and every temperature makes at least ``--moves`` HMC moves and more, up to ``--max-moves``,
until in every run the correlation across particles of ℓ = log p(y | θ) before and after the moves
is below ``--decorrelate`` (the particles have left where resampling put them).  A run's estimate of the
log evidence, Σ_t log mean_k w_k, is a by-product, and the genealogy is followed: how many
particles of the first population past β = b (``--lineage-betas``) have descendants at β = 1.

``--runs`` independent runs (their own prior draws and randomness) advance side by side in one
batch, each with its own β schedule (a run that reaches β = 1 first goes on moving at β = 1:
more MCMC steps at the target, valid).  Whether they sampled the posterior is judged the way nested
R-hat judges superchains (Margossian et al. 2024): each run a superchain of K chains of one draw,
R_ν = sqrt(1 + B/W) of f at the held-back inputs, B the variance of the runs' means, W the mean
within-run variance.  Resampling correlates the particles of a run, which raises B beside W, so
this is a conservative reading: agreement by it is real agreement.

Checked before it runs (``--check``): on exact Bayesian linear regression (fixed noise) the
particles' mean and covariance match the closed form within their Monte Carlo error, and the log
evidence matches the closed form log N(y | 0, s² Φ Φᵀ + I/β) within the runs' spread; the same
check with the reweighting exponent halved fails it (so the check can see a wrong weight).

    python comparisons/research/smc_tempering.py --check
    python comparisons/research/smc_tempering.py --data-dir ../shared/datasets --dataset yacht --split 0 \\
        --runs 4 --particles 128 --moves 5 --steps 64 --compile
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # comparisons/: uci_references
from uci_references import make_model  # noqa: E402

import pyrobdl  # noqa: E402
from pyrobdl import datasets  # noqa: E402
from pyrobdl.diagnostics.certification import nested_rhat  # noqa: E402
from pyrobdl.flat import FlatLogJoint  # noqa: E402
from pyrobdl.inference.chees import _Sampler, _Tempered  # noqa: E402


def next_increment(ll: torch.Tensor, room: torch.Tensor, target: float) -> torch.Tensor:
    """Per run, the largest δ ≤ ``room`` whose weights exp(δ ℓ) keep ESS ≥ ``target`` · K
    (bisection on log δ); ``ll`` ``[R, K]`` float64."""
    def ess(delta: torch.Tensor) -> torch.Tensor:
        logw = delta[:, None] * ll
        logw = logw - logw.max(1, keepdim=True).values
        w = logw.exp()
        return w.sum(1) ** 2 / (w * w).sum(1) / ll.shape[1]

    ok = ess(room) >= target
    lo, hi = torch.full_like(room, -40.0), room.log()
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        good = ess(mid.exp()) >= target
        lo, hi = torch.where(good, mid, lo), torch.where(good, hi, mid)
    return torch.where(ok, room, lo.exp())


def systematic(logw: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Systematic resampling of each run's particles: indices ``[R, K]`` into that run."""
    r, k = logw.shape
    w = torch.softmax(logw, 1)
    u = (torch.rand(r, 1, dtype=w.dtype, generator=gen) + torch.arange(k, dtype=w.dtype)) / k
    return torch.searchsorted(w.cumsum(1).contiguous(), u.contiguous()).clamp(max=k - 1)


def smc(lj: FlatLogJoint, runs: int, particles: int, args: argparse.Namespace, weight_power: float = 1.0) -> dict:
    """Run ``runs`` tempered SMC samplers of ``particles`` particles side by side; the final
    particles ``[R, K, P]``, each run's log evidence and the per-temperature record.
    ``weight_power`` != 1 only to show that the checks can fail."""
    gen = torch.Generator().manual_seed(args.seed)
    r, k, n = runs, particles, runs * particles
    theta = lj.sample_prior(n, generator=gen)
    beta = torch.zeros(r, dtype=torch.float64)
    rows = torch.zeros(n, dtype=lj.dtype)
    tempered = _Tempered(lj, rows)
    step = torch.full((r,), args.initial_step, dtype=torch.float64)
    log_z = torch.zeros(r, dtype=torch.float64)
    record, gradients, t = [], 0, 0
    ancestor = {b: torch.zeros(r, k, dtype=torch.long) for b in args.lineage_betas}
    seeded = {b: torch.zeros(r, dtype=torch.bool) for b in args.lineage_betas}
    cpu, wall = time.process_time(), time.perf_counter()
    while True:
        full, _ = lj.value_and_grad(theta)
        gradients += n
        ll = (full - lj.log_prior(theta)[0]).double().view(r, k)
        if bool((beta >= 1).all()) and t > 0:
            break
        delta = next_increment(ll, (1 - beta).clamp(min=0), args.ess)
        logw = weight_power * delta[:, None] * ll
        logw = torch.where(torch.isfinite(logw), logw, torch.full_like(logw, -math.inf))
        log_z += torch.logsumexp(logw, 1) - math.log(k)
        w = torch.softmax(logw, 1)
        flat = theta.view(r, k, -1).double()
        mean = (w[..., None] * flat).sum(1)
        var = (w[..., None] * (flat - mean[:, None]) ** 2).sum(1).clamp(min=1e-12)
        idx = systematic(logw, gen)
        theta = flat.gather(1, idx[..., None].expand(-1, -1, flat.shape[-1])).to(lj.dtype).reshape(n, -1)
        beta = torch.where(beta >= 1, beta, (beta + delta).clamp(max=1.0))
        beta = torch.where(beta > 1 - 1e-12, torch.ones_like(beta), beta)
        rows.copy_(beta.to(lj.dtype).repeat_interleave(k))
        # genealogy: each particle's ancestor in the population of the first temperature with β ≥ b
        # (which particle of that population it descends from), for every b of --lineage-betas
        for b in args.lineage_betas:
            fresh = (beta >= b) & ~seeded[b]
            ancestor[b] = torch.where(fresh[:, None], torch.arange(k).expand(r, k), ancestor[b].gather(1, idx))
            seeded[b] |= fresh
        sampler = _Sampler(tempered, theta, gen, threshold=1000.0)
        sampler.inv_mass = var.to(lj.dtype).repeat_interleave(k, 0)
        ll_before = ll.gather(1, idx)
        accepts, corr = [], None
        while len(accepts) < args.max_moves:
            steps = max(1, int(args.steps * (0.5 + torch.rand((), generator=gen).item())))
            eps = step.to(lj.dtype).repeat_interleave(k)[:, None]
            *_, prob, _, _ = sampler.transition(eps, steps)
            accepts.append(prob.double().view(r, k).mean(1))
            # how far the moves have carried the particles: the correlation, across each run's
            # particles, of ℓ before the moves and now; move on once every run's is below --decorrelate
            ll_now = tempered.log_likelihood(sampler.theta, sampler.logp).double().view(r, k)
            corr = [float(np.corrcoef(a, b)[0, 1]) for a, b in zip(ll_before.numpy(), ll_now.numpy())]
            if len(accepts) >= args.moves and max(corr) < args.decorrelate:
                break
        theta = sampler.theta
        gradients += sampler.gradients
        acc = torch.stack(accepts).mean(0)
        record.append({
            "t": t, "beta": beta.tolist(), "delta": delta.tolist(), "step": step.tolist(), "accept": acc.tolist(),
            "unique_after_resampling": [int(torch.unique(i).numel()) for i in idx],
            # how far the moves carried each particle: the correlation of ℓ before and after them
            "ll_corr_before_after": corr, "moves": len(accepts),
            "ll_mean": ll.mean(1).tolist(), "gradients": gradients,
        })
        if args.verbose:
            print(json.dumps({key: record[-1][key] for key in ("t", "beta", "step", "accept", "ll_corr_before_after",
                                                                "moves", "gradients")}), flush=True)
        step = step * torch.exp(args.step_gain * (acc - 0.65)).clamp(0.5, 1.5)
        t += 1
    lineages = {f"{b:g}": [int(torch.unique(a).numel()) for a in ancestor[b]] for b in args.lineage_betas}
    return {"theta": theta.view(r, k, -1), "log_evidence": log_z.tolist(), "temperatures": t, "record": record,
            "lineages": lineages,
            "chain_gradients": gradients, "cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall}


def check_blr(args: argparse.Namespace) -> dict:
    """Exact Bayesian linear regression: particles' mean and covariance against the closed form,
    and the log evidence against log N(y | 0, s² Φ Φᵀ + I / β)."""
    data = datasets.bayesian_linear_regression(100, 20, 3, prior_scale=1.0, precision=10.0, seed=0)
    model = pyrobdl.BayesianMLP(3, (), 1, prior=pyrobdl.priors.Gaussian(1.0),
                                likelihood=pyrobdl.likelihoods.Gaussian(10.0))
    x, y = data.x_train.double(), data.y_train.double()
    lj = FlatLogJoint(model, x, y)
    exact = data.posterior
    phi = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)
    cov_y = phi @ phi.T + torch.eye(len(x), dtype=x.dtype) / 10.0
    log_z_exact = float(torch.distributions.MultivariateNormal(torch.zeros(len(x), dtype=x.dtype), cov_y).log_prob(y))
    out = {}
    for power in (1.0, 0.5):
        res = smc(lj, args.runs, args.particles, args, weight_power=power)
        flat = res["theta"]
        draws = torch.cat([flat[..., lj.layout["layers.0.weight"].start : lj.layout["layers.0.weight"].stop],
                           flat[..., lj.layout["layers.0.bias"].start : lj.layout["layers.0.bias"].stop]], -1)
        run_means = draws.mean(1)  # [R, 4]: the runs are independent, so their spread is the error
        se = run_means.std(0) / math.sqrt(args.runs)
        z_mean = ((run_means.mean(0) - exact.mean) / se).abs().max().item()
        sd = draws.reshape(-1, 4).std(0)
        sd_ratio = (sd / exact.covariance.diagonal().sqrt()).tolist()
        lz = torch.tensor(res["log_evidence"])
        z_evidence = float((lz.mean() - log_z_exact) / (lz.std() / math.sqrt(args.runs)))
        out[f"weight_power_{power:g}"] = {"mean_max_abs_z": z_mean, "sd_ratio": sd_ratio,
                                          "log_evidence_mean": float(lz.mean()), "log_evidence_sd": float(lz.std()),
                                          "log_evidence_exact": log_z_exact, "log_evidence_z": z_evidence,
                                          "temperatures": res["temperatures"]}
        print(json.dumps(out[f"weight_power_{power:g}"]), flush=True)
    return out


def held_back_functions(lj: FlatLogJoint, theta: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """f at ``x`` and τ of every particle: ``[R, K, n]``, ``[R, K]``."""
    r, k, p = theta.shape
    w = lj.layout.unpack(theta.reshape(r * k, p).double(), constrained=False)
    h = torch.relu(x @ w["layers.0.weight"].transpose(-1, -2) + w["layers.0.bias"].unsqueeze(-2))
    f = (h @ w["layers.1.weight"].transpose(-1, -2)).squeeze(-1) + w["layers.1.bias"]
    tau = theta[..., lj.precision_index].double().exp()
    return f.view(r, k, -1), tau


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir")
    parser.add_argument("--dataset", default="yacht")
    parser.add_argument("--split", type=int, default=0)
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--particles", type=int, default=128)
    parser.add_argument("--moves", type=int, default=5, help="HMC moves per temperature, at least")
    parser.add_argument("--max-moves", type=int, default=50, help="HMC moves per temperature, at most")
    parser.add_argument("--decorrelate", type=float, default=0.1,
                        help="more moves (up to --max-moves) until ℓ's correlation with its value before them is below this")
    parser.add_argument("--step-gain", type=float, default=1.0)
    parser.add_argument("--lineage-betas", type=float, nargs="*", default=[0.01, 0.1, 0.3, 0.5, 0.8],
                        help="report how many particles of the first population with β ≥ b have descendants at the end")
    parser.add_argument("--steps", type=int, default=64, help="leapfrog steps per move (jittered 0.5-1.5x)")
    parser.add_argument("--ess", type=float, default=0.5, help="the weights' ESS per particle kept by each step")
    parser.add_argument("--initial-step", type=float, default=0.2)
    parser.add_argument("--cert-points", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--float64", action="store_true")
    parser.add_argument("--check", action="store_true", help="only the exact-BLR check")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(1)

    if args.check:
        result = check_blr(args)
        right, wrong = result["weight_power_1"], result["weight_power_0.5"]
        assert right["mean_max_abs_z"] < 4 and abs(right["log_evidence_z"]) < 4, right
        assert wrong["mean_max_abs_z"] > 4 or abs(wrong["log_evidence_z"]) > 4, wrong
        return

    data = datasets.load_uci(args.dataset, args.split, data_dir=args.data_dir)
    dtype = torch.float64 if args.float64 else torch.float32
    model = make_model(data.x_train.shape[1])
    lj = FlatLogJoint(model, data.x_train.to(dtype), data.y_train.to(dtype))
    compile_s = lj.compile(args.runs * args.particles) if args.compile else 0.0
    res = smc(lj, args.runs, args.particles, args)
    x_held = data.x_test[: args.cert_points].double()
    f, _ = held_back_functions(lj, res["theta"], x_held)
    r, k = f.shape[:2]
    rhat = nested_rhat(f.reshape(r * k, 1, -1).numpy(), k)
    # each run's predictive on the whole test split, on the original scale
    ft, tau = held_back_functions(lj, res["theta"], data.x_test.double())
    y = data.y_test.double() * data.y_std + data.y_mean
    mu = ft * data.y_std + data.y_mean
    sd = data.y_std / tau.sqrt()
    log_p = torch.distributions.Normal(mu, sd[..., None]).log_prob(y)  # [R, K, n]
    test_ll = (torch.logsumexp(log_p, 1) - math.log(k)).mean(-1)
    rmse = ((mu.mean(1) - y) ** 2).mean(-1).sqrt()
    all_ll = float((torch.logsumexp(log_p.reshape(r * k, -1), 0) - math.log(r * k)).mean())
    all_rmse = float(((mu.reshape(r * k, -1).mean(0) - y) ** 2).mean().sqrt())
    last = res["record"][-1]
    row = {
        "dataset": args.dataset, "split": args.split, "runs": r, "particles": k, "moves": args.moves,
        "steps": args.steps, "ess": args.ess, "dtype": str(dtype), "temperatures": res["temperatures"],
        "nested_rhat_runs_max": float(np.max(rhat)), "nested_rhat_runs_median": float(np.median(rhat)),
        "points_above_1.01": int((rhat > 1.01).sum()), "points": int(rhat.size),
        "log_evidence": res["log_evidence"], "lineages_surviving": res["lineages"], "rmse_per_run": rmse.tolist(), "test_ll_per_run": test_ll.tolist(),
        "rmse_all": all_rmse, "test_ll_all": all_ll,
        "final_step": last["step"], "final_accept": last["accept"], "final_ll_corr": last["ll_corr_before_after"],
        "final_unique": last["unique_after_resampling"],
        "chain_gradients": res["chain_gradients"], "cpu_s": res["cpu_s"], "wall_s": res["wall_s"],
        "compile_s": compile_s, "load_average": os.getloadavg(), "torch": torch.__version__,
    }
    print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(json.dumps({**row, "record": res["record"]}) + "\n")


if __name__ == "__main__":
    main()
