"""Sampling with the output layer integrated out: does it move yacht's chains faster?  A probe.

The reference network (1 x L ReLU, N(0, s²) priors, Gaussian likelihood with precision τ) is
linear in its output layer: given the hidden layer and τ, the output weights and bias w have a
Gaussian conditional, N(τ A⁻¹ Φᵀy, A⁻¹) with A = I/s² + τ ΦᵀΦ and Φ = [relu(X W₁ᵀ + b₁), 1] the
N x (L + 1) features, and the marginal of y is N(0, s² ΦΦᵀ + I/τ).  So HMC can sample the
hidden layer and log τ alone from the *collapsed* log density

    log p(W₁, b₁, log τ | y) = log p(y | W₁, b₁, τ) + log prior(W₁, b₁) + log Gamma(τ) + log τ

(the marginal likelihood through Woodbury and a Cholesky factor of A, [L + 1, L + 1] per chain)
and draw w exactly from its conditional for every kept draw — a collapsed Gibbs sampler, exact
like the full one.  Checked here, before anything runs: the collapsed value equals the full log
joint (``FlatLogJoint``, itself proven equal to Pyro's potential) minus the log conditional
density of any w, to 1e-10 of the largest term (float64).

Then the same plain HMC as ``comparisons/research/dense_metric.py`` (diagonal metric from the starting
draws' cross-chain variance, jittered ``--steps`` leapfrog steps, step size adapted for
``--adapt`` iterations, ``--samples`` kept, float64, one thread) runs from the same warm states
— chees's chains after 300 + 20 iterations — on the full and on the collapsed coordinates.
Reported: step size, split R-hat and bulk ESS of the function at the held-back inputs (the
split's first ``--cert-points`` test inputs, as ``uci_references.py`` certifies; yacht has 31), each chain's own ESS of the
log-likelihood, and cost (the collapsed gradient is plain autograd, the full one pyrobdl's
hand-written kernel, so CPU seconds favour the full path).

    python comparisons/research/collapsed_output.py --data-dir ../shared/datasets --dataset yacht --split 0 \
        --chains 8 --steps 256 --adapt 100 --samples 200
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dense_metric import diagonal_hmc, hmc_parser  # noqa: E402
from posterior_geometry import chees_draws, hessian, spectrum  # noqa: E402

from pyrobdl.diagnostics import convergence  # noqa: E402
from pyrobdl.flat import FlatLogJoint  # noqa: E402


class Collapsed:
    """The reference network's log density with the output layer integrated out (one output)."""

    def __init__(self, lj: FlatLogJoint, x: torch.Tensor, y: torch.Tensor) -> None:
        lay = lj.layout
        self.lj, self.x, self.y = lj, x, y.reshape(-1)
        self.hidden = lay["layers.0.weight"].shape[0]
        w0, b0, w1, b1, tau = (lay[n] for n in ("layers.0.weight", "layers.0.bias", "layers.1.weight",
                                                "layers.1.bias", "precision"))
        self.keep = torch.cat([torch.arange(w0.start, w0.stop), torch.arange(b0.start, b0.stop),
                               torch.tensor([tau.start])])
        self.out = torch.cat([torch.arange(w1.start, w1.stop), torch.arange(b1.start, b1.stop)])
        prec = lj._prior_prec  # the prior precisions of every flat coordinate
        self.hidden_prec, self.out_prec = prec[self.keep[:-1]], prec[self.out]
        self.a, self.b = lj._a, lj._b  # the Gamma prior of tau

    def parts(self, z: torch.Tensor):
        """Collapsed log density ``[K]`` and what the conditional of the output layer needs."""
        k, n, h = z.shape[0], self.x.shape[0], self.hidden
        d = self.x.shape[1]
        weight = z[:, : h * d].view(k, h, d)
        bias = z[:, h * d : h * d + h]
        u = z[:, -1]
        tau = u.exp()
        phi = torch.relu(self.x @ weight.transpose(-1, -2) + bias.unsqueeze(-2))
        phi = torch.cat([phi, phi.new_ones(k, n, 1)], -1)  # [K, N, h + 1]
        a_mat = torch.diag_embed(self.out_prec.expand(k, -1)) + tau[:, None, None] * phi.transpose(-1, -2) @ phi
        chol = torch.linalg.cholesky(a_mat)
        py = phi.transpose(-1, -2) @ self.y
        sol = torch.cholesky_solve(py.unsqueeze(-1), chol).squeeze(-1)  # A^{-1} Φᵀy
        quad = tau * (self.y @ self.y) - tau**2 * (py * sol).sum(-1)
        # log|s² ΦΦᵀ + I/τ| = log|A| - Σ log(1/s²) - N log τ
        logdet = 2 * torch.diagonal(chol, dim1=-2, dim2=-1).log().sum(-1) - self.out_prec.log().sum() - n * u
        loglik = -0.5 * n * math.log(2 * math.pi) - 0.5 * logdet - 0.5 * quad
        hz = z[:, :-1]
        logprior = (-0.5 * (self.hidden_prec * hz * hz).sum(-1) + 0.5 * self.hidden_prec.log().sum()
                    - 0.5 * hz.shape[1] * math.log(2 * math.pi))
        logprior = logprior + self.a * math.log(self.b) - math.lgamma(self.a) + self.a * u - self.b * tau
        return loglik + logprior, tau, chol, sol

    def value_and_grad(self, z: torch.Tensor):
        z = z.detach().requires_grad_(True)
        value = self.parts(z)[0]
        (grad,) = torch.autograd.grad(value.sum(), z)
        return value.detach(), grad

    def conditional_log_density(self, z: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        _, tau, chol, sol = self.parts(z)
        diff = w - tau[:, None] * sol
        q = ((chol.transpose(-1, -2) @ diff.unsqueeze(-1)).squeeze(-1) ** 2).sum(-1)
        return (-0.5 * w.shape[1] * math.log(2 * math.pi) + torch.diagonal(chol, dim1=-2, dim2=-1).log().sum(-1)
                - 0.5 * q)

    def complete(self, z: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """Full flat vectors: ``z`` with an exact draw of the output layer from its conditional."""
        _, tau, chol, sol = self.parts(z)
        eps = torch.randn(sol.shape, dtype=z.dtype, generator=gen)
        w = tau[:, None] * sol + torch.linalg.solve_triangular(chol.transpose(-1, -2), eps.unsqueeze(-1),
                                                                upper=True).squeeze(-1)
        theta = z.new_zeros(z.shape[0], self.lj.size)
        theta[:, self.keep], theta[:, self.out] = z, w
        return theta


def function_space(lj: FlatLogJoint, draws: torch.Tensor, x_held: torch.Tensor) -> dict:
    """Split R-hat (max) and bulk ESS (min) of f at the held-back inputs; each chain's own ESS of ℓ."""
    k, s, p = draws.shape
    flat = draws.reshape(k * s, p)
    w = lj.layout.unpack(flat, constrained=False)
    h = torch.relu(x_held @ w["layers.0.weight"].transpose(-1, -2) + w["layers.0.bias"].unsqueeze(-2))
    f = (h @ w["layers.1.weight"].transpose(-1, -2)).squeeze(-1) + w["layers.1.bias"]
    conv = convergence(f.view(k, s, -1).numpy())
    with torch.no_grad():
        ell = lj.value_and_grad(flat, prior=False)[0].view(k, s, 1).numpy()
    own = float(np.median([convergence(ell[i : i + 1])["ess_bulk"][0] for i in range(k)]))
    return {"f_rhat_max": float(np.max(conv["rhat"])), "f_ess_bulk_min": float(np.min(conv["ess_bulk"])),
            "f_ess_bulk_median": float(np.median(conv["ess_bulk"])), "ell_rhat": float(convergence(ell)["rhat"][0]),
            "ell_ess_per_chain": own}


def report_runs(key: str, runs: dict, lj: FlatLogJoint, x_held: torch.Tensor, extra=None) -> list[dict]:
    """Run each ``runs[name]()`` (returning draws, step size, acceptance, chain-gradients), time it
    (process CPU and wall seconds) and print one JSON row with ``function_space`` of its draws and
    ``extra(draws)`` if given."""
    rows = []
    for name, run in runs.items():
        cpu, wall = time.process_time(), time.perf_counter()
        draws, step, accept, gradients = run()
        rows.append({key: name, "step_size": step, "accept": accept, **function_space(lj, draws, x_held),
                     **(extra(draws) if extra else {}), "chain_gradients": gradients,
                     "cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = hmc_parser(__doc__.splitlines()[0])
    parser.add_argument("--cert-points", type=int, default=50)
    parser.add_argument("--geometry-chains", type=int, default=4, help="chains whose Hessians are compared")
    args = parser.parse_args()
    torch.set_num_threads(1)

    data, lj, _, theta = chees_draws(args, num_warmup=300, num_samples=20)
    x, y = lj.x, lj.y
    col = Collapsed(lj, x, y)
    c, d = theta.shape[:2]
    start = theta[:, -1].clone()

    # the identity: collapsed = full log joint - log conditional density of the output layer, any w
    gen = torch.Generator().manual_seed(args.seed)
    w_any = start[:, col.out] + torch.randn(c, col.out.numel(), dtype=start.dtype, generator=gen)
    full_any = start.clone()
    full_any[:, col.out] = w_any
    lhs = col.parts(start[:, col.keep])[0]
    rhs = lj.log_joint(full_any) - col.conditional_log_density(start[:, col.keep], w_any)
    scale = torch.maximum(lhs.abs(), lj.log_joint(full_any).abs())  # the terms cancel: error relative to the largest
    identity_error = float(((lhs - rhs).abs() / scale).max())
    assert identity_error < 1e-10, identity_error

    geometry = []
    var_full = theta.reshape(c * d, -1).var(0)
    var_col = var_full[col.keep]
    for ch in range(min(args.geometry_chains, c)):
        h_col = torch.autograd.functional.hessian(lambda v: -col.parts(v.unsqueeze(0))[0][0], start[ch, col.keep])
        geometry.append({"full": spectrum(hessian(lj, start[ch]), var_full, True),
                         "collapsed": spectrum(h_col, var_col, True)})
    geo = {kind: {key: float(np.median([g[kind][key] for g in geometry])) for key in geometry[0][kind]}
           for kind in ("full", "collapsed")}
    print(json.dumps({"identity_relative_error": identity_error, "diagonal_metric_spectrum_median": geo}), flush=True)

    def collapsed():
        z0 = start[:, col.keep]
        draws, step, accept, gradients = diagonal_hmc(col, z0, var_col, args)
        k, s, _ = draws.shape
        return col.complete(draws.reshape(k * s, -1), torch.Generator().manual_seed(args.seed + 2)).view(k, s, -1), \
            step, accept, gradients

    report_runs("coordinates", {"full": lambda: diagonal_hmc(lj, start, var_full, args), "collapsed": collapsed},
                lj, data.x_test[: args.cert_points].double())
    print(json.dumps({"dataset": args.dataset, "split": args.split, "chains": c, "load_average": os.getloadavg()}))


if __name__ == "__main__":
    main()
