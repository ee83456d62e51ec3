r"""Distributions of a weight matrix under dropout, and their KL divergences to a Gaussian prior.

A weight site of :class:`~pyrobdl.BayesianMLP` is stored ``[out, in]`` and used as
``h = x @ W.T``.  Dropping *input unit* :math:`j` of a layer zeroes the column ``W[:, j]``,
which is row :math:`j` of Gal & Ghahramani's :math:`M` (they write ``[in, out]`` and
``h = x M``).  Both distributions here therefore draw one multiplier per input unit and
apply it to a whole column of the stored weight:

.. math:: W = \xi \odot_{\text{col}} M + \sigma E, \qquad E_{oj} \sim \mathcal N(0, 1),

with :math:`\xi_j \sim \text{Bernoulli}(1 - p)` (:class:`BernoulliDropoutRows`) or
:math:`\xi_j \sim \mathcal N(1, p/(1-p))` (:class:`GaussianDropoutRows`).  The multipliers
do not depend on :math:`M`, so the draw is reparameterized in :math:`M` given them.
Here :math:`p` is the *drop* probability, as in ``torch.nn.Dropout`` (Gal & Ghahramani write
:math:`p` for the keep probability).

``register_kl`` pairs with ``Independent(Normal)`` priors give ``TraceMeanField_ELBO`` and
:class:`~pyrobdl.inference.DirectELBO` their ``kl="analytic"`` treatment.
"""

from __future__ import annotations

import math

import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from pyro.distributions.util import broadcast_shape  # torch.broadcast_shapes imports sympy on first use
from torch.distributions import register_kl

__all__ = ["BernoulliDropoutRows", "DropoutRows", "GaussianDropoutRows", "gaussian_prior_parts"]

_LOG_2PI = math.log(2 * math.pi)


