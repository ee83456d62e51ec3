r"""Variational dropout and local reparameterization on the flat SVI hot path.

Companion of :class:`~pyrobdl.inference.flat_elbo.FlatELBO`, like :mod:`pyrobdl.inference.flat_dropout`
(which has MC dropout and the conventions: packed parameters and one step's noise in, the negative
ELBO and its exact gradient out, equal to Pyro's on the unchanged guide, ``tests/test_flat_dropout.py``).

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

A learned noise precision has the mean-field family of :class:`~pyrobdl.guides.MeanField` and a
Monte Carlo KL, as on the distribution path.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .._grad import no_grad
from ..flat import FlatLogJoint
from ..flat import kernel as _kernel
from ..guides import variational_dropout as _vd
from ..guides.variational_dropout import KINGMA_CONSTANTS, LOG_ALPHA_RANGE, MOLCHANOV_CONSTANTS, _EPS
from . import numpy_elbo as _numpy_elbo
from .flat_dropout import _HALF_LOG_2PI, _precision_terms

__all__ = ["NormalLRTPlan", "VDPlan", "normal_lrt_noise", "vd_loss_and_grads", "vd_noise"]

# the clamp of LocalReparameterizationMessenger: sqrt has an infinite derivative at 0
_VAR_FLOOR = 1e-30


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


def _kl_and_slope(log_alpha: torch.Tensor, approximation: str, c: Any = float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~pyrobdl.guides.variational_dropout.kl_log_uniform` (the value: the one formula the
    registered KL uses too) and its derivative in log alpha, written out here; ``c``: the numbers as
    :meth:`FlatLogJoint.const <pyrobdl.flat.FlatLogJoint.const>` makes them (the same bits)."""
    kl = _vd.kl_log_uniform(log_alpha, approximation)
    if approximation == "molchanov":
        k1, k2, k3 = MOLCHANOV_CONSTANTS
        t = torch.sigmoid(c(k2) + c(k3) * log_alpha)
        return kl, c(-k1 * k3) * t * torch.rsub(t, c(1.0)) - c(0.5) * torch.sigmoid(-log_alpha)  # rsub: 1 - t
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
    if _numpy_elbo.usable(lj, theta.shape[0], idx, functional):  # small CPU steps: the numpy twin
        return _numpy_elbo.lrt_likelihood(plan, lj, mu, var, theta, idx, noise, _VAR_FLOOR)
    x = lj.x if idx is None else lj.x[idx]
    c = lj.const  # numbers as 0-d tensors (the same bits; numbers while torch.compile traces)
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
        half_inv_sd = sd.reciprocal().mul_(c(0.5))
        if functional:
            half_inv_sd = torch.ops.aten.threshold_backward(half_inv_sd, v, _VAR_FLOOR)
        else:
            torch.ops.aten.threshold_backward.grad_input(half_inv_sd, v, _VAR_FLOOR, grad_input=half_inv_sd)
        saved.append((h, h2, half_inv_sd))
        if i < last:
            # tanh as 2 sigmoid(2a) - 1 where ATen's tanh is MKL's slow path (pyrobdl.flat.kernel), and compiled
            h = a.relu_() if relu else _kernel.tanh_(a, lj._sigmoid_tanh or functional)
    ll, g, du = lj.output_log_lik_and_grad(a, idx, theta)
    if du is not None:
        g_theta[:, lj.precision_index] = du
    for i in range(last, -1, -1):
        wsl, out, inp, ssl = plan.weights[i]
        h, h2, half_inv_sd = saved[i]
        gv = (g * noise[i]).mul_(half_inv_sd)  # d/dv, [S, B, out]
        # (each layer's coordinates are written once, into zeros: a copy, not a read-add-write)
        if h.dim() == 2:  # the first layer: the inputs are shared by the particles
            g_mu[wsl].copy_((h.t() @ g.sum(0)).t().reshape(-1))
            g_var[ssl].copy_((h2.t() @ gv.sum(0)).t().reshape(-1))
        else:
            # sums over particles and data points as one [out, S*B] @ [S*B, in] product each
            g_mu[wsl].copy_((g.reshape(-1, out).t() @ h.reshape(-1, inp)).reshape(-1))
            g_var[ssl].copy_((gv.reshape(-1, out).t() @ h2.reshape(-1, inp)).reshape(-1))
        if plan.biases[i] is not None:
            g_theta[:, plan.biases[i]] = g.sum(1)
        if i > 0:
            w_mu = mu[wsl].view(out, inp)
            w_var = var[ssl].view(out, inp)
            gh = (g @ w_mu).add_((gv @ w_var).mul_(h).mul_(c(2.0)))  # [S, B, in]
            if relu:
                g = torch.ops.aten.threshold_backward(gh, h, 0.0)
            else:
                g = gh.mul_(torch.rsub(h2, c(1.0)))  # 1 - h2 (Tensor.__rsub__ is a Python wrapper)
    return ll, g_mu, g_var, g_theta


