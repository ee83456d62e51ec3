r"""Mean-field Gaussian guide: Bayes by Backprop (Blundell et al., 2015)."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Mapping

import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from pyro.nn import PyroParam

from .._validation import positive_number
from ..poutine import LocalReparameterizationMessenger
from .base import BNNGuide, init_values

__all__ = ["MeanField"]




def _inverse_softplus(x: torch.Tensor) -> torch.Tensor:
    return x + torch.log(-torch.expm1(-x))


class MeanField(BNNGuide):
    r"""Fully factorised Gaussian over every weight and bias: Bayes by Backprop.

    :math:`q(w) = \prod_i \mathcal N(w_i; \mu_i, \sigma_i^2)` with
    :math:`\sigma_i = \operatorname{softplus}(\rho_i)`.  Sites with constrained support (the
    noise precision of a learned-noise likelihood) get a Gaussian in the unconstrained space
    pushed through ``biject_to(support)`` (a log-normal for a positive site).

    Parameters
    ----------
    model : pyrobdl.BayesianMLP
        The model whose sites the guide covers.
    init_scale : float, default 1e-2
        Initial standard deviation :math:`\sigma` of every site (> 0).
    init_loc : {"linear", "prior", "prior_mean"} or dict, default "linear"
        Initial means; see :func:`pyrobdl.guides.base.init_values`.
    local_reparameterization : bool, default False
        Sample pre-activations instead of weights while training (Kingma et al., 2015); see
        :meth:`training_context`.

    Notes
    -----
    The guide's sample sites are the Normal distributions themselves, so
    ``TraceMeanField_ELBO`` uses the analytic KL to a Gaussian prior (``register_kl``), and
    ``Trace_ELBO`` a Monte Carlo estimate of it.  Parameters are ``PyroParam`` attributes named
    ``{site}_loc`` and ``{site}_scale`` with dots replaced by underscores, e.g.
    ``layers_0_weight_scale``; the scale is stored through the softplus transform
    (``constraints.softplus_positive``).  The per-site parameters are views of one packed
    vector (:meth:`BNNGuide.packed`, group ``"params"``: every loc, then every scale, each half
    laid out like :class:`pyrobdl.flat.FlatLayout`), which pyrobdl's flat ELBO updates in one
    operation.

    References
    ----------
    C. Blundell, J. Cornebise, K. Kavukcuoglu, D. Wierstra. Weight Uncertainty in Neural
    Networks. ICML 2015.
    """

    def __init__(
        self,
        model: Any,
        init_scale: float = 1e-2,
        init_loc: str | Mapping[str, torch.Tensor] = "linear",
        local_reparameterization: bool = False,
    ) -> None:
        super().__init__(model)
        init_scale = positive_number("init_scale", init_scale)
        self.local_reparameterization = bool(local_reparameterization)
        values = init_values(self.site_specs, init_loc)
        self._transforms = {}
        for s in self.site_specs:
            transform = torch.distributions.biject_to(s.support)
            self._transforms[s.name] = transform
            loc = transform.inv(values[s.name])
            setattr(self, f"{s.key}_loc", PyroParam(loc.detach().clone()))
            setattr(
                self,
                f"{s.key}_scale",
                PyroParam(torch.full_like(loc, init_scale), constraint=constraints.softplus_positive),
            )
        # every site's loc and scale is a view of one vector [locs..., scales...], each half in
        # the flat layout's order
        self._pack("params", [f"{s.key}_loc" for s in self.site_specs] + [f"{s.key}_scale" for s in self.site_specs])

    def flat_family(self) -> tuple[str, dict[str, torch.Tensor]] | None:
        r"""The guide as packed vectors for pyrobdl's flat hot path.

        Returns
        -------
        ("normal", {"vector": v, "loc": mu, "scale": rho}) or None
            ``v`` is the packed parameter vector ``[2P]``; ``mu = v[:P]`` and the unconstrained
            ``rho = v[P:]`` (:math:`\sigma = \operatorname{softplus}(\rho)`) are its views over
            every site in the model's order, in unconstrained space (a positive site's
            coordinates are its logarithm); None when the guide must go through its
            distributions (a subclass that changes the family, e.g.
            :class:`~pyrobdl.guides.ScoreFunction`).  With ``local_reparameterization`` the
            flat path samples the weights' pre-activations itself
            (:mod:`pyrobdl.inference.flat_elbo`).
        """
        if type(self).variational_distributions is not MeanField.variational_distributions:
            return None
        v = self.packed("params")
        half = v.shape[0] // 2
        return "normal", {"vector": v, "loc": v[:half], "scale": v[half:]}

    def variational_distributions(self) -> dict[str, dist.Distribution]:
        out = {}
        for s in self.site_specs:
            loc = self.param(f"{s.key}_loc")
            scale = self.param(f"{s.key}_scale")
            q: dist.Distribution = dist.Normal(loc, scale, validate_args=False)
            if not s.is_real:
                q = dist.TransformedDistribution(q, [self._transforms[s.name]], validate_args=False)
            out[s.name] = q.to_event(s.event_dim) if s.event_dim else q
        return out

    def training_context(self) -> ContextManager[Any]:
        """The local reparameterization handler when enabled, else a no-op context.

        With plain ``pyro.infer.SVI``, wrap the steps: ``with guide.training_context():
        svi.step(x, y)``.  Without it the guide samples weights, which gives the same ELBO with a
        higher-variance gradient.  ``pyrobdl.fit`` enters it for you.
        """
        if not self.local_reparameterization:
            return contextlib.nullcontext()
        return LocalReparameterizationMessenger(s.name for s in self.site_specs if s.name.endswith(".weight"))
