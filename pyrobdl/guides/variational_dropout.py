r"""Variational dropout with a log-uniform prior (Kingma et al. 2015; Molchanov et al. 2017).

Every weight gets :math:`q(w) = \mathcal N(\theta, \sigma^2)` with the *additive*
reparameterization (:math:`\theta` and :math:`\log\sigma^2` are the parameters, so the dropout
rate :math:`\alpha = \sigma^2/\theta^2` can grow without the gradient noise of the
multiplicative form), the KL divergence to the improper log-uniform prior
(:class:`pyrobdl.priors.LogUniform`) is a registered approximation (``register_kl``, so both
:class:`pyrobdl.inference.DirectELBO` and Pyro's ``TraceMeanField_ELBO`` use it), and the local
reparameterization trick is on while training.  Weights whose :math:`\log\alpha` exceeds a
threshold carry no information and are pruned (:meth:`VariationalDropout.prune`).
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass
from typing import Any, ContextManager, Mapping

import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from pyro.distributions.util import broadcast_shape  # torch.broadcast_shapes imports sympy on first use
from pyro.nn import PyroParam
from torch.distributions import register_kl

from ..posterior import SVIPosterior
from ..poutine import LocalReparameterizationMessenger
from ..priors import ImproperFlat, ImproperLogUniform, LogUniform
from .base import BNNGuide, init_values

__all__ = [
    "KINGMA_CONSTANTS",
    "KL_APPROXIMATIONS",
    "LOG_ALPHA_RANGE",
    "MOLCHANOV_CONSTANTS",
    "Sparsity",
    "VariationalDropout",
    "VariationalDropoutNormal",
    "kl_log_uniform",
    "pruned_posterior",
]

#: Clipping range of :math:`\log\alpha` (Molchanov et al. 2017, section 4.2 and their code).
LOG_ALPHA_RANGE = (-8.0, 8.0)
#: :math:`(k_1, k_2, k_3)` of Molchanov et al. 2017, eq. (14); REFERENCES.md section 2.
MOLCHANOV_CONSTANTS = (0.63576, 1.87320, 1.48695)
#: :math:`(c_0, c_1, c_2, c_3)`: :math:`c_{1..3}` from Kingma et al. 2015, eq. (11)
#: (REFERENCES.md section 2).  Their constant is left free in the paper; :math:`c_0` puts the
#: approximation on Molchanov's normalisation (:math:`-\mathrm{KL}\to 0` as
#: :math:`\alpha\to\infty`): it is the least-squares offset to the exact :math:`-\mathrm{KL}` on
#: a uniform grid of :math:`\log\alpha\in[-8, 0]` (recomputed in
#: ``tests/test_variational_dropout.py``).
KINGMA_CONSTANTS = (-0.65222, 1.16145124, -1.50204118, 0.58629921)
#: Values of the KL approximation a :class:`VariationalDropoutNormal` carries.
KL_APPROXIMATIONS = ("molchanov", "kingma", "ard")
# Molchanov's code adds this to theta^2 inside the log so that theta = 0 gives a finite log alpha.
_EPS = 1e-8


def kl_log_uniform(log_alpha: torch.Tensor, approximation: str = "molchanov") -> torch.Tensor:
    r"""Elementwise KL divergence from :math:`\mathcal N(\theta, \alpha\theta^2)` to the log-uniform prior.

    Parameters
    ----------
    log_alpha : torch.Tensor
        :math:`\log\alpha`, already clipped (to :data:`LOG_ALPHA_RANGE`, and to
        :math:`\le 0` for ``"kingma"``).
    approximation : {"molchanov", "kingma", "ard"}, default "molchanov"
        Which approximation to evaluate.

    Returns
    -------
    torch.Tensor
        The KL, same shape as ``log_alpha``.

    Raises
    ------
    ValueError
        For an unknown ``approximation``.

    Notes
    -----
    The exact KL is, up to an additive constant, a function of :math:`\alpha` alone:

    .. math::

        -\mathrm{KL}(\alpha) = \tfrac12\log\alpha
            - \mathbb E_{\varepsilon\sim\mathcal N(1,\alpha)}\log|\varepsilon| + C.

    ``"molchanov"`` (Molchanov et al. 2017, eq. 14; normalised so that
    :math:`-\mathrm{KL}\to 0` as :math:`\alpha\to\infty`):

    .. math::

        -\mathrm{KL} \approx k_1\,\mathrm{sigmoid}(k_2 + k_3\log\alpha)
            - \tfrac12\log(1 + \alpha^{-1}) - k_1 .

    ``"kingma"`` (Kingma et al. 2015, eq. 11, valid for :math:`\alpha\le 1`):

    .. math::

        -\mathrm{KL} \approx c_0 + \tfrac12\log\alpha + c_1\alpha + c_2\alpha^2 + c_3\alpha^3 .

    ``"ard"``: the KL to a Gaussian prior :math:`\mathcal N(0, \lambda^2)` whose variance is at
    its optimum :math:`\lambda^2 = \theta^2 + \sigma^2` (automatic relevance determination),

    .. math::

        \mathrm{KL} = \tfrac12\log(1 + \alpha^{-1}).

    References
    ----------
    D. P. Kingma, T. Salimans, M. Welling. Variational Dropout and the Local
    Reparameterization Trick. NeurIPS 2015.
    D. Molchanov, A. Ashukha, D. Vetrov. Variational Dropout Sparsifies Deep Neural Networks.
    ICML 2017.
    """
    # log(1 + 1/alpha) = softplus(-log alpha), stable for any log alpha.
    if approximation == "molchanov":
        k1, k2, k3 = MOLCHANOV_CONSTANTS
        # k1 - k1 sigmoid(...) as torch.rsub: Tensor.__rsub__ is a Python wrapper (~3 us a step)
        return torch.rsub(k1 * torch.sigmoid(k2 + k3 * log_alpha), k1) + 0.5 * torch.nn.functional.softplus(-log_alpha)
    if approximation == "kingma":
        c0, c1, c2, c3 = KINGMA_CONSTANTS
        alpha = log_alpha.exp()
        return -(c0 + 0.5 * log_alpha + alpha * (c1 + alpha * (c2 + alpha * c3)))
    if approximation == "ard":
        return 0.5 * torch.nn.functional.softplus(-log_alpha)
    raise ValueError(f"unknown approximation {approximation!r}; valid: {list(KL_APPROXIMATIONS)}")


class VariationalDropoutNormal(dist.Normal):
    r"""The Normal :math:`\mathcal N(\mu, \sigma^2)` of one weight tensor, carrying its :math:`\log\alpha`.

    A plain ``Normal`` for sampling and densities (so Pyro, ``Predictive`` and
    :class:`~pyrobdl.poutine.LocalReparameterizationMessenger` treat it as one) whose only
    addition is the (clipped) :math:`\log\alpha` and the name of the KL approximation to use
    against :class:`~pyrobdl.priors.ImproperLogUniform`; the pair is registered with
    ``torch.distributions.kl.register_kl``.

    Parameters
    ----------
    loc, scale : torch.Tensor
        Mean and standard deviation (``scale`` may be 0 for pruned weights).
    log_alpha : torch.Tensor
        Clipped :math:`\log\alpha`, broadcastable to ``loc``.
    approximation : {"molchanov", "kingma", "ard"}
        KL approximation, see :func:`kl_log_uniform`.
    """

    def __init__(
        self, loc: torch.Tensor, scale: torch.Tensor, log_alpha: torch.Tensor, approximation: str = "molchanov"
    ) -> None:
        if approximation not in KL_APPROXIMATIONS:
            raise ValueError(f"unknown approximation {approximation!r}; valid: {list(KL_APPROXIMATIONS)}")
        super().__init__(loc, scale, validate_args=False)
        self.log_alpha = log_alpha.expand(self.batch_shape)
        self.approximation = approximation

    def expand(self, batch_shape, _instance=None):  # type: ignore[no-untyped-def]
        new = self._get_checked_instance(VariationalDropoutNormal, _instance)
        batch_shape = torch.Size(batch_shape)
        super().expand(batch_shape, _instance=new)
        new.log_alpha = self.log_alpha.expand(batch_shape)
        new.approximation = self.approximation
        return new


@register_kl(VariationalDropoutNormal, ImproperLogUniform)
def _kl_vd_log_uniform(q: VariationalDropoutNormal, p: ImproperLogUniform) -> torch.Tensor:
    if type(p) is not ImproperLogUniform:  # the flat subclass: no KL defined, fall back
        raise NotImplementedError
    kl = kl_log_uniform(q.log_alpha, q.approximation)
    return kl.expand(broadcast_shape(q.batch_shape, p.batch_shape))


@dataclass(frozen=True)
class Sparsity:
    """How many weights a variational-dropout posterior drops.

    Attributes
    ----------
    threshold : float
        Weights with :math:`\\log\\alpha \\ge` ``threshold`` (or already pruned) count as removed.
    removed : Mapping[str, float]
        Fraction of weights removed, per sparsified site (``layers.{i}.weight``, and the biases
        when they have a log-uniform prior).
    kept : Mapping[str, int]
        Number of kept weights per site.
    total : Mapping[str, int]
        Number of weights per site.
    removed_total : float
        Fraction removed over all sparsified sites.
    compression_ratio : float
        All weights / kept weights over the sparsified sites (``inf`` when none is kept).
    """

    threshold: float
    removed: Mapping[str, float]
    kept: Mapping[str, int]
    total: Mapping[str, int]
    removed_total: float
    compression_ratio: float


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def _check_threshold(threshold: Any) -> float:
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
        raise ValueError(f"threshold must be a finite number, got {threshold!r}")
    return float(threshold)


def _check_vd_arguments(model: Any, sparse: Any, ard: Any, init_log_sigma2: Any, init_loc: Any,
                        local_reparameterization: Any) -> tuple[bool, bool, bool]:
    """:class:`VariationalDropout`'s arguments checked before anything is built; the three flags."""
    sparse = _check_bool("sparse", sparse)
    ard = _check_bool("ard", ard)
    local_reparameterization = _check_bool("local_reparameterization", local_reparameterization)
    if not isinstance(getattr(model, "prior", None), LogUniform):
        raise ValueError(
            f"VariationalDropout needs a model with prior=pyrobdl.priors.LogUniform(); got "
            f"{getattr(model, 'prior', None)!r}"
        )
    if ard and not sparse:
        raise ValueError("ard=True needs sparse=True: the ARD KL does not bound alpha")
    if (isinstance(init_log_sigma2, bool) or not isinstance(init_log_sigma2, (int, float))
            or not math.isfinite(init_log_sigma2)):
        raise ValueError(f"init_log_sigma2 must be a finite number, got {init_log_sigma2!r}")
    if isinstance(init_loc, str) and init_loc != "linear":
        raise ValueError(
            f"init_loc must be 'linear' or a dict of tensors, got {init_loc!r} (the log-uniform "
            "prior is improper: it has neither draws nor a mean)"
        )
    return sparse, ard, local_reparameterization


