r"""Priors over the weights and biases of a :class:`~pyrobdl.BayesianMLP`.

A prior is a small object with one hook, :meth:`Prior.site_distribution`, which receives a
:class:`Site` (the name, layer, kind and shape of one weight or bias tensor) and returns the
distribution of that site, with every dimension of the tensor declared as an event dimension.
The model turns each hook result into a ``PyroSample``; guides and the direct ELBO read the same
hook through :meth:`pyrobdl.BayesianMLP.prior_distributions`.  New priors (log-uniform,
scale mixtures, ...) only implement this hook.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import pyro.distributions as dist
import torch
from pyro.distributions.util import broadcast_shape  # torch.broadcast_shapes imports sympy on first use

from ._validation import positive_number as _positive

__all__ = ["Gaussian", "ImproperFlat", "ImproperLogUniform", "LogUniform", "Prior", "Site"]


@dataclass(frozen=True)
class Site:
    """Description of one sample site of a Bayesian MLP.

    Attributes
    ----------
    name : str
        Stable Pyro site name, ``"layers.{layer}.weight"`` or ``"layers.{layer}.bias"``.
    layer : int
        Index of the layer, 0 for the input layer.
    kind : str
        ``"weight"`` or ``"bias"``.
    shape : tuple of int
        Shape of the tensor: ``(out, in)`` for weights, ``(out,)`` for biases.
    fan_in : int
        Number of inputs of the layer.
    num_layers : int
        Number of linear layers of the network.
    """

    name: str
    layer: int
    kind: str
    shape: tuple[int, ...]
    fan_in: int
    num_layers: int


class Prior:
    """Base class of weight priors: one hook that returns each site's distribution.

    Subclasses implement :meth:`site_distribution`.  ``proper`` says whether the prior is a
    normalisable density; MCMC and MAP refuse improper priors before running.
    """

    #: Whether the density integrates to one (False for log-uniform priors).
    proper: bool = True

    def site_distribution(self, site: Site, device: torch.device | None = None) -> dist.Distribution:
        """Return the prior distribution of ``site``.

        Parameters
        ----------
        site : Site
            The weight or bias tensor the distribution is for.
        device : torch.device, optional
            Device on which the distribution's parameters live.

        Returns
        -------
        pyro.distributions.Distribution
            A distribution with ``event_shape == site.shape`` and empty batch shape.
        """
        raise NotImplementedError

    def validate(self, num_layers: int) -> None:
        """Check the prior fits a network with ``num_layers`` linear layers (raise ValueError)."""




class Gaussian(Prior):
    r"""Independent zero-mean Gaussian prior :math:`w \sim \mathcal N(0, s_\ell^2)`.

    Parameters
    ----------
    scale : float or sequence of float or "fan_in"
        Prior standard deviation.  A number applies to every weight and bias; a sequence gives
        one scale per layer (its length must equal the number of linear layers); the string
        ``"fan_in"`` uses :math:`s_\ell = \text{gain}/\sqrt{\text{fan\_in}_\ell}`.
    bias_scale : float, optional
        Standard deviation of the biases; by default the layer's weight scale.
    gain : float, default 1.0
        Multiplier of the fan-in convention (ignored otherwise).

    Raises
    ------
    ValueError
        If any scale is not a finite number > 0, or ``scale`` is an unknown string.

    Notes
    -----
    With :math:`s = 1/l` this is the prior of Gal & Ghahramani's length-scale :math:`l`.
    The fan-in convention keeps the prior variance of each pre-activation independent of
    the layer width (Neal, 1996).

    Examples
    --------
    >>> Gaussian(scale=1.0)
    >>> Gaussian(scale=[1.0, 0.1])
    >>> Gaussian(scale="fan_in")
    """

    def __init__(
        self,
        scale: float | Sequence[float] | str = 1.0,
        *,
        bias_scale: float | None = None,
        gain: float = 1.0,
    ) -> None:
        if isinstance(scale, str):
            if scale != "fan_in":
                raise ValueError(
                    f"scale must be a number > 0, a sequence of numbers, or 'fan_in'; got {scale!r}"
                )
            self.gain = _positive("gain", gain)
        elif isinstance(scale, (list, tuple)):
            if len(scale) == 0:
                raise ValueError("scale must not be an empty sequence")
            scale = tuple(_positive(f"scale[{i}]", s) for i, s in enumerate(scale))
        else:
            scale = _positive("scale", scale)
        self.scale = scale
        self.bias_scale = None if bias_scale is None else _positive("bias_scale", bias_scale)
        self._cache: dict[tuple, dist.Distribution] = {}

    def __repr__(self) -> str:
        return f"Gaussian(scale={self.scale!r}, bias_scale={self.bias_scale!r})"

    def validate(self, num_layers: int) -> None:
        """Check a per-layer scale has one entry per linear layer.

        Raises
        ------
        ValueError
            If ``scale`` is a sequence whose length differs from ``num_layers``.
        """
        if isinstance(self.scale, tuple) and len(self.scale) != num_layers:
            raise ValueError(
                f"scale has {len(self.scale)} entries but the network has {num_layers} layers"
            )

    def layer_scale(self, site: Site) -> float:
        """Standard deviation of ``site`` under this prior."""
        if site.kind == "bias" and self.bias_scale is not None:
            return self.bias_scale
        if isinstance(self.scale, str):
            return self.gain / math.sqrt(site.fan_in)
        if isinstance(self.scale, tuple):
            return self.scale[site.layer]
        return self.scale

    def site_distribution(self, site: Site, device: torch.device | None = None) -> dist.Distribution:
        """Return :math:`\\mathcal N(0, s^2)` expanded to the site's shape (all dims event)."""
        # Distributions are immutable, so one object per (site, device) is reused across steps.
        key = (site, str(device))
        cached = self._cache.get(key)
        if cached is None:
            s = self.layer_scale(site)
            zero = torch.zeros((), device=device)
            cached = (
                dist.Normal(zero, zero + s, validate_args=False)
                .expand(site.shape)
                .to_event(len(site.shape))
            )
            self._cache[key] = cached
        return cached


