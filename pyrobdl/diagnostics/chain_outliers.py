r"""A noise-aware test for a few stuck chains: chains whose mean of some function-space quantity lies
further from the other chains' than the Monte Carlo error of a chain mean explains.

R-hat compares the variance between chain means with the variance within chains, **averaged over
the chains**, so a fixed number of chains stuck in a shifted mode is diluted as chains are added
(4 of 64 chains 0.5 posterior sd away: split R-hat 1.009-1.011, nested 1.001-1.006; 8 of 512
chains 1 sd away: split R-hat 1.008; docs/diagnostics.md, "One set of criteria for every
reference, and stuck chains").  This test looks at every chain instead.  For each quantity
:math:`q` (an input point and output of f) and chain :math:`k`, with :math:`m_{kq}` the chain's
mean of :math:`q`'s rank-normal scores (below) over its draws,

.. math::

    z_{kq} = \frac{m_{kq} - \operatorname{median}_k m_{kq}}{s_q}, \qquad
    s_q = \max\Big(1.4826\,\operatorname{MAD}_k(m_{kq}),\;
    c\,\sqrt{W_q / \mathrm{ESS}^{\mathrm{chain}}_q}\Big),

and chain :math:`k` is flagged when :math:`\max_q |z_{kq}| > z_{K,Q} = \Phi^{-1}(1 - \alpha/(2KQ))`
(Bonferroni over the :math:`K` chains and :math:`Q` quantities, two-sided).

* The **centre** is the median of the chain means: a few stuck chains barely move it.
* The **noise sd** :math:`s_q` is the larger of two estimates of the Monte Carlo error of one
  chain's mean.  (a) The chains' robust spread, 1.4826 x MAD of the chain means: robust to a few
  stuck chains, and it measures the real error whatever the autocorrelation; but with K chains its
  relative sampling error is about :math:`1.17/\sqrt{K}` (15% at K = 64), and the largest of
  :math:`K Q` scores divided by it is far more often above the Bonferroni threshold than
  :math:`\alpha` (measured on exact Gaussian chain means of 50 quantities: a chain flagged in
  22% of runs at K = 64, 2% at K = 512, 86% at K = 16; ``comparisons/research/stuck_chains.py``).
  (b) A floor, the within-chain standard deviation over the square root of the
  **within-chain** ESS of one chain: :math:`W_q` the mean within-chain variance,
  :math:`\mathrm{ESS}^{\mathrm{chain}}_q` Geyer's ESS of the chains centred on their own
  means (so that stuck chains do not lower it, as they lower ArviZ's ESS) divided by :math:`K`,
  and at most the draws per chain (an antithetic estimate does not shrink the floor).  The floor
  is estimated from all :math:`K D` draws, precise where the MAD is not, but biased low for
  autocorrelated chains (centring each chain on its own mean removes ~tau/N of the variance at
  every lag: 7% low at rho = 0.8 over 300 draws), so it is multiplied by the median over the
  quantities of the ratio MAD-sd / floor when that exceeds 1 (a few stuck chains or quantities do
  not move a median): that factor is :math:`c`.  With both the false-alarm rate is at most
  about :math:`\alpha` (measured in docs/diagnostics.md).
* The scores are of the draws' **rank-normal scores** (pooled over the chains, as for bulk ESS
  and R-hat), not of the raw values: with heavy-tailed marginals one extreme draw moves a chain
  mean far in units of the Gaussian noise sd (on raw Student-t 5 draws a prototype flagged a chain
  in 3 of 20 well-mixed runs of 512 chains, largest score 7.3 against 5.07).
* With fewer than :data:`MIN_CHAINS` chains the test is not run (:func:`chain_outliers` returns
  None): the median and the MAD of a handful of chains cannot single out one of them, and with
  few long chains R-hat, which is not diluted there, is the check.
* The quantities are correlated (f at nearby inputs), so the Bonferroni count :math:`Q` is
  larger than the number of independent tests, and the threshold conservative.  A quantity that
  is not finite in some draw is not scored (R-hat fails it); a quantity whose chains all hold
  the same mean scores 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np
import torch

from .rank_diagnostics import _CHUNK_ELEMENTS, _ess, _z_scale

__all__ = ["MIN_CHAINS", "ChainOutliers", "chain_mean_scores", "chain_outliers"]

#: Fewest chains the test is run with.
MIN_CHAINS = 8
#: Consistency factor of the median absolute deviation for a Gaussian's standard deviation.
MAD_SD = 1.4826
#: At most this many chains are listed in a failure sentence.
_MAX_LISTED = 8


@dataclass(frozen=True)
class ChainOutliers:
    """What :func:`chain_outliers` measured.

    Attributes
    ----------
    chains : tuple of int
        The flagged chains (numbered from 0), in increasing order.
    values : tuple of float
        Each flagged chain's largest :math:`|z_{kq}|` over the quantities.
    largest : float
        The largest :math:`|z_{kq}|` of any chain (how close a passing posterior came).
    largest_chain : int
        The chain that holds it.
    z : float
        The threshold :math:`\\Phi^{-1}(1 - \\alpha / (2 K Q))`.
    alpha : float
    num_chains, num_quantities, num_draws : int
        :math:`K`, :math:`Q` and the draws per chain.
    """

    chains: tuple[int, ...]
    values: tuple[float, ...]
    largest: float
    largest_chain: int
    z: float
    alpha: float
    num_chains: int
    num_quantities: int
    num_draws: int

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-serialisable)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}

    def sentence(self) -> str:
        """The failure sentence, e.g. ``"chains 3, 17 hold means of f 6.2-8.1 noise sd from the
        chains' median (more than 4.66 sd is an outlier among 64 chains x 50 quantities at alpha
        0.01)"``; empty when no chain is flagged."""
        if not self.chains:
            return ""
        shown = ", ".join(str(c) for c in self.chains[:_MAX_LISTED])
        more = f", … ({len(self.chains)} chains)" if len(self.chains) > _MAX_LISTED else ""
        low, high = min(self.values), max(self.values)
        far = f"{low:.1f}" if len(self.values) == 1 else f"{low:.1f}-{high:.1f}"
        who = f"chain {shown} holds" if len(self.chains) == 1 else f"chains {shown}{more} hold"
        return (f"{who} means of f {far} noise sd from the chains' median (more than {self.z:.2f} sd is an "
                f"outlier among {self.num_chains} chains x {self.num_quantities} quantities at alpha {self.alpha:g})")


