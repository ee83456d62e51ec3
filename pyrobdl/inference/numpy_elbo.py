"""Pieces of the flat ELBO paths in numpy, for small CPU steps.

At the quickstart's sizes a flat SVI step is dispatch-bound: each of its ~80-180 small tensor
operations costs 1.5-3 CPU µs, the same operation on a numpy array of a few hundred numbers
0.5-1 µs (``comparisons/benchmarks/numpy_kernel.py``; the same reason as
:mod:`pyrobdl.flat.numpy_kernel`, whose size rule these share).  Here, on numpy views of the
tensors' memory, with the torch versions' algebra:

- :func:`lrt_likelihood`: :func:`~pyrobdl.inference.flat_vd._lrt_likelihood` (variational dropout
  and mean field with local reparameterization), 122 against 233 CPU µs a call at gap's shape;
- :func:`normal_loss_and_grad`: :func:`~pyrobdl.inference.flat_elbo.normal_loss_and_grad` for a
  mean-field guide with weight draws and the closed-form KL (no learned precision);
- :func:`vd_loss_and_grads`: :func:`~pyrobdl.inference.flat_vd.vd_loss_and_grads` (variational
  dropout, every variant and KL, no learned precision);
- :func:`score_loss_and_grad`: the score-function step of
  :class:`~pyrobdl.inference.flat_score_function.FlatScoreFunctionELBO` (BBVI: every baseline, both
  KL treatments, no learned precision).

Equal to the torch versions up to float rounding: the flat paths' Pyro-equality tests run on both
(``tests/conftest.py``, fixture ``flat_kernel``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ..flat import numpy_kernel as _nk
from ..guides import variational_dropout as _vd
from ..guides.variational_dropout import KINGMA_CONSTANTS, LOG_ALPHA_RANGE, MOLCHANOV_CONSTANTS, _EPS


def usable(lj: Any, particles: int, idx: torch.Tensor | None, functional: bool) -> bool:
    """Whether :func:`lrt_likelihood` serves a step: the log joint's numpy rule at ``particles`` rows,
    eagerly (not under ``torch.compile``)."""
    if functional or not lj.numpy_kernel:
        return False
    return _nk.usable_rows(lj, particles, idx)


def lrt_likelihood(plan: Any, lj: Any, mu: torch.Tensor, var: torch.Tensor, theta: torch.Tensor,
                   idx: torch.Tensor | None, noise: list[torch.Tensor], floor: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`~pyrobdl.inference.flat_vd._lrt_likelihood` (same arguments and outputs; ``floor``: its
    variance floor), computed in numpy."""
    npl = _nk.plan_of(lj)
    arr = [t.detach().numpy() for t in (mu, var, theta)]
    eps = [e.detach().numpy() for e in noise]
    i = None if idx is None else idx.numpy()
    with np.errstate(all="ignore"):
        out = _lrt_np(plan, npl, lj, *arr, i, eps, floor)
    return tuple(torch.from_numpy(a) for a in out)