@no_grad
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
    if _numpy_elbo.step_usable(lj, noise["eps"], idx, beta, functional):  # small CPU steps: the numpy twin
        return _numpy_elbo.vd_loss_and_grads(guide, plan, lj, loc, spread, noise, idx, analytic_kl, beta, _VAR_FLOOR)
    eps = noise["eps"]
    s, size = eps.shape
    ps = plan.sparse.numel()
    c = lj.const  # numbers as 0-d tensors (the same bits; numbers while torch.compile traces)
    weighted = functional or beta != 1.0  # (1.0 * x is x: the product is skipped)
    sc = _vd_scales(guide, plan, loc, spread, c)
    theta = torch.addcmul(loc, sc["sigma"], eps)  # [S, P]; point sites have sigma = 0
    local = guide.local_reparameterization
    g_mu = g_var = None
    if local:
        ll, g_mu, g_var, g = _lrt_likelihood(plan, lj, loc, sc["sig_s"] * sc["sig_s"], theta, idx,
                                             noise["preactivations"], functional)
        g_mu, g_var = g_mu / c(float(s)), g_var / c(float(s))
    elif functional:
        ll, g = lj._value_and_grad(theta, idx, False, functional=True)
    else:
        ll, g = lj.value_and_grad(theta, idx, prior=False)
    # G: d(loss)/dw per particle and coordinate (w = theta), before the chain rule to the
    # parameters; d_sig: the direct derivative in sigma of the sparsified coordinates
    G = g.neg()
    d_sig = torch.zeros_like(sc["sig_s"])
    w_s = theta[:, plan.sparse]
    e_s = eps[:, plan.sparse]
    if analytic_kl:
        kl_w, slope = _kl_and_slope(sc["log_alpha"], guide.approximation, c)
        kl = kl_w.sum().expand(s)
        low, high = sc["range"]
        live = ((sc["raw"] >= c(low)) & (sc["raw"] <= c(high))).to(slope.dtype)  # clamp's derivative
        d_la = (beta * slope if weighted else slope) * live  # d(loss)/d log alpha
    else:
        kl = (-0.5 * e_s * e_s - _HALF_LOG_2PI + torch.log(w_s.abs())).sum(-1) - sc["log_sigma2"].sum() * 0.5
        G[:, plan.sparse] += beta / w_s
        d_sig = d_sig - beta / sc["sig_s"]
        d_la = None
    u = lj.precision_index
    prec = None
    if u is not None:
        kl_u, dl, ds = _precision_terms(lj, u, loc[u], sc["rho_o"][plan.precision_position], eps, theta)
        kl = kl + kl_u
        prec = (u, dl, ds)
    grad_loc, d_ls = _vd_chain_rule(plan, sc, G, d_sig, d_la, e_s, (g_mu, g_var) if local else None, c)
    grad = torch.empty(size + spread.shape[0], dtype=loc.dtype, device=loc.device)
    grad[:size] = grad_loc
    grad[size : size + ps] = d_ls
    if plan.other.numel():
        grad[size + ps :] = _other_sites_grad(plan, sc["rho_o"], G, eps, grad_loc, grad, beta, prec)
    loss = ((beta * kl if weighted else kl) - ll).mean()
    return loss, [grad]