def shape_placeholder(d: dist.TorchDistribution, sample_shape: Sequence[int] = ()) -> torch.Tensor | None:
    """Ones of an improper distribution's sample shape while Pyro is initialising, else ``None``.

    ``pyro.infer.Predictive`` runs the model once under ``InitMessenger(init_to_sample)`` to
    learn every site's shape and the plate nesting, before it replays the guide's draws; it
    reads only the shapes of that run's values.  Autoguides' initialisation strategies run
    under the same handler and need some finite value of the right shape.  Ones are such a
    value for both improper densities here (finite ``log_prob``: ``-log 1 = 0``).  Outside an
    ``InitMessenger`` there is no draw to give, and the caller raises.

    Parameters
    ----------
    d : TorchDistribution
        The improper distribution (its batch shape and device are used).
    sample_shape : sequence of int
        Leading sample shape, as in ``Distribution.sample``.

    Returns
    -------
    Tensor or None
        ``ones(sample_shape + batch_shape)`` when an ``InitMessenger`` is on Pyro's handler
        stack, otherwise ``None``.
    """
    from pyro.infer.autoguide.initialization import InitMessenger
    from pyro.poutine.runtime import _PYRO_STACK

    if not any(isinstance(handler, InitMessenger) for handler in _PYRO_STACK):
        return None
    return torch.ones(torch.Size(sample_shape) + d.batch_shape, device=d._device)


class ImproperLogUniform(dist.TorchDistribution):
    r"""Elementwise improper log-uniform density :math:`p(w) \propto 1/|w|` on the real line.

    ``log_prob(w) = -log|w|`` (no normalising constant exists).  The batch shape is the shape
    of the weight tensor; :meth:`LogUniform.site_distribution` wraps it with ``to_event`` so
    the site's event shape is the tensor's and ``log_prob`` sums over it.

    Parameters
    ----------
    batch_shape : tuple of int, default ()
        Shape of the tensor of independent weights.
    device : torch.device, optional
        Device of the tensors this distribution returns.

    Notes
    -----
    The density is improper: it has no draws (:meth:`sample` raises ``NotImplementedError``),
    its mean is undefined (returned as NaN, like torch's ``Cauchy``) and its variance infinite.
    One exception, for Pyro's machinery: under Pyro's initialisation handler
    (``InitMessenger``, through which ``pyro.infer.Predictive`` runs the model once to learn
    every site's shape, and autoguides choose initial values) :meth:`sample` returns a
    placeholder of ones with the right shape, since only the shape is used there (see
    :func:`shape_placeholder`).  It is only usable as a prior together with a
    guide that defines a KL divergence to it (``pyrobdl.guides.VariationalDropout`` registers
    one) or with a Monte Carlo KL :math:`\log q(w) + \log|w|`, which is the KL up to an
    additive constant.
    """

    arg_constraints: dict = {}
    support = dist.constraints.real
    has_rsample = False

    def __init__(self, batch_shape: Sequence[int] = (), device: torch.device | None = None) -> None:
        self._device = torch.device("cpu") if device is None else torch.device(device)
        super().__init__(torch.Size(batch_shape), torch.Size(), validate_args=False)

    def expand(self, batch_shape, _instance=None):  # type: ignore[no-untyped-def]
        new = self._get_checked_instance(ImproperLogUniform, _instance)
        new._device = self._device
        super(ImproperLogUniform, new).__init__(torch.Size(batch_shape), torch.Size(), validate_args=False)
        return new

    @property
    def mean(self) -> torch.Tensor:
        return torch.full(self.batch_shape, math.nan, device=self._device)

    @property
    def variance(self) -> torch.Tensor:
        return torch.full(self.batch_shape, math.inf, device=self._device)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        """:math:`-\\log|w|` elementwise, broadcast to the batch shape."""
        return (-torch.log(value.abs())).expand(broadcast_shape(value.shape, self.batch_shape))

    def sample(self, sample_shape=torch.Size()):  # type: ignore[no-untyped-def]
        placeholder = shape_placeholder(self, sample_shape)
        if placeholder is not None:
            return placeholder
        raise NotImplementedError(
            "the log-uniform prior is improper and cannot be sampled; draw weights from a guide "
            "that defines a KL to it (pyrobdl.guides.VariationalDropout)"
        )

    rsample = sample


