r"""MC dropout on the flat SVI hot path (variational dropout and local reparameterization:
:mod:`pyrobdl.inference.flat_vd`).

Companions of :class:`~pyrobdl.inference.flat_elbo.FlatELBO` (which dispatches here by the
guide's :meth:`~pyrobdl.guides.BNNGuide.flat_family`).  Each function takes the packed
parameters, the noise of one step and the flat log joint, and returns the negative ELBO and its
exact gradient in every packed vector, with no autograd.  The objective is, in each case, the
one Pyro's ``Trace_ELBO`` (``kl="monte_carlo"``) or ``TraceMeanField_ELBO`` (``kl="analytic"``)
computes on the unchanged guide; ``tests/test_flat_dropout.py`` holds them equal for the same
draws.

MC dropout (:class:`~pyrobdl.guides.Dropout`, Gal & Ghahramani 2016)
    A weight is :math:`w_{oj} = \xi_j m_{oj} + \sigma\varepsilon_{oj}` with one multiplier
    :math:`\xi_j` per input unit (Bernoulli keep mask, or :math:`\mathcal N(1, \alpha)`), a bias
    :math:`b = m_b + \sigma\varepsilon`.  With :math:`c` the multiplier of a coordinate (1 for a
    bias) the path derivative of the likelihood is :math:`c\,\partial_w`.  Analytic KLs to
    :math:`\mathcal N(0, s^2)` (:math:`\pi = 1/s^2`):

    * Bernoulli rows (Gal's large-K form): :math:`\sum \tfrac{\pi}{2}((1-p)m^2 + \sigma^2)
      - \tfrac12\log\pi - \log\sigma - \tfrac12` per weight, minus :math:`n_{\text{in}}
      \mathcal H(p)` per layer; :math:`\partial_m = (1-p)\pi m`;
    * Gaussian rows (exact): :math:`\sum \tfrac{\pi}{2}(\sigma^2 + (1+\alpha)m^2) - \tfrac12\log\pi
      - \log\sigma - \tfrac12` per weight, minus :math:`\tfrac12\log(1 + \alpha\lVert m_j\rVert^2/\sigma^2)`
      per column; :math:`\partial_m = (1+\alpha)\pi m - \alpha m/(\sigma^2 + \alpha\lVert m_j\rVert^2)`;
    * biases: the Gaussian KL, :math:`\partial_m = \pi m`.

    Monte Carlo (Bernoulli rows only): :math:`\log q(w) - \log p(w)` with the exact mixture
    density; with responsibilities :math:`r_k, r_d` of the kept and dropped components and
    :math:`z_k = (w_j - m_j)/\sigma`, :math:`z_d = w_j/\sigma`, the total derivative of
    :math:`\log q(w(m))` in :math:`m_j` is :math:`-[r_k(\xi_j - 1)z_k + r_d\,\xi_j z_d]/\sigma`.
    A Gaussian-rows guide with a Monte Carlo KL stays on the distribution path.

A learned noise precision has the mean-field family of
:class:`~pyrobdl.guides.MeanField` and a Monte Carlo KL, as on the distribution path.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .._grad import no_grad
from ..flat import FlatLogJoint

__all__ = ["DropoutPlan", "dropout_loss_and_grads", "dropout_noise"]

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


# ------------------------------------------------------------------------------------- helpers
def _precision_terms(
    lj: FlatLogJoint, u: int, loc_u: torch.Tensor, rho_u: torch.Tensor, eps: torch.Tensor, theta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Monte Carlo KL of the learned precision's log-normal ``[S]`` and its total derivatives in
    (loc, sigma) of :math:`u = \log\tau`, averaged over particles (the likelihood not included)."""
    e = eps[:, u]
    sigma = torch.nn.functional.softplus(rho_u)
    lp, gp = lj.precision_log_prior(theta)  # Gamma + log-Jacobian, and d/du
    kl = -0.5 * e * e - _HALF_LOG_2PI - sigma.log() - lp
    return kl, -gp.mean(), -(gp * e).mean() - sigma.reciprocal()


