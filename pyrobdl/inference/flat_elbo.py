r"""The flat SVI hot path: the ELBO of a packed guide on the flat log joint, with its gradient.

:class:`DirectELBO` builds a distribution object per site, draws each site separately, runs the
network through Pyro's effectful ``linear`` and lets autograd record some 170 nodes per step;
for the small networks of a BNN benchmark that bookkeeping costs three times the arithmetic.
:class:`FlatELBO` computes the same objective on packed vectors over
:class:`~pyrobdl.flat.FlatLayout` (the guide's per-site parameters are views of them, see
:meth:`pyrobdl.guides.BNNGuide.packed`):

* one noise draw :math:`\varepsilon \in \mathbb R^{S\times P}` for all sites and particles,
  :math:`\theta = \mu + \sigma\odot\varepsilon`, :math:`\sigma = \operatorname{softplus}(\rho)`;
* the scaled log-likelihood and its gradient from
  :meth:`pyrobdl.flat.FlatLogJoint.value_and_grad` (a hand-written backward, particles as the
  leading batch dimension);
* the KL terms as closed-form expressions over whole vectors, with their derivatives written
  out (below), so no autograd graph is built at all: :meth:`FlatELBO.loss_and_grad` sets the
  packed parameters' ``.grad`` and the SVI loop steps its optimizer over the two packed
  vectors.

With :math:`A(\theta)` the scaled log-likelihood, :math:`\beta` the KL weight and the loss
:math:`-\frac1S\sum_s [A(\theta_s) - \beta\,\mathrm{KL}_s]`, the KL terms and their total
derivatives (through :math:`\theta = \mu + \sigma\varepsilon`) are, per coordinate:

* analytic KL to a :math:`\mathcal N(0, s^2)` prior (``kl="analytic"``, weights and biases):
  :math:`\log s - \log\sigma + (\sigma^2+\mu^2)/(2s^2) - \tfrac12`, with
  :math:`\partial_\mu = \mu/s^2`, :math:`\partial_\sigma = -1/\sigma + \sigma/s^2`;
* Monte Carlo KL (``kl="monte_carlo"``, and always for a learned noise precision, which has no
  closed form against its Gamma prior — the choice Pyro's ``TraceMeanField_ELBO`` makes too):
  :math:`\log q(\theta) - \log p(\theta) = -\tfrac12\varepsilon^2 - \log\sigma - \tfrac12\log 2\pi
  - \log \pi_0(\theta)` in unconstrained space (the Jacobians of :math:`q` and :math:`p` cancel),
  where :math:`\log\pi_0` is :meth:`~pyrobdl.flat.FlatLogJoint.log_prior`; the total derivative
  of :math:`\log q(\theta(\mu,\sigma))` is :math:`0` in :math:`\mu` and :math:`-1/\sigma` in
  :math:`\sigma`.

A point-mass guide (:class:`~pyrobdl.guides.MAP`) has loss
:math:`-[A(\theta) + \beta \log p(c(\theta))]`: the prior in constrained space, without the
log-Jacobian, as Pyro's ``Delta`` guide gives.

With local reparameterization (:class:`~pyrobdl.guides.MeanField` ``local_reparameterization=True``)
the weights reach the likelihood through sampled pre-activations, :math:`a = h\mu_W^\top + b +
\sqrt{h^2\sigma_W^{2\top}}\odot\xi`, one standard normal :math:`\xi` per particle, data point and
unit (the draws of :class:`~pyrobdl.poutine.LocalReparameterizationMessenger`); the weights
sampled from :math:`\varepsilon` then enter only a Monte Carlo KL, as under Pyro's ELBOs.

MC dropout and variational dropout (with local reparameterization) have their own closed forms
and derivatives in :mod:`pyrobdl.inference.flat_dropout` and :mod:`pyrobdl.inference.flat_vd`
(``tests/test_flat_dropout.py``).

``tests/test_flat_elbo.py`` holds value and gradient equal to Pyro's ``Trace_ELBO`` and
``TraceMeanField_ELBO`` on the unchanged model and guide for the same draws (the noise
recovered from Pyro's guide trace), in float64, for every supported likelihood, KL treatment and
number of particles.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .._grad import no_grad
from ..flat import FlatLogJoint
from . import numpy_elbo

__all__ = ["FlatELBO", "delta_loss_and_grad", "flat_support", "normal_loss_and_grad"]

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


def flat_support(model: Any, guide: Any, analytic_kl: bool = True) -> str | None:
    """Why the flat path cannot run this model and guide, or None when it can.

    Parameters
    ----------
    model : pyrobdl.BayesianMLP
    guide : pyrobdl.guides.BNNGuide
    analytic_kl : bool, default True
        The KL treatment that will be asked for.

    Returns
    -------
    str or None
        A reason in words (e.g. the guide has no packed family, or the prior is not Gaussian).
    """
    family = getattr(guide, "flat_family", lambda: None)()
    if family is None:
        return f"{type(guide).__name__} (as configured) has no packed family for the flat path"
    if family[0] == "dropout" and guide.kind == "gaussian" and not analytic_kl:
        return "Dropout(kind='gaussian') with a Monte Carlo KL (its rank-one log-density) has no flat form"
    try:
        # the checks of FlatLogJoint, without data; variational dropout brings its own KL to
        # the (improper) log-uniform prior, so only the likelihood and network are checked
        from ..flat import _check_supported

        _check_supported(model, prior=family[0] != "variational_dropout")
    except (TypeError, ValueError) as err:
        return str(err)
    return None


class FlatELBO(torch.nn.Module):
    r"""Negative ELBO of a packed guide, and its exact gradient without autograd.

    Parameters
    ----------
    model : pyrobdl.BayesianMLP
        Gaussian prior; Gaussian, learned-precision Gaussian or categorical likelihood; relu or
        tanh (see :class:`~pyrobdl.flat.FlatLogJoint`).
    guide : pyrobdl.guides.MeanField, MAP, Dropout or VariationalDropout
        A guide whose :meth:`flat_family` is not None (the dropout families are computed by
        :mod:`pyrobdl.inference.flat_dropout` and :mod:`pyrobdl.inference.flat_vd`; variational dropout
        needs no Gaussian prior).
    num_particles : int, default 1
        Monte Carlo samples per step, evaluated as one batch.
    analytic_kl : bool, default True
        Closed-form KL for the weights and biases (Monte Carlo otherwise); ignored for a
        point-mass guide.  A Gaussian-rows :class:`~pyrobdl.guides.Dropout` needs it.

    Attributes
    ----------
    kl_weight : float
        :math:`\beta`, set by the loop for KL annealing.

    Raises
    ------
    ValueError
        If :func:`flat_support` gives a reason, or the guide's packed vectors do not match the
        model's flat layout.
    """

    def __init__(self, model: Any, guide: Any, num_particles: int = 1, analytic_kl: bool = True) -> None:
        super().__init__()
        reason = flat_support(model, guide, analytic_kl)
        if reason is not None:
            raise ValueError(f"the flat ELBO cannot run: {reason}")
        self.model = model
        self.guide = guide
        self.num_particles = int(num_particles)
        self.analytic_kl = bool(analytic_kl)
        self.kl_weight = 1.0
        self.family, params = guide.flat_family()
        self._params = params
        self._lj: FlatLogJoint | None = None
        self._data: tuple[torch.Tensor, torch.Tensor] | None = None
        self._check_layout(params)
        self._plan: Any = None
        self._numpy_step: Any = None  # numpy_elbo.NumpyStep of the present log joint and parameters

    def _check_layout(self, params: dict[str, torch.Tensor]) -> None:
        from ..flat import FlatLayout

        layout = FlatLayout(self.model)
        names = [s.name for s in self.guide.site_specs]
        size = params["loc"].numel()
        if params.get("fallback") is not None:  # Dropout: the fallback's [loc, rho] of the last sites
            size += params["fallback"].numel() // 2
        if names != [s.name for s in layout.sites] or size != layout.size:
            raise ValueError(
                f"the guide's packed sites {names} ({params['loc'].numel()} numbers) do not match the "
                f"model's flat layout {[s.name for s in layout.sites]} ({layout.size})"
            )

    def parameters_to_optimize(self) -> list[torch.Tensor]:
        """The one packed vector the optimizer steps (the guide's per-site parameters are views).

        Re-reads it from the guide (repairing the packing if something broke it); the steps use
        the vector returned by the last call.
        """
        _, self._params = self.guide.flat_family()
        return self._vectors()

    def _vectors(self) -> list[torch.Tensor]:
        vectors = [self._params["vector"]]
        if self._params.get("fallback") is not None:  # Dropout: the learned precision's [loc, rho]
            vectors.append(self._params["fallback"])
        return vectors

    def _vector_owners(self) -> list[Any]:
        """The guide module whose packed group ``"params"`` each vector of :meth:`_vectors` is."""
        owners = [self.guide]
        if self._params.get("fallback") is not None:
            owners.append(self.guide.fallback)
        return owners

    def _log_joint(self, x: torch.Tensor, y: torch.Tensor) -> FlatLogJoint:
        if self._lj is None or self._data[0] is not x or self._data[1] is not y:
            from .flat_dropout import DropoutPlan
            from .flat_vd import VDPlan

            vd = self.family == "variational_dropout"
            self._lj = FlatLogJoint(self.model, x, y, prior=not vd)
            self._data = (x, y)
            if vd:
                self._plan = VDPlan(self.guide, self._lj)
            else:
                # the prior precision 1/s^2 of every coordinate (0 for a learned precision) and
                # the constant of the closed-form Gaussian KL
                prec = self._lj._prior_prec
                self._prec = prec
                self._kl_const = float((-0.5 * prec[prec > 0].log() - 0.5).sum())
                if self.family == "dropout":
                    self._plan = DropoutPlan(self.guide, self._lj)
                elif self.family == "normal" and self.guide.local_reparameterization:
                    from .flat_vd import NormalLRTPlan

                    self._plan = NormalLRTPlan(self._lj)
        return self._lj

    # ---------------------------------------------------------------------------- the step
    def loss_and_grad(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        subsample: torch.Tensor | None = None,
        noise: torch.Tensor | dict | None = None,
    ) -> torch.Tensor:
        """Negative ELBO (a detached scalar); sets the ``.grad`` of the packed vectors.

        Parameters
        ----------
        x, y : torch.Tensor
            Training data (the same tensors every step: the flat log joint is built once).
        subsample : torch.Tensor, optional
            Minibatch indices; the likelihood is scaled by N/B.
        noise : torch.Tensor or dict, optional
            The draws of the step (default: drawn here), for tests that replay a Pyro trace:
            the standard normals ``[S, P]``; for the dropout families a dict with ``"eps"``
            (those), ``"multipliers"`` (MC dropout, ``[S, U]``, one per input unit of every
            layer in order) and ``"preactivations"`` (mean field and variational dropout with
            local reparameterization, one ``[S, B, out]`` per layer).
        """
        step = self._numpy_step  # a small CPU step (mean field, MAP, MC or variational dropout): all in numpy
        if noise is None and step is not None and step.serves(self, x, y, subsample):
            return step.run(self, subsample)
        # inference mode: no autograd bookkeeping on the step's small ops (the SVI loop's own
        # path; forward() keeps autograd's); the gradients are only read outside it
        with torch.inference_mode():
            loss, grads = self._loss_and_grads(x, y, subsample, noise)
        for v, g in zip(self._vectors(), grads):
            v.grad = g
        if step is None or not step.current(self):
            self._numpy_step = self._make_numpy_step()
        return loss

    def _make_numpy_step(self) -> Any:
        """A :class:`~pyrobdl.inference.numpy_elbo.NumpyStep` for the present log joint and parameters,
        drawing the noise as the general path does (:meth:`_loss_and_grads`)."""
        from . import flat_vd

        s = self.num_particles
        if self.family == "variational_dropout":
            guide, plan, lj = self.guide, self._plan, self._lj
            return numpy_elbo.NumpyStep(self, lambda batch: flat_vd.vd_noise(guide, plan, s, batch, lj),
                                        flat_vd._VAR_FLOOR)
        if self.family == "dropout":
            from . import flat_dropout

            guide, plan, lj = self.guide, self._plan, self._lj
            return numpy_elbo.NumpyStep(self, lambda batch: flat_dropout.dropout_noise(guide, plan, s, lj))
        if self._plan is not None:  # mean field with local reparameterization
            plan, lj = self._plan, self._lj
            return numpy_elbo.NumpyStep(self, lambda batch: flat_vd.normal_lrt_noise(plan, s, batch, lj),
                                        flat_vd._VAR_FLOOR)
        loc = self._params["loc"]
        p, dtype, device = loc.shape[0], loc.dtype, loc.device
        return numpy_elbo.NumpyStep(self, lambda batch: torch.randn(s, p, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, y: torch.Tensor, subsample: torch.Tensor | None = None) -> torch.Tensor:
        """The negative ELBO as a differentiable scalar, like every other loss of the SVI loop.

        ``loss.backward()`` gives the guide's per-site parameters their gradients (the exact
        gradient computed with the value, handed to autograd); the SVI loop itself calls
        :meth:`loss_and_grad` and skips autograd altogether.
        """
        sites = [
            owner._parameters[n + "_unconstrained"] for owner in self._vector_owners() for n in owner._packs["params"]
        ]
        return _FlatLoss.apply(self, x, y, subsample, *sites)


    @no_grad
    def _loss_and_grads(
        self, x: torch.Tensor, y: torch.Tensor, subsample: torch.Tensor | None, noise: torch.Tensor | dict | None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        lj = self._log_joint(x, y)
        beta = self.kl_weight
        if self.family == "dropout":
            from . import flat_dropout as fd

            if noise is None:
                noise = fd.dropout_noise(self.guide, self._plan, self.num_particles, lj)
            return fd.dropout_loss_and_grads(self.guide, self._plan, lj, self._params["loc"],
                                             self._params["fallback"], noise, subsample, self.analytic_kl, beta)
        if self.family == "variational_dropout":
            from . import flat_vd

            if noise is None:
                batch = lj.num_data if subsample is None else subsample.shape[-1]
                noise = flat_vd.vd_noise(self.guide, self._plan, self.num_particles, batch, lj)
            return flat_vd.vd_loss_and_grads(self.guide, self._plan, lj, self._params["loc"], self._params["spread"],
                                             noise, subsample, self.analytic_kl, beta)
        if self._plan is not None:  # mean field with local reparameterization
            from . import flat_vd

            if noise is None:
                batch = lj.num_data if subsample is None else subsample.shape[-1]
                noise = flat_vd.normal_lrt_noise(self._plan, self.num_particles, batch, lj)
            loss, grad = self._loss_and_grads_normal(lj, beta, subsample, noise["eps"], noise["preactivations"])
            return loss, [grad]
        if isinstance(noise, dict):
            noise = noise["eps"]
        loss, grad = self._loss_and_grads_normal(lj, beta, subsample, noise)
        return loss, [grad]

    def _loss_and_grads_normal(
        self, lj: FlatLogJoint, beta: float, subsample: torch.Tensor | None, noise: torch.Tensor | None,
        preactivations: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.family == "delta":
            return delta_loss_and_grad(lj, self._params["loc"], subsample, beta)
        loc, rho = self._params["loc"], self._params["scale"]
        eps = torch.randn(self.num_particles, loc.shape[0], dtype=loc.dtype, device=loc.device) if noise is None else noise
        return normal_loss_and_grad(lj, self._kl_terms(), loc, rho, eps, subsample, beta, self._plan, preactivations)

    def _kl_terms(self) -> tuple[torch.Tensor, float, bool]:
        """The prior precisions, the closed-form KL's constant and whether the KL is analytic."""
        return self._prec, self._kl_const, self.analytic_kl


