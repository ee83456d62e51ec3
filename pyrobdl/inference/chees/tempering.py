"""Replica exchange between chains at inverse temperatures (method "chees" with ``temperatures``):
the tempered log joint, the even-odd exchange, the ladder's respacing and the replicas' round trips."""

from __future__ import annotations

import numpy as np
import torch

from ...flat import FlatLogJoint
from .kernel import _Sampler

# ----------------------------------------------------------------------------------- sampler
class _Tempered:
    r"""The log joint of chains at inverse temperatures: :math:`\log p(\theta) + \beta_k \log p(y|\theta)`.

    ``beta`` ``[K]`` is each row's inverse temperature.  One call of the (possibly compiled) full
    log joint and one of the cheap prior give both parts: the likelihood is their difference.
    """

    #: no compiled leapfrog block: every step calls :meth:`value_and_grad` (the tempered sum)
    leapfrog_block = 0

    def __init__(self, lj: FlatLogJoint, beta: torch.Tensor) -> None:
        self.lj, self.beta = lj, beta
        self.size, self.layout = lj.size, lj.layout

    def value_and_grad(self, theta: torch.Tensor, value: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The tempered log joint and its gradient (``value`` is accepted and ignored: both always)."""
        full, g_full = self.lj.value_and_grad(theta)
        prior, g_prior = self.lj.log_prior(theta)
        return prior + self.beta * (full - prior), g_prior + self.beta.unsqueeze(-1) * (g_full - g_prior)

    def log_likelihood(self, theta: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
        """Each row's log-likelihood, from its tempered log joint ``logp`` (no gradient call)."""
        return (logp - self.lj.log_prior(theta)[0]) / self.beta


def _swap(sampler: "_Sampler", tempered: _Tempered, rungs: int, parity: int,
          generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Replica exchange between neighbouring rungs (deterministic even-odd scheme).

    Rungs are ``rungs`` equal blocks of consecutive rows.  For each pair of rungs
    :math:`(r, r+1)` with :math:`r \equiv` ``parity`` (mod 2) and each column ``c``, the states of
    row ``c`` of the two rungs are exchanged with probability
    :math:`\min\{1, \exp[(\beta_r - \beta_{r+1})(\ell_{r+1,c} - \ell_{r,c})]\}`, which keeps
    every rung's tempered posterior invariant (the priors cancel).  After an exchange the log joint
    and gradient of every row are recomputed at its new temperature (one chain-gradient per row,
    counted).  Returns the lower rungs of the proposed pairs, their acceptance probabilities
    ``[pairs, C]``, and the permutation of the rows (``None`` when nothing was exchanged): row i
    now holds the state that was in row ``perm[i]``.
    """
    k = sampler.theta.shape[0]
    c = k // rungs
    lower = torch.arange(parity, rungs - 1, 2, device=sampler.theta.device)
    if lower.numel() == 0:
        return lower, sampler.theta.new_zeros(0, c), None
    ll = tempered.log_likelihood(sampler.theta, sampler.logp).view(rungs, c)
    beta = tempered.beta.view(rungs, c)[:, 0]
    log_a = (beta[lower] - beta[lower + 1]).unsqueeze(-1) * (ll[lower + 1] - ll[lower])
    prob = torch.where(torch.isfinite(log_a), torch.exp(torch.clamp(log_a, max=0.0)), torch.zeros_like(log_a))
    u = torch.rand(prob.shape, dtype=prob.dtype, device=prob.device, generator=generator)
    accept = u < prob
    if bool(accept.any()):
        rows = torch.arange(k, device=sampler.theta.device).view(rungs, c)
        lo, hi = rows[lower], rows[lower + 1]
        perm = rows.clone()
        perm[lower] = torch.where(accept, hi, lo)
        perm[lower + 1] = torch.where(accept, lo, hi)
        sampler.theta = sampler.theta[perm.view(-1)]
        sampler.logp, sampler.grad = tempered.value_and_grad(sampler.theta)
        sampler.gradients += k
        return lower, prob, perm.view(-1)
    return lower, prob, None


def respace_ladder(betas: "list[float]", reject: "list[float] | np.ndarray", floor: float = 1e-3) -> list[float]:
    r"""Move the inner inverse temperatures so that every neighbouring pair rejects exchanges equally.

    The schedule adaptation of non-reversible parallel tempering (Syed, Bouchard-Côté,
    Deligiannidis & Doucet 2022, JRSS-B): the rejection rate :math:`r_i` measured between rungs
    i and i + 1 estimates the *communication barrier* :math:`\Lambda` accumulated between their
    inverse temperatures; the cumulative barrier :math:`\Lambda(eta_i) = \sum_{j<i} r_j` is
    interpolated (piecewise linearly in :math:`\logeta`, the coordinate of a geometric ladder)
    and inverted at R equally spaced levels, so each new pair holds :math:`\Lambda / (R-1)` of it.
    The ends (1 and the hottest :math:`eta`) stay where they are.

    Parameters
    ----------
    betas : list of float
        The current ladder, :math:`1 = eta_0 > eta_1 > \dots > eta_{R-1} > 0`.
    reject : array of float, length R - 1
        Each neighbouring pair's estimated rejection rate (1 - mean acceptance probability).
    floor : float, default 1e-3
        Rates below it count as ``floor``, so the cumulative barrier is strictly increasing and the
        new ladder strictly decreasing.

    Returns
    -------
    list of float
        The new ladder, strictly decreasing, with the same ends.
    """
    b = np.asarray(betas, dtype=np.float64)
    r = np.asarray(reject, dtype=np.float64)
    if r.shape != (b.size - 1,) or not np.isfinite(r).all():
        raise ValueError(f"reject needs one finite rate per neighbouring pair ({b.size - 1}), got {r!r}")
    cum = np.concatenate([[0.0], np.cumsum(np.clip(r, floor, None))])
    levels = np.linspace(0.0, cum[-1], b.size)
    new = np.exp(np.interp(levels, cum, np.log(b)))
    new[0], new[-1] = b[0], b[-1]
    return [float(v) for v in new]


class _ReplicaTracker:
    """Which replica (the lineage of one state as exchanges move it) sits in each row, and its
    journeys between the coldest and the hottest rung.

    ``replica[i]`` is the replica in row i.  A replica's label is the last end of the ladder it
    visited: 0 neither yet, 1 the coldest (beta = 1), 2 the hottest after the coldest, 3 the hottest
    before any visit to the coldest.  When a replica labelled 2 or 3 reaches the coldest rung it
    brings the posterior a state that has been through the hottest rung (an *arrival from the hot
    end*); labelled 2 it also completes a *round trip* (coldest, hottest, coldest), the unit in
    which Katzgraber et al. (2006) and Syed et al. (2022) measure parallel tempering.  Counts are
    kept per phase (0 warm-up, 1 sampling) on the device.  ``span`` is, per replica, the number of
    rungs between the coldest and the hottest it occupied in the sampling phase: how far states
    travel along the ladder at all.
    """

    def __init__(self, k: int, rungs: int, device: torch.device) -> None:
        self.kept = k // rungs
        self.replica = torch.arange(k, device=device)
        self.row_rung = torch.arange(k, device=device) // self.kept
        self.label = torch.zeros(k, dtype=torch.int8, device=device)
        self.counts = torch.zeros(2, 2, dtype=torch.int64, device=device)  # [phase, (round trips, arrivals)]
        self.lo = self.hi = None  # per replica, the coldest / hottest rung of the sampling phase

    @property
    def span(self) -> torch.Tensor:
        """``[K]``: hottest minus coldest rung each replica occupied in the sampling phase."""
        return self.hi - self.lo if self.lo is not None else torch.zeros_like(self.replica)

    def update(self, perm: torch.Tensor | None, phase: int) -> None:
        if perm is not None:
            self.replica = self.replica[perm]
        if phase == 1:
            rung = torch.empty_like(self.replica)
            rung[self.replica] = self.row_rung  # each replica's rung now
            if self.lo is None:
                self.lo, self.hi = rung, rung
            else:
                self.lo, self.hi = torch.minimum(self.lo, rung), torch.maximum(self.hi, rung)
        cold, hot = self.replica[: self.kept], self.replica[-self.kept :]
        lab = self.label[cold]
        self.counts[phase, 0] += (lab == 2).sum()
        self.counts[phase, 1] += (lab >= 2).sum()
        self.label[cold] = 1
        lab = self.label[hot]
        self.label[hot] = torch.where(lab == 1, torch.full_like(lab, 2), torch.where(lab == 0, torch.full_like(lab, 3), lab))


def _rung_rows(values: list[float], per_rung: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[K]``: rung r's value (inverse temperature, step size) for its ``per_rung`` consecutive rows."""
    return torch.tensor(values, dtype=dtype, device=device).repeat_interleave(per_rung)

