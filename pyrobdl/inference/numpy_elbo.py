"""Pieces of the flat ELBO paths in numpy, for small CPU steps.

At the quickstart's sizes a flat SVI step is dispatch-bound: each of its ~80-180 small tensor
operations costs 1.5-3 CPU µs, the same operation on a numpy array of a few hundred numbers
0.5-1 µs (``comparisons/benchmarks/numpy_kernel.py``; the same reason as
:mod:`pyrobdl.flat.numpy_kernel`, whose size rule these share).  Here, on numpy views of the
tensors' memory, with the torch versions' algebra:

- :func:`lrt_likelihood`: :func:`~pyrobdl.inference.flat_vd._lrt_likelihood` (variational dropout
  and mean field with local reparameterization), 122 against 233 CPU µs a call at gap's shape;
- :func:`normal_loss_and_grad`: :func:`~pyrobdl.inference.flat_elbo.normal_loss_and_grad` for a
  mean-field guide with weight draws and the closed-form KL (no learned precision).

Equal to the torch versions up to float rounding: the flat paths' Pyro-equality tests run on both
(``tests/conftest.py``, fixture ``flat_kernel``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..flat import numpy_kernel as _nk


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
    arr = [t.detach().numpy() if t.is_contiguous() else t.detach().contiguous().numpy() for t in (mu, var, theta)]
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


def _normal_np(npl, lj, loc, rho, eps, prec, kl_const, idx, beta):
    dt = loc.dtype.type
    s, p = eps.shape
    # softplus with torch's threshold: rho itself above 20
    sigma = np.where(rho > dt(20.0), rho, np.log1p(np.exp(np.minimum(rho, dt(20.0)))))
    theta = loc + sigma * eps  # [S, P]
    ll, g = _nk.value_and_grad_np(npl, lj, theta, idx, False)
    kl = dt(kl_const) - np.log(sigma).sum() + dt(0.5) * (prec * (sigma * sigma + loc * loc)).sum()
    d_loc = prec * loc
    d_sigma = prec * sigma - dt(1.0) / sigma
    if s == 1:
        g_loc, g_sigma = g[0], g[0] * eps[0]
    else:
        g_loc, g_sigma = g.mean(0), (g * eps).mean(0)
    if beta != 1.0:
        d_loc, d_sigma, kl = d_loc * dt(beta), d_sigma * dt(beta), kl * dt(beta)
    loss = (kl - ll).mean(dtype=loc.dtype)
    grad = np.empty(2 * p, dtype=loc.dtype)
    grad[:p] = d_loc - g_loc
    grad[p:] = (d_sigma - g_sigma) / (dt(1.0) + np.exp(-rho))  # d sigma / d rho = sigmoid(rho)
    return loss, grad