class DropoutPlan:
    """Index tensors of the MC dropout family over the flat layout (built once per data device).

    Attributes
    ----------
    col : torch.Tensor
        ``[P_w]``: for each weight/bias coordinate, its input unit's index in the multipliers
        ``[S, U]`` (``U`` = all layers' inputs), and ``U`` for a bias (an appended column of ones).
    keep : torch.Tensor
        ``[P_w]``: the factor of :math:`\\pi m^2` in the analytic KL ((1-p) or 1+alpha for
        weights, 1 for biases).
    alpha : torch.Tensor
        ``[P_w]``: the multiplier variance of a Gaussian-rows weight (0 for biases and
        Bernoulli rows).
    layers : list of (slice, int, int, float, int)
        Per weight site: its coordinates, (out, in), drop probability, first unit index.
    """

    def __init__(self, guide: Any, lj: FlatLogJoint) -> None:
        layout, dtype, device = lj.layout, lj.dtype, lj.device
        p_w = guide.packed("params").numel()
        col = torch.empty(p_w, dtype=torch.long)
        keep = torch.ones(p_w, dtype=torch.float64)
        alpha = torch.zeros(p_w, dtype=torch.float64)
        self.layers = []
        units = 0
        for s in guide.site_specs:
            if s.name not in guide._layout:
                continue
            sl = layout[s.name]
            layer, kind = guide._layout[s.name]
            if kind == "weight":
                out, inp = s.shape
                p = guide.p[layer]
                col[sl.start : sl.stop] = (torch.arange(inp) + units).repeat(out)
                a = p / (1.0 - p)
                keep[sl.start : sl.stop] = (1.0 - p) if guide.kind == "bernoulli" else 1.0 + a
                if guide.kind == "gaussian":
                    alpha[sl.start : sl.stop] = a
                self.layers.append((slice(sl.start, sl.stop), out, inp, p, units))
                units += inp
            else:
                col[sl.start : sl.stop] = -1
        col[col < 0] = units
        self.num_units = units
        # the bias coordinates as indices (a boolean mask would sync a GPU at every step)
        self.bias_index = (col == units).nonzero().squeeze(1).to(device)
        self.num_bias = int((col == units).sum())
        self.col = col.to(device)
        self.keep = keep.to(device=device, dtype=dtype)
        self.alpha = alpha.to(device=device, dtype=dtype)
        self.prec = lj._prior_prec[:p_w]
        # the KL's constant: -1/2 log(prec) - 1/2 per coordinate, the entropy of the masks
        const = float((-0.5 * self.prec.log() - 0.5).sum())
        for _, _, inp, p, _ in self.layers:
            if guide.kind == "bernoulli":
                const -= inp * -(p * math.log(p) + (1.0 - p) * math.log1p(-p))
        self.kl_const = const


def dropout_noise(guide: Any, plan: DropoutPlan, num_particles: int, lj: FlatLogJoint) -> dict:
    """One step's draws: multipliers ``[S, U]`` (keep masks or N(1, alpha)) and standard normals ``[S, P]``.

    Drawn site by site in the order and shapes of the guide's own ``rsample`` calls (a weight's
    multipliers, then its noise; a bias's noise; the precision's), so a seed gives the flat path
    the very draws of :class:`~pyrobdl.inference.DirectELBO` (``tests/test_dropout.py`` relies on
    it to compare with a plain dropout loss).
    """
    kw = {"dtype": lj.dtype, "device": lj.device}
    s = num_particles
    mults, parts = [], []
    layers = iter(plan.layers)
    for site in lj.layout.sites:
        if site.name in guide._layout and guide._layout[site.name][1] == "weight":
            _, _, inp, p, _ = next(layers)
            if guide.kind == "bernoulli":
                mults.append(torch.bernoulli(torch.full((s, inp), 1.0 - p, **kw)))
            else:
                mults.append(1.0 + math.sqrt(p / (1.0 - p)) * torch.randn(s, inp, **kw))
        parts.append(torch.randn(s, site.size, **kw))
    return {"multipliers": torch.cat(mults, 1), "eps": torch.cat(parts, 1)}


