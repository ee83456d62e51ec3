"""Does a metric that follows the position move yacht's chains faster?  A probe of simplified
manifold MALA with the Gauss–Newton (Fisher) metric.

``comparisons/research/posterior_geometry.py`` found yacht's posterior ~6,400 leapfrog steps per
independent draw from well conditioned under the diagonal metric chees adapts, and its stiff
directions turning as a chain moves, so that no fixed metric (diagonal, dense, per chain) does
better.  A metric evaluated *at the current point* follows the turn.  The full Riemannian HMC
needs the metric's derivatives in every leapfrog step; simplified manifold MALA (Girolami &
Calderhead 2011, their "simplified mMALA") needs only the metric at the current and the proposed
point:

    θ' = θ + (ε²/2) G(θ)⁻¹ ∇log π(θ) + ε G(θ)^(-1/2) ξ,   ξ ~ N(0, I),

accepted with the Metropolis–Hastings ratio of the two Gaussian proposal densities, so the chain
keeps the posterior exactly whatever G is.  For a Gaussian likelihood the Fisher (Gauss–Newton)
metric is cheap and positive definite: G(θ) = τ J(θ)ᵀ J(θ) + Λ over the weights (J = ∂f/∂w, the
network outputs' Jacobian at the N training inputs, Λ the prior precisions) and, for the learned
precision's u = log τ, N/2 + b·τ (the likelihood's Fisher information in u plus the Gamma prior's
curvature); one Cholesky factor of a [P, P] matrix per chain and iteration.

First a check that can fail: on Bayesian linear regression (no hidden layer, τ fixed) G is the
exact posterior precision, so the draws' mean and covariance must match the closed form within
Monte Carlo error.  Then, from the same warm yacht states as ``dense_metric.py`` (chees's chains
after 300 warm-up and 20 sampling iterations), plain HMC with the diagonal metric (that script's
baseline) and smMALA, each adapting its step size (Robbins–Monro on the chains' mean acceptance;
HMC to 0.75, smMALA to 0.574) and then sampling.  Reported as in ``collapsed_output.py``: split
R-hat and bulk ESS of f at the held-back inputs, the log-likelihood's R-hat and ESS per chain,
cost; and, first, how well G describes the curvature where the chains are (the eigenvalues of the
exact Hessian whitened by G, all 1 where G is the Hessian).

    python comparisons/research/manifold_mala.py --data-dir ../shared/datasets --dataset yacht --split 0 \
        --chains 8 --steps 256 --adapt 100 --samples 200 --mala-adapt 300 --mala-samples 1500
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from collapsed_output import report_runs  # noqa: E402
from dense_metric import diagonal_hmc, hmc_parser  # noqa: E402
from posterior_geometry import chees_draws, hessian  # noqa: E402

import pyrobdl  # noqa: E402
from pyrobdl.datasets import bayesian_linear_regression  # noqa: E402
from pyrobdl.flat import FlatLogJoint  # noqa: E402


class FisherMetric:
    """G(θ) and its Cholesky factor for a single-output Gaussian regression ``FlatLogJoint``."""

    def __init__(self, lj: FlatLogJoint) -> None:
        self.lj = lj
        self.u = lj.precision_index  # None: fixed precision
        self.weights = [i for i in range(lj.size) if i != self.u]

    def outputs(self, theta: torch.Tensor) -> torch.Tensor:
        """f at the training inputs for one flat vector ``[P]``: ``[N]``."""
        params = self.lj.layout.unpack(theta.unsqueeze(0), constrained=False)
        h = self.lj.x
        layers = sum(1 for name in params if name.endswith(".weight"))
        for i in range(layers):
            h = h @ params[f"layers.{i}.weight"][0].T
            if f"layers.{i}.bias" in params:
                h = h + params[f"layers.{i}.bias"][0]
            if i < layers - 1:
                h = torch.relu(h) if self.lj._act == "relu" else torch.tanh(h)
        return h.squeeze(-1)

    def __call__(self, theta: torch.Tensor) -> torch.Tensor:
        """Cholesky factors ``L`` (G = L Lᵀ) for a batch ``[K, P]``: ``[K, P, P]``."""
        jac = torch.func.vmap(torch.func.jacrev(self.outputs))(theta)  # [K, N, P]
        jw = jac[:, :, self.weights]
        if self.u is None:
            tau = torch.full((theta.shape[0],), self.lj._tau, dtype=theta.dtype)
        else:
            tau = theta[:, self.u].exp()
        g = torch.zeros(theta.shape[0], self.lj.size, self.lj.size, dtype=theta.dtype)
        idx = torch.tensor(self.weights)
        g[:, idx[:, None], idx[None, :]] = tau[:, None, None] * jw.transpose(1, 2) @ jw
        g = g + torch.diag_embed(self.lj._prior_prec.expand_as(theta))
        if self.u is not None:
            g[:, self.u, self.u] = 0.5 * self.lj.num_data + self.lj._b * tau
        return torch.linalg.cholesky(g)


def smmala(lj: FlatLogJoint, start: torch.Tensor, adapt: int, samples: int, seed: int,
           step: float = 0.5, target: float = 0.574):
    """Simplified manifold MALA of every row of ``start`` with :class:`FisherMetric`: the kept
    draws ``[K, S, P]``, the final step size, the mean acceptance while sampling and the
    chain-gradients spent (one value-and-gradient per proposal; the Jacobians are extra, and in
    the CPU seconds)."""
    metric = FisherMetric(lj)
    gen = torch.Generator().manual_seed(seed)
    k, p = start.shape

    def state(t):
        logp, grad = lj.value_and_grad(t)
        chol = metric(t)
        drift = torch.cholesky_solve(grad.unsqueeze(-1), chol).squeeze(-1)  # G⁻¹ ∇log π
        return logp, chol, drift

    def log_q(to, frm, chol, drift, eps):
        """log N(to; frm + eps²/2 G⁻¹∇, eps² G⁻¹) up to a constant shared by both directions."""
        r = (to - frm - 0.5 * eps**2 * drift).unsqueeze(-1)
        z = (chol.transpose(1, 2) @ r).squeeze(-1)  # Lᵀ r: G = L Lᵀ
        return -0.5 * (z * z).sum(-1) / eps**2 + torch.diagonal(chol, dim1=1, dim2=2).log().sum(-1)

    theta = start.clone()
    logp, chol, drift = state(theta)
    log_step, draws, accepts, gradients = math.log(step), [], [], k
    for it in range(adapt + samples):
        eps = math.exp(log_step)
        xi = torch.randn(k, p, 1, dtype=theta.dtype, generator=gen)
        noise = torch.linalg.solve_triangular(chol.transpose(1, 2), xi, upper=True).squeeze(-1)  # L⁻ᵀ ξ
        prop = theta + 0.5 * eps**2 * drift + eps * noise
        logp1, chol1, drift1 = state(prop)
        gradients += k
        log_a = logp1 - logp + log_q(theta, prop, chol1, drift1, eps) - log_q(prop, theta, chol, drift, eps)
        acc = torch.where(torch.isfinite(log_a), log_a.clamp(max=0).exp(), torch.zeros_like(log_a))
        ok = torch.rand(k, generator=gen, dtype=acc.dtype) < acc
        theta = torch.where(ok[:, None], prop, theta)
        logp = torch.where(ok, logp1, logp)
        chol = torch.where(ok[:, None, None], chol1, chol)
        drift = torch.where(ok[:, None], drift1, drift)
        if it < adapt:
            log_step += 2.0 * (float(acc.mean()) - target) / math.sqrt(it + 1)
        else:
            draws.append(theta.clone())
            accepts.append(float(acc.mean()))
    return torch.stack(draws, 1), math.exp(log_step), float(np.mean(accepts)), gradients


def blr_check(seed: int) -> dict:
    """smMALA on Bayesian linear regression (fixed τ): G is the exact posterior precision, so the
    draws' mean and covariance must match the closed form.  z-scores of the mean from each
    coordinate's ESS; the covariance's largest relative error."""
    from pyrobdl.diagnostics import convergence

    d = bayesian_linear_regression(200, 20, 4, prior_scale=1.0, precision=4.0, seed=seed)
    model = pyrobdl.BayesianMLP(4, (), 1, prior=pyrobdl.priors.Gaussian(1.0),
                                likelihood=pyrobdl.likelihoods.Gaussian(4.0))
    lj = FlatLogJoint(model, d.x_train.double(), d.y_train.double())
    start = lj.sample_prior(8, generator=torch.Generator().manual_seed(seed))
    draws, step, accept, _ = smmala(lj, start, 200, 1500, seed)
    # the exact posterior of (w, b) in the layout's order: w (4 weights), then b
    xb = torch.cat([lj.x, torch.ones(lj.x.shape[0], 1, dtype=lj.x.dtype)], 1)
    precision = 4.0 * xb.T @ xb + torch.eye(5, dtype=xb.dtype)
    cov = torch.linalg.inv(precision)
    mean = cov @ (4.0 * xb.T @ lj.y.reshape(-1))
    flat = draws.reshape(-1, 5)
    ess = convergence(draws.numpy())["ess_bulk"]
    z = ((flat.mean(0) - mean) / (cov.diagonal().sqrt() / torch.as_tensor(ess).sqrt())).abs()
    cov_err = float(((torch.cov(flat.T) - cov).abs() / cov.diagonal().sqrt().outer(cov.diagonal().sqrt())).max())
    return {"blr_step": step, "blr_accept": accept, "blr_ess_min": float(ess.min()), "blr_mean_max_abs_z": float(z.max()),
            "blr_cov_max_error_in_sd_units": cov_err}


def learned_precision_check(seed: int) -> dict:
    """smMALA against chees on Bayesian linear regression with a learned noise precision, where
    the Fisher metric changes with τ (so its log-determinant and the reverse proposal matter):
    z-scores of every coordinate's posterior mean (standard errors from both samplers' ESS) and
    the ratio of the posterior standard deviations."""
    import warnings

    from pyrobdl.diagnostics import convergence

    d = bayesian_linear_regression(30, 10, 4, prior_scale=1.0, precision=4.0, seed=seed)
    model = pyrobdl.BayesianMLP(4, (), 1, prior=pyrobdl.priors.Gaussian(1.0),
                                likelihood=pyrobdl.likelihoods.GaussianLearnedPrecision(2.0, 1.0))
    lj = FlatLogJoint(model, d.x_train.double(), d.y_train.double())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning)
        ref = pyrobdl.fit(model, d.x_train.double(), d.y_train.double(), method="chees", num_chains=32,
                          num_warmup=300, num_samples=500, seed=seed, progress=False)
    c, n = ref.num_chains, ref.num_draws
    ref_draws = lj.layout.pack({k: v.reshape(c * n, *v.shape[2:]) for k, v in ref.samples.items()}).view(c, n, -1)
    # warm starts, as on yacht (from a far prior draw MALA can stay put: the move back is improbable)
    start = ref_draws[:8, 0].double().clone()
    draws, step, accept, _ = smmala(lj, start, 300, 2000, seed)
    out = {}
    for name, x in (("chees", ref_draws.double()), ("smmala", draws)):
        out[name] = (x.reshape(-1, x.shape[-1]).mean(0), x.reshape(-1, x.shape[-1]).std(0),
                     torch.as_tensor(convergence(x.numpy())["ess_bulk"]))
    (m1, s1, e1), (m2, s2, e2) = out["chees"], out["smmala"]
    z = (m1 - m2).abs() / torch.sqrt(s1**2 / e1 + s2**2 / e2)
    return {"learned_step": step, "learned_accept": accept, "learned_ess_min": float(e2.min()),
            "learned_mean_max_abs_z": float(z.max()), "learned_sd_ratio_range": [float((s2 / s1).min()),
                                                                                 float((s2 / s1).max())]}


def main() -> None:
    parser = hmc_parser(__doc__.splitlines()[0])
    parser.add_argument("--cert-points", type=int, default=50)
    parser.add_argument("--mala-adapt", type=int, default=300)
    parser.add_argument("--mala-samples", type=int, default=1500)
    parser.add_argument("--skip-hmc", action="store_true")
    parser.add_argument("--geometry-chains", type=int, default=4, help="chains whose Hessians are whitened by G")
    args = parser.parse_args()
    torch.set_num_threads(1)

    check = blr_check(args.seed)
    print(json.dumps(check), flush=True)
    # a wrong proposal density (or metric) shows as a biased mean: |z| of 5 over 5 coordinates is
    # far beyond Monte Carlo error; 0.1 sd is ~4x the covariance's sampling error at this ESS
    assert check["blr_mean_max_abs_z"] < 5 and check["blr_cov_max_error_in_sd_units"] < 0.1, check
    learned = learned_precision_check(args.seed)
    print(json.dumps(learned), flush=True)
    assert learned["learned_mean_max_abs_z"] < 5, learned

    data, lj, _, theta = chees_draws(args, num_warmup=300, num_samples=20)
    c, d = theta.shape[:2]
    start = theta[:, -1].clone()
    # how well G describes the curvature where the chains are: the eigenvalues of L⁻¹ H L⁻ᵀ
    # (H the exact Hessian of -log π, G = L Lᵀ) are all 1 where G is the Hessian
    chol = FisherMetric(lj)(start[: args.geometry_chains])
    for k in range(chol.shape[0]):
        half = torch.linalg.solve_triangular(chol[k], hessian(lj, start[k]), upper=False)
        w = torch.linalg.eigvalsh(torch.linalg.solve_triangular(chol[k], half.T, upper=False))
        print(json.dumps({"chain": k, "whitened_hessian_eig_min": float(w.min()), "eig_max": float(w.max()),
                          "negative": int((w < 0).sum()), "above_4": int((w > 4).sum()),
                          "median": float(w.median())}), flush=True)
    variance = theta.reshape(c * d, -1).var(0)
    runs = {} if args.skip_hmc else {"HMC, diagonal metric": lambda: diagonal_hmc(lj, start, variance, args)}
    runs["smMALA, Fisher metric"] = lambda: smmala(lj, start, args.mala_adapt, args.mala_samples, args.seed + 1)
    report_runs("sampler", runs, lj, data.x_test[: args.cert_points].double())
    print(json.dumps({"dataset": args.dataset, "split": args.split, "chains": c, "P": lj.size,
                      "load_average": os.getloadavg()}))


if __name__ == "__main__":
    main()