def _lrt_np(plan, npl, lj, mu, var, theta, idx, eps, floor):
    x, y, scale = (npl.x, npl.y, 1.0) if idx is None else (npl.x[idx], npl.y[idx], lj.num_data / idx.shape[0])
    dt = theta.dtype.type
    relu = plan.activation == "relu"
    g_theta, g_mu, g_var = np.zeros_like(theta), np.zeros_like(mu), np.zeros_like(var)
    h = x
    saved = []
    last = len(plan.weights) - 1
    for i, ((wsl, out, inp, ssl), e) in enumerate(zip(plan.weights, eps)):
        w_mu, w_var = mu[wsl].reshape(out, inp), var[ssl].reshape(out, inp)
        h2 = h * h
        mean = h @ w_mu.T
        v = h2 @ w_var.T
        if plan.biases[i] is not None:
            mean = mean + theta[:, None, plan.biases[i]]
        sd = np.sqrt(np.maximum(v, dt(floor)))
        a = mean + sd * e  # [S, B, out]
        # d sd / d v: 1 / (2 sd) where v > floor, 0 where the floor held it
        half_inv_sd = np.where(v > dt(floor), dt(0.5) / sd, dt(0.0))
        saved.append((h, h2, half_inv_sd))
        if i < last:
            h = np.maximum(a, dt(0.0)) if relu else np.tanh(a)
    ll, g, du = _nk.output_log_lik(npl, lj, a, y, theta, scale)
    if du is not None:
        g_theta[:, npl.u] = du
    for i in range(last, -1, -1):
        wsl, out, inp, ssl = plan.weights[i]
        h, h2, half_inv_sd = saved[i]
        gv = g * eps[i] * half_inv_sd  # d/dv, [S, B, out]
        if h.ndim == 2:  # the first layer: the inputs are shared by the particles
            g_mu[wsl] = (h.T @ g.sum(0)).T.reshape(-1)
            g_var[ssl] = (h2.T @ gv.sum(0)).T.reshape(-1)
        else:
            g_mu[wsl] = (g.reshape(-1, out).T @ h.reshape(-1, inp)).reshape(-1)
            g_var[ssl] = (gv.reshape(-1, out).T @ h2.reshape(-1, inp)).reshape(-1)
        if plan.biases[i] is not None:
            g_theta[:, plan.biases[i]] = g.sum(1)
        if i > 0:
            gh = g @ mu[wsl].reshape(out, inp) + dt(2.0) * (gv @ var[ssl].reshape(out, inp)) * h
            g = gh * (h > 0) if relu else gh * (dt(1.0) - h2)
    return ll, g_mu, g_var, g_theta


def normal_usable(lj: Any, eps: torch.Tensor, kl_terms: tuple, subsample: torch.Tensor | None, beta: Any,
                  preactivations: Any, functional: bool) -> bool:
    """Whether :func:`normal_loss_and_grad` serves a mean-field step: weight draws (no local
    reparameterization), the closed-form KL, no learned precision, a number as the KL weight, and the
    log joint's numpy rule at the step's particles."""
    return (preactivations is None and not functional and kl_terms[2] and lj.precision_index is None
            and isinstance(beta, (int, float)) and usable(lj, eps.shape[0], subsample, False))


