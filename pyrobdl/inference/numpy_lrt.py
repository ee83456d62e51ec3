"""The locally reparameterized likelihood of :mod:`pyrobdl.inference.flat_vd` in numpy, for small CPU steps.

:func:`~pyrobdl.inference.flat_vd._lrt_likelihood` (variational dropout and mean field with local
reparameterization) is ~100 small tensor operations a step at the quickstart's sizes, each
dispatch-bound; the same algebra on numpy arrays (views of the tensors' memory) costs a third to
a half of the CPU time (``comparisons/benchmarks/numpy_kernel.py``, the same reason as
:mod:`pyrobdl.flat.numpy_kernel`, whose size rule it shares).  Equal to the torch version up to
float rounding (``tests/test_flat_vd.py`` runs its tests on both).
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
    npl = lj._numpy_plan
    if npl is None:
        npl = lj._numpy_plan = _nk.NumpyPlan(lj)
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
    ll, g, du = _output_log_lik(npl, lj, a, y, theta, scale)
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


def _output_log_lik(npl, lj, f, y, theta, scale):
    """:meth:`FlatLogJoint.output_log_lik_and_grad <pyrobdl.flat.FlatLogJoint.output_log_lik_and_grad>`
    on arrays: the scaled log-likelihood ``[S]``, its derivative in ``f`` and in a learned precision's u."""
    dt = theta.dtype.type
    s, b = f.shape[0], f.shape[1]
    if npl.classification:
        z = f - f.max(-1, keepdims=True)
        e = np.exp(z)
        tot = e.sum(-1, keepdims=True)
        rows, points = np.ogrid[:s, :b]
        ll = (z[rows, points, y] - np.log(tot[..., 0])).sum(1)
        gf = -(e / tot)
        gf[rows, points, y] += dt(1.0)
        return dt(scale) * ll, gf * dt(scale), None
    r = y - f
    sq = (r * r).sum((1, 2))
    if npl.learned:
        u = theta[:, npl.u]
        tau = np.exp(u)
        m = r.shape[1] * r.shape[2]
        ll = dt(0.5 * m) * (u - dt(_nk._LOG_2PI)) - dt(0.5) * tau * sq
        du = dt(scale) * (dt(0.5 * m) - dt(0.5) * tau * sq)
        return dt(scale) * ll, r * (dt(scale) * tau)[:, None, None], du
    ll = dt(b * lj._lik_const_point) - dt(0.5 * lj._tau) * sq
    return dt(scale) * ll, r * dt(scale * lj._tau), None
