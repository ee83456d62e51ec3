r"""E-BFMI (Betancourt 2016) of Hamiltonian Monte Carlo chains: per chain, pooled over chains, the
sampling noise of one chain's estimate, and a noise-aware test for a chain whose E-BFMI is an outlier.

:func:`ebfmi` and :func:`ebfmi_pooled` are what :func:`pyrobdl.diagnostics.certification.certify`
checks against ``min_ebfmi``.  The pooled value averages the chains' E-BFMIs (weighted by their
energy variances), so one chain with a pathological energy among many barely moves it (one chain
at 0.06 among 63 at 0.5 leaves it at ~0.50).  :func:`ebfmi_outliers` catches such a chain: it
flags a chain whose E-BFMI lies further below the chains' centre than the smallest of ``K``
chains' sampling noise explains.  The centre is the **median** of the chains' E-BFMIs, not the
pooled value: a chain whose energy wanders (a random walk) has a large energy variance and drags
the pooled value towards itself (one such chain of four iid-energy chains takes it from ~2 to
~0.1, and would hide behind it), where the median does not move.  Under the null (every chain
sharing one E-BFMI) the two agree to a small fraction of the noise.  The noise standard deviation
is the larger of

* :func:`ebfmi_noise_sd`, a parametric bootstrap: one chain's E-BFMI over ``N`` Gaussian AR(1)
  energies whose E-BFMI is the centre (``rho = 1 - b/2``; fixed seed, cached), and
* the spread of the chains' own E-BFMIs, ``1.4826 * MAD`` (robust to a few outlying chains).

The AR(1) model alone **underestimates** the noise of real samplers' energies, which are not
Gaussian: over 300 draws at an E-BFMI of ~0.4 it gives 0.072 where the wine references' chains
show 0.102 (docs/diagnostics.md, "E-BFMI"); the spread across chains measures the real noise
when there are enough chains, and the AR(1) value is a floor when there are few.  A chain is
flagged when ``(centre - e_k) / sd > z_K`` with ``z_K = Phi^-1(1 - alpha / K)`` (Bonferroni over
the ``K`` chains: 3.60 at ``K = 64``, 4.11 at ``K = 512`` for ``alpha = 0.01``).  The estimator's
distribution is right-skewed (skewness 0.3-0.7 at these lengths), so its lower tail is lighter
than the Gaussian one and the test errs on the side of passing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist
from typing import Any

import numpy as np

__all__ = ["EBFMIOutliers", "ebfmi", "ebfmi_noise_sd", "ebfmi_outliers", "ebfmi_pooled"]

#: Replicate chains of the parametric bootstrap in :func:`ebfmi_noise_sd` (relative sampling
#: error of its standard deviation about 1/sqrt(2 * 2000) = 1.6%).
NOISE_REPLICATES = 2000
#: Seed of that bootstrap: the noise model is deterministic.
NOISE_SEED = 20261127
#: Consistency factor of the median absolute deviation for a Gaussian's standard deviation.
MAD_SD = 1.4826


def ebfmi(energy: Any) -> np.ndarray:
    r"""Energy Bayesian fraction of missing information of each chain (Betancourt 2016).

    .. math::

        \widehat{\text{E-BFMI}} = \frac{\sum_{n=2}^{N} (E_n - E_{n-1})^2}{\sum_{n=1}^{N} (E_n - \bar E)^2}

    over the sampling iterations of one chain, :math:`E_n` the Hamiltonian of iteration
    :math:`n`: how far one momentum resampling moves the energy, relative to the spread of its
    marginal distribution (equal to ArviZ's ``az.bfmi``).  About 1 or more for a sampler that
    explores the energy levels well; below 0.2-0.3 the momentum resampling moves slowly through
    them (heavy tails, a badly adapted metric) and estimates may be biased.

    Parameters
    ----------
    energy : array-like
        ``[chain, iteration]`` (or ``[iteration]`` for one chain), sampling iterations only.

    Returns
    -------
    numpy.ndarray
        ``[chain]``; nan for a chain with fewer than two iterations or constant energy.
    """
    num, den = _energy_sums(energy)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def _energy_sums(energy: Any) -> tuple[np.ndarray, np.ndarray]:
    """Per chain of ``[chain, iteration]`` energies: the sum of squared successive differences
    and the sum of squared deviations from the chain's mean (nan with fewer than two iterations)."""
    e = np.atleast_2d(np.asarray(energy, dtype=float))
    if e.ndim != 2:
        raise ValueError(f"energy must have shape [chain, iteration], got {np.shape(energy)}")
    if e.shape[1] < 2:
        return np.full(e.shape[0], np.nan), np.full(e.shape[0], np.nan)
    return np.square(np.diff(e, axis=1)).sum(1), np.square(e - e.mean(1, keepdims=True)).sum(1)


def ebfmi_pooled(energy: Any) -> float:
    r"""E-BFMI pooled over the chains: every chain's squared successive differences of the energy
    over every chain's squared deviations from its own mean.

    .. math::

        \widehat{\text{E-BFMI}}_{\text{pooled}} = \frac{\sum_k \sum_{n=2}^{N} (E_{kn} - E_{k,n-1})^2}
        {\sum_k \sum_{n=1}^{N} (E_{kn} - \bar E_k)^2}

    The quantity :func:`ebfmi` estimates from one chain — how far a momentum resampling moves the
    energy relative to the spread of its marginal distribution, a property of the target and the
    kinetic energy, the same for every chain that samples it — estimated from all of them.  It is
    the chains' E-BFMIs averaged with weights proportional to their energy variances, so a chain
    that wanders in energy (a random walk, E-BFMI near 0, with a large variance) pulls it down
    much more than its share; each chain's own mean is used, so chains at different energy
    levels do not inflate the denominator (R-hat is the check for chains that disagree).

    Parameters
    ----------
    energy : array-like
        As for :func:`ebfmi`: the sampling iterations' energies, one row per chain.

    Returns
    -------
    float
        nan with fewer than two iterations, a non-finite energy, or constant energies in every chain.
    """
    num, den = (float(v.sum()) for v in _energy_sums(energy))  # nan from any non-finite energy
    return num / den if math.isfinite(num) and math.isfinite(den) and den > 0 else float("nan")




def ebfmi_noise_sd(num_draws: int, value: float) -> float:
    r"""Sampling standard deviation of one chain's E-BFMI estimate over ``num_draws`` energies
    whose true E-BFMI is ``value``, under a Gaussian AR(1) model of the energy.

    An AR(1) sequence :math:`E_n = 
ho E_{n-1} + \varepsilon_n` has E-BFMI
    :math:`2(1 - 
ho)`; :data:`NOISE_REPLICATES` stationary chains with
    :math:`
ho = 1 - b/2` (``b = value`` rounded to 0.01 and clipped to [0.01, 3.9]) are
    simulated with the fixed seed :data:`NOISE_SEED` and the standard deviation of their
    :func:`ebfmi` returned.  Deterministic and cached per ``(num_draws, b)``.

    Parameters
    ----------
    num_draws : int
        Sampling iterations per chain, at least 2.
    value : float
        The E-BFMI the chains share (e.g. their median), finite and positive.

    Returns
    -------
    float
        E.g. 0.072 at 300 draws and 0.060 at 500 draws for an E-BFMI of 0.4 and 0.5.  Real
        samplers' energies are noisier (module docstring).

    Raises
    ------
    ValueError
        ``num_draws`` not an integer >= 2, or ``value`` not finite and positive.
    """
    if isinstance(num_draws, bool) or not isinstance(num_draws, (int, np.integer)) or num_draws < 2:
        raise ValueError(f"num_draws must be an integer >= 2, got {num_draws!r}")
    if not (isinstance(value, (int, float, np.floating)) and math.isfinite(value) and value > 0):
        raise ValueError(f"value must be a finite E-BFMI > 0, got {value!r}")
    return _noise_sd(int(num_draws), round(min(max(float(value), 0.01), 3.9), 2))


@lru_cache(maxsize=256)
def _noise_sd(n: int, b: float) -> float:
    from scipy.signal import lfilter

    rho = 1.0 - b / 2.0
    rng = np.random.default_rng([NOISE_SEED, n, int(round(100 * b))])
    z = rng.normal(size=(NOISE_REPLICATES, n))
    z[:, 0] /= math.sqrt(1.0 - rho * rho)  # start in the stationary distribution
    return float(np.std(ebfmi(lfilter([1.0], [1.0, -rho], z, axis=1)), ddof=1))


@dataclass(frozen=True)
class EBFMIOutliers:
    """What :func:`ebfmi_outliers` measured.

    Attributes
    ----------
    chains : tuple of int
        The flagged chains (numbered from 0), in increasing order.
    values : tuple of float
        Their E-BFMIs.
    centre : float
        The median of the chains' E-BFMIs, what each chain is compared with.
    pooled : float
        :func:`ebfmi_pooled` (recorded beside it: a chain with a wandering energy pulls it down
        and would hide behind it, module docstring).
    noise_sd : float
        The noise standard deviation used: ``max(model_sd, spread_sd)``.
    model_sd, spread_sd : float
        :func:`ebfmi_noise_sd` at ``centre``, and ``1.4826 * MAD`` of the chains' E-BFMIs.
    z : float
        How many noise sds below ``centre`` a chain is flagged: ``Phi^-1(1 - alpha / K)``.
    alpha : float
    num_chains, num_draws : int
    """

    chains: tuple[int, ...]
    values: tuple[float, ...]
    centre: float
    pooled: float
    noise_sd: float
    model_sd: float
    spread_sd: float
    z: float
    alpha: float
    num_chains: int
    num_draws: int

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-serialisable)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}