def normal_loss_and_grad(lj: Any, kl_terms: tuple, loc: torch.Tensor, rho: torch.Tensor, eps: torch.Tensor,
                         subsample: torch.Tensor | None, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~pyrobdl.inference.flat_elbo.normal_loss_and_grad` (same arguments and outputs) where
    :func:`normal_usable` holds, computed in numpy."""
    npl = _nk.plan_of(lj)
    prec, kl_const, _ = kl_terms
    mu, r, e, pr = (t.detach().numpy() for t in (loc, rho, eps, prec))
    idx = None if subsample is None else subsample.numpy()
    with np.errstate(all="ignore"):
        loss, grad = _normal_np(npl, lj, mu, r, e, pr, kl_const, idx, beta)
    return torch.from_numpy(np.asarray(loss)), torch.from_numpy(grad)


def _normal_np(npl, lj, loc, rho, eps, prec, kl_const, idx, beta, lrt=None):
    """The mean-field step on arrays; ``lrt``: (plan, pre-activation noise, variance floor) with local
    reparameterization (:func:`~pyrobdl.inference.flat_elbo.normal_loss_and_grad`'s ``plan`` and
    ``preactivations``)."""
    dt = loc.dtype.type
    s, p = eps.shape
    sigma = _softplus(rho)
    theta = loc + sigma * eps  # [S, P]
    if lrt is None:
        ll, g = _nk.value_and_grad_np(npl, lj, theta, idx, False)
    else:  # the weights reach the likelihood through sampled pre-activations; g is zero at them
        ll, g_mu, g_var, g = _lrt_np(lrt[0], npl, lj, loc, sigma * sigma, theta, idx, lrt[1], lrt[2])
    kl = dt(kl_const) - np.log(sigma).sum() + dt(0.5) * (prec * (sigma * sigma + loc * loc)).sum()
    d_loc = prec * loc
    d_sigma = prec * sigma - dt(1.0) / sigma
    if npl.learned:  # Monte Carlo for the learned precision u = log tau (flat_elbo._normal_kl)
        u = npl.u
        e = eps[:, u]
        lp, gp = _nk.precision_log_prior(lj, theta[:, u], dt)
        kl = kl - dt(0.5) * e * e - dt(_HALF_LOG_2PI) - lp  # [S]
        d_loc[u] -= _mean0(gp, s, dt)
        d_sigma[u] -= _mean0(gp * e, s, dt)
    if s == 1:
        g_loc, g_sigma = g[0], g[0] * eps[0]
    else:
        g_loc, g_sigma = _mean0(g, s, dt), _mean0(g * eps, s, dt)
    if lrt is not None:
        g_loc = g_loc + dt(1.0 / s) * g_mu
        g_sigma = g_sigma + dt(2.0 / s) * (sigma * g_var)
    if beta != 1.0:
        d_loc, d_sigma, kl = d_loc * dt(beta), d_sigma * dt(beta), kl * dt(beta)
    loss = _mean0(kl - ll, s, dt)
    grad = np.empty(2 * p, dtype=loc.dtype)
    grad[:p] = d_loc - g_loc
    grad[p:] = (d_sigma - g_sigma) / (dt(1.0) + np.exp(-rho))  # d sigma / d rho = sigmoid(rho)
    return loss, grad


class NumpyStep:
    """A whole small flat SVI step on the CPU in numpy: mean field, point mass, MC and variational dropout.

    :meth:`FlatELBO.loss_and_grad <pyrobdl.inference.flat_elbo.FlatELBO.loss_and_grad>` calls it
    where :meth:`serves` holds, in place of its general path (inference mode, the family's dispatch,
    the per-step checks of :func:`normal_usable` / :func:`step_usable`, tensor-to-array
    conversions): at the SVI benchmark's batch 32 those layers cost about as much as a mean-field
    step's arithmetic.  Made once per log joint and packed vector, it keeps numpy views of the
    parameters (the optimizer updates them in place); each step it draws the noise with the general
    path's own function (``draw``: the same draws from the same generator) and runs the numpy
    function the general path would (:func:`_normal_np`, :func:`_vd_np`: the same floats) or
    :func:`_delta_np` (the same gradient; the loss summed in numpy), :func:`_dropout_np` (MC dropout:
    the same floats for Bernoulli rows), or, with local reparameterization, :func:`_normal_np` with
    :func:`_lrt_np` (the KL and chain rule in numpy: float rounding).  A learned noise precision is
    served for mean field with weight draws and for a point mass (its Gamma prior in numpy, where the
    general path is torch's: float rounding).  Above the log joint's numpy
    size rule the general path runs (the torch kernel with numpy arithmetic around it measured
    slower than with torch's in a fit, 363-402 against 347-382 CPU µs a mean-field step at full
    batch on the SVI benchmark; docs/benchmarks/svi.md).

    Parameters
    ----------
    elbo : FlatELBO
        Its log joint must be built (``elbo._lj``).
    draw : callable
        ``draw(batch)``: one step's noise as the general path draws it (standard normals ``[S, P]``
        for mean field; the dicts of :func:`~pyrobdl.inference.flat_vd.normal_lrt_noise`,
        :func:`~pyrobdl.inference.flat_vd.vd_noise` and
        :func:`~pyrobdl.inference.flat_dropout.dropout_noise`); not called for a point mass.
    var_floor : float
        The floor of the locally reparameterized variances (variational dropout, mean field with
        local reparameterization).
    """

    def __init__(self, elbo: Any, draw: Any, var_floor: float = 0.0) -> None:
        lj = self.lj = elbo._lj
        (self.x, self.y), self.params = elbo._data, elbo._params  # the tensors the log joint was made for
        self.family, self.draw, self.floor = elbo.family, draw, var_floor
        self.particles, self.analytic = elbo.num_particles, elbo.analytic_kl
        self.rows = 1 if self.family == "delta" else elbo.num_particles
        # a Monte Carlo KL of mean field or MC dropout keeps the general path, and so does a learned
        # precision but for mean field with weight draws and a point mass
        learned_ok = lj.precision_index is None or (self.family == "delta" or (self.family == "normal"
                                                                                and elbo._plan is None))
        family_ok = self.family in ("delta", "variational_dropout") or (
            self.family in ("normal", "dropout") and elbo.analytic_kl)
        self.ok = family_ok and learned_ok and lj.device.type == "cpu" and lj.dtype in (torch.float32, torch.float64)
        if not self.ok:
            return
        self.npl = _nk.plan_of(lj)
        self.vector = elbo._params["vector"]
        self.loc = elbo._params["loc"].detach().numpy()
        self.full = _nk.usable_rows(lj, self.rows, None)
        if self.family == "variational_dropout":
            self.guide, self.plan = elbo.guide, elbo._plan
            self.spread = elbo._params["spread"].detach().numpy()
            self.index = (elbo._plan.sparse.numpy(), elbo._plan.other.numpy())
        elif self.family == "normal":
            self.rho = elbo._params["scale"].detach().numpy()
            self.prec, self.kl_const = elbo._prec.numpy(), elbo._kl_const
            self.plan = elbo._plan  # NormalLRTPlan with local reparameterization, else None
        elif self.family == "dropout":
            plan = elbo._plan
            self.guide, self.layers = elbo.guide, plan.layers
            self.arrays = (plan.col.numpy(), plan.keep.numpy(), plan.alpha.numpy(), plan.prec.numpy(), plan.kl_const,
                           plan.num_units)

    def current(self, elbo: Any) -> bool:
        """Whether this step was made for ``elbo``'s present log joint, parameters and settings."""
        return (elbo._lj is self.lj and elbo._params is self.params and elbo.num_particles == self.particles
                and elbo.analytic_kl == self.analytic)

    def serves(self, elbo: Any, x: torch.Tensor, y: torch.Tensor, subsample: torch.Tensor | None) -> bool:
        """Whether :meth:`run` computes this step: the same data, log joint and parameters as when it was
        made (and its particles and KL treatment), the log joint's numpy rule
        (:func:`~pyrobdl.flat.numpy_kernel.usable_rows`) at this minibatch, and a number as the KL weight."""
        if not (self.ok and x is self.x and y is self.y and self.current(elbo) and self.lj.numpy_kernel):
            return False
        beta = elbo.kl_weight
        if not isinstance(beta, (int, float)) or isinstance(beta, bool):
            return False
        if subsample is None:
            return self.full
        return subsample.dim() == 1 and _nk.fits(self.lj, self.rows, subsample.shape[0])

    def run(self, elbo: Any, subsample: torch.Tensor | None) -> torch.Tensor:
        """The negative ELBO (a 0-d tensor); sets the packed vector's ``.grad``."""
        idx = None if subsample is None else subsample.numpy()
        beta, lj = elbo.kl_weight, self.lj
        if self.family == "delta":
            with np.errstate(all="ignore"):
                loss, grad = _delta_np(self.npl, lj, self.loc, idx, beta)
        elif self.family == "normal" and self.plan is None:
            eps = self.draw(None).numpy()
            with np.errstate(all="ignore"):
                loss, grad = _normal_np(self.npl, lj, self.loc, self.rho, eps, self.prec, self.kl_const, idx, beta)
        elif self.family == "normal":  # local reparameterization
            noise = self.draw(lj.num_data if subsample is None else subsample.shape[-1])
            pre = [e.numpy() for e in noise["preactivations"]]
            with np.errstate(all="ignore"):
                loss, grad = _normal_np(self.npl, lj, self.loc, self.rho, noise["eps"].numpy(), self.prec,
                                        self.kl_const, idx, beta, (self.plan, pre, self.floor))
        elif self.family == "dropout":
            noise = self.draw(None)
            with np.errstate(all="ignore"):
                loss, grad = _dropout_np(self.npl, lj, self.loc, noise["multipliers"].numpy(), noise["eps"].numpy(),
                                         idx, beta, self.guide.sigma, self.guide.kind, self.layers, *self.arrays)
        else:
            noise = self.draw(lj.num_data if subsample is None else subsample.shape[-1])
            pre = [e.numpy() for e in noise["preactivations"]] if "preactivations" in noise else None
            with np.errstate(all="ignore"):
                loss, grad = _vd_np(self.guide, self.plan, self.npl, lj, self.loc, self.spread, noise["eps"].numpy(),
                                    pre, idx, self.analytic, beta, self.floor, *self.index)
        self.vector.grad = torch.from_numpy(grad)
        return torch.from_numpy(np.asarray(loss))


def _dropout_np(npl, lj, m, mult, eps, idx, beta, sigma, kind, layers, col, keep, alpha, prec, kl_const, units):
    """:func:`~pyrobdl.inference.flat_dropout.dropout_loss_and_grads` with the closed-form KL and no learned
    precision (then the means ``m`` are the whole layout), on arrays; the plan's tensors as arrays."""
    dt = m.dtype.type
    s, p_w = eps.shape[0], m.shape[0]
    c = np.concatenate([mult, np.ones((s, 1), dtype=m.dtype)], 1)[:, col]  # [S, P]: each coordinate's multiplier
    theta = eps * dt(sigma) + c * m
    ll, g = _nk.value_and_grad_np(npl, lj, theta, idx, False)
    # flat_dropout._analytic_kl
    kl = dt(kl_const - p_w * math.log(sigma)) + dt(0.5) * (prec * (dt(sigma * sigma) + keep * m * m)).sum()
    d_m = prec * keep * m
    if kind == "gaussian":
        norm = np.zeros(units + 1, dtype=m.dtype)
        np.add.at(norm, col, m * m)
        big = dt(sigma * sigma) + alpha * norm[col]  # sigma^2 + alpha |m_j|^2, per coordinate
        for _, _, inp, p, start in layers:
            kl = kl - dt(0.5) * np.log1p(dt(p / (1.0 - p)) * norm[start : start + inp] / dt(sigma * sigma)).sum()
        d_m = d_m - alpha * m / big
    grad = d_m * dt(beta) - _mean0(g * c, s, dt)
    return _mean0(dt(beta) * kl - ll, s, dt), grad


def _delta_np(npl, lj, theta, idx, beta):
    """:func:`~pyrobdl.inference.flat_elbo.delta_loss_and_grad` on an array."""
    dt = theta.dtype.type
    ll, g = _nk.value_and_grad_np(npl, lj, theta[None], idx, False)
    gp = theta * npl.neg_prior_prec  # FlatLogJoint.log_prior
    lp = (theta * gp).sum() * dt(0.5) + dt(lj._prior_const)
    if npl.learned:  # the precision's Gamma prior of tau itself: a point mass has no log-Jacobian u
        u = npl.u
        value, slope = _nk.precision_log_prior(lj, theta[u], dt)
        lp = lp + (value - theta[u])
        gp[u] = slope - dt(1.0)
    if beta != 1.0:
        lp, gp = lp * dt(beta), gp * dt(beta)
    return -(ll[0] + lp), -(gp + g[0])


def step_usable(lj: Any, eps: torch.Tensor, idx: torch.Tensor | None, beta: Any, functional: bool) -> bool:
    """Whether :func:`vd_loss_and_grads` (a variational-dropout step) or :func:`score_loss_and_grad` (a BBVI
    step) serves a step of noise ``eps`` ``[particles, ...]``: no learned precision, a number as the KL
    weight ``beta``, the log joint's numpy rule at the step's particles, eagerly."""
    return step_usable_rows(lj, eps.shape[0], idx, beta, functional)


def step_usable_rows(lj: Any, rows: int, idx: torch.Tensor | None, beta: Any, functional: bool = False) -> bool:
    """:func:`step_usable` for noise of ``rows`` particles."""
    return (lj.precision_index is None and isinstance(beta, (int, float)) and not isinstance(beta, bool)
            and usable(lj, rows, idx, functional))


def vd_loss_and_grads(guide: Any, plan: Any, lj: Any, loc: torch.Tensor, spread: torch.Tensor, noise: dict,
                      idx: torch.Tensor | None, analytic_kl: bool, beta: float, floor: float
                      ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """:func:`~pyrobdl.inference.flat_vd.vd_loss_and_grads` (same arguments and outputs; ``floor``: the
    locally reparameterized variances' floor) where :func:`step_usable` holds, computed in numpy."""
    npl = _nk.plan_of(lj)
    arr = [t.detach().numpy() for t in (loc, spread, noise["eps"])]
    pre = [e.detach().numpy() for e in noise["preactivations"]] if guide.local_reparameterization else None
    index = (plan.sparse.numpy(), plan.other.numpy())
    with np.errstate(all="ignore"):
        loss, grad = _vd_np(guide, plan, npl, lj, *arr, pre, None if idx is None else idx.numpy(), analytic_kl,
                            beta, floor, *index)
    return torch.from_numpy(np.asarray(loss)), [torch.from_numpy(grad)]


def _vd_np(guide, plan, npl, lj, loc, spread, eps, pre, idx, analytic, beta, floor, sparse, other):
    dt = loc.dtype.type
    s, size = eps.shape
    ps = sparse.size
    # the scales (flat_vd._vd_scales)
    theta_s = loc[sparse]
    log_sigma2 = spread[:ps]
    log_theta2 = np.log(theta_s * theta_s + dt(_EPS))
    low, high = LOG_ALPHA_RANGE
    capped = None
    if not guide.sparse:  # Kingma et al.: the variance of q itself is capped at theta^2
        capped = log_sigma2 >= log_theta2
        log_sigma2 = np.minimum(log_sigma2, log_theta2)
        high = 0.0
    raw = log_sigma2 - log_theta2
    sig_s = np.exp(dt(0.5) * log_sigma2)
    sigma = np.zeros_like(loc)
    sigma[sparse] = sig_s
    rho_o = spread[ps:]
    if other.size:
        sigma[other] = _softplus(rho_o)
    theta = loc + sigma * eps  # [S, P]; point sites have sigma = 0
    if pre is not None:
        ll, g_mu, g_var, g = _lrt_np(plan, npl, lj, loc, sig_s * sig_s, theta, idx, pre, floor)
        g_mu, g_var = g_mu / dt(s), g_var / dt(s)
    else:
        ll, g = _nk.value_and_grad_np(npl, lj, theta, idx, False)
    G = -g  # d(loss)/dw per particle and coordinate
    d_sig = np.zeros_like(sig_s)
    w_s, e_s = theta[:, sparse], eps[:, sparse]
    if analytic:
        kl_w, slope = _kl_and_slope(np.clip(raw, dt(low), dt(high)), guide.approximation, dt)
        kl = np.full(s, kl_w.sum(), dtype=loc.dtype)
        d_la = slope * dt(beta) * ((raw >= dt(low)) & (raw <= dt(high)))  # the clip's derivative
    else:
        kl = (dt(-0.5) * e_s * e_s - dt(_HALF_LOG_2PI) + np.log(np.abs(w_s))).sum(-1) - log_sigma2.sum() * dt(0.5)
        G[:, sparse] += dt(beta) / w_s
        d_sig = d_sig - dt(beta) / sig_s
        d_la = None
    # the chain rule to the parameters (flat_vd._vd_chain_rule)
    grad_loc = _mean0(G, s, dt)
    grad_sig = d_sig + _mean0(G[:, sparse] * e_s, s, dt)
    if pre is not None:
        grad_loc -= g_mu
        grad_sig = grad_sig - dt(2.0) * sig_s * g_var
    d_ls = dt(0.5) * sig_s * grad_sig
    grad_theta_s = grad_loc[sparse]
    dlt2 = dt(2.0) * theta_s / (theta_s * theta_s + dt(_EPS))
    if d_la is not None:
        d_ls = d_ls + d_la
        grad_theta_s = grad_theta_s - d_la * dlt2
    if capped is not None:  # the capped log sigma^2 is log theta^2: its derivative goes to theta
        grad_theta_s = grad_theta_s + np.where(capped, d_ls * dlt2, dt(0.0))
        d_ls = np.where(capped, dt(0.0), d_ls)
    grad_loc[sparse] = grad_theta_s
    grad = np.empty(size + spread.shape[0], dtype=loc.dtype)
    grad[:size] = grad_loc
    grad[size : size + ps] = d_ls
    if other.size:  # the other sites' softplus scales
        grad[size + ps :] = _mean0(G[:, other] * eps[:, other], s, dt) / (dt(1.0) + np.exp(-rho_o))
    return _mean0(kl * dt(beta) - ll, s, dt), grad


def _kl_and_slope(log_alpha: np.ndarray, approximation: str, dt: Any) -> tuple[np.ndarray, np.ndarray]:
    """:func:`~pyrobdl.inference.flat_vd._kl_and_slope` on an array: the KL of
    :func:`~pyrobdl.guides.variational_dropout.kl_log_uniform` and its derivative in log alpha, written out.

    While ``kl_log_uniform`` is pyrobdl's own, its formulas are evaluated here in numpy (the same
    algebra, sharing the slope's exponentials: a few numpy operations on a few hundred numbers
    instead of a round trip through torch's); a replaced ``kl_log_uniform`` (the one function that
    ``register_kl`` and every ELBO evaluate) gives the value, called on a tensor."""
    if approximation == "molchanov":
        k1, k2, k3 = MOLCHANOV_CONSTANTS
        t = dt(1.0) / (dt(1.0) + np.exp(-(dt(k2) + dt(k3) * log_alpha)))
        kl = (dt(k1) - dt(k1) * t) + dt(0.5) * np.log1p(np.exp(-log_alpha))
        slope = dt(-k1 * k3) * t * (dt(1.0) - t) - dt(0.5) / (dt(1.0) + np.exp(log_alpha))
    elif approximation == "kingma":
        c0, c1, c2, c3 = KINGMA_CONSTANTS
        a = np.exp(log_alpha)
        kl = -(dt(c0) + dt(0.5) * log_alpha + a * (dt(c1) + a * (dt(c2) + a * dt(c3))))
        slope = -(dt(0.5) + a * (dt(c1) + a * (dt(2.0 * c2) + a * dt(3.0 * c3))))
    else:  # "ard" (the guide refused any other approximation)
        kl = dt(0.5) * np.log1p(np.exp(-log_alpha))
        slope = dt(-0.5) / (dt(1.0) + np.exp(log_alpha))
    if _vd.kl_log_uniform is not _KL_LOG_UNIFORM:
        kl = _vd.kl_log_uniform(torch.from_numpy(log_alpha), approximation).numpy()
    return kl, slope


def score_loss_and_grad(est: Any, lj: Any, vector: torch.Tensor, eps: torch.Tensor, subsample: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`FlatScoreFunctionELBO._loss_and_grads
    <pyrobdl.inference.flat_score_function.FlatScoreFunctionELBO>`'s loss and gradient (the packed
    vector ``[loc, rho]``, standard normals ``eps`` ``[P, D]``) where :func:`step_usable` holds, in numpy;
    a decaying-average baseline's state is kept on ``est`` as the torch path keeps it."""
    npl = _nk.plan_of(lj)
    v, e = vector.detach().numpy(), eps.detach().numpy()
    idx = None if subsample is None else subsample.numpy()
    old = est._flat_average
    arrays = est._numpy_arrays
    if arrays is None or arrays[0] is not lj:  # the estimator's per-coordinate tensors as arrays, once per log joint
        arrays = est._numpy_arrays = (lj, lj._prior_prec.numpy(), est._half_log_prec.numpy(), est._own_sites.numpy(),
                                      est._index.numpy(), est._gaussian.numpy())
    with np.errstate(all="ignore"):
        loss, grad, average = _score_np(est, npl, lj, v, e, idx, None if old is None else old.numpy(), *arrays[1:])
    if average is not None:
        est._flat_average = torch.from_numpy(average)
    return torch.from_numpy(np.asarray(loss)), torch.from_numpy(grad)


def _score_np(est, npl, lj, v, eps, idx, old, prec, half_log_prec, own_sites, index, gaussian):
    dt = v.dtype.type
    p, d = eps.shape
    loc, rho = v[:d], v[d:]
    sigma = _softplus(rho)
    theta = eps * sigma + loc  # [P, D]
    x, y, scale = (npl.x, npl.y, 1.0) if idx is None else (npl.x[idx], npl.y[idx], lj.num_data / idx.shape[0])
    ll = _nk.output_log_lik(npl, lj, _nk._forward(npl, theta, x, p)[2], y, theta, scale)[0]  # [P]
    # log p - log q per coordinate (Gaussian prior): -prec theta^2/2 + eps^2/2 + log sigma + log(prec)/2
    elem = (theta * theta) * (dt(-0.5) * prec) + dt(0.5) * (eps * eps) + (np.log(sigma) + half_log_prec)
    own = np.add.reduceat(elem, est._site_starts, axis=1) * own_sites  # [P, S]
    beta = est.kl_weight
    if beta != 1.0:
        own = own * dt(beta)
    whole = own.sum(1) + ll
    cost = own + ll[:, None]
    average = None
    if est.baseline == "leave_one_out":
        cost = cost - (cost.sum(0) - cost) / dt(p - 1)
    elif est.baseline == "vargrad":
        cost = np.broadcast_to(((whole - whole.mean()) * dt(p / (p - 1)))[:, None], cost.shape)
    elif est.baseline == "decaying_average":
        if old is None or old.shape != cost.shape:
            old = np.zeros_like(cost)
        average = dt(est.beta) * old + dt(1 - est.beta) * cost
        cost = cost - old
    c = cost[:, index]  # [P, D]
    inv = (dt(1.0) / sigma) * dt(-1.0 / p)
    g_loc = (c * eps).sum(0) * inv
    g_sigma = (c * (eps * eps - dt(1.0))).sum(0) * inv
    kl = 0.0
    if est.analytic_kl:
        mask = gaussian
        kl = (dt(est._kl_const) - np.where(mask, np.log(sigma), dt(0.0)).sum()
              + dt(0.5) * (prec * (sigma * sigma + loc * loc)).sum()) * dt(beta)
        g_loc = g_loc + prec * loc * dt(beta)
        g_sigma = g_sigma + np.where(mask, prec * sigma - dt(1.0) / sigma, dt(0.0)) * dt(beta)
    grad = np.concatenate([g_loc, g_sigma / (dt(1.0) + np.exp(-rho))])  # d sigma / d rho = sigmoid(rho)
    return dt(kl) - whole.mean(), grad, average


def _mean0(a: np.ndarray, s: int, dt: Any) -> np.ndarray:
    """``a.mean(0)`` of ``a`` ``[S, ...]`` (S = ``s``, dtype ``dt``), the same floats (float32 / 64 sums
    alike, and a division by S correctly rounded either way) without ``np.mean``'s ~3-5 µs of Python
    a call, several a step; a fresh array even for S = 1."""
    total = a.sum(0)
    return total if s == 1 else total / dt(s)


def _softplus(x: np.ndarray) -> np.ndarray:
    """torch's softplus: ``log(1 + exp(x))``, and ``x`` itself above 20."""
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


_HALF_LOG_2PI = 0.5 * float(np.log(2.0 * np.pi))
#: pyrobdl's own KL formula, told apart from a replacement (see :func:`_kl_and_slope`).
_KL_LOG_UNIFORM = _vd.kl_log_uniform