@no_grad
def dropout_loss_and_grads(
    guide: Any,
    plan: DropoutPlan,
    lj: FlatLogJoint,
    m: torch.Tensor,
    fallback: torch.Tensor | None,
    noise: dict,
    idx: torch.Tensor | None,
    analytic_kl: bool,
    beta: Any,
    functional: bool = False,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Negative ELBO of a :class:`~pyrobdl.guides.Dropout` guide and its exact gradient.

    Parameters
    ----------
    guide : pyrobdl.guides.Dropout
    plan : DropoutPlan
    lj : pyrobdl.flat.FlatLogJoint
        The model's flat log joint (Gaussian prior).
    m : torch.Tensor
        The packed weight and bias means ``[P_w]``.
    fallback : torch.Tensor or None
        The learned precision's packed ``[loc, rho]`` (None without one).
    noise : dict
        ``{"multipliers": [S, U], "eps": [S, P]}`` (:func:`dropout_noise`).
    idx : torch.Tensor or None
        Minibatch indices (the likelihood is scaled by N/B).
    analytic_kl : bool
        Closed-form KLs (else the Monte Carlo KL with the exact mixture density; Bernoulli rows only).
    beta : float or torch.Tensor
        KL weight (a 0-d tensor in the compiled step).
    functional : bool, default False
        No ``out=`` writes (for ``torch.compile``, :mod:`pyrobdl.inference.flat_step`); ``guide``
        may then be any object with the guide's ``sigma`` and ``kind``.

    Returns
    -------
    (torch.Tensor, list of torch.Tensor)
        The loss (mean over particles) and the gradient of each packed vector (``m``, then the
        fallback's when present).

    Raises
    ------
    ValueError
        For Gaussian rows with ``analytic_kl=False``.
    """
    sigma = guide.sigma
    mult, eps = noise["multipliers"], noise["eps"]
    s, p_w = eps.shape[0], m.shape[0]
    ones = torch.ones(s, 1, dtype=mult.dtype, device=mult.device)
    c = torch.cat([mult, ones], 1)[:, plan.col]  # [S, P_w]: each coordinate's multiplier
    theta = torch.empty_like(eps)
    if functional:
        theta[:, :p_w] = torch.addcmul(eps[:, :p_w] * sigma, c, m)
    else:
        torch.addcmul(eps[:, :p_w] * sigma, c, m, out=theta[:, :p_w])
    u = lj.precision_index
    if u is not None:
        loc_u, rho_u = fallback[0], fallback[1]
        theta[:, u] = loc_u + torch.nn.functional.softplus(rho_u) * eps[:, u]
    if functional:
        ll, g = lj._value_and_grad(theta, idx, False, functional=True)
    else:
        ll, g = lj.value_and_grad(theta, idx, prior=False)
    if analytic_kl:
        kl, d_m = _analytic_kl(guide.kind, plan, m, sigma)
        kl = kl.expand(s)
        g_w = g[:, :p_w]
    else:
        if guide.kind != "bernoulli":
            raise ValueError("the flat path has no Monte Carlo KL for Gaussian dropout rows")
        kl, d_m, gp = _monte_carlo_kl(plan, lj, theta, m, mult, eps, sigma)
        g_w = g[:, :p_w] + beta * gp[:, :p_w]
    # d(loss)/dm = beta dKL/dm (direct) - E[c * dA/dw] (A: likelihood, + beta log p for MC)
    g_m = (g_w * c).mean(0)
    grad_m = d_m.mul_(beta).sub_(g_m)
    grads = [grad_m]
    if u is not None:
        kl_u, dl, ds = _precision_terms(lj, u, loc_u, rho_u, eps, theta)
        kl = kl + kl_u
        e = eps[:, u]
        gu = g[:, u]
        d_loc = beta * dl - gu.mean()
        d_sigma = beta * ds - (gu * e).mean()
        grads.append(torch.stack([d_loc, d_sigma * torch.sigmoid(rho_u)]))
    loss = (beta * kl - ll).mean()
    return loss, grads


def _analytic_kl(kind: str, plan: DropoutPlan, m: torch.Tensor, sigma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The closed-form KL of the weights and biases (module docstring) and its derivative in ``m``."""
    norm = None
    if kind == "gaussian":
        norm = torch.zeros(plan.num_units + 1, dtype=m.dtype, device=m.device).index_add_(0, plan.col, m * m)
        big = (sigma * sigma + plan.alpha * norm[plan.col])  # sigma^2 + alpha |m_j|^2, per coordinate
    kl = plan.kl_const - m.shape[0] * math.log(sigma) + 0.5 * (plan.prec * (sigma * sigma + plan.keep * m * m)).sum()
    d_m = plan.prec * plan.keep * m
    if norm is not None:
        for _, _, inp, p, start in plan.layers:
            a = p / (1.0 - p)
            kl = kl - 0.5 * torch.log1p(a * norm[start : start + inp] / (sigma * sigma)).sum()
        d_m = d_m - plan.alpha * m / big
    return kl, d_m


def _monte_carlo_kl(plan: DropoutPlan, lj: FlatLogJoint, theta: torch.Tensor, m: torch.Tensor, mult: torch.Tensor,
                    eps: torch.Tensor, sigma: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bernoulli rows: ``log q(w) - log p(w)`` per particle ``[S]`` with the exact mixture density
    (the learned precision's part left out), the particles' mean total derivative of ``log q`` in
    ``m``, and the gradient of ``log p`` in ``theta``."""
    s = theta.shape[0]
    u = lj.precision_index
    lp, gp = lj.log_prior(theta)  # the Gaussian prior (and the precision's Gamma): log p(w)
    if u is not None:  # the precision's KL is added by the caller, with its own derivatives
        gpu_value, _ = lj.precision_log_prior(theta)
        lp = lp - gpu_value
    logq = theta.new_zeros(s)
    d_m = torch.zeros_like(m)
    # biases: log N(b; m_b, sigma) = -eps^2/2 - log sigma - log(2 pi)/2, no total derivative in m_b
    e_b = eps[:, plan.bias_index]
    logq = logq + (-0.5 * e_b * e_b).sum(-1) - plan.num_bias * (math.log(sigma) + _HALF_LOG_2PI)
    for sl, out, inp, p, start in plan.layers:
        w = theta[:, sl].view(s, out, inp)
        loc = m[sl].view(out, inp)
        xi = mult[:, start : start + inp].unsqueeze(1)  # [S, 1, in]
        zk = (w - loc) / sigma
        zd = w / sigma
        norm_c = out * (math.log(sigma) + _HALF_LOG_2PI)
        lk = math.log1p(-p) - 0.5 * (zk * zk).sum(-2) - norm_c  # [S, in]
        ld = math.log(p) - 0.5 * (zd * zd).sum(-2) - norm_c
        logq = logq + torch.logaddexp(lk, ld).sum(-1)
        rk = torch.sigmoid(lk - ld).unsqueeze(1)  # responsibility of the kept component
        dq = -(rk * (xi - 1.0) * zk + (1.0 - rk) * xi * zd) / sigma  # [S, out, in]
        d_m[sl] = dq.mean(0).reshape(-1)
    return logq - lp, d_m, gp