def _vd_scales(guide: Any, plan: VDPlan, loc: torch.Tensor, spread: torch.Tensor, c: Any = float) -> dict[str, Any]:
    r"""The sparsified coordinates' :math:`	heta`, (capped) :math:`\log\sigma^2`, :math:`\loglpha`
    before (``raw``) and after the clip to ``range``, which coordinates Kingma's cap binds
    (``capped``, None for sparse VD), :math:`\sigma` (``sig_s``; ``sigma``: every coordinate's, 0 at
    point sites) and the other sites' unconstrained scales ``rho_o``."""
    ps = plan.sparse.numel()
    theta_s = loc[plan.sparse]
    log_sigma2 = spread[:ps]
    log_theta2 = torch.log(theta_s * theta_s + c(_EPS))
    low, high = LOG_ALPHA_RANGE
    capped = None
    if not guide.sparse:  # Kingma et al.: the variance of q itself is capped at theta^2
        capped = log_sigma2 >= log_theta2
        log_sigma2 = torch.minimum(log_sigma2, log_theta2)
        high = 0.0
    raw = log_sigma2 - log_theta2
    sig_s = (c(0.5) * log_sigma2).exp()
    sigma = torch.zeros_like(loc)
    sigma[plan.sparse] = sig_s
    rho_o = spread[ps:]
    if plan.other.numel():
        sigma[plan.other] = torch.nn.functional.softplus(rho_o)
    return {"theta_s": theta_s, "log_sigma2": log_sigma2, "raw": raw, "log_alpha": raw.clamp(low, high),
            "range": (low, high), "capped": capped, "sig_s": sig_s, "sigma": sigma, "rho_o": rho_o}


def _vd_chain_rule(plan: VDPlan, sc: Mapping[str, Any], G: torch.Tensor, d_sig: torch.Tensor, d_la: Any,
                   e_s: torch.Tensor, lrt: tuple[torch.Tensor, torch.Tensor] | None, c: Any = float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The particles' mean path derivatives taken to the parameters: every mean's gradient and the
    sparsified coordinates' d(loss)/d(stored log sigma^2); ``lrt``: local reparameterization's
    (mean, variance) gradients, through which the weights' likelihood term went instead of w."""
    sig_s, theta_s, capped = sc["sig_s"], sc["theta_s"], sc["capped"]
    grad_loc = G.mean(0)
    grad_sig = d_sig + (G[:, plan.sparse] * e_s).mean(0)
    if lrt is not None:  # g_mu, g_var are zero outside the weights' coordinates: whole vectors, three ops
        g_mu, g_var = lrt
        grad_loc.sub_(g_mu)
        grad_sig = grad_sig.sub_(sig_s * g_var, alpha=2.0)
    # sigma = exp(log_sigma2 / 2) with log_sigma2 the capped value (Kingma)
    d_ls = c(0.5) * sig_s * grad_sig  # d(loss)/d(effective log sigma^2)
    grad_theta_s = grad_loc[plan.sparse]
    dlt2 = c(2.0) * theta_s / (theta_s * theta_s + c(_EPS))
    if d_la is not None:
        d_ls = d_ls + d_la
        grad_theta_s = grad_theta_s - d_la * dlt2
    if capped is not None:  # the capped log sigma^2 is log theta^2: its derivative goes to theta
        grad_theta_s = grad_theta_s + torch.where(capped, d_ls * dlt2, torch.zeros_like(d_ls))
        d_ls = torch.where(capped, torch.zeros_like(d_ls), d_ls)
    grad_loc[plan.sparse] = grad_theta_s
    return grad_loc, d_ls


def _other_sites_grad(plan: VDPlan, rho_o: torch.Tensor, G: torch.Tensor, eps: torch.Tensor, grad_loc: torch.Tensor,
                      grad: torch.Tensor, beta: Any, prec: tuple | None) -> torch.Tensor:
    """The gradient in the softplus scales of the non-sparsified, non-point sites; a learned
    precision's KL derivatives ``prec = (u, d/dloc, d/dsigma)`` are added, its loc's into ``grad``."""
    e_o = eps[:, plan.other]
    gs_o = (G[:, plan.other] * e_o).mean(0)
    d_loc_o = grad_loc[plan.other]
    if prec is not None:
        u, dl, ds = prec
        o_mask = plan.other == u
        d_loc_o = d_loc_o + torch.where(o_mask, beta * dl, torch.zeros_like(d_loc_o))
        gs_o = gs_o + torch.where(o_mask, beta * ds, torch.zeros_like(gs_o))
        grad[plan.other] = d_loc_o
    return gs_o * torch.sigmoid(rho_o)
