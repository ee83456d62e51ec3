r"""Observation models of a :class:`~pyrobdl.BayesianMLP`.

A likelihood turns the network output ``f`` (shape ``[..., batch, out_features]``) into the
distribution of the targets, may add latent sites of its own (the noise precision of
:class:`GaussianLearnedPrecision`), checks targets, and gives the moments of the predictive.
Minibatch scaling by the dataset size is done by the model's ``pyro.plate``, not here.
"""

from __future__ import annotations


import pyro.distributions as dist
import torch

from ._validation import positive_number as _positive

__all__ = ["Categorical", "Gaussian", "GaussianLearnedPrecision", "Likelihood"]




class Likelihood:
    """Base class of observation models."""

    #: "regression" or "classification".
    task: str = "regression"

    def latent_distributions(self, device: torch.device | None = None) -> dict[str, dist.Distribution]:
        """Priors of the likelihood's own latent sites (name -> distribution); none by default."""
        return {}

    def prepare_targets(self, y: torch.Tensor, out_features: int) -> torch.Tensor:
        """Return ``y`` in the shape :meth:`distribution` expects, or raise ValueError."""
        raise NotImplementedError

    def distribution(self, f: torch.Tensor, latents: dict[str, torch.Tensor]) -> dist.Distribution:
        """Distribution of one target per data point given network outputs ``f``.

        Parameters
        ----------
        f : torch.Tensor
            Network outputs, shape ``[..., batch, out_features]``.
        latents : dict
            Values of the likelihood's latent sites (each with leading particle dims).

        Returns
        -------
        pyro.distributions.Distribution
            Batch shape ``[..., batch]``.
        """
        raise NotImplementedError

    def noise_variance(self, latents: dict[str, torch.Tensor], f: torch.Tensor) -> torch.Tensor:
        """Observation-noise variance per draw, broadcastable to ``f`` (regression only)."""
        raise NotImplementedError(f"{type(self).__name__} has no observation-noise variance")


class _GaussianBase(Likelihood):
    task = "regression"

    def prepare_targets(self, y: torch.Tensor, out_features: int) -> torch.Tensor:
        if y.dim() == 1 and out_features == 1:
            return y.unsqueeze(-1)
        if y.dim() == 2 and y.shape[-1] == out_features:
            return y
        raise ValueError(
            f"y must have shape [N] or [N, {out_features}] for a Gaussian likelihood with "
            f"out_features={out_features}, got {list(y.shape)}"
        )

    def _precision(self, latents: dict[str, torch.Tensor]) -> torch.Tensor | float:
        raise NotImplementedError

    def distribution(self, f: torch.Tensor, latents: dict[str, torch.Tensor]) -> dist.Distribution:
        scale = self._noise_scale(latents, f)
        return dist.Normal(f, scale, validate_args=False).to_event(1)

    def _noise_scale(self, latents: dict[str, torch.Tensor], f: torch.Tensor) -> torch.Tensor | float:
        tau = self._precision(latents)
        if isinstance(tau, torch.Tensor):
            # one precision per particle: [*particles] -> [*particles, 1, 1] against f
            return tau.unsqueeze(-1).unsqueeze(-1).rsqrt()
        return tau ** -0.5

    def noise_variance(self, latents: dict[str, torch.Tensor], f: torch.Tensor) -> torch.Tensor:
        scale = self._noise_scale(latents, f)
        if isinstance(scale, float):
            return torch.full((), scale**2, dtype=f.dtype, device=f.device)
        return scale * scale


class Gaussian(_GaussianBase):
    r"""Gaussian regression with fixed precision :math:`\tau`: :math:`y \sim \mathcal N(f(x), \tau^{-1})`.

    Parameters
    ----------
    precision : float
        Noise precision :math:`\tau > 0` (inverse variance), in the units of the targets the
        model is trained on (standardised targets when the data were standardised).

    Raises
    ------
    ValueError
        If ``precision`` is not a finite number > 0.
    """

    def __init__(self, precision: float = 1.0) -> None:
        self.precision = _positive("precision", precision)

    def __repr__(self) -> str:
        return f"Gaussian(precision={self.precision!r})"

    def _precision(self, latents: dict[str, torch.Tensor]) -> float:
        return self.precision


class GaussianLearnedPrecision(_GaussianBase):
    r"""Gaussian regression whose precision is a latent variable with a Gamma prior.

    :math:`\tau \sim \mathrm{Gamma}(a, b)` (shape ``concentration`` :math:`a`, rate :math:`b`,
    mean :math:`a/b`) and :math:`y \sim \mathcal N(f(x), \tau^{-1})`.  The precision is the
    sample site ``"precision"``, so guides learn an approximate posterior for it and NUTS
    samples it with the weights.

    Parameters
    ----------
    concentration : float, default 6.0
        Gamma shape :math:`a > 0`.
    rate : float, default 6.0
        Gamma rate :math:`b > 0`.  The default puts the prior mean at 1 (unit noise variance on
        standardised targets) with a broad spread.

    Raises
    ------
    ValueError
        If either parameter is not a finite number > 0.
    """

    site = "precision"

    def __init__(self, concentration: float = 6.0, rate: float = 6.0) -> None:
        self.concentration = _positive("concentration", concentration)
        self.rate = _positive("rate", rate)
        self._cache: dict[str, dist.Distribution] = {}

    def __repr__(self) -> str:
        return f"GaussianLearnedPrecision(concentration={self.concentration!r}, rate={self.rate!r})"

    def latent_distributions(self, device: torch.device | None = None) -> dict[str, dist.Distribution]:
        key = str(device)
        if key not in self._cache:
            zero = torch.zeros((), device=device)
            self._cache[key] = dist.Gamma(zero + self.concentration, zero + self.rate, validate_args=False)
        return {self.site: self._cache[key]}

    def _precision(self, latents: dict[str, torch.Tensor]) -> torch.Tensor:
        return latents[self.site]


class Categorical(Likelihood):
    """Classification: ``y ~ Categorical(logits=f(x))`` with ``out_features`` classes.

    Targets are integer class labels of shape ``[N]`` in ``0 .. out_features - 1``.
    """

    task = "classification"

    def __repr__(self) -> str:
        return "Categorical()"

    def prepare_targets(self, y: torch.Tensor, out_features: int) -> torch.Tensor:
        if y.dim() != 1:
            raise ValueError(f"y must have shape [N] (class labels) for Categorical, got {list(y.shape)}")
        return y

    def distribution(self, f: torch.Tensor, latents: dict[str, torch.Tensor]) -> dist.Distribution:
        return dist.Categorical(logits=f, validate_args=False)
