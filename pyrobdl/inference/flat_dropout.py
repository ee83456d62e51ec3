r"""The dropout families on the flat SVI hot path: MC dropout and variational dropout.

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

Variational dropout (:class:`~pyrobdl.guides.VariationalDropout`, Kingma et al. 2015, Molchanov
et al. 2017)
    :math:`w = \theta + \sigma\varepsilon`, :math:`\sigma^2 = e^{\ell}` with :math:`\ell` the
    stored :math:`\log\sigma^2` (capped at :math:`\lambda = \log(\theta^2 + 10^{-8})` for
    Kingma's variant), :math:`\log\alpha = \operatorname{clip}(\ell - \lambda)`.  Analytic KL:
    :func:`~pyrobdl.guides.variational_dropout.kl_log_uniform` with its derivative in
    :math:`\log\alpha` (zero outside the clip), :math:`\partial_\theta\lambda = 2\theta/(\theta^2
    + 10^{-8})`.  Monte Carlo KL: :math:`-\tfrac12\varepsilon^2 - \log\sigma - \tfrac12\log 2\pi +
    \log|w|`, derivative :math:`1/w` in :math:`w`.  Point-estimated biases (flat prior) carry no
    KL.  **Local reparameterization**: each layer's pre-activation is drawn per data point,
    :math:`a = h\theta^\top + b + \sqrt{h^2(\sigma^2)^\top}\odot\epsilon`, and the backward pass
    goes through its mean and variance (:func:`_lrt_likelihood`).

In both families a learned noise precision has the mean-field family of
:class:`~pyrobdl.guides.MeanField` and a Monte Carlo KL, as on the distribution path.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..flat import FlatLogJoint
from ..guides import variational_dropout as _vd
from ..guides.variational_dropout import KINGMA_CONSTANTS, LOG_ALPHA_RANGE, MOLCHANOV_CONSTANTS, _EPS

__all__ = ["DropoutPlan", "VDPlan", "dropout_loss_and_grads", "dropout_noise", "vd_loss_and_grads", "vd_noise"]

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)
# the clamp of LocalReparameterizationMessenger: sqrt has an infinite derivative at 0
_VAR_FLOOR = 1e-30


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


@torch.no_grad()
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
        norm = None
        if guide.kind == "gaussian":
            norm = torch.zeros(plan.num_units + 1, dtype=m.dtype, device=m.device).index_add_(0, plan.col, m * m)
            big = (sigma * sigma + plan.alpha * norm[plan.col])  # sigma^2 + alpha |m_j|^2, per coordinate
        kl = plan.kl_const - p_w * math.log(sigma) + 0.5 * (plan.prec * (sigma * sigma + plan.keep * m * m)).sum()
        d_m = plan.prec * plan.keep * m
        if norm is not None:
            for _, _, inp, p, start in plan.layers:
                a = p / (1.0 - p)
                kl = kl - 0.5 * torch.log1p(a * norm[start : start + inp] / (sigma * sigma)).sum()
            d_m = d_m - plan.alpha * m / big
        kl = kl.expand(s)
        g_w = g[:, :p_w]
    else:
        if guide.kind != "bernoulli":
            raise ValueError("the flat path has no Monte Carlo KL for Gaussian dropout rows")
        lp, gp = lj.log_prior(theta)  # the Gaussian prior (and the precision's Gamma): log p(w)
        if u is not None:  # the precision's KL is added below, with its own derivatives
            gpu_value, _ = lj.precision_log_prior(theta)
            lp = lp - gpu_value
        g_w = g[:, :p_w] + beta * gp[:, :p_w]
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
        kl = logq - lp
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


# ---------------------------------------------------------------------------- variational dropout
class VDPlan:
    """Index tensors of the variational-dropout family over the flat layout.

    Attributes
    ----------
    sparse : torch.Tensor
        ``[P_s]`` coordinates of the sparsified sites (their order in ``spread``).
    other : torch.Tensor
        ``[P_o]`` coordinates of the mean-field sites (a learned precision), after them in
        ``spread``.
    weights : list of (slice, int, int, slice)
        Per layer: the weight's coordinates in the flat vector, (out, in), and its
        coordinates in the sparse vector.
    biases : list of slice or None
        Per layer: the bias's coordinates (None for a model without biases).
    """

    def __init__(self, guide: Any, lj: FlatLogJoint) -> None:
        layout = lj.layout
        sparse, other = [], []
        for s in guide.site_specs:
            sl = layout[s.name]
            if s.name in guide.sparse_sites:
                sparse.append(torch.arange(sl.start, sl.stop))
            elif s.name not in guide.point_sites:
                other.append(torch.arange(sl.start, sl.stop))
        cat = lambda parts: torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)  # noqa: E731
        self.sparse = cat(sparse).to(lj.device)
        self.other = cat(other).to(lj.device)
        u = lj.precision_index
        # the precision's position among the mean-field sites (a Python int: no device sync per step)
        self.precision_position = None if u is None else [int(i) for i in cat(other)].index(u)
        position = {int(i): k for k, i in enumerate(cat(sparse))}
        # a weight's variances live in the sparse vector, at the weight's position there
        self.weights, self.biases, self.activation = _lrt_layers(lj, lambda w: position[w.start])


def _lrt_layers(lj: FlatLogJoint, variance_start: Any) -> tuple[list, list, str]:
    """Per layer, what :func:`_lrt_likelihood` reads: ``(weight slice, out, in, slice of its
    variances)`` with the variances starting at ``variance_start(weight SiteSlice)``, and the
    bias's slice (None without biases); then the activation."""
    layout = lj.layout
    weights, biases = [], []
    for i in range(lj._num_layers):
        w = layout[f"layers.{i}.weight"]
        k = variance_start(w)
        weights.append((slice(w.start, w.stop), w.shape[0], w.shape[1], slice(k, k + w.size)))
        name = f"layers.{i}.bias"
        biases.append(slice(layout[name].start, layout[name].stop) if name in layout else None)
    return weights, biases, lj._act


