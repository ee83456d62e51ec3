"""Synthetic regression problems with known ground truth.

:func:`bayesian_linear_regression` returns data together with its exact
posterior, the reference for approximate inference; :func:`gap_regression`
gives 1-D data in two clusters for judging "in-between" uncertainty.  All
randomness comes from a local :class:`torch.Generator`; the global RNG is
never used.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from ._data import RegressionData, _as_float64, _count, _generator, _move, _positive_real

__all__ = [
    "BLRData", "ExactBLRPosterior", "bayesian_linear_regression", "blr_posterior", "gap_regression"
]

# Training inputs of the gap problem live on [-1, -0.35] and [0.35, 1]; the
# test grid extends past both ends to show extrapolation as well.
_GAP_CLUSTERS = ((-1.0, -0.35), (0.35, 1.0))
_GAP_TEST_RANGE = (-1.5, 1.5)


@dataclass(frozen=True)
class ExactBLRPosterior:
    """Exact Gaussian posterior of Bayesian linear regression.

    Coordinates are ordered ``(w_1, ..., w_D, b)``; every tensor is float64.

    Parameters
    ----------
    mean : torch.Tensor
        Posterior mean, shape ``[D+1]``.
    covariance : torch.Tensor
        Posterior covariance, shape ``[D+1, D+1]``.
    precision_matrix : torch.Tensor
        Posterior precision (inverse covariance), shape ``[D+1, D+1]``.
    mean_field_sd : torch.Tensor
        Standard deviations of the optimal fully factorised Gaussian, shape
        ``[D+1]`` (see Notes); its mean equals ``mean``.

    Notes
    -----
    Among factorised Gaussians :math:`q(\\theta)=\\prod_i N(\\theta_i; m_i, s_i^2)`
    the minimiser of :math:`\\mathrm{KL}(q \\,\\|\\, p)` for a Gaussian
    posterior :math:`p = N(\\mu, \\Lambda^{-1})` has :math:`m = \\mu` and
    :math:`s_i^2 = 1/\\Lambda_{ii}`, which is never larger than the exact
    marginal variance :math:`(\\Lambda^{-1})_{ii}`.  Mean-field VI on this
    model should therefore converge to ``mean`` and ``mean_field_sd``.

    References
    ----------
    .. [1] C. M. Bishop, *Pattern Recognition and Machine Learning*,
       Springer, 2006, sections 3.3 and 10.1.2.
    """

    mean: torch.Tensor
    covariance: torch.Tensor
    precision_matrix: torch.Tensor
    mean_field_sd: torch.Tensor

    @property
    def weight_mean(self) -> torch.Tensor:
        """torch.Tensor: Posterior mean of the weights, shape ``[D]``."""
        return self.mean[:-1]

    @property
    def bias_mean(self) -> torch.Tensor:
        """torch.Tensor: Posterior mean of the bias, 0-d."""
        return self.mean[-1]

    @property
    def posterior_sd(self) -> torch.Tensor:
        """torch.Tensor: Exact marginal standard deviations, shape ``[D+1]``."""
        return torch.sqrt(torch.diagonal(self.covariance))

    @property
    def weight_sd(self) -> torch.Tensor:
        """torch.Tensor: Exact marginal sd of the weights, shape ``[D]``."""
        return self.posterior_sd[:-1]

    @property
    def bias_sd(self) -> torch.Tensor:
        """torch.Tensor: Exact marginal sd of the bias, 0-d."""
        return self.posterior_sd[-1]

    @property
    def weight_mean_field_sd(self) -> torch.Tensor:
        """torch.Tensor: Optimal mean-field sd of the weights, shape ``[D]``."""
        return self.mean_field_sd[:-1]

    @property
    def bias_mean_field_sd(self) -> torch.Tensor:
        """torch.Tensor: Optimal mean-field sd of the bias, 0-d."""
        return self.mean_field_sd[-1]

    def to(self, device: torch.device | str) -> ExactBLRPosterior:
        """Return a copy with every tensor on ``device``.

        Parameters
        ----------
        device : torch.device or str
            Target device.

        Returns
        -------
        ExactBLRPosterior
            The moved copy.
        """
        moved = {f.name: _move(getattr(self, f.name), device) for f in dataclasses.fields(self)}
        return dataclasses.replace(self, **moved)


def blr_posterior(
    x: torch.Tensor | np.ndarray,
    y: torch.Tensor | np.ndarray,
    *,
    weight_prior_scale: float,
    bias_prior_scale: float | None = None,
    precision: float,
) -> ExactBLRPosterior:
    """Exact posterior of Bayesian linear regression with known noise.

    Parameters
    ----------
    x : torch.Tensor or numpy.ndarray
        Inputs, shape ``[N, D]``.
    y : torch.Tensor or numpy.ndarray
        Targets, shape ``[N]``.
    weight_prior_scale : float
        Prior standard deviation of every weight, :math:`w_j \\sim N(0, s_w^2)`.
    bias_prior_scale : float or None, default None
        Prior standard deviation of the bias; ``None`` means the same as
        ``weight_prior_scale``.
    precision : float
        Known noise precision :math:`\\beta`, i.e. the noise variance is
        :math:`1/\\beta`.

    Returns
    -------
    ExactBLRPosterior
        Posterior over ``(w_1, ..., w_D, b)`` in float64, on ``x``'s device.

    Raises
    ------
    TypeError
        If ``x``/``y`` are not tensors or arrays or a scale is not a number.
    ValueError
        If ``x`` is not 2-D, ``y`` is not 1-D, their lengths differ, they
        contain non-finite values, or a scale/precision is not positive.

    Notes
    -----
    With the design matrix :math:`\\Phi = [x, \\mathbf{1}]` and prior precision
    :math:`\\Lambda_0 = \\mathrm{diag}(s_w^{-2}, \\dots, s_w^{-2}, s_b^{-2})`,

    .. math::

        \\Lambda = \\Lambda_0 + \\beta \\Phi^\\top \\Phi, \\qquad
        \\mu = \\beta \\Lambda^{-1} \\Phi^\\top y, \\qquad
        \\Sigma = \\Lambda^{-1}.

    Solves go through a Cholesky factor of :math:`\\Lambda` (which is
    symmetric positive definite because the prior is proper) in float64.

    References
    ----------
    .. [1] C. M. Bishop, *Pattern Recognition and Machine Learning*,
       Springer, 2006, eq. (3.50)-(3.51).
    """
    x64 = _as_float64(x, "x")
    y64 = _as_float64(y, "y")
    if x64.dim() != 2:
        raise ValueError(f"`x` must be 2-D [N, D], got shape {tuple(x64.shape)}")
    if y64.dim() != 1:
        raise ValueError(f"`y` must be 1-D [N], got shape {tuple(y64.shape)}")
    if y64.shape[0] != x64.shape[0]:
        raise ValueError(f"`y` has {y64.shape[0]} entries but `x` has {x64.shape[0]} rows")
    if not bool(torch.isfinite(x64).all()):
        raise ValueError("`x` contains non-finite values")
    if not bool(torch.isfinite(y64).all()):
        raise ValueError("`y` contains non-finite values")
    weight_scale = _positive_real(weight_prior_scale, "weight_prior_scale")
    bias_scale = (
        weight_scale
        if bias_prior_scale is None
        else _positive_real(bias_prior_scale, "bias_prior_scale")
    )
    beta = _positive_real(precision, "precision")

    y64 = y64.to(x64.device)
    design = torch.cat([x64, torch.ones_like(x64[:, :1])], dim=1)
    prior_precision = torch.full((design.shape[1],), weight_scale**-2, dtype=torch.float64)
    prior_precision[-1] = bias_scale**-2
    precision_matrix = torch.diag(prior_precision.to(x64.device)) + beta * design.T @ design
    # Symmetrise so rounding in the matmul cannot upset the Cholesky factor.
    precision_matrix = 0.5 * (precision_matrix + precision_matrix.T)
    chol = torch.linalg.cholesky(precision_matrix)
    covariance = torch.cholesky_inverse(chol)
    covariance = 0.5 * (covariance + covariance.T)
    mean = torch.cholesky_solve((beta * design.T @ y64).unsqueeze(-1), chol).squeeze(-1)
    mean_field_sd = torch.diagonal(precision_matrix).rsqrt()
    return ExactBLRPosterior(
        mean=mean,
        covariance=covariance,
        precision_matrix=precision_matrix,
        mean_field_sd=mean_field_sd,
    )


@dataclass(frozen=True, kw_only=True)
class BLRData(RegressionData):
    """Data drawn from a Bayesian linear model, with its exact posterior.

    Has every field of :class:`RegressionData` (``y_mean = 0``,
    ``y_std = 1``: the data are not standardised) plus the ones below.

    Parameters
    ----------
    true_weight : torch.Tensor
        Weights drawn from the prior and used to generate ``y``, shape ``[D]``.
    true_bias : float
        Bias drawn from the prior and used to generate ``y``.
    prior_scale : float
        Prior standard deviation of every weight and of the bias.
    precision : float
        Noise precision :math:`\\beta` used to generate ``y``.
    posterior : ExactBLRPosterior
        Exact posterior given ``x_train`` and ``y_train`` (as stored, in
        float32, then promoted to float64).
    """

    true_weight: torch.Tensor
    true_bias: float
    prior_scale: float
    precision: float
    posterior: ExactBLRPosterior


def _check_size(num_train: int, num_test: int, in_features: int) -> None:
    """Refuse a data set no machine here can hold, naming the option, before drawing it (a float
    of x and y per value, twice: the draw and its conversion)."""
    from .._validation import check_memory

    per_row = 2 * 8.0 * (in_features + 1)
    if in_features > 1:
        check_memory("in_features", in_features, per_row * (num_train + num_test))
    check_memory("num_train", num_train, per_row * num_train)
    check_memory("num_test", num_test, per_row * num_test)
    check_memory("num_train + num_test", num_train + num_test, per_row * (num_train + num_test))


def bayesian_linear_regression(
    num_train: int = 100,
    num_test: int = 100,
    in_features: int = 3,
    *,
    prior_scale: float = 1.0,
    precision: float = 10.0,
    seed: int = 0,
) -> BLRData:
    """Sample a dataset from a Bayesian linear regression model.

    Parameters
    ----------
    num_train : int, default 100
        Number of training points (>= 1).
    num_test : int, default 100
        Number of test points (>= 1).
    in_features : int, default 3
        Input dimension ``D`` (>= 1).
    prior_scale : float, default 1.0
        Prior standard deviation of the weights and the bias.
    precision : float, default 10.0
        Noise precision :math:`\\beta`.
    seed : int, default 0
        Seed of a local :class:`torch.Generator` (>= 0); the global RNG is
        neither used nor changed.

    Returns
    -------
    BLRData
        Float32 data named ``"blr"`` with the true parameters and the exact
        posterior (see :func:`blr_posterior`).

    Raises
    ------
    TypeError
        If a count or the seed is not an int, or a scale is not a number.
    ValueError
        If a count is too small, the seed is negative, or a scale is not
        positive.

    Notes
    -----
    The generative model is

    .. math::

        w_j, b \\sim N(0, s^2), \\quad x_n \\sim N(0, I_D), \\quad
        y_n = x_n^\\top w + b + \\varepsilon_n, \\quad
        \\varepsilon_n \\sim N(0, 1/\\beta).

    Draw order (fixed, so a seed always gives the same data): ``w``, ``b``,
    ``x_train``, ``x_test``, training noise, test noise.
    """
    num_train = _count(num_train, "num_train", 1)
    num_test = _count(num_test, "num_test", 1)
    in_features = _count(in_features, "in_features", 1)
    _check_size(num_train, num_test, in_features)
    prior_scale = _positive_real(prior_scale, "prior_scale")
    precision = _positive_real(precision, "precision")
    gen = _generator(seed)

    weight = prior_scale * torch.randn(in_features, generator=gen)
    bias = prior_scale * torch.randn((), generator=gen)
    x_train = torch.randn(num_train, in_features, generator=gen)
    x_test = torch.randn(num_test, in_features, generator=gen)
    noise_sd = precision**-0.5
    y_train = x_train @ weight + bias + noise_sd * torch.randn(num_train, generator=gen)
    y_test = x_test @ weight + bias + noise_sd * torch.randn(num_test, generator=gen)
    posterior = blr_posterior(
        x_train, y_train, weight_prior_scale=prior_scale, precision=precision
    )
    return BLRData(
        "blr", x_train, y_train, x_test, y_test,
        true_weight=weight, true_bias=float(bias), prior_scale=prior_scale,
        precision=precision, posterior=posterior,
    )


def _gap_mean(x: torch.Tensor) -> torch.Tensor:
    """Noise-free target of :func:`gap_regression`, :math:`\\sin 3x + 0.3 x^2`."""
    return torch.sin(3.0 * x) + 0.3 * x**2


def gap_regression(
    num_train: int = 160,
    num_test: int = 200,
    *,
    noise_sd: float = 0.1,
    seed: int = 0,
) -> RegressionData:
    """1-D regression data with a gap between two training clusters.

    Parameters
    ----------
    num_train : int, default 160
        Number of training points (>= 2); ``num_train // 2`` fall in the left
        cluster and the rest in the right one.
    num_test : int, default 200
        Number of points in the evenly spaced test grid (>= 2).
    noise_sd : float, default 0.1
        Standard deviation of the Gaussian observation noise (>= 0).
    seed : int, default 0
        Seed of a local :class:`torch.Generator` (>= 0).

    Returns
    -------
    RegressionData
        Float32 data named ``"gap"``: ``x_train`` of shape ``[num_train, 1]``
        sorted ascending, ``x_test`` the grid over ``[-1.5, 1.5]``.

    Raises
    ------
    TypeError
        If a count or the seed is not an int or ``noise_sd`` not a number.
    ValueError
        If a count is too small, the seed is negative or ``noise_sd`` is
        negative or not finite.

    Notes
    -----
    Training inputs are uniform on :math:`[-1, -0.35] \\cup [0.35, 1]`; the
    test grid covers the gap :math:`(-0.35, 0.35)` and extends beyond the
    data.  Targets are

    .. math:: y = \\sin(3x) + 0.3 x^2 + \\varepsilon, \\quad
              \\varepsilon \\sim N(0, \\sigma^2).

    A good posterior predictive should be more uncertain inside the gap than
    on the clusters (Foong et al., 2019).

    References
    ----------
    .. [1] A. Y. K. Foong, Y. Li, J. M. Hernández-Lobato, R. E. Turner,
       "'In-Between' Uncertainty in Bayesian Neural Networks",
       ICML Workshop on Uncertainty and Robustness in Deep Learning, 2019.
    """
    num_train = _count(num_train, "num_train", 2)
    num_test = _count(num_test, "num_test", 2)
    _check_size(num_train, num_test, 1)
    noise_sd = _positive_real(noise_sd, "noise_sd", allow_zero=True)
    gen = _generator(seed)

    sizes = (num_train // 2, num_train - num_train // 2)
    parts = [
        low + (high - low) * torch.rand(n, generator=gen)
        for (low, high), n in zip(_GAP_CLUSTERS, sizes)
    ]
    # Sorting makes line plots of the training data readable; order carries no meaning.
    x_train = torch.sort(torch.cat(parts)).values
    x_test = torch.linspace(*_GAP_TEST_RANGE, num_test)
    y_train = _gap_mean(x_train) + noise_sd * torch.randn(num_train, generator=gen)
    y_test = _gap_mean(x_test) + noise_sd * torch.randn(num_test, generator=gen)
    return RegressionData("gap", x_train.unsqueeze(-1), y_train, x_test.unsqueeze(-1), y_test)
