r"""Dropout as variational inference: MC dropout (Gal & Ghahramani, 2016) as a Pyro guide."""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import pyro.distributions as dist
import torch
from pyro.nn import PyroParam

from .._validation import check_inputs
from ..posterior import Prediction, predictive_from_draws
from ._dropout_dists import BernoulliDropoutRows, DropoutRows, GaussianDropoutRows
from .base import BNNGuide, init_values
from .mean_field import MeanField

__all__ = ["DROPOUT_KINDS", "Dropout"]

#: Values of ``Dropout(kind=...)`` and the distribution of a weight matrix each one selects.
DROPOUT_KINDS: dict[str, type[DropoutRows]] = {
    "bernoulli": BernoulliDropoutRows,
    "gaussian": GaussianDropoutRows,
}


def _check_rate(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number in (0, 1), got {type(value).__name__}")
    if not (math.isfinite(value) and 0.0 < value < 1.0):
        raise ValueError(f"{name} must be a drop probability in (0, 1), got {value!r}")
    return float(value)


def _layer_rates(p: float | Sequence[float], num_layers: int) -> tuple[float, ...]:
    if isinstance(p, (list, tuple)):
        if len(p) != num_layers:
            raise ValueError(f"p has {len(p)} entries but the network has {num_layers} layers")
        return tuple(_check_rate(f"p[{i}]", v) for i, v in enumerate(p))
    return (_check_rate("p", p),) * num_layers


class _SiteSubset:
    """A view of a model exposing only some of its latent sites (enough for a guide's constructor)."""

    def __init__(self, model: Any, names: set[str]) -> None:
        self.sites = tuple(s for s in model.sites if s.name in names)
        self._priors = {k: v for k, v in model.prior_distributions().items() if k in names}

    def prior_distributions(self) -> dict[str, dist.Distribution]:
        return dict(self._priors)


class Dropout(BNNGuide):
    r"""MC dropout as a variational distribution over the weights (Gal & Ghahramani, 2016).

    For layer :math:`\ell` with drop probability :math:`p_\ell`, every input unit :math:`j`
    has its vector of outgoing weights :math:`w_j` (column ``j`` of the stored ``[out, in]``
    weight, row :math:`j` of Gal's :math:`M_\ell`) distributed independently as

    .. math:: q(w_j) = (1 - p_\ell)\,\mathcal N(m_j, \sigma^2 I) + p_\ell\,\mathcal N(0, \sigma^2 I)

    (``kind="bernoulli"``), or as :math:`\xi_j m_j + \sigma\epsilon_j`,
    :math:`\xi_j \sim \mathcal N(1, p_\ell/(1 - p_\ell))` (``kind="gaussian"``).  Biases get
    :math:`\mathcal N(m_b, \sigma^2)`.  Only the means :math:`M` and :math:`m_b` are learned;
    :math:`p` and :math:`\sigma` are fixed.  Sites with constrained support (the precision of a
    learned-noise likelihood) get the :class:`~pyrobdl.guides.MeanField` family.

    Parameters
    ----------
    model : pyrobdl.BayesianMLP
        The model whose sites the guide covers.
    p : float or sequence of float, default 0.05
        Drop probability of each layer's *inputs*, as ``torch.nn.Dropout(p)`` (Gal & Ghahramani
        write :math:`p` for the keep probability).  One value for every layer or one per linear
        layer (entry 0 drops the network inputs, entry :math:`\ell` the hidden units feeding
        layer :math:`\ell`).
    sigma : float, default 1e-3
        Standard deviation :math:`\sigma` of the narrow Gaussians (weights and biases).
    kind : {"bernoulli", "gaussian"}, default "bernoulli"
        Bernoulli mixture rows or multiplicative Gaussian rows.
    init_loc : {"linear", "prior", "prior_mean"} or dict, default "linear"
        Initial means; see :func:`pyrobdl.guides.base.init_values`.

    Raises
    ------
    ValueError
        If a drop probability is outside (0, 1), ``p`` has the wrong number of entries,
        ``sigma`` is not a finite number > 0, or ``kind`` is unknown.
    TypeError
        If ``p`` or ``sigma`` is not a number.

    Notes
    -----
    Parameters are ``PyroParam`` attributes ``{site}_loc`` (dots replaced by underscores) for
    weights and biases; other sites live in the sub-guide ``fallback``.

    KL treatments (the ``kl`` option of :func:`pyrobdl.fit`): with ``"monte_carlo"`` (or plain
    ``Trace_ELBO``) the ELBO uses the exact mixture log-density of
    :class:`~pyrobdl.guides._dropout_dists.BernoulliDropoutRows`, an unbiased estimate.  With
    ``"analytic"`` (or ``TraceMeanField_ELBO``) a registered KL is used: Gal's large-K closed
    form for Bernoulli rows, the exact Gaussian KL for Gaussian rows.  See
    ``docs/methods/dropout.md`` for both and for the equivalence with weight decay
    :math:`\lambda = l^2(1-p)/(2N\tau)`.

    MC dropout prediction is ``posterior.predict`` (draws from this guide); the deterministic
    "weight-averaging" prediction is :meth:`weight_averaged_prediction`.

    References
    ----------
    Y. Gal, Z. Ghahramani. Dropout as a Bayesian Approximation: Representing Model Uncertainty
    in Deep Learning. ICML 2016 (appendix: arXiv:1506.02157).

    Examples
    --------
    >>> guide = Dropout(model, p=0.05)
    >>> svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), pyro.infer.Trace_ELBO())
    """

    def __init__(
        self,
        model: Any,
        p: float | Sequence[float] = 0.05,
        sigma: float = 1e-3,
        kind: str = "bernoulli",
        init_loc: str | Mapping[str, torch.Tensor] = "linear",
    ) -> None:
        num_layers = len(model.layers)
        rates = _layer_rates(p, num_layers)
        if isinstance(sigma, bool) or not isinstance(sigma, (int, float)):
            raise TypeError(f"sigma must be a number > 0, got {type(sigma).__name__}")
        if not (math.isfinite(sigma) and sigma > 0):
            raise ValueError(f"sigma must be a finite number > 0, got {sigma!r}")
        if kind not in DROPOUT_KINDS:
            raise ValueError(f"unknown kind {kind!r}; valid: {sorted(DROPOUT_KINDS)}")
        super().__init__(model)
        self.p = rates
        self.sigma = float(sigma)
        self.kind = kind
        self._rows = DROPOUT_KINDS[kind]
        layer_of = {s.name: (s.layer, s.kind) for s in model.sites}
        self._layout: dict[str, tuple[int, str]] = {}
        real = [s for s in self.site_specs if s.is_real and s.name in layer_of]
        values = init_values(real, init_loc)
        for s in real:
            self._layout[s.name] = layer_of[s.name]
            setattr(self, f"{s.key}_loc", PyroParam(values[s.name].detach().clone()))
        others = {s.name for s in self.site_specs} - set(self._layout)
        # Constrained sites reuse the mean-field family rather than a copy of it.
        self.fallback = MeanField(_SiteSubset(model, others)) if others else None
        # every weight and bias mean is a view of one vector in the flat layout's order (the
        # layout puts the likelihood's latents, which the fallback holds, after them)
        self._pack("params", [f"{s.key}_loc" for s in real])

    def flat_family(self) -> tuple[str, dict[str, Any]] | None:
        r"""The guide as packed vectors for pyrobdl's flat hot path.

        Returns
        -------
        ("dropout", dict) or None
            ``{"vector": m, "loc": m, "fallback": v or None}``: ``m`` ``[P_w]`` holds every
            weight and bias mean (:math:`M` and :math:`m_b`) in the flat layout's order; ``v``
            is the fallback :class:`~pyrobdl.guides.MeanField`'s packed ``[loc, rho]`` of the
            remaining sites (a learned noise precision), which the layout puts last.  None for a
            subclass that changes the family.
        """
        if type(self).variational_distributions is not Dropout.variational_distributions:
            return None
        m = self.packed("params")
        fallback = None
        if self.fallback is not None:
            fam = self.fallback.flat_family()
            if fam is None:
                return None
            fallback = fam[1]["vector"]
        return "dropout", {"vector": m, "loc": m, "fallback": fallback}

    def extra_repr(self) -> str:
        return f"p={self.p}, sigma={self.sigma}, kind={self.kind!r}"

    def variational_distributions(self) -> dict[str, dist.Distribution]:
        out: dict[str, dist.Distribution] = {}
        for s in self.site_specs:
            if s.name not in self._layout:
                continue
            loc = getattr(self, f"{s.key}_loc")
            layer, kind = self._layout[s.name]
            if kind == "weight":
                out[s.name] = self._rows(loc, self.p[layer], self.sigma)
            else:
                out[s.name] = dist.Normal(loc, self.sigma, validate_args=False).to_event(s.event_dim)
        if self.fallback is not None:
            out.update(self.fallback.variational_distributions())
        return {s.name: out[s.name] for s in self.site_specs}

    @torch.no_grad()
    def weight_averaged_params(self) -> dict[str, torch.Tensor]:
        r"""Dropout switched off, weights scaled: the mean of :math:`q` for weights and biases.

        Returns
        -------
        dict
            Site name -> tensor of the site's shape: :math:`(1-p_\ell)M_\ell` for Bernoulli
            rows, :math:`M_\ell` for Gaussian rows (already scaled, the inverted-dropout
            convention), bias means, and for constrained sites (a learned precision) the
            fallback's median, the transformed location.
        """
        qs = self.variational_distributions()
        params = {}
        for s in self.site_specs:
            if s.name in self._layout:
                params[s.name] = qs[s.name].mean.detach().clone()
            else:
                loc = getattr(self.fallback, f"{s.key}_loc")
                params[s.name] = torch.distributions.biject_to(s.support)(loc).detach().clone()
        return params

    @torch.no_grad()
    def weight_averaged_prediction(self, model: Any, x: torch.Tensor) -> Prediction:
        """The deterministic "standard dropout" prediction at ``x`` (one pass, scaled weights).

        Parameters
        ----------
        model : pyrobdl.BayesianMLP
            The model the guide was trained for.
        x : array-like
            Inputs ``[N, in_features]``.

        Returns
        -------
        Prediction
            One "draw" (``samples`` is ``[1, N, out]``), zero epistemic variance; for a
            Gaussian likelihood the variance is the observation noise :math:`\\tau^{-1}` alone.
        """
        x = check_inputs(model, x).to(model.device)
        draws = {k: v.unsqueeze(0) for k, v in self.weight_averaged_params().items()}
        return predictive_from_draws(model, draws, x)