class NormalLRTPlan:
    """What :func:`_lrt_likelihood` needs of a mean-field guide with local reparameterization:
    every layer's weight (its variances are the squared scales at the same coordinates) and bias.

    Attributes are those of :class:`VDPlan`; ``weights[i][3]`` is the weight's own slice.
    """

    def __init__(self, lj: FlatLogJoint) -> None:
        self.weights, self.biases, self.activation = _lrt_layers(lj, lambda w: w.start)


def normal_lrt_noise(plan: NormalLRTPlan, num_particles: int, batch: int, lj: FlatLogJoint) -> dict:
    """One step's draws for a mean-field guide with local reparameterization: standard normals
    ``[S, P]`` (the weight coordinates enter only a Monte Carlo KL) and one per pre-activation
    and data point per layer (``[S, B, out]``)."""
    kw = {"dtype": lj.dtype, "device": lj.device}
    return {"eps": torch.randn(num_particles, lj.size, **kw),
            "preactivations": [torch.randn(num_particles, batch, out, **kw) for _, out, _, _ in plan.weights]}


def _kl_and_slope(log_alpha: torch.Tensor, approximation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~pyrobdl.guides.variational_dropout.kl_log_uniform` (the value: the one formula the
    registered KL uses too) and its derivative in log alpha, written out here."""
    kl = _vd.kl_log_uniform(log_alpha, approximation)
    if approximation == "molchanov":
        k1, k2, k3 = MOLCHANOV_CONSTANTS
        t = torch.sigmoid(k2 + k3 * log_alpha)
        return kl, -k1 * k3 * t * (1.0 - t) - 0.5 * torch.sigmoid(-log_alpha)
    if approximation == "kingma":
        _, c1, c2, c3 = KINGMA_CONSTANTS
        a = log_alpha.exp()
        return kl, -(0.5 + a * (c1 + a * (2.0 * c2 + a * 3.0 * c3)))
    return kl, -0.5 * torch.sigmoid(-log_alpha)


def vd_noise(guide: Any, plan: VDPlan, num_particles: int, batch: int, lj: FlatLogJoint) -> dict:
    """One step's draws: standard normals ``[S, P]`` (zeros at point sites) and, with local
    reparameterization, one per pre-activation and data point per layer (``[S, B, out]``).

    Drawn site by site, then layer by layer, in the order and shapes of the guide's own
    ``rsample`` calls and of :class:`~pyrobdl.poutine.LocalReparameterizationMessenger`, so a
    seed gives the flat path the draws of :class:`~pyrobdl.inference.DirectELBO` and Pyro's ELBOs.
    """
    kw = {"dtype": lj.dtype, "device": lj.device}
    s = num_particles
    parts = [
        torch.zeros(s, site.size, **kw) if site.name in guide.point_sites else torch.randn(s, site.size, **kw)
        for site in lj.layout.sites
    ]
    noise = {"eps": torch.cat(parts, 1)}
    if guide.local_reparameterization:
        noise["preactivations"] = [torch.randn(s, batch, out, **kw) for _, out, _, _ in plan.weights]
    return noise


def _lrt_likelihood(
    plan: VDPlan,
    lj: FlatLogJoint,
    mu: torch.Tensor,
    var: torch.Tensor,
    theta: torch.Tensor,
    idx: torch.Tensor | None,
    noise: list[torch.Tensor],
    functional: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Scaled log-likelihood ``[S]`` under locally reparameterized weights, and its gradients:
    in the weight means ``[P]`` and variances ``[P_s]`` (summed over particles), and in the
    per-particle coordinates of ``theta`` (biases and a learned precision) ``[S, P]``.
    ``functional``: no ``out=`` writes (for ``torch.compile``, :mod:`pyrobdl.inference.flat_step`).

    Layer :math:`l`: :math:`a = h\mu^\top + b + \sqrt{v}\odot\epsilon`, :math:`v = h^2 s^\top`;
    backward with :math:`g = \partial a`: :math:`\partial\mu = g^\top h`,
    :math:`\partial s = (g\epsilon/2\sqrt v)^\top h^2`, :math:`\partial b = \sum_n g`,
    :math:`\partial h = g\mu + 2h\odot(g\epsilon/2\sqrt v)\,s`.
    """
    x = lj.x if idx is None else lj.x[idx]
    s = theta.shape[0]
    relu = plan.activation == "relu"
    g_theta = torch.zeros_like(theta)
    g_mu = torch.zeros_like(mu)
    g_var = torch.zeros_like(var)
    h = x  # [B, in], then [S, B, in]
    saved = []
    last = len(plan.weights) - 1
    for i, ((wsl, out, inp, ssl), eps) in enumerate(zip(plan.weights, noise)):
        w_mu = mu[wsl].view(out, inp)
        w_var = var[ssl].view(out, inp)
        h2 = h * h
        mean = h @ w_mu.t()
        v = h2 @ w_var.t()
        if plan.biases[i] is not None:
            mean = mean + theta[:, plan.biases[i]].unsqueeze(1)
        sd = v.clamp_min(_VAR_FLOOR).sqrt_()
        a = torch.addcmul(mean, sd, eps)  # [S, B, out]
        # d sd/d v = 1/(2 sd) where v > floor, 0 where clamp_min held it (its derivative; at
        # v == floor exactly torch's clamp passes the gradient, a case of measure zero), one op
        half_inv_sd = sd.reciprocal().mul_(0.5)
        if functional:
            half_inv_sd = torch.ops.aten.threshold_backward(half_inv_sd, v, _VAR_FLOOR)
        else:
            torch.ops.aten.threshold_backward.grad_input(half_inv_sd, v, _VAR_FLOOR, grad_input=half_inv_sd)
        saved.append((h, h2, half_inv_sd))
        if i < last:
            h = a.relu_() if relu else a.tanh_()
    ll, g, du = lj.output_log_lik_and_grad(a, idx, theta)
    if du is not None:
        g_theta[:, lj.precision_index] = du
    for i in range(last, -1, -1):
        wsl, out, inp, ssl = plan.weights[i]
        h, h2, half_inv_sd = saved[i]
        gv = (g * noise[i]).mul_(half_inv_sd)  # d/dv, [S, B, out]
        if h.dim() == 2:  # the first layer: the inputs are shared by the particles
            g_mu[wsl] += (h.t() @ g.sum(0)).t().reshape(-1)
            g_var[ssl] += (h2.t() @ gv.sum(0)).t().reshape(-1)
        else:
            # sums over particles and data points as one [out, S*B] @ [S*B, in] product each
            g_mu[wsl] += (g.reshape(-1, out).t() @ h.reshape(-1, inp)).reshape(-1)
            g_var[ssl] += (gv.reshape(-1, out).t() @ h2.reshape(-1, inp)).reshape(-1)
        if plan.biases[i] is not None:
            g_theta[:, plan.biases[i]] = g.sum(1)
        if i > 0:
            w_mu = mu[wsl].view(out, inp)
            w_var = var[ssl].view(out, inp)
            gh = (g @ w_mu).add_((gv @ w_var).mul_(h).mul_(2.0))  # [S, B, in]
            if relu:
                g = torch.ops.aten.threshold_backward(gh, h, 0.0)
            else:
                g = gh.mul_(1.0 - h2)
    return ll, g_mu, g_var, g_theta


@torch.no_grad()
def vd_loss_and_grads(
    guide: Any,
    plan: VDPlan,
    lj: FlatLogJoint,
    loc: torch.Tensor,
    spread: torch.Tensor,
    noise: dict,
    idx: torch.Tensor | None,
    analytic_kl: bool,
    beta: Any,
    functional: bool = False,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Negative ELBO of a :class:`~pyrobdl.guides.VariationalDropout` guide and its exact gradient.

    Parameters
    ----------
    guide : pyrobdl.guides.VariationalDropout
        An unpruned guide (its ``sparse``/``ard`` variant and ``local_reparameterization``
        flag are read here).
    plan : VDPlan
    lj : pyrobdl.flat.FlatLogJoint
        The model's flat log joint, built with ``prior=False``.
    loc, spread : torch.Tensor
        Views of the guide's packed vector (:meth:`~pyrobdl.guides.VariationalDropout.flat_family`).
    noise : dict
        ``{"eps": [S, P]}`` and, with local reparameterization, ``"preactivations"`` (:func:`vd_noise`).
    idx : torch.Tensor or None
        Minibatch indices (the likelihood is scaled by N/B).
    analytic_kl : bool
        The guide's log-uniform KL approximation (else the Monte Carlo KL).
    beta : float or torch.Tensor
        KL weight (a 0-d tensor in the compiled step).
    functional : bool, default False
        No ``out=`` writes (for ``torch.compile``, :mod:`pyrobdl.inference.flat_step`).

    Returns
    -------
    (torch.Tensor, list of torch.Tensor)
        The loss (mean over particles) and ``[gradient of the packed vector]``.
    """
    eps = noise["eps"]
    s, size = eps.shape
    ps = plan.sparse.numel()
    theta_s = loc[plan.sparse]
    log_sigma2 = spread[:ps]
    log_theta2 = torch.log(theta_s * theta_s + _EPS)
    low, high = LOG_ALPHA_RANGE
    capped = None
    if not guide.sparse:  # Kingma et al.: the variance of q itself is capped at theta^2
        capped = log_sigma2 >= log_theta2
        log_sigma2 = torch.minimum(log_sigma2, log_theta2)
        high = 0.0
    raw = log_sigma2 - log_theta2
    log_alpha = raw.clamp(low, high)
    sig_s = (0.5 * log_sigma2).exp()
    sigma = torch.zeros_like(loc)
    sigma[plan.sparse] = sig_s
    rho_o = spread[ps:]
    if plan.other.numel():
        sigma[plan.other] = torch.nn.functional.softplus(rho_o)
    theta = torch.addcmul(loc, sigma, eps)  # [S, P]; point sites have sigma = 0
    local = guide.local_reparameterization
    if local:
        ll, g_mu, g_var, g = _lrt_likelihood(plan, lj, loc, sig_s * sig_s, theta, idx, noise["preactivations"], functional)
        g_mu, g_var = g_mu / s, g_var / s
    elif functional:
        ll, g = lj._value_and_grad(theta, idx, False, functional=True)
    else:
        ll, g = lj.value_and_grad(theta, idx, prior=False)
    # G: d(loss)/dw per particle and coordinate (w = theta), before the chain rule to the
    # parameters; d_sig: the direct derivative in sigma of the sparsified coordinates
    G = g.neg()
    d_sig = torch.zeros_like(sig_s)
    w_s = theta[:, plan.sparse]
    e_s = eps[:, plan.sparse]
    if analytic_kl:
        kl_w, slope = _kl_and_slope(log_alpha, guide.approximation)
        kl = kl_w.sum().expand(s)
        live = ((raw >= low) & (raw <= high)).to(slope.dtype)  # clamp's derivative
        d_la = beta * slope * live  # d(loss)/d log alpha
    else:
        kl = (-0.5 * e_s * e_s - _HALF_LOG_2PI + torch.log(w_s.abs())).sum(-1) - log_sigma2.sum() * 0.5
        G[:, plan.sparse] += beta / w_s
        d_sig = d_sig - beta / sig_s
        d_la = None
    u = lj.precision_index
    if u is not None:
        kl_u, dl, ds = _precision_terms(lj, u, loc[u], rho_o[plan.precision_position], eps, theta)
        kl = kl + kl_u
    # mean over particles of the path derivatives
    grad_loc = G.mean(0)
    grad_sig = d_sig + (G[:, plan.sparse] * e_s).mean(0)
    if local:  # the weights' likelihood term went through the pre-activations, not w
        for wsl, _, _, ssl in plan.weights:
            grad_loc[wsl] -= g_mu[wsl]
            grad_sig[ssl] -= 2.0 * sig_s[ssl] * g_var[ssl]
    # sigma = exp(log_sigma2 / 2) with log_sigma2 the capped value (Kingma)
    d_ls = 0.5 * sig_s * grad_sig  # d(loss)/d(effective log sigma^2)
    grad_theta_s = grad_loc[plan.sparse]
    dlt2 = 2.0 * theta_s / (theta_s * theta_s + _EPS)
    if d_la is not None:
        d_ls = d_ls + d_la
        grad_theta_s = grad_theta_s - d_la * dlt2
    if capped is not None:  # the capped log sigma^2 is log theta^2: its derivative goes to theta
        grad_theta_s = grad_theta_s + torch.where(capped, d_ls * dlt2, torch.zeros_like(d_ls))
        d_ls = torch.where(capped, torch.zeros_like(d_ls), d_ls)
    grad_loc[plan.sparse] = grad_theta_s
    grad = torch.empty(size + spread.shape[0], dtype=loc.dtype, device=loc.device)
    grad[:size] = grad_loc
    grad[size : size + ps] = d_ls
    if plan.other.numel():
        e_o = eps[:, plan.other]
        gs_o = (G[:, plan.other] * e_o).mean(0)
        d_loc_o = grad_loc[plan.other]
        if u is not None:
            o_mask = plan.other == u
            d_loc_o = d_loc_o + torch.where(o_mask, beta * dl, torch.zeros_like(d_loc_o))
            gs_o = gs_o + torch.where(o_mask, beta * ds, torch.zeros_like(gs_o))
            grad[plan.other] = d_loc_o
        grad[size + ps :] = gs_o * torch.sigmoid(rho_o)
    loss = (beta * kl - ll).mean()
    return loss, [grad]