def delta_loss_and_grad(
    lj: FlatLogJoint, theta: torch.Tensor, subsample: torch.Tensor | None, beta: Any, functional: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""A point-mass guide's loss :math:`-[A(\theta) + \beta \log p(c(\theta))]` ``[]`` and its gradient ``[P]``.

    ``beta`` may be a 0-d tensor; ``functional``: no ``out=`` writes and no branch on ``beta``
    (for ``torch.compile``, :mod:`pyrobdl.inference.flat_step`).
    """
    if functional:
        ll, g = lj._value_and_grad(theta.unsqueeze(0), subsample, False, functional=True)
    else:
        ll, g = lj.value_and_grad(theta.unsqueeze(0), subsample, prior=False)
    lp, gp = lj.log_prior(theta.unsqueeze(0))
    u = lj.precision_index
    if u is not None:  # a Delta guide scores the prior of tau itself: no log-Jacobian u
        lp = lp - theta[u]
        gp[:, u] -= 1.0
    if functional or beta != 1.0:
        lp, gp = beta * lp, gp.mul_(beta)
    return -(ll[0] + lp[0]), gp[0].add_(g[0]).neg_()


def normal_loss_and_grad(
    lj: FlatLogJoint,
    kl_terms: tuple[torch.Tensor, float, bool],
    loc: torch.Tensor,
    rho: torch.Tensor,
    eps: torch.Tensor,
    subsample: torch.Tensor | None,
    beta: Any,
    plan: Any = None,
    preactivations: list[torch.Tensor] | None = None,
    functional: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""A mean-field guide's negative ELBO ``[]`` and its gradient in ``[loc, rho]`` ``[2P]``.

    ``kl_terms``: (prior precisions ``[P]``, the closed-form KL's constant, analytic or Monte
    Carlo KL); ``eps`` ``[S, P]``: the standard normals of the step; ``plan`` and
    ``preactivations``: local reparameterization (:class:`~pyrobdl.inference.flat_vd.NormalLRTPlan`).
    ``beta`` may be a 0-d tensor; ``functional``: no ``out=`` writes and no branch on ``beta``
    (for ``torch.compile``, :mod:`pyrobdl.inference.flat_step`; the same operations otherwise).
    """
    if numpy_elbo.normal_usable(lj, eps, kl_terms, subsample, beta, preactivations, functional):
        return numpy_elbo.normal_loss_and_grad(lj, kl_terms, loc, rho, eps, subsample, beta)  # small CPU steps
    s = eps.shape[0]
    sigma = torch.nn.functional.softplus(rho)
    theta = torch.addcmul(loc, sigma, eps)  # [S, P]
    if preactivations is not None:  # the weights reach the likelihood through sampled pre-activations, not theta
        from .flat_vd import _lrt_likelihood

        ll, g_mu, g_var, g = _lrt_likelihood(plan, lj, loc, sigma * sigma, theta, subsample, preactivations, functional)
    elif functional:
        ll, g = lj._value_and_grad(theta, subsample, False, functional=True)
    else:
        ll, g = lj.value_and_grad(theta, subsample, prior=False)
    kl, d_loc, d_sigma = _normal_kl(lj, kl_terms, loc, sigma, theta, eps, lj.const)
    if s == 1:
        g_loc, g_sigma = g[0], g[0] * eps[0]
    else:
        g_loc, g_sigma = g.mean(0), (g * eps).mean(0)
    if preactivations is not None:  # g is zero at the weights: their terms come from the LRT
        # (g_mu, g_var are zero outside the weights' coordinates: whole vectors, three ops)
        g_loc.add_(g_mu, alpha=1.0 / s)
        g_sigma.add_(sigma * g_var, alpha=2.0 / s)
    weighted = functional or beta != 1.0
    if weighted:
        d_loc.mul_(beta)
        d_sigma.mul_(beta)
    loss = (beta * kl - ll).mean() if weighted else (kl - ll).mean()
    if functional:
        return loss, torch.cat([d_loc - g_loc, (d_sigma - g_sigma) * torch.sigmoid(rho)])
    grad = torch.empty(2 * loc.shape[0], dtype=loc.dtype, device=loc.device)
    torch.sub(d_loc, g_loc, out=grad[: loc.shape[0]])
    torch.mul(d_sigma.sub_(g_sigma), torch.sigmoid(rho), out=grad[loc.shape[0] :])
    return loss, grad


def _normal_kl(
    lj: FlatLogJoint, kl_terms: tuple[torch.Tensor, float, bool], loc: torch.Tensor, sigma: torch.Tensor,
    theta: torch.Tensor, eps: torch.Tensor, c: Any = float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The KL term ``[S]`` (or ``[]``) and its total derivatives in ``loc`` and ``sigma`` ``[P]``; ``c``: the
    numbers as :meth:`FlatLogJoint.const <pyrobdl.flat.FlatLogJoint.const>` makes them (the same bits)."""
    prec, kl_const, analytic = kl_terms
    log_sigma_sum = sigma.log().sum()
    if analytic:
        # closed form where the prior is Gaussian (prec > 0); where prec = 0 these
        # expressions reduce to the -log(sigma) and -1/sigma of the Monte Carlo term
        # kl_const - log_sigma_sum as torch.rsub: Tensor.__rsub__ is a Python wrapper (~3 us a step)
        kl = torch.rsub(log_sigma_sum, c(kl_const)) + c(0.5) * (prec * (sigma * sigma + loc * loc)).sum()
        d_loc = prec * loc
        d_sigma = prec * sigma - sigma.reciprocal()
        u = lj.precision_index
        if u is not None:  # Monte Carlo for the learned precision u = log tau (Gamma prior)
            e = eps[:, u]
            lp, gp = lj.precision_log_prior(theta)  # Gamma + log-Jacobian, and d/du
            kl = kl - 0.5 * e * e - _HALF_LOG_2PI - lp
            d_loc[u] -= gp.mean()
            d_sigma[u] -= (gp * e).mean()
    else:
        lp, gp = lj.log_prior(theta)
        kl = -0.5 * (eps * eps).sum(-1) - log_sigma_sum - loc.shape[0] * _HALF_LOG_2PI - lp
        d_loc = gp.mean(0).neg_()
        d_sigma = (gp * eps).mean(0).neg_().sub_(sigma.reciprocal())
    return kl, d_loc, d_sigma


class _FlatLoss(torch.autograd.Function):
    """Autograd wrapper of :meth:`FlatELBO._loss_and_grads` over the per-site parameters."""

    @staticmethod
    def forward(ctx: Any, elbo: FlatELBO, x: torch.Tensor, y: torch.Tensor, subsample: Any, *sites: torch.Tensor) -> torch.Tensor:
        elbo.parameters_to_optimize()  # the packed vectors behind `sites` (repaired if needed)
        loss, grads = elbo._loss_and_grads(x, y, subsample, None)
        ctx.shapes = [p.shape for p in sites]
        ctx.save_for_backward(torch.cat(grads))
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        (grad,) = ctx.saved_tensors
        grads, start = [], 0
        for shape in ctx.shapes:
            n = shape.numel()
            grads.append((grad_output * grad[start : start + n]).view(shape))
            start += n
        return (None, None, None, None, *grads)