class VariationalDropout(BNNGuide):
    r"""Variational dropout guide: sparse VD (Molchanov 2017), Kingma's VD (2015) or its ARD reading.

    Each weight (and, with ``LogUniform(bias="log_uniform")``, each bias) has
    :math:`q(w_{ij}) = \mathcal N(\theta_{ij}, \sigma_{ij}^2)` with parameters
    :math:`\theta_{ij}` and :math:`\log\sigma^2_{ij}` (additive reparameterization) and dropout
    rate :math:`\alpha_{ij} = \sigma^2_{ij}/\theta^2_{ij}`, i.e. :math:`w = \theta(1 +
    \sqrt\alpha\,\varepsilon)`, Gaussian dropout with a per-weight rate.

    Parameters
    ----------
    model : pyrobdl.BayesianMLP
        A model whose prior is :class:`pyrobdl.priors.LogUniform`.
    sparse : bool, default True
        True: sparse variational dropout, :math:`\log\alpha\in[-8, 8]` and Molchanov's KL
        approximation.  False: Kingma et al.'s variational dropout, :math:`\alpha\le 1` (the
        variance of :math:`q` itself is capped at :math:`\theta^2`) and their approximation.
    ard : bool, default False
        Use the KL :math:`\tfrac12\log(1+\alpha^{-1})` of the automatic-relevance-determination
        reading (a Gaussian prior with per-weight variance at its optimum
        :math:`\theta^2+\sigma^2`) instead of the log-uniform approximation.  Needs
        ``sparse=True`` (ARD does not bound :math:`\alpha`).
    init_log_sigma2 : float, default -10.0
        Initial :math:`\log\sigma^2` of every weight (Molchanov et al.).
    init_loc : "linear" or dict, default "linear"
        Initial :math:`\theta` (``torch.nn.Linear`` initialisation, or values by site name).
    local_reparameterization : bool, default True
        Sample pre-activations instead of weights while training (see
        :meth:`training_context`).

    Raises
    ------
    ValueError
        If the model's prior is not log-uniform, for ``ard=True`` with ``sparse=False``, a
        non-finite ``init_log_sigma2`` or an ``init_loc`` drawing from the improper prior.
    TypeError
        If a flag is not a bool.

    Notes
    -----
    *Biases.*  With the default ``LogUniform(bias="flat")`` each bias is a point estimate, a
    ``Delta`` with a flat improper prior: its KL term is zero (Pyro's ``KL(Delta, p) =
    -log p``), so biases are fitted by maximum likelihood, as in Molchanov et al.'s code.
    *Other latent sites* (the noise precision of a learned-noise likelihood) get a Gaussian in
    their unconstrained space, as in :class:`~pyrobdl.guides.MeanField`, with a Monte Carlo KL.
    *Clipping.*  :math:`\log\alpha` is clipped in the KL only (the sampled variance is
    :math:`\sigma^2` itself), so the KL is flat beyond the clip.
    *Monte Carlo KL* (``kl="monte_carlo"``) estimates the exact log-uniform KL
    :math:`\mathbb E_q[\log q(w) + \log|w|]` regardless of ``sparse``/``ard``; it differs from
    the analytic one by a constant and the approximation error.
    Parameters are ``PyroParam`` attributes ``{site}_theta`` and ``{site}_log_sigma2`` (dots
    replaced by underscores) for sparsified sites, ``{site}_loc`` for point-estimated biases.

    References
    ----------
    D. P. Kingma, T. Salimans, M. Welling. Variational Dropout and the Local
    Reparameterization Trick. NeurIPS 2015.
    D. Molchanov, A. Ashukha, D. Vetrov. Variational Dropout Sparsifies Deep Neural Networks.
    ICML 2017.
    """

    def __init__(
        self,
        model: Any,
        sparse: bool = True,
        ard: bool = False,
        init_log_sigma2: float = -10.0,
        init_loc: str | Mapping[str, torch.Tensor] = "linear",
        local_reparameterization: bool = True,
    ) -> None:
        sparse, ard, local_reparameterization = _check_vd_arguments(model, sparse, ard, init_log_sigma2, init_loc,
                                                                    local_reparameterization)
        super().__init__(model)
        self.sparse = sparse
        self.ard = ard
        self.approximation = "ard" if ard else ("molchanov" if sparse else "kingma")
        self.local_reparameterization = local_reparameterization
        self.sparse_sites = tuple(
            s.name for s in self.site_specs if isinstance(_base(s.prior), ImproperLogUniform)
            and not isinstance(_base(s.prior), ImproperFlat)
        )
        self.point_sites = tuple(s.name for s in self.site_specs if isinstance(_base(s.prior), ImproperFlat))
        self._transforms = {}
        self._init_params(init_values(self.site_specs, init_loc), float(init_log_sigma2))
        # one vector [means (P), spreads]: the means (theta, a point site's loc, another site's
        # unconstrained loc) in the flat layout's order, then log sigma^2 of the sparsified
        # sites and the softplus-scale of the others, in the same order (point sites have none)
        means = [f"{s.key}_theta" if s.name in self.sparse_sites else f"{s.key}_loc" for s in self.site_specs]
        spreads = [f"{s.key}_log_sigma2" for s in self.site_specs if s.name in self.sparse_sites]
        spreads += [f"{s.key}_scale" for s in self.site_specs if s.name not in self.sparse_sites + self.point_sites]
        self._pack("params", means + spreads)

    def _init_params(self, values: Mapping[str, torch.Tensor], init_log_sigma2: float) -> None:
        """Each site's parameters: theta, log sigma^2 and an all-ones mask for a sparsified site, a loc
        for a point site, an unconstrained loc and a softplus scale for any other."""
        for s in self.site_specs:
            v = values[s.name].detach().clone()
            if s.name in self.sparse_sites:
                setattr(self, f"{s.key}_theta", PyroParam(v))
                setattr(self, f"{s.key}_log_sigma2", PyroParam(torch.full_like(v, init_log_sigma2)))
                # all-ones mask: a pruned copy (see prune) replaces it
                self.register_buffer(f"{s.key}_mask", torch.ones_like(v))
            elif s.name in self.point_sites:
                setattr(self, f"{s.key}_loc", PyroParam(v))
            else:
                transform = torch.distributions.biject_to(s.support)
                self._transforms[s.name] = transform
                loc = transform.inv(v)
                setattr(self, f"{s.key}_loc", PyroParam(loc.detach().clone()))
                setattr(
                    self,
                    f"{s.key}_scale",
                    PyroParam(torch.full_like(loc, 1e-2), constraint=constraints.softplus_positive),
                )

    def flat_family(self) -> tuple[str, dict[str, Any]] | None:
        r"""The guide as one packed vector for pyrobdl's flat hot path.

        Returns
        -------
        ("variational_dropout", dict) or None
            ``{"vector": v, "loc": v[:P], "spread": v[P:]}``: ``loc`` holds every site's
            mean in the flat layout's order (:math:`\theta` of sparsified sites, the point of a
            point-estimated bias, the unconstrained location of a learned precision); ``spread``
            holds :math:`\log\sigma^2` of every sparsified site, then the unconstrained
            softplus-scale of the other non-point sites, each in the layout's order.  None for
            a pruned guide (its point masses at zero stay on the distribution path) or a
            subclass that changes the family.
        """
        if type(self).variational_distributions is not VariationalDropout.variational_distributions:
            return None
        if any(bool((getattr(self, f"{s.key}_mask") < 1).any()) for s in self._sparse_specs()):
            return None
        v = self.packed("params")
        size = sum(s.shape.numel() for s in self.site_specs)
        return "variational_dropout", {"vector": v, "loc": v[:size], "spread": v[size:]}

    # ---- the distributions -------------------------------------------------------------------
    def _log_alpha(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(log sigma^2 actually used by q, clipped log alpha) of one sparsified site."""
        theta = getattr(self, f"{key}_theta")
        log_sigma2 = getattr(self, f"{key}_log_sigma2")
        log_theta2 = torch.log(theta * theta + _EPS)
        low, high = LOG_ALPHA_RANGE
        if not self.sparse:
            # Kingma et al. constrain alpha <= 1: cap the variance of q itself at theta^2.
            log_sigma2 = torch.minimum(log_sigma2, log_theta2)
            high = 0.0
        log_alpha = (log_sigma2 - log_theta2).clamp(low, high)
        mask = getattr(self, f"{key}_mask")
        # A pruned weight is a point mass at 0; its KL is taken at the upper clip (~0 for the
        # sparse KL), the value of a weight whose noise has swamped its mean.
        log_alpha = torch.where(mask > 0, log_alpha, torch.full_like(log_alpha, high))
        return log_sigma2, log_alpha

    def variational_distributions(self) -> dict[str, dist.Distribution]:
        out: dict[str, dist.Distribution] = {}
        for s in self.site_specs:
            if s.name in self.sparse_sites:
                theta = getattr(self, f"{s.key}_theta")
                mask = getattr(self, f"{s.key}_mask")
                log_sigma2, log_alpha = self._log_alpha(s.key)
                q: dist.Distribution = VariationalDropoutNormal(
                    theta * mask, (0.5 * log_sigma2).exp() * mask, log_alpha, self.approximation
                )
            elif s.name in self.point_sites:
                out[s.name] = dist.Delta(getattr(self, f"{s.key}_loc"), event_dim=s.event_dim)
                continue
            else:
                q = dist.Normal(getattr(self, f"{s.key}_loc"), getattr(self, f"{s.key}_scale"), validate_args=False)
                if not s.is_real:
                    q = dist.TransformedDistribution(q, [self._transforms[s.name]], validate_args=False)
            out[s.name] = q.to_event(s.event_dim) if s.event_dim else q
        return out

    def training_context(self) -> ContextManager[Any]:
        """The local reparameterization handler over the weight sites when enabled.

        With plain ``pyro.infer.SVI`` wrap the steps: ``with guide.training_context():
        svi.step(x, y)``; ``pyrobdl.fit`` enters it for you.  Without it the guide samples
        whole weight matrices: the same ELBO with a noisier gradient.
        """
        if not self.local_reparameterization:
            return contextlib.nullcontext()
        return LocalReparameterizationMessenger(n for n in self.sparse_sites if n.endswith(".weight"))

    @torch.no_grad()
    def point_params(self) -> dict[str, torch.Tensor]:
        r"""The posterior-mean network (masked :math:`\theta`), ``{name: [1, *shape]}``.

        Molchanov et al. evaluate test error with these weights; pass them to
        :func:`pyrobdl.posterior.predictive_from_draws`.  Constrained sites use the transformed
        mean of their unconstrained Gaussian (the median of :math:`q`).
        """
        out = {}
        for s in self.site_specs:
            if s.name in self.sparse_sites:
                v = getattr(self, f"{s.key}_theta") * getattr(self, f"{s.key}_mask")
            elif s.name in self.point_sites:
                v = getattr(self, f"{s.key}_loc")
            else:
                v = getattr(self, f"{s.key}_loc")
                if not s.is_real:
                    v = self._transforms[s.name](v)
            out[s.name] = v.detach().unsqueeze(0).clone()
        return out

    # ---- sparsification ----------------------------------------------------------------------
    @torch.no_grad()
    def log_alpha(self) -> dict[str, torch.Tensor]:
        r"""Clipped :math:`\log\alpha` of every sparsified site (pruned weights at the upper clip).

        Returns
        -------
        dict
            Site name (``layers.{i}.weight``, biases too with a log-uniform bias prior) ->
            tensor of the site's shape.
        """
        return {s.name: self._log_alpha(s.key)[1].detach().clone() for s in self._sparse_specs()}

    def _sparse_specs(self) -> list[Any]:
        return [s for s in self.site_specs if s.name in self.sparse_sites]

    def _keep(self, threshold: float) -> dict[str, torch.Tensor]:
        out = {}
        for s in self._sparse_specs():
            la = self._log_alpha(s.key)[1]
            out[s.name] = (la < threshold) & (getattr(self, f"{s.key}_mask") > 0)
        return out

    @torch.no_grad()
    def sparsity(self, threshold: float = 3.0) -> Sparsity:
        r"""Fraction of weights with :math:`\log\alpha \ge` ``threshold``, per site and in total.

        Parameters
        ----------
        threshold : float, default 3.0
            Pruning threshold on the clipped :math:`\log\alpha` (Molchanov et al. use 3:
            :math:`\alpha > 20`, a dropout rate above 0.95).

        Returns
        -------
        Sparsity

        Raises
        ------
        ValueError
            If ``threshold`` is not a finite number.
        """
        threshold = _check_threshold(threshold)
        keep = self._keep(threshold)
        kept = {n: int(k.sum()) for n, k in keep.items()}
        total = {n: k.numel() for n, k in keep.items()}
        all_w, kept_w = sum(total.values()), sum(kept.values())
        return Sparsity(
            threshold=threshold,
            removed={n: 1.0 - kept[n] / total[n] for n in keep},
            kept=kept,
            total=total,
            removed_total=1.0 - kept_w / all_w if all_w else 0.0,
            compression_ratio=all_w / kept_w if kept_w else math.inf,
        )

    @torch.no_grad()
    def prune(self, threshold: float = 3.0) -> "VariationalDropout":
        r"""A copy whose weights with :math:`\log\alpha \ge` ``threshold`` are exactly zero.

        The copy's :meth:`variational_distributions` put pruned weights at a point mass at 0, so
        its draws, ``sample_params``, ``pyro.infer.Predictive`` and the shared
        ``Posterior.predict`` all use only the kept weights.  ``self`` is left unchanged.

        Parameters
        ----------
        threshold : float, default 3.0
            Pruning threshold on the clipped :math:`\log\alpha`.

        Returns
        -------
        VariationalDropout

        Raises
        ------
        ValueError
            If ``threshold`` is not a finite number.
        """
        threshold = _check_threshold(threshold)
        keep = self._keep(threshold)
        pruned = copy.deepcopy(self)
        for s in self._sparse_specs():
            getattr(pruned, f"{s.key}_mask").copy_(keep[s.name].to(getattr(pruned, f"{s.key}_mask").dtype))
        return pruned


def _base(prior: dist.Distribution) -> dist.Distribution:
    while isinstance(prior, torch.distributions.Independent):
        prior = prior.base_dist
    return prior


def pruned_posterior(posterior: SVIPosterior, threshold: float = 3.0) -> SVIPosterior:
    r"""The posterior of a fitted variational-dropout guide with its weights pruned.

    Parameters
    ----------
    posterior : SVIPosterior
        Result of ``pyrobdl.fit(..., method="variational_dropout")``.
    threshold : float, default 3.0
        Pruning threshold on :math:`\log\alpha`.

    Returns
    -------
    SVIPosterior
        Same model, cost and history; its guide is ``posterior.guide.prune(threshold)`` and its
        settings record ``prune_threshold``.  ``predict`` and ``sample`` use only kept weights.

    Raises
    ------
    TypeError
        If ``posterior`` does not hold a :class:`VariationalDropout` guide.
    """
    guide = getattr(posterior, "guide", None)
    if not isinstance(guide, VariationalDropout):
        raise TypeError(f"posterior must hold a VariationalDropout guide, got {type(guide).__name__}")
    return SVIPosterior(
        posterior.model,
        guide.prune(threshold),
        method=posterior.method,
        settings={**posterior.settings, "prune_threshold": float(threshold)},
        cost=posterior.cost,
        history=posterior.history,
        diagnostics=posterior.diagnostics,
    )
