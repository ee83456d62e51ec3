"""Does a dense, per-chain metric from local Hessians move yacht's chains faster?  A probe.

``comparisons/research/posterior_geometry.py`` found the Hessian of yacht's posterior averaged over a few
earlier draws of a chain conditioning the curvature at its next draw better (sqrt(λ_max/λ_min)
1,300 against 6,400 for the diagonal metric).  This runs the same plain HMC twice from the same
warm states — chees's ``num_chains`` chains after 300 warm-up and 20 sampling iterations — once
with the diagonal metric chees adapts (the draws' variance across chains) and once with a
per-chain dense metric ``M_k``: the Hessian of the negative log joint averaged over five of
chain k's 20 draws, its eigenvalues replaced by ``max(|λ|, 1)``.  Momentum ``p ~ N(0, M_k)``,
velocity ``M_k^{-1} p``; both runs take a jittered number of leapfrog steps (uniform on
0.5–1.5 times ``--steps``), adapt one step size for ``--adapt`` iterations (Robbins–Monro on the
chains' mean acceptance, target 0.75) and then keep ``--samples`` draws, float64, one thread.
Reported: step size, acceptance, the split R-hat and each chain's own ESS of the log-likelihood
and of the positions on the hidden units' ReLU rescaling orbits (posterior_geometry.py), cost.

    python comparisons/research/dense_metric.py --data-dir ../shared/datasets --dataset yacht --split 0 \
        --chains 8 --steps 256 --adapt 100 --samples 200
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from posterior_geometry import abs_floor, chees_draws, hessian  # noqa: E402

from pyrobdl.diagnostics import convergence  # noqa: E402


def run_hmc(lj, start, momentum, velocity, step, args, seed, between=None):
    """Plain HMC of every row of ``start`` with the given metric; the kept draws ``[K, S, P]``,
    the final step size, the mean acceptance while sampling and the chain-gradients spent.
    ``between(theta, generator)``, if given, is a further posterior-invariant move applied to
    every chain after each HMC transition (its new states' gradients are counted)."""
    gen = torch.Generator().manual_seed(seed)
    k = start.shape[0]
    theta = start.clone()
    logp, grad = lj.value_and_grad(theta)
    log_step, draws, accepts, gradients = math.log(step), [], [], 0
    for it in range(args.adapt + args.samples):
        step = math.exp(log_step)
        n = max(1, int(args.steps * (0.5 + torch.rand((), generator=gen).item())))
        p = momentum(gen)
        h0 = -logp + 0.5 * (p * velocity(p)).sum(-1)
        t, q = theta.clone(), p + 0.5 * step * grad
        for i in range(n):
            t = t + step * velocity(q)
            logp1, grad1 = lj.value_and_grad(t)
            q = q + (step if i < n - 1 else 0.5 * step) * grad1
        gradients += n * k
        dh = -logp1 + 0.5 * (q * velocity(q)).sum(-1) - h0
        acc = torch.where(torch.isfinite(dh), torch.exp(-dh.clamp(min=0)), torch.zeros_like(dh))
        ok = torch.rand(k, generator=gen, dtype=acc.dtype) < acc
        theta = torch.where(ok[:, None], t, theta)
        logp, grad = torch.where(ok, logp1, logp), torch.where(ok[:, None], grad1, grad)
        if between is not None:
            theta = between(theta, gen)
            logp, grad = lj.value_and_grad(theta)
            gradients += k
        if it < args.adapt:
            log_step += 2.0 * (float(acc.mean()) - 0.75) / math.sqrt(it + 1)
        else:
            draws.append(theta.clone())
            accepts.append(float(acc.mean()))
    return torch.stack(draws, 1), step, float(np.mean(accepts)), gradients


def diagonal_hmc(lj, start, variance, args, between=None):
    """``run_hmc`` with the diagonal metric ``variance`` (momentum ~ N(0, 1 / variance)), the
    probes' first step size 1e-3 and seed ``args.seed + 1``."""
    return run_hmc(lj, start, lambda g: torch.randn(start.shape, dtype=start.dtype, generator=g) * variance.rsqrt(),
                   lambda p: p * variance, 1e-3, args, seed=args.seed + 1, between=between)


def orbit_positions(lj, flat):
    """Each hidden unit's position on its ReLU rescaling orbit, log(|a_j| / |v_j|) (a_j its incoming
    weights and bias, v_j its outgoing weights), for flat draws ``[n, P]``: ``[n, H]``."""
    w = lj.layout.unpack(flat, constrained=False)
    a = torch.cat([w["layers.0.weight"], w["layers.0.bias"].unsqueeze(-1)], -1)
    v = w["layers.1.weight"].transpose(-1, -2)
    return a.norm(dim=-1).log() - v.norm(dim=-1).log()


def mixing(lj, draws):
    """Split R-hat and each chain's own bulk ESS (median over chains) of the log-likelihood and
    of the ReLU orbit positions log(|a_j| / |v_j|) (median over units)."""
    k, s, p = draws.shape
    flat = draws.reshape(k * s, p)
    with torch.no_grad():
        ell = lj.value_and_grad(flat, prior=False)[0].view(k, s, 1).numpy()
    orbit = orbit_positions(lj, flat).view(k, s, -1).numpy()

    def own(values):  # each chain alone (ArviZ logs that it expected two chains and computes it)
        return float(np.median([np.median(convergence(values[i : i + 1])["ess_bulk"]) for i in range(k)]))

    return {"log_likelihood": {"rhat": float(convergence(ell)["rhat"][0]), "ess_per_chain": own(ell),
                               "chain_means": [round(float(m), 1) for m in ell.mean(1).ravel()]},
            "orbit_position": {"rhat_median_over_units": float(np.median(convergence(orbit)["rhat"])),
                               "ess_per_chain": own(orbit)}}


def hmc_parser(description: str) -> argparse.ArgumentParser:
    """The arguments of the plain-HMC probes: data, chains, steps, adaptation, draws, seed."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--dataset", default="yacht")
    parser.add_argument("--split", type=int, default=0)
    parser.add_argument("--chains", type=int, default=8)
    parser.add_argument("--steps", type=int, default=256, help="mean leapfrog steps per iteration")
    parser.add_argument("--adapt", type=int, default=100)
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main() -> None:
    args = hmc_parser(__doc__.splitlines()[0]).parse_args()
    torch.set_num_threads(1)

    _, lj, _, theta = chees_draws(args, num_warmup=300, num_samples=20)
    c, d = theta.shape[:2]
    start = theta[:, -1].clone()
    variance = theta.reshape(c * d, -1).var(0)
    cpu0 = time.process_time()
    metric = torch.stack([abs_floor(sum(hessian(lj, theta[k, i]) for i in (0, 5, 10, 15, 19)) / 5) for k in range(c)])
    root = torch.linalg.cholesky(metric)
    inverse = torch.cholesky_inverse(root)
    metric_cpu = time.process_time() - cpu0

    def dense_momentum(gen):
        return (root @ torch.randn(start.shape, dtype=start.dtype, generator=gen).unsqueeze(-1)).squeeze(-1)

    kinds = {
        "diagonal": lambda: diagonal_hmc(lj, start, variance, args),
        "dense per chain": lambda: run_hmc(lj, start, dense_momentum, lambda p: (inverse @ p.unsqueeze(-1)).squeeze(-1),
                                           0.05, args, seed=args.seed + 1),
    }
    rows = []
    for name, run in kinds.items():
        cpu, wall = time.process_time(), time.perf_counter()
        draws, step, accept, gradients = run()
        rows.append({"metric": name, "step_size": step, "accept": accept, **mixing(lj, draws),
                     "chain_gradients": gradients, "cpu_s": time.process_time() - cpu,
                     "wall_s": time.perf_counter() - wall})
        print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"dataset": args.dataset, "split": args.split, "P": start.shape[1], "chains": c,
                      "metric_cpu_s": metric_cpu, "load_average": os.getloadavg()}))


if __name__ == "__main__":
    main()
