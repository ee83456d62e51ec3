r"""The flat path of BBVI: the score-function ELBO on packed vectors and a forward-only likelihood.

:class:`FlatScoreFunctionELBO` computes, for a :class:`~pyrobdl.guides.ScoreFunction` guide on
a :class:`~pyrobdl.BayesianMLP` that the flat log joint implements, the value and surrogate
gradient of :class:`~pyrobdl.inference.DirectScoreFunctionELBO` (hence of
:class:`~pyrobdl.inference.ScoreFunctionELBO`, Pyro's ``TraceGraph_ELBO`` with the particle
baselines) on the same draws, without distribution objects or autograd:

* the guide's loc and softplus-scale parameters are views of one packed vector ``[2D]``
  (:meth:`pyrobdl.guides.BNNGuide.packed`); the particles :math:`\theta = \mu + \sigma\odot
  \varepsilon` ``[P, D]`` are drawn site by site in the model's order, one ``[P, *shape]``
  standard-normal draw per site, exactly as ``Normal.sample`` draws them
  (``torch.normal(loc, scale)`` fills the standard normals, then scales and shifts), so a seed
  gives the draws of the other two estimators;
* the scaled log-likelihood per particle, :math:`A^{(p)}`, from a *forward* pass of the flat
  kernel (:meth:`pyrobdl.flat.FlatLogJoint.log_likelihood`): the score-function estimator needs no
  gradient through the network;
* per site :math:`k` (a weight or bias tensor, or the learned noise precision) the
  Rao-Blackwellized downstream cost :math:`c_k^{(p)} = A^{(p)} + \beta(\log p(w_k^{(p)}) - \log
  q(w_k^{(p)}))`, without the :math:`\beta(\cdot)` term where the KL is in closed form
  (``analytic_kl``: the Gaussian-prior sites; the precision's Gamma prior has none), centred
  by the guide's baseline exactly as in ``DirectScoreFunctionELBO`` (``"none"``,
  ``"decaying_average"`` with its per-site, per-particle moving average, ``"leave_one_out"``,
  ``"vargrad"``);
* the surrogate's gradient written out: with :math:`\tilde c` the centred cost of a
  coordinate's site, :math:`\partial_\mu \log q = \varepsilon/\sigma` and
  :math:`\partial_\sigma \log q = (\varepsilon^2 - 1)/\sigma`, the loss's gradient is
  :math:`-\frac1P\sum_p \tilde c^{(p)}\,\partial\log q^{(p)}` plus :math:`\beta` times the
  closed-form KL's derivative (:math:`\mu/s^2` and :math:`\sigma/s^2 - 1/\sigma`), times
  :math:`\operatorname{sigmoid}(\rho)` for :math:`\rho`.

``tests/test_flat_score_function.py`` holds value and gradient equal to
``DirectScoreFunctionELBO`` (and Pyro's path) on the same draws in float64 for every baseline,
both KL treatments, a KL weight :math:`\beta\ne1`, minibatches, tanh and relu, several hidden
layers, regression with fixed and learned precision and classification.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .._grad import no_grad
from ..flat import FlatLayout, FlatLogJoint
from . import numpy_elbo
from .flat_elbo import _FlatLoss
from .score_function_direct import _BASELINES, DirectScoreFunctionELBO

__all__ = ["FlatScoreFunctionELBO", "flat_score_function_support"]

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


def flat_score_function_support(model: Any, guide: Any) -> str | None:
    """Why the flat score-function path cannot run this model and guide, or None when it can.

    Parameters
    ----------
    model : pyrobdl.BayesianMLP
    guide : pyrobdl.guides.ScoreFunction

    Returns
    -------
    str or None
        A reason in words (a guide that is not exactly a ``ScoreFunction``, a baseline only Pyro's
        trace forms, a prior, likelihood or activation the flat log joint does not implement).
    """
    from ..guides import ScoreFunction

    if type(guide).variational_distributions is not ScoreFunction.variational_distributions or not isinstance(
        guide, ScoreFunction
    ):
        return f"{type(guide).__name__} is not a ScoreFunction guide with its mean-field Gaussian family"
    if guide.baseline not in _BASELINES:
        return f"the {guide.baseline!r} baseline needs Pyro's trace"
    try:
        from ..flat import _check_supported

        _check_supported(model, prior=True)
    except (TypeError, ValueError) as err:
        return str(err)
    layout = FlatLayout(model)
    names = [s.name for s in guide.site_specs]
    if names != [s.name for s in layout.sites] or guide.packed("params").numel() != 2 * layout.size:
        return f"the guide's sites {names} do not match the model's flat layout {[s.name for s in layout.sites]}"
    return None


class FlatScoreFunctionELBO(DirectScoreFunctionELBO):
    r"""``DirectScoreFunctionELBO`` on packed vectors: same value and gradient, no autograd.

    Called as ``loss(x, y, subsample)`` (a differentiable scalar, for ``backward``) or, by the
    SVI loop, :meth:`loss_and_grad`, which sets the packed vector's ``.grad`` itself.

    Parameters
    ----------
    model : pyrobdl.BayesianMLP
        Gaussian prior; Gaussian, learned-precision Gaussian or categorical likelihood; relu or
        tanh (see :class:`~pyrobdl.flat.FlatLogJoint`).
    guide : pyrobdl.guides.ScoreFunction
        Baseline ``"none"``, ``"decaying_average"``, ``"leave_one_out"`` or ``"vargrad"``.
    num_particles : int, default 1
        Particles :math:`P` per step (>= 2 for the particle baselines).
    analytic_kl : bool, default False
        Closed-form KL for the Gaussian-prior sites (the scores then see only the likelihood).

    Raises
    ------
    ValueError
        As ``DirectScoreFunctionELBO`` (baseline, particles), or when
        :func:`flat_score_function_support` gives a reason.
    """

    def __init__(self, model: Any, guide: Any, num_particles: int = 1, analytic_kl: bool = False) -> None:
        super().__init__(model, guide, num_particles=num_particles, analytic_kl=analytic_kl)
        reason = flat_score_function_support(model, guide)
        if reason is not None:
            raise ValueError(f"the flat score-function ELBO cannot run: {reason}")
        layout = FlatLayout(model)
        self._sites = [(sl.start, sl.stop, sl.shape) for sl in (layout[s.name] for s in layout.sites)]
        # the site of every coordinate, and a [D, S] indicator that sums coordinates to sites
        self._site_index = torch.cat([torch.full((b - a,), k) for k, (a, b, _) in enumerate(self._sites)])
        self._site_starts = [a for a, _, _ in self._sites]  # the numpy twin's site sums (np.add.reduceat)
        self._lj: FlatLogJoint | None = None
        self._data: tuple[torch.Tensor, torch.Tensor] | None = None
        self._flat_average: torch.Tensor | None = None  # the decaying averages [P, S]
        self._numpy_arrays: tuple | None = None  # the numpy twin's arrays of the log joint's tensors below
        self.parameters_to_optimize()

    def parameters_to_optimize(self) -> list[torch.Tensor]:
        """The packed vector ``[loc, rho]`` the optimizer steps (the per-site parameters are views).

        Re-read from the guide (repairing the packing if something broke it).
        """
        self._vector = self.guide.packed("params")
        return [self._vector]

    def _vector_owners(self) -> list[Any]:
        return [self.guide]

    def _log_joint(self, x: torch.Tensor, y: torch.Tensor) -> FlatLogJoint:
        if self._lj is None or self._data[0] is not x or self._data[1] is not y:
            lj = FlatLogJoint(self.model, x, y)
            prec = lj._prior_prec
            d = lj.size
            index = self._site_index.to(x.device)
            self._index = index
            self._indicator = torch.zeros(d, len(self._sites), dtype=x.dtype, device=x.device)
            self._indicator[torch.arange(d, device=x.device), index] = 1.0
            gaussian = prec > 0
            self._gaussian = gaussian
            # log p - log q per coordinate is -prec theta^2 / 2 + eps^2 / 2 + log sigma + this
            self._half_log_prec = 0.5 * torch.where(gaussian, prec, torch.ones_like(prec)).log()
            # sites with a closed-form KL (analytic_kl): every coordinate has a Gaussian prior
            closed = torch.tensor([bool(gaussian[a:b].all()) for a, b, _ in self._sites], device=x.device)
            self._own_sites = (~closed if self.analytic_kl else torch.ones_like(closed)).to(x.dtype)
            self._kl_const = float((-0.5 * prec[gaussian].log() - 0.5).sum())
            self._lj, self._data = lj, (x, y)
        return self._lj

    def draw(self, like: torch.Tensor) -> torch.Tensor:
        """Standard normals ``[P, D]`` of ``like``'s dtype and device, one ``[P, *shape]`` draw per site in
        order (``Normal.sample``'s)."""
        p = self.num_particles
        return torch.cat([torch.randn(p, *shape, dtype=like.dtype, device=like.device).reshape(p, -1)
                          for _, _, shape in self._sites], 1)

    # ---------------------------------------------------------------------------- the step
    def loss_and_grad(
        self, x: torch.Tensor, y: torch.Tensor, subsample: torch.Tensor | None = None, noise: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Negative ELBO (a detached scalar); sets the packed vector's ``.grad``.

        Parameters
        ----------
        x, y : torch.Tensor
            Training data (the same tensors every step: the flat log joint is built once).
        subsample : torch.Tensor, optional
            Minibatch indices; the likelihood is scaled by N/B.
        noise : torch.Tensor, optional
            The standard normals ``[P, D]`` of the step (default: :meth:`draw`).
        """
        lj = self._lj
        if (noise is None and lj is not None and self._data[0] is x and self._data[1] is y
                and numpy_elbo.step_usable_rows(lj, self.num_particles, subsample, self.kl_weight)):
            # a small CPU step: straight to the numpy twin (what _loss_and_grads calls there, without
            # its inference mode and dispatch), the same draws and the same floats
            loss, grad = numpy_elbo.score_loss_and_grad(self, lj, self._vector, self.draw(self._vector), subsample)
        else:
            with torch.inference_mode():  # as FlatELBO.loss_and_grad: the gradient is only read outside it
                loss, (grad,) = self._loss_and_grads(x, y, subsample, noise)
        self._vector.grad = grad
        return loss

    def forward(self, x: torch.Tensor, y: torch.Tensor, subsample: torch.Tensor | None = None) -> torch.Tensor:
        """The negative ELBO whose ``backward`` gives the per-site parameters the surrogate gradient."""
        sites = [self.guide._parameters[n + "_unconstrained"] for n in self.guide._packs["params"]]
        return _FlatLoss.apply(self, x, y, subsample, *sites)

    @no_grad
    def _loss_and_grads(
        self, x: torch.Tensor, y: torch.Tensor, subsample: torch.Tensor | None, noise: torch.Tensor | None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        lj = self._log_joint(x, y)
        v = self._vector
        eps = self.draw(v) if noise is None else noise
        if numpy_elbo.step_usable(lj, eps, subsample, self.kl_weight, False):  # small CPU steps
            loss, grad = numpy_elbo.score_loss_and_grad(self, lj, v, eps, subsample)
            return loss, [grad]
        d = lj.size
        loc, rho = v[:d], v[d:]
        sigma = torch.nn.functional.softplus(rho)
        theta = (eps * sigma).add_(loc)  # as torch.normal(loc, scale): draw, scale, shift
        ll = lj.log_likelihood(theta, subsample)  # [P]: the forward pass alone
        beta = self.kl_weight
        own = self._own_terms(lj, theta, eps, sigma)  # [P, S]: log p - log q per site
        if beta != 1.0:
            own.mul_(beta)
        whole = own.sum(1).add_(ll)  # [P]
        cost = self._centred(own.add_(ll.unsqueeze(1)), whole)  # [P, S]
        kl, d_loc, d_sigma = self._analytic_kl(loc, sigma, beta)
        # the surrogate's gradient: -(1/P) sum_p c~ dlog q, per coordinate through its site
        c = cost[:, self._index]  # [P, D]
        scale = sigma.reciprocal().mul_(-1.0 / self.num_particles)  # = (-1/P) / sigma, as Tensor.__rdiv__ computes it
        g_loc = (c * eps).sum(0).mul_(scale)
        g_sigma = (c * (eps * eps - 1.0)).sum(0).mul_(scale)
        if d_loc is not None:
            g_loc.add_(d_loc)
            g_sigma.add_(d_sigma)
        grad = torch.cat([g_loc, g_sigma.mul_(torch.sigmoid(rho))])
        # float - tensor as torch.rsub: Tensor.__rsub__ is a Python wrapper (~3 us a call in the SVI loop)
        return (torch.rsub(whole.mean(), kl) if isinstance(kl, float) else kl - whole.mean()), [grad]

    def _own_terms(self, lj: FlatLogJoint, theta: torch.Tensor, eps: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        r"""Per site :math:`\log p(w_k) - \log q(w_k)` ``[P, S]``, zero where the KL is in closed form."""
        # Gaussian prior coordinates: -prec theta^2/2 + log(prec)/2 + eps^2/2 + log sigma (the 2 pi's cancel)
        elem = (theta * theta).mul_(-0.5 * lj._prior_prec).addcmul_(eps, eps, value=0.5).add_(sigma.log() + self._half_log_prec)
        u = lj.precision_index
        if u is not None:  # learned precision: its Gamma prior with the log-Jacobian, and q's 2 pi
            lp, _ = lj.precision_log_prior(theta)
            elem[:, u] += lp + _HALF_LOG_2PI
        return (elem @ self._indicator).mul_(self._own_sites)

    def _centred(self, cost: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
        """The downstream costs ``[P, S]`` minus the guide's baseline (as ``DirectScoreFunctionELBO``)."""
        p = self.num_particles
        if self.baseline == "leave_one_out":
            return cost.sub_((cost.sum(0) - cost).div_(p - 1))
        if self.baseline == "vargrad":
            return ((whole - whole.mean()) * (p / (p - 1))).unsqueeze(1).expand_as(cost)
        if self.baseline == "decaying_average":
            old = self._flat_average
            if old is None or old.shape != cost.shape:
                old = torch.zeros_like(cost)
            self._flat_average = self.beta * old + (1 - self.beta) * cost
            return cost.sub_(old)
        return cost

    def _analytic_kl(
        self, loc: torch.Tensor, sigma: torch.Tensor, beta: float
    ) -> tuple[torch.Tensor | float, torch.Tensor | None, torch.Tensor | None]:
        r""":math:`\beta` times the closed-form KL of the Gaussian-prior sites and its derivatives in loc and sigma."""
        if not self.analytic_kl:
            return 0.0, None, None
        prec, mask = self._lj._prior_prec, self._gaussian
        log_sigma = torch.where(mask, sigma.log(), sigma.new_zeros(()))
        kl = torch.rsub(log_sigma.sum(), self._kl_const) + 0.5 * (prec * (sigma * sigma + loc * loc)).sum()
        d_loc = prec * loc
        d_sigma = torch.where(mask, prec * sigma - sigma.reciprocal(), sigma.new_zeros(()))
        if beta != 1.0:
            return beta * kl, d_loc.mul_(beta), d_sigma.mul_(beta)
        return kl, d_loc, d_sigma
