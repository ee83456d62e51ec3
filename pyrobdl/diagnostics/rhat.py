r"""Function-space R-hat for :func:`~pyrobdl.diagnostics.certification.certify`: nested R-hat
(Margossian et al. 2024) of many short chains in superchains, and the R-hat / ESS failure
sentences (printed with :data:`RHAT_DECIMALS` decimals).  Split R-hat and ESS themselves are
:func:`~pyrobdl.diagnostics.rank_diagnostics.convergence`'s.  Everything here is re-exported by
:mod:`pyrobdl.diagnostics.certification`, where it lived before.

References
----------
C. C. Margossian, M. D. Hoffman, P. Sountsov, L. Riou-Durand, A. Vehtari, A. Gelman. Nested
:math:`\hat R`: assessing the convergence of Markov chain Monte Carlo when running many short
chains. Bayesian Analysis, 2024 (arXiv:2110.13017).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["RHAT_DECIMALS", "nested_rhat"]


#: Decimals an R-hat is printed with (at least): 3, so that a value near the 1.01 threshold shows
#: on which side of it it lies (1.009 passes, 1.012 fails; with 2 both read "1.01").
RHAT_DECIMALS = 3


def _beyond(value: float, limit: float, upper: bool, start: int | None = None) -> str:
    """``value`` with the fewest decimals (from ``start``; default 2, or 0 for ESS-like numbers)
    that still show it on the failing side of ``limit`` (so 1.0103 > 1.01 is not printed as
    "1.01 > 1.01")."""
    if start is None:
        start = 0 if abs(limit) >= 10 else 2
    for d in range(start, 7):
        text = f"{value:.{d}f}"
        if (float(text) > limit) if upper else (float(text) < limit):
            return text
    return repr(value)


def nested_rhat(draws: Any, superchain_size: int) -> np.ndarray:
    r"""Nested :math:`\hat R` (Margossian et al. 2024) of each scalar quantity.

    Parameters
    ----------
    draws : array-like
        ``[chain, draw, *dims]``; chains ``k*M .. (k+1)*M - 1`` form superchain ``k``
        (``M = superchain_size``), ideally chains started from the same point.
    superchain_size : int
        Chains per superchain :math:`M`.

    Returns
    -------
    numpy.ndarray
        Shape ``dims``: :math:`\hat R_\nu` of every quantity (nan or inf where the
        within-superchain variance is zero).

    Raises
    ------
    ValueError
        Unless the chains form at least two superchains of ``superchain_size`` chains.

    Notes
    -----
    With :math:`K` superchains of :math:`M` chains of :math:`N` draws
    :math:`\theta^{(nmk)}`, chain means :math:`\bar\theta^{(\cdot mk)}`, superchain means
    :math:`\bar\theta^{(\cdot\cdot k)}` (over all :math:`MN` draws) and overall mean
    :math:`\bar\theta^{(\cdot\cdot\cdot)}` (eqs. 4-8 of the paper, as in the R package
    ``posterior::rhat_nested``):

    .. math::

        \hat B_\nu &= \frac{1}{K-1}\sum_{k=1}^K
            \big(\bar\theta^{(\cdot\cdot k)} - \bar\theta^{(\cdot\cdot\cdot)}\big)^2, \\
        \tilde B_k &= \frac{1}{M-1}\sum_{m=1}^M
            \big(\bar\theta^{(\cdot mk)} - \bar\theta^{(\cdot\cdot k)}\big)^2
            \quad (0 \text{ when } M = 1), \\
        \tilde W_k &= \frac{1}{M}\sum_{m=1}^M \frac{1}{N-1}\sum_{n=1}^N
            \big(\theta^{(nmk)} - \bar\theta^{(\cdot mk)}\big)^2
            \quad (0 \text{ when } N = 1), \\
        \hat W_\nu &= \frac{1}{K}\sum_{k=1}^K \big(\tilde B_k + \tilde W_k\big), \qquad
        \hat R_\nu = \sqrt{1 + \hat B_\nu / \hat W_\nu}.

    The within-superchain variance counts both the spread of the chain means inside a superchain
    and the within-chain variance, so with many short chains (even :math:`N = 1`) it still
    estimates the posterior variance once the chains have forgotten their common start.  With
    :math:`M = 1` (every chain its own superchain) :math:`\hat W_\nu` is the mean within-chain
    variance and :math:`\hat R_\nu^2 = 1 + \hat B_\nu/\hat W_\nu`, the classic (non-split,
    not rank-normalised) R-hat of Gelman & Rubin except for its :math:`-1/N` term: nested R-hat is
    bounded below by 1 (footnote 3 of the paper).  No splitting and no rank normalisation are
    applied, as in the paper.
    """
    if isinstance(superchain_size, bool) or not isinstance(superchain_size, int) or superchain_size < 1:
        raise ValueError(f"nested_rhat.superchain_size must be an integer >= 1, got {superchain_size!r}")
    if isinstance(draws, torch.Tensor):  # computed where the draws are (a CUDA posterior's stay on the GPU)
        arr = draws.detach().to(torch.float64)
    else:
        arr = torch.as_tensor(np.asarray(draws, dtype=float))
    if arr.ndim < 2:
        raise ValueError(f"draws must have shape [chain, draw, ...], got {tuple(arr.shape)}")
    c, n = arr.shape[:2]
    m = superchain_size
    if c % m or c // m < 2:
        raise ValueError(
            f"nested R-hat needs at least 2 superchains of superchain_size={m} chains; got {c} chain(s)"
        )
    k = c // m
    x = arr.reshape(k, m, n, -1)
    chain_mean = x.mean(2)  # [K, M, Q]
    super_mean = chain_mean.mean(1)  # [K, Q]: equal chain lengths, so the mean of all M*N draws
    b_nu = super_mean.var(0, correction=1)
    b_k = chain_mean.var(1, correction=1) if m > 1 else torch.zeros_like(super_mean)
    w_k = x.var(2, correction=1).mean(1) if n > 1 else torch.zeros_like(super_mean)
    w_nu = (b_k + w_k).mean(0)
    r = torch.sqrt(1.0 + b_nu / w_nu)  # 0/0 -> nan, b/0 -> inf, as documented
    return r.reshape(arr.shape[2:]).cpu().numpy()


def _points_failing(values: np.ndarray, ok: np.ndarray) -> int:
    """Input points (first axis) where some output fails (``~ok``, NaN included)."""
    return int((~ok).reshape(values.shape[0], -1).any(1).sum())


def _check_rhat(rhat: np.ndarray, limit: float, label: str, n: int) -> list[str]:
    """The failure sentence of R-hats ``[N, out]`` above ``limit`` (none when all pass)."""
    ok = rhat <= limit
    if ok.all():
        return []
    bad = _points_failing(rhat, ok)
    finite = rhat[np.isfinite(rhat)]
    nonfinite = _points_failing(rhat, np.isfinite(rhat))
    if finite.size and finite.max() > limit:
        shown = _beyond(float(finite.max()), limit, True, RHAT_DECIMALS)
        text = f"{label} {shown} > {limit:g} at {bad} of {n} points"
        return [text + (f" (not finite at {nonfinite})" if nonfinite else "")]
    return [f"{label} not finite at {nonfinite} of {n} points"]


def _check_ess(ess: np.ndarray, limit: float, label: str, n: int) -> list[str]:
    """The failure sentence of ESSs ``[N, out]`` below ``limit`` (none when all pass)."""
    ok = ess >= limit
    if ok.all():
        return []
    bad = _points_failing(ess, ok)
    finite = ess[np.isfinite(ess)]
    nonfinite = _points_failing(ess, np.isfinite(ess))
    if finite.size and finite.min() < limit:
        text = f"{label} {_beyond(float(finite.min()), limit, False)} < {limit:g} at {bad} of {n} points"
        return [text + (f" (not finite at {nonfinite})" if nonfinite else "")]
    return [f"{label} not finite at {nonfinite} of {n} points"]