def _chain_sums(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Of ``x[chain, draw, quantity]``'s rank-normal scores (pooled over the chains): the chain
    means ``[K, Q]``, the mean within-chain variance ``[Q]`` and the within-chain ESS of one chain
    ``[Q]``; and which quantities are finite in every draw ``[Q]``.  On ``x``'s device."""
    k, d, q = x.shape
    out = [torch.empty(k, q, dtype=x.dtype, device=x.device)] + [torch.empty(q, dtype=x.dtype, device=x.device)
                                                                   for _ in range(2)]
    step = max(1, _CHUNK_ELEMENTS // max(1, k * d))
    for start in range(0, q, step):
        part = x[:, :, start:start + step].permute(2, 0, 1).contiguous()  # [quantity, chain, draw]
        scores = _z_scale(part)[0]
        centred = scores - scores.mean(2, keepdim=True)  # the autocorrelation within chains only
        out[0][:, start:start + step] = scores.mean(2).T
        out[1][start:start + step] = scores.var(2, correction=1).mean(1)
        out[2][start:start + step] = _ess(centred)
    finite = torch.isfinite(x).all(1).all(0)
    return out[0], out[1], torch.clamp(out[2] / k, max=float(d)), finite


def chain_mean_scores(draws: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    r"""The scores :math:`z_{kq}` of every chain's mean of every quantity (module docstring).

    Parameters
    ----------
    draws : array-like or torch.Tensor
        ``[chain, draw, *dims]`` (at least 4 draws).  A tensor's chain sums are computed on its
        own device (a CUDA posterior's draws stay on the GPU), in float64.

    Returns
    -------
    z : numpy.ndarray
        ``[chain, quantity]`` (quantities flattened from ``dims``); 0 where a quantity is not
        finite in some draw or all its chains hold the same mean.
    spread_sd, floor_sd : numpy.ndarray
        ``[quantity]``: 1.4826 x MAD of the chain means, and the within-chain floor; the larger
        divides.
    """
    t = draws.detach() if isinstance(draws, torch.Tensor) else torch.as_tensor(np.asarray(draws, dtype=float))
    if t.ndim < 2 or t.shape[1] < 4:
        raise ValueError(f"draws must have shape [chain, draw, ...] with at least 4 draws, got {tuple(t.shape)}")
    x = t.to(torch.float64).reshape(t.shape[0], t.shape[1], -1)
    means, within, ess, finite = (v.cpu().numpy() for v in _chain_sums(x))
    centre = np.median(means, axis=0)
    spread = MAD_SD * np.median(np.abs(means - centre), axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        floor = np.sqrt(within / ess)
        ratio = spread / floor
        ratio = ratio[np.isfinite(ratio) & finite]
        # the floor's bias (low by ~tau/N from centring each chain), measured on the chains
        floor = floor * max(1.0, float(np.median(ratio)) if ratio.size else 1.0)
        sd = np.fmax(spread, floor)
        z = (means - centre) / sd  # 0/0 where every chain holds the median: nan, scored 0 below
    return np.where(np.isnan(z) | ~finite, 0.0, z), spread, floor


def chain_outliers(draws: Any, alpha: float = 0.01) -> ChainOutliers | None:
    r"""Chains whose mean of some quantity lies further from the chains' median than the Monte
    Carlo error of a chain mean explains, Bonferroni over chains and quantities (module docstring).

    Parameters
    ----------
    draws : array-like or torch.Tensor
        ``[chain, draw, *dims]``, e.g. the function values ``[chain, draw, N, out]`` that
        :func:`~pyrobdl.diagnostics.certification.certify` checks.
    alpha : float, default 0.01
        Probability that well-mixed chains have some chain flagged (at most about: the
        quantities are correlated and the noise sd is the larger of two estimates).

    Returns
    -------
    ChainOutliers or None
        None with fewer than :data:`MIN_CHAINS` chains, fewer than 4 draws or no quantity.

    Raises
    ------
    ValueError
        ``alpha`` not in (0, 1).
    """
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 1:
        raise ValueError(f"alpha must be a number in (0, 1), got {alpha!r}")
    shape = tuple(draws.shape) if isinstance(draws, torch.Tensor) else np.shape(draws)
    quantities = math.prod(shape[2:]) if len(shape) >= 2 else 0
    if len(shape) < 2 or shape[0] < MIN_CHAINS or shape[1] < 4 or quantities == 0:
        return None
    k, d = int(shape[0]), int(shape[1])
    score = np.abs(chain_mean_scores(draws)[0]).max(axis=1)  # [chain]
    z = NormalDist().inv_cdf(1.0 - alpha / (2 * k * quantities))
    idx = np.flatnonzero(score > z)
    top = int(np.argmax(score))
    return ChainOutliers(tuple(int(i) for i in idx), tuple(float(score[i]) for i in idx), float(score[top]), top,
                         float(z), float(alpha), k, int(quantities), d)
