r"""The score-function ELBO gradient without Pyro's traces: the fast path for BBVI guides.

:class:`DirectScoreFunctionELBO` computes, for a :class:`~pyrobdl.guides.ScoreFunction` guide on
a :class:`~pyrobdl.BayesianMLP`, the same value and surrogate gradient as
:class:`~pyrobdl.inference.ScoreFunctionELBO` (Pyro's ``TraceGraph_ELBO`` with the particle
baselines) for the same draws, reading the guide's and the model's distributions through their
hooks as :class:`~pyrobdl.inference.DirectELBO` does.  Rao-Blackwellization is written out for
this model class: every weight and bias reaches every output, and the sites are independent
under the mean-field guide, so site :math:`k`'s downstream cost is

.. math::

    c_k^{(p)} = \tfrac{N}{B}\sum_{n\in\mathcal B}\log p(y_n\mid x_n, w^{(p)})
    + \beta\big(\log p(w_k^{(p)}) - \log q(w_k^{(p)})\big),

without the :math:`\beta(\cdot)` term for a site whose KL is taken in closed form
(``analytic_kl=True``).  ``tests/test_bbvi.py`` checks value and gradient against
``ScoreFunctionELBO`` on the same draws for every baseline.

One difference from Pyro: under KL annealing (:math:`\beta\ne1`) Pyro's ``poutine.scale`` also
scales the *score* of a latent site, so its likelihood part is multiplied by :math:`\beta`; here
the score is not scaled, which is the gradient of
:math:`\mathbb E_q[\log p(y\mid w)] - \beta\,\mathrm{KL}`.  With :math:`\beta = 1` the two agree.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributions import kl_divergence

__all__ = ["DirectScoreFunctionELBO"]

_BASELINES = ("none", "decaying_average", "leave_one_out", "vargrad")


class DirectScoreFunctionELBO(torch.nn.Module):
    r"""Negative ELBO whose gradient is the Rao-Blackwellized score-function estimator.

    Called as ``loss(x, y, subsample)`` like :class:`~pyrobdl.inference.DirectELBO`; the value
    is the Monte Carlo negative ELBO, the gradient that of the surrogate
    :math:`-\frac1P\sum_k\sum_p \log q(w_k^{(p)};\phi_k)\,\tilde c_k^{(p)}` (plus the pathwise
    gradient of closed-form KL terms), with :math:`\tilde c_k` the downstream cost minus the
    guide's baseline (``guide.baseline``).

    Parameters
    ----------
    model : pyrobdl.BayesianMLP
        The model.
    guide : pyrobdl.guides.ScoreFunction
        A guide with a ``baseline`` attribute: ``"none"``, ``"decaying_average"``,
        ``"leave_one_out"`` or ``"vargrad"``.  (The neural baseline needs Pyro's trace: use
        ``elbo="trace_graph"``.)
    num_particles : int, default 1
        Vectorized particles :math:`P`.
    analytic_kl : bool, default False
        Closed-form KL terms where a ``register_kl`` pair exists.

    Raises
    ------
    ValueError
        For a guide without a supported ``baseline``, or a particle baseline with fewer than
        two particles.
    """

    def __init__(self, model: Any, guide: Any, num_particles: int = 1, analytic_kl: bool = False) -> None:
        super().__init__()
        baseline = getattr(guide, "baseline", None)
        if baseline not in _BASELINES:
            raise ValueError(
                f"elbo='direct_score_function' needs a ScoreFunction guide with baseline in {list(_BASELINES)}, "
                f"got baseline {baseline!r}; use elbo='trace_graph'"
            )
        if baseline in ("leave_one_out", "vargrad") and num_particles < 2:
            raise ValueError(f"baseline {baseline!r} needs num_particles >= 2, got {num_particles}")
        self.model = model
        self.guide = guide
        self.num_particles = num_particles
        self.analytic_kl = bool(analytic_kl)
        self.baseline = baseline
        self.beta = float(getattr(guide, "baseline_beta", 0.9))
        self.kl_weight = 1.0
        self._average: dict[str, torch.Tensor] = {}  # decaying averages, one per particle slot

    def _closed_form_kl(self, q: Any, p: Any) -> torch.Tensor | None:
        if not self.analytic_kl:
            return None
        try:
            return kl_divergence(q, p)
        except NotImplementedError:
            return None

    def forward(self, x: torch.Tensor, y: torch.Tensor, subsample: torch.Tensor | None = None) -> torch.Tensor:
        """Return the negative ELBO estimate, differentiable as the score-function surrogate."""
        qs = self.guide.variational_distributions()
        ps = self.model.prior_distributions()
        shape = torch.Size((self.num_particles,))
        y = self.model.likelihood.prepare_targets(y, self.model.out_features)
        scale = 1.0
        if subsample is not None:
            scale = x.shape[0] / subsample.shape[0]
            x, y = x[subsample], y[subsample]
        beta = self.kl_weight
        with torch.no_grad():
            values = {name: q.sample(shape) for name, q in qs.items()}
            log_lik = scale * self.model.log_likelihood(values, x, y).sum(-1)  # [P]
        log_q, own, kl_total = {}, {}, 0.0
        for name, q in qs.items():
            log_q[name] = q.log_prob(values[name])  # [P], differentiable in the guide's parameters
            kl = self._closed_form_kl(q, ps[name])
            if kl is None:
                own[name] = beta * (ps[name].log_prob(values[name]) - log_q[name]).detach()
            else:
                kl_total = kl_total + beta * kl
        whole = log_lik + sum(own.values(), torch.zeros_like(log_lik))
        surrogate = 0.0
        p = self.num_particles
        for name in qs:
            cost = log_lik + own[name] if name in own else log_lik
            if self.baseline == "leave_one_out":
                cost = cost - (cost.sum() - cost) / (p - 1)
            elif self.baseline == "vargrad":
                cost = (whole - whole.mean()) * (p / (p - 1))
            elif self.baseline == "decaying_average":
                old = self._average.get(name)
                if old is None or old.shape != cost.shape:
                    old = torch.zeros_like(cost)
                self._average[name] = self.beta * old + (1 - self.beta) * cost
                cost = cost - old
            surrogate = surrogate + (log_q[name] * cost).mean()
        surrogate = surrogate - kl_total
        value = (whole.mean() - kl_total).detach()
        return -value - (surrogate - surrogate.detach())