class ImproperFlat(ImproperLogUniform):
    r"""Elementwise improper flat density on the real line: ``log_prob(w) = 0``.

    The bias prior of :class:`LogUniform` with ``bias="flat"``: biases are then point
    estimates (maximum likelihood) in a variational-dropout guide, as in Molchanov et al.
    (2017).  Same improper-distribution conventions as :class:`ImproperLogUniform`.
    """

    def expand(self, batch_shape, _instance=None):  # type: ignore[no-untyped-def]
        return super().expand(batch_shape, self._get_checked_instance(ImproperFlat, _instance))

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        """Zero, broadcast to the batch shape."""
        return value.new_zeros(()).expand(broadcast_shape(value.shape, self.batch_shape))

    def sample(self, sample_shape=torch.Size()):  # type: ignore[no-untyped-def]
        placeholder = shape_placeholder(self, sample_shape)
        if placeholder is not None:
            return placeholder
        raise NotImplementedError("the flat bias prior is improper and cannot be sampled")

    rsample = sample


#: Values of the ``bias`` option of :class:`LogUniform`.
LOG_UNIFORM_BIAS = ("flat", "log_uniform")


class LogUniform(Prior):
    r"""Improper, scale-invariant log-uniform prior :math:`p(\log|w|) = \text{const}`.

    Equivalently :math:`p(w) \propto 1/|w|` for every weight.  It is the prior under which
    Gaussian (multiplicative) dropout with a learned rate is variational inference
    (Kingma et al., 2015), and the prior of sparse variational dropout (Molchanov et al.,
    2017).  ``proper = False``: MAP and MCMC refuse it; use ``pyrobdl.guides.VariationalDropout``.

    Parameters
    ----------
    bias : {"flat", "log_uniform"}, default "flat"
        Prior of the biases.  ``"flat"`` (an improper constant density; a variational-dropout
        guide then keeps biases as point estimates with no KL term, as Molchanov et al. do);
        ``"log_uniform"`` puts the same log-uniform prior on biases (they are then sparsified
        like weights).

    Raises
    ------
    ValueError
        For an unknown ``bias`` value.

    Notes
    -----
    Each weight site's distribution is :class:`ImproperLogUniform` over the tensor, wrapped
    with ``to_event`` (event shape = the tensor's shape), so ``log_prob`` is
    :math:`-\sum_i \log|w_i|`.

    References
    ----------
    D. P. Kingma, T. Salimans, M. Welling. Variational Dropout and the Local
    Reparameterization Trick. NeurIPS 2015.
    D. Molchanov, A. Ashukha, D. Vetrov. Variational Dropout Sparsifies Deep Neural Networks.
    ICML 2017.
    """

    proper = False

    def __init__(self, *, bias: str = "flat") -> None:
        if bias not in LOG_UNIFORM_BIAS:
            raise ValueError(f"unknown bias prior {bias!r}; valid: {list(LOG_UNIFORM_BIAS)}")
        self.bias = bias
        self._cache: dict[tuple, dist.Distribution] = {}

    def __repr__(self) -> str:
        return f"LogUniform(bias={self.bias!r})"

    def site_distribution(self, site: Site, device: torch.device | None = None) -> dist.Distribution:
        """Return the improper log-uniform (or, for flat biases, flat) density of ``site``."""
        key = (site, str(device))
        cached = self._cache.get(key)
        if cached is None:
            cls = ImproperFlat if site.kind == "bias" and self.bias == "flat" else ImproperLogUniform
            cached = cls(site.shape, device=device).to_event(len(site.shape))
            self._cache[key] = cached
        return cached