def ebfmi_outliers(energy: Any, alpha: float = 0.01) -> EBFMIOutliers | None:
    r"""Chains whose E-BFMI lies further below the chains' centre than ``K`` chains' noise explains.

    Chain ``k`` is flagged when :math:`(\tilde e - e_k)/\sigma > z_K`, :math:`\tilde e` the
    median of the chains' E-BFMIs, :math:`z_K = \Phi^{-1}(1 - \alpha/K)`, :math:`\sigma` the
    larger of the AR(1) noise model (:func:`ebfmi_noise_sd` at :math:`\tilde e`) and the
    chains' robust spread
    (:math:`1.4826\,\mathrm{MAD}` of their E-BFMIs); see the module docstring for why both.

    Parameters
    ----------
    energy : array-like
        ``[chain, iteration]``, sampling iterations only.
    alpha : float, default 0.01
        Probability that a sampler whose chains share one E-BFMI has some chain flagged (about,
        under the Gaussian approximation; less, the estimator's lower tail being light).

    Returns
    -------
    EBFMIOutliers or None
        None when it cannot be tested: fewer than 2 chains with a finite E-BFMI, fewer than 2
        iterations, or a median E-BFMI that is not positive.
    """
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 1:
        raise ValueError(f"alpha must be a number in (0, 1), got {alpha!r}")
    e = np.atleast_2d(np.asarray(energy, dtype=float))
    values, pooled = ebfmi(e), ebfmi_pooled(e)
    finite = np.isfinite(values)
    k, n = int(finite.sum()), e.shape[1]
    if k < 2 or n < 2:
        return None
    v = values[finite]
    centre = float(np.median(v))
    if not centre > 0:
        return None
    model = ebfmi_noise_sd(n, centre)
    spread = MAD_SD * float(np.median(np.abs(v - centre)))
    sd = max(model, spread)
    z = NormalDist().inv_cdf(1.0 - alpha / k)
    idx = np.flatnonzero(finite & ((centre - np.where(finite, values, centre)) / sd > z))
    return EBFMIOutliers(tuple(int(i) for i in idx), tuple(float(values[i]) for i in idx), centre, float(pooled),
                         float(sd), float(model), float(spread), float(z), float(alpha), k, n)