class DropoutRows(dist.TorchDistribution):
    r"""Base class: a weight matrix ``[out, in]`` whose input-unit columns share a multiplier.

    Parameters
    ----------
    loc : torch.Tensor
        Variational parameter :math:`M` stored like the weight, shape ``[*batch, out, in]``.
    p : float
        Drop probability, in (0, 1).
    sigma : float
        Standard deviation of the small additive Gaussian noise, > 0.

    Notes
    -----
    Subclasses implement :meth:`sample_multipliers`, :meth:`log_prob`, ``mean`` and
    ``variance``.  :meth:`rsample_from` is the reparameterization itself, public so that a
    caller (a test, a user reproducing a dropout pass) can supply its own multipliers and noise.
    """

    arg_constraints: dict = {}
    support = constraints.independent(constraints.real, 2)
    has_rsample = True

    def __init__(self, loc: torch.Tensor, p: float, sigma: float, validate_args: bool | None = None) -> None:
        if loc.dim() < 2:
            raise ValueError(f"loc must have shape [*batch, out, in], got {list(loc.shape)}")
        if not 0.0 < p < 1.0:
            raise ValueError(f"p must be in (0, 1), got {p!r}")
        if not sigma > 0.0:
            raise ValueError(f"sigma must be > 0, got {sigma!r}")
        self.loc = loc
        self.p = float(p)
        self.sigma = float(sigma)
        super().__init__(loc.shape[:-2], loc.shape[-2:], validate_args=False)

    def expand(self, batch_shape: torch.Size, _instance: DropoutRows | None = None) -> DropoutRows:
        new = self._get_checked_instance(type(self), _instance)
        batch_shape = torch.Size(batch_shape)
        new.loc = self.loc.expand(batch_shape + self.event_shape)
        new.p, new.sigma = self.p, self.sigma
        super(DropoutRows, new).__init__(batch_shape, self.event_shape, validate_args=False)
        return new

    @property
    def num_units(self) -> int:
        """Number of input units (columns of the stored weight)."""
        return self.event_shape[-1]

    def sample_multipliers(self, sample_shape: torch.Size = torch.Size()) -> torch.Tensor:
        """Draw one multiplier per input unit, shape ``[*sample, *batch, in]`` (no gradient)."""
        raise NotImplementedError

    def rsample_from(self, multipliers: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        r"""The reparameterization :math:`W = \xi \odot_{\text{col}} M + \sigma E`.

        Parameters
        ----------
        multipliers : torch.Tensor
            :math:`\xi`, shape ``[..., in]`` (one per input unit; a Bernoulli mask is 0/1).
        noise : torch.Tensor
            :math:`E`, shape ``[..., out, in]``; zeros give a noise-free dropout pass.

        Returns
        -------
        torch.Tensor
            Weights ``[..., out, in]``, differentiable in ``loc``.
        """
        return multipliers.unsqueeze(-2) * self.loc + self.sigma * noise

    def rsample(self, sample_shape: torch.Size = torch.Size()) -> torch.Tensor:
        # Order of random draws (multipliers, then noise) is part of the contract used by the
        # equivalence test in tests/test_dropout.py, which replays them.
        sample_shape = torch.Size(sample_shape)
        multipliers = self.sample_multipliers(sample_shape)
        shape = sample_shape + self.batch_shape + self.event_shape
        noise = torch.randn(shape, dtype=self.loc.dtype, device=self.loc.device)
        return self.rsample_from(multipliers, noise)

    def _noise_log_prob(self, value: torch.Tensor, center: torch.Tensor) -> torch.Tensor:
        # sum over the output dimension of log N(value; center, sigma^2): shape [..., in]
        z = (value - center) / self.sigma
        return -0.5 * (z * z).sum(-2) - self.event_shape[-2] * (math.log(self.sigma) + 0.5 * _LOG_2PI)


class BernoulliDropoutRows(DropoutRows):
    r"""Gal & Ghahramani's dropout distribution of one weight matrix.

    Each input-unit column :math:`w_j` (row :math:`j` of Gal's :math:`M`) is an independent
    two-component mixture

    .. math:: q(w_j) = (1 - p)\,\mathcal N(w_j; m_j, \sigma^2 I_K) + p\,\mathcal N(w_j; 0, \sigma^2 I_K),

    kept with probability :math:`1 - p`, dropped with probability :math:`p`, where
    :math:`K` is the layer's number of outputs.  :meth:`log_prob` is the exact mixture
    log-density (a log-sum-exp over the two components), so a Monte Carlo ELBO with it is
    unbiased.  The mean is :math:`(1 - p)M`: dropout's weight-averaging rule.

    Parameters
    ----------
    loc : torch.Tensor
        :math:`M`, shape ``[*batch, out, in]``.
    p : float
        Drop probability in (0, 1).
    sigma : float
        Component standard deviation :math:`\sigma > 0`.
    """

    def sample_multipliers(self, sample_shape: torch.Size = torch.Size()) -> torch.Tensor:
        shape = torch.Size(sample_shape) + self.batch_shape + self.event_shape[-1:]
        keep = torch.full(shape, 1.0 - self.p, dtype=self.loc.dtype, device=self.loc.device)
        return torch.bernoulli(keep)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        kept = math.log1p(-self.p) + self._noise_log_prob(value, self.loc)
        dropped = math.log(self.p) + self._noise_log_prob(value, torch.zeros_like(self.loc))
        return torch.logaddexp(kept, dropped).sum(-1)

    @property
    def mean(self) -> torch.Tensor:
        return (1.0 - self.p) * self.loc

    @property
    def variance(self) -> torch.Tensor:
        return self.p * (1.0 - self.p) * self.loc**2 + self.sigma**2


class GaussianDropoutRows(DropoutRows):
    r"""Multiplicative Gaussian noise on the input-unit columns of one weight matrix.

    :math:`w_j = \xi_j m_j + \sigma\epsilon_j` with :math:`\xi_j \sim \mathcal N(1, \alpha)`,
    :math:`\alpha = p/(1-p)`: the continuous relaxation of dropout with the same first two
    moments as inverted Bernoulli dropout (Srivastava et al., 2014, §10; Kingma et al., 2015).
    Each column is Gaussian, :math:`q(w_j) = \mathcal N(m_j, \sigma^2 I + \alpha m_j m_j^\top)`,
    so the log-density and the KL to a Gaussian prior are exact.  The mean is :math:`M`.

    Parameters
    ----------
    loc : torch.Tensor
        :math:`M`, shape ``[*batch, out, in]``.
    p : float
        Drop probability in (0, 1), giving :math:`\alpha = p/(1-p)`.
    sigma : float
        Isotropic noise standard deviation :math:`\sigma > 0`.

    Notes
    -----
    With :math:`\hat m = m/\lVert m\rVert`, the covariance has eigenvalue
    :math:`\sigma^2 + \alpha\lVert m\rVert^2` along :math:`\hat m` and :math:`\sigma^2`
    across it; :meth:`log_prob` splits :math:`w - m` along those directions instead of using
    the Sherman–Morrison form, whose two large terms cancel catastrophically when
    :math:`\sigma \ll \lVert m\rVert`.
    """

    @property
    def alpha(self) -> float:
        """Variance of the multiplicative noise, :math:`p/(1-p)`."""
        return self.p / (1.0 - self.p)

    def sample_multipliers(self, sample_shape: torch.Size = torch.Size()) -> torch.Tensor:
        shape = torch.Size(sample_shape) + self.batch_shape + self.event_shape[-1:]
        return 1.0 + math.sqrt(self.alpha) * torch.randn(shape, dtype=self.loc.dtype, device=self.loc.device)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        diff = value - self.loc
        norm2 = (self.loc * self.loc).sum(-2)  # [..., in]
        # a zero column has no preferred direction; any unit vector gives the same density
        direction = self.loc / norm2.clamp_min(torch.finfo(self.loc.dtype).tiny).sqrt().unsqueeze(-2)
        along = (diff * direction).sum(-2)
        across = diff - along.unsqueeze(-2) * direction
        s2 = self.sigma**2
        big = s2 + self.alpha * norm2
        k = self.event_shape[-2]
        quad = (across * across).sum(-2) / s2 + along * along / big
        logdet = (k - 1) * math.log(s2) + torch.log(big)
        return (-0.5 * (quad + logdet + k * _LOG_2PI)).sum(-1)

    @property
    def mean(self) -> torch.Tensor:
        return self.loc

    @property
    def variance(self) -> torch.Tensor:
        return self.alpha * self.loc**2 + self.sigma**2


def gaussian_prior_parts(
    prior: torch.distributions.Distribution, event_shape: torch.Size
) -> tuple[torch.Tensor, torch.Tensor]:
    """Location and scale of a prior ``Independent(Normal)`` with the given event shape.

    Raises
    ------
    NotImplementedError
        If the prior is not a diagonal Gaussian over the whole event (``kl_divergence``
        callers then fall back to a Monte Carlo KL).
    """
    if not isinstance(prior, torch.distributions.Independent) or prior.event_shape != event_shape:
        raise NotImplementedError
    base = prior.base_dist
    while isinstance(base, torch.distributions.Independent):
        base = base.base_dist
    if not isinstance(base, torch.distributions.Normal):
        raise NotImplementedError
    return base.loc, base.scale


def _batch_shaped(kl: torch.Tensor, q: DropoutRows, prior: torch.distributions.Distribution) -> torch.Tensor:
    # a prior with a broadcastable (smaller) batch shape still yields one KL per batch element
    if q.batch_shape == prior.batch_shape:
        return kl
    return kl.expand(broadcast_shape(q.batch_shape, prior.batch_shape))


@register_kl(BernoulliDropoutRows, torch.distributions.Independent)
def _kl_bernoulli_rows_normal(q: BernoulliDropoutRows, prior: torch.distributions.Independent) -> torch.Tensor:
    r"""Gal & Ghahramani's large-K KL (their Proposition 1), constant included.

    For well-separated components (:math:`\lVert m_j\rVert \gg \sigma`) the mixture's KL to
    :math:`\mathcal N(\mu, \operatorname{diag} s^2)` is

    .. math:: \sum_{o,j}\Big[\frac{(1-p)(m_{oj}-\mu_{oj})^2 + p\,\mu_{oj}^2 + \sigma^2}{2 s_{oj}^2}
              + \log\frac{s_{oj}}{\sigma} - \frac12\Big] - n_{\text{in}}\,\mathcal H(p),

    with :math:`\mathcal H(p) = -p\log p - (1-p)\log(1-p)`.  What it leaves out is the
    overlap of the two components, of order :math:`\exp(-\lVert m_j\rVert^2/8\sigma^2)`.
    """
    loc, scale = gaussian_prior_parts(prior, q.event_shape)
    p = q.p
    var = scale * scale
    per_weight = ((1.0 - p) * (q.loc - loc) ** 2 + p * loc * loc + q.sigma**2) / (2.0 * var)
    per_weight = per_weight + torch.log(scale) - math.log(q.sigma) - 0.5
    entropy = -(p * math.log(p) + (1.0 - p) * math.log1p(-p))
    kl = per_weight.sum((-2, -1)) - q.num_units * entropy
    return _batch_shaped(kl, q, prior)


@register_kl(GaussianDropoutRows, torch.distributions.Independent)
def _kl_gaussian_rows_normal(q: GaussianDropoutRows, prior: torch.distributions.Independent) -> torch.Tensor:
    r"""Exact KL of :math:`\mathcal N(m_j, \sigma^2 I + \alpha m_j m_j^\top)` columns to a diagonal Gaussian.

    .. math:: \sum_j \frac12\Big[\sum_o \frac{\sigma^2 + \alpha m_{oj}^2 + (m_{oj}-\mu_{oj})^2}{s_{oj}^2}
              - K + \sum_o \log\frac{s_{oj}^2}{\sigma^2}
              - \log\Big(1 + \frac{\alpha\lVert m_j\rVert^2}{\sigma^2}\Big)\Big]
    """
    loc, scale = gaussian_prior_parts(prior, q.event_shape)
    var = scale * scale
    s2 = q.sigma**2
    trace_quad = ((s2 + q.alpha * q.loc**2 + (q.loc - loc) ** 2) / var).sum(-2)
    log_ratio = (torch.log(var) - math.log(s2)).sum(-2)
    k = q.event_shape[-2]
    norm2 = (q.loc * q.loc).sum(-2)
    kl = 0.5 * (trace_quad - k + log_ratio - torch.log1p(q.alpha * norm2 / s2)).sum(-1)
    return _batch_shaped(kl, q, prior)
