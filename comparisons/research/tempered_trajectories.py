"""Tempered trajectories (Neal 2011, "MCMC using Hamiltonian dynamics", section 5.5.7): a probe.

Within one HMC trajectory the momentum is multiplied by sqrt(a) before and after every leapfrog
step of the first half and divided by it in the second half, so the kinetic energy peaks at
``F = a^(n/2)`` times its start in the middle of the trajectory and the trajectory can climb
``(F - 1)`` times its kinetic energy higher than plain HMC before it cools again; the map stays
reversible and volume-preserving (as many multiplications as divisions), so the usual
Metropolis test on the Hamiltonian keeps the posterior exact.  The question: can this move a
chain of yacht's posterior to another likelihood level (docs/results/narrow_posteriors.md, "Round trips")?

Two parts:

* ``--gaussian``: the Hamiltonian error of tempered trajectories on a 400-dimensional Gaussian
  whose standard deviations span 1e-3 to 1 (yacht's span of curvatures, comparisons/research/
  posterior_geometry.py), for F = 1, 1.2, 4 and several trajectory lengths and step sizes;
* otherwise: ``comparisons/research/likelihood_levels.py`` (same arguments) with chees's leapfrog replaced
  by the tempered one (``--peak-kinetic-factor F``); not a chees option.

    python comparisons/research/tempered_trajectories.py --gaussian
    python comparisons/research/tempered_trajectories.py --peak-kinetic-factor 1.2 --data-dir ../shared/datasets \
        --dataset yacht --split 0 --chains 32 --warmup 300 --samples 300 --compile
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import likelihood_levels  # noqa: E402

from pyrobdl.inference import chees  # noqa: E402


def tempered_leapfrog(grad_fn, theta, p, grad, step, n, factor, inv_mass=1.0):
    """``n`` tempered leapfrog steps from ``(theta, p)``; ``grad_fn(theta) -> (logp, grad)``.

    Returns ``theta, p, logp, grad`` at the end, as chees's own leapfrog does.
    """
    theta, p = theta.clone(), p.clone()
    s = math.sqrt(factor ** (1.0 / n))  # kinetic energy times s^2 per multiplication pair: F at mid-trajectory
    logp, kick = None, 0.5 * step  # step: a number, or [K, 1] (a step per chain)
    for i in range(n):
        first = i < n // 2
        middle = n % 2 == 1 and i == n // 2
        p.mul_(s if (first or middle) else 1.0 / s)
        p.add_(kick * grad)
        theta.add_(step * inv_mass * p)
        logp, grad = grad_fn(theta)
        p.add_(kick * grad)
        p.mul_(s if first else 1.0 / s)
    return theta, p, logp, grad


def gaussian_check(dim: int = 400, chains: int = 256, seed: int = 0) -> None:
    """Hamiltonian error of tempered trajectories on N(0, diag(sd^2)), sd log-spaced 1e-3 .. 1."""
    torch.manual_seed(seed)
    sd = torch.logspace(-3, 0, dim, dtype=torch.float64)

    def grad_fn(th):
        return -0.5 * ((th / sd) ** 2).sum(-1), -th / sd**2

    theta = torch.randn(chains, dim, dtype=torch.float64) * sd
    p = torch.randn(chains, dim, dtype=torch.float64)
    h0 = -grad_fn(theta)[0] + 0.5 * (p * p).sum(-1)
    print("| F | trajectory length | step | steps | mean ΔH | sd ΔH | mean acceptance |")
    print("|---|---|---|---|---|---|---|")
    for factor in (1.0, 1.2, 4.0):
        for length in (1e-3, 1e-2, 0.1, 1.0):
            for step in (1e-3, 1e-4):
                n = max(1, round(length / step))
                if n > 20_000:
                    continue
                _, p1, logp1, _ = tempered_leapfrog(grad_fn, theta, p, grad_fn(theta)[1], step, n, factor)
                dh = -logp1 + 0.5 * (p1 * p1).sum(-1) - h0
                acc = torch.exp(-dh.clamp(min=0)).mean()
                print(f"| {factor} | {length:g} | {step:g} | {n} | {dh.mean():.3f} | {dh.std():.3f} | {acc:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    parser.add_argument("--gaussian", action="store_true")
    parser.add_argument("--peak-kinetic-factor", type=float, default=1.0)
    args, rest = parser.parse_known_args()
    if args.gaussian:
        gaussian_check()
        return
    factor = args.peak_kinetic_factor

    def leapfrog(self, theta, p, grad, step, n):
        out = tempered_leapfrog(self.lj.value_and_grad, theta, p, grad, step, n, factor, self.inv_mass)
        self.gradients += n * theta.shape[0]
        return out

    chees._Sampler.leapfrog = leapfrog  # this process only
    sys.argv = [sys.argv[0], *rest]
    likelihood_levels.main()


if __name__ == "__main__":
    main()
