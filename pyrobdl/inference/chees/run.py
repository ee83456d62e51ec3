r"""Many-chain HMC with ChEES adaptation: every chain advanced in lock-step, one batched gradient.

``fit(model, x, y, method="chees", num_chains=64, ...)`` runs K chains of jittered Hamiltonian
Monte Carlo on the flat log joint of :mod:`pyrobdl.flat`.  Every chain shares the step size,
the diagonal mass matrix and the number of leapfrog steps of an iteration, so each leapfrog
step is *one* call of :meth:`~pyrobdl.flat.FlatLogJoint.value_and_grad` on a ``[K, P]``
batch; the chains differ only in their state, momentum and accept/reject decision.  Sharing
the tuning parameters is what makes the cross-chain adaptation of Hoffman, Radul & Sountsov
(2021) possible:

* **step size** by dual averaging (Hoffman & Gelman 2014) of the *harmonic mean* of the
  chains' acceptance probabilities, target 0.651 (Beskos et al. 2013's optimum for HMC), as
  TFP and BlackJAX do;
* **trajectory length** T by stochastic gradient ascent of the ChEES criterion
  (the Change in the Estimator of the Expected Square,
  :math:`\tfrac14 E[(\lVert\theta'-E\theta'\rVert^2 - \lVert\theta-E\theta\rVert^2)^2]`), whose
  per-chain gradient with respect to :math:`\log T` is
  :math:`h\,T\,(\lVert\theta'-\bar\theta'\rVert^2-\lVert\theta-\bar\theta\rVert^2)\,
  (\theta'-\bar\theta')^\top M^{-1}p'`, averaged over chains with their acceptance
  probabilities as weights, fed to Adam (no momentum, :math:`\beta_2 = 0.95`), each update
  clipped to :math:`\pm 0.35` in log space, and smoothed by a moving average;
* **jitter**: iteration t uses :math:`\lceil h_t T/\epsilon\rceil` leapfrog steps, where
  :math:`h_t \in (0, 1)` is the base-2 Halton (van der Corput) sequence — even coverage of
  trajectory lengths with less variance than uniform draws (the paper's choice);
* **diagonal mass matrix** re-estimated at the end of Stan-style warm-up windows (an initial
  fast buffer, doubling slow windows, a final fast buffer), by default from the variance across
  chains *and* iterations of the window (``mass_matrix="cross-chain"``); or from the chains'
  own variances over the window, pooled into one shared matrix (``"within-chain"``) or kept one
  per chain (``"per-chain"``, the one tuning parameter the chains then do not share);
* **divergences** per chain: a non-finite energy or an energy error above
  ``divergence_threshold``.

The result is the project's :class:`~pyrobdl.inference.mcmc.MCMCPosterior` with K chains, so
every diagnostic, the ArviZ adapter, the suite and the report treat it like ``"nuts"``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

from ...diagnostics.certification import (
    attach_certification,
    certification_points,
    check_certify_inputs,
    ebfmi,
    given_inputs,
    reference_criteria,
)
from ...flat import FlatLogJoint
from ...posterior import Cost, Posterior
from ..checkpoint import CheckpointError, SamplerCheckpoint, run_identity
from ..mcmc import MCMCPosterior, SamplerTrace
from ..registry import Method, register_method, require_proper_prior
from ..svi import _peak_memory

__all__ = ["CERTIFY_RHATS", "CHEES_OPTIONS", "INIT_STRATEGIES", "JITTERS", "MASS_MATRICES", "WindowVariance", "halton",
           "run_chees"]

#: Starting points of the chains.
INIT_STRATEGIES = ("prior", "map", "ensemble")
#: How each iteration's trajectory length is jittered.
JITTERS = ("halton", "uniform", "none")
#: How the diagonal mass matrix is estimated from a warm-up window (:class:`WindowVariance`).
MASS_MATRICES = ("cross-chain", "within-chain", "per-chain")
#: Which R-hat certifies the chains ("auto": nested over superchain starts, else split).
CERTIFY_RHATS = ("auto", "split", "nested", "both")

CHEES_OPTIONS: dict[str, Any] = {
    "num_chains": 64,
    "num_warmup": 500,
    "num_samples": 200,
    "target_accept_prob": 0.651,
    "step_size": None,
    "init_trajectory_length": 1.0,
    "trajectory_lr": 0.05,
    "adapt_mass_matrix": True,
    "mass_matrix": "cross-chain",
    "max_num_steps": 1024,
    "jitter": "halton",
    "init_strategy": "prior",
    "superchain_size": 1,
    "map_num_steps": 500,
    "map_lr": 1e-2,
    "divergence_threshold": 1000.0,
    "chunk_size": "auto",
    "compile": "auto",
    "diagnostic_points": 50,
    "certify_inputs": None,
    "max_num_samples": None,
    "extend_by": 100,
    "certify_rhat": "auto",
    "temperatures": None,
    "adapt_temperatures": False,
    "checkpoint": None,
    "checkpoint_every_s": 300.0,
}

#: Options that do not change the chains (where and how often they are saved, the kernel, the
#: thread count, the points the result is diagnosed and certified at) or that a resumed run
#: reconciles itself (``num_samples`` may grow: the run is extended; so may the extension's
#: bounds), so a checkpoint's identity leaves them out.
_NOT_IDENTITY = ("checkpoint", "checkpoint_every_s", "compile", "chunk_size", "threads", "device", "num_samples",
                 "diagnostic_points", "certify_inputs", "max_num_samples", "extend_by", "certify_rhat")

# Dual averaging constants of Hoffman & Gelman (2014), as Stan, NumPyro and Pyro use them.
_DA_GAMMA, _DA_T0, _DA_KAPPA = 0.05, 10.0, 0.75
# Adam on log T as in TFP's GradientBasedTrajectoryLengthAdaptation: no momentum, beta2 0.95;
# every update clipped in log space (TFP and BlackJAX: ~log(2)/2).
_ADAM_BETA2, _ADAM_EPS, _LOG_T_CLIP = 0.95, 1e-8, 0.35
# Weight of iteration t in the moving averages of log T: t ** -0.5 (BlackJAX's decay_rate).
_MA_DECAY = 0.5


def halton(index: int, base: int = 2) -> float:
    """The ``index``-th element (``index >= 1``) of the van der Corput sequence in ``base``.

    ``halton(1), halton(2), halton(3), ... = 1/2, 1/4, 3/4, 1/8, 5/8, ...`` for base 2: a
    low-discrepancy sequence in (0, 1).
    """
    result, f, i = 0.0, 1.0 / base, index
    while i > 0:
        result += f * (i % base)
        i //= base
        f /= base
    return result


# ----------------------------------------------------------------------------------- options
def _int(options: Mapping[str, Any], name: str, low: int) -> None:
    v = options[name]
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")


def _positive(options: Mapping[str, Any], name: str, allow_none: bool = False) -> None:
    v = options[name]
    if v is None and allow_none:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a finite number > 0{' or None' if allow_none else ''}, got {v!r}")


def _check_options(model: Any, options: Mapping[str, Any]) -> None:
    require_proper_prior(model, options)
    _int(options, "num_chains", 2)
    _int(options, "num_warmup", 0)
    _int(options, "superchain_size", 1)
    k, m = options["num_chains"], options["superchain_size"]
    if m > 1 and (k % m or k // m < 2):
        raise ValueError(
            f"superchain_size={m} must divide num_chains={k} into at least 2 superchains "
            f"(num_chains a multiple of superchain_size, num_chains >= 2 * superchain_size)"
        )
    for name in ("num_samples", "max_num_steps", "map_num_steps", "diagnostic_points", "extend_by"):
        _int(options, name, 1)
    if options["max_num_samples"] is not None:
        _int(options, "max_num_samples", 1)
        if options["max_num_samples"] < options["num_samples"]:
            raise ValueError(f"max_num_samples={options['max_num_samples']} must be >= num_samples="
                             f"{options['num_samples']} (the draws per chain before the first certification), "
                             "or None: no extension")
    check_certify_inputs(model, options)
    if options["certify_rhat"] not in CERTIFY_RHATS:
        raise ValueError(f"unknown certify_rhat {options['certify_rhat']!r}; valid: {list(CERTIFY_RHATS)}")
    if options["certify_rhat"] in ("nested", "both") and m == 1:
        raise ValueError(
            f"certify_rhat={options['certify_rhat']!r} needs chains started in superchains (superchain_size > 1): "
            "nested R-hat over independently started chains cannot see chains that never left their start")
    for name in ("init_trajectory_length", "trajectory_lr", "map_lr", "divergence_threshold"):
        _positive(options, name)
    _positive(options, "step_size", allow_none=True)
    p = options["target_accept_prob"]
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p < 1:
        raise ValueError(f"target_accept_prob must be in (0, 1), got {p!r}")
    for name in ("adapt_mass_matrix", "adapt_temperatures"):
        if not isinstance(options[name], bool):
            raise TypeError(f"{name} must be True or False, got {options[name]!r}")
    if not (isinstance(options["compile"], bool) or options["compile"] == "auto"):
        raise TypeError(f"compile must be True, False or 'auto', got {options['compile']!r}")
    if options["jitter"] not in JITTERS:
        raise ValueError(f"unknown jitter {options['jitter']!r}; valid: {list(JITTERS)}")
    if options["mass_matrix"] not in MASS_MATRICES:
        raise ValueError(f"unknown mass_matrix {options['mass_matrix']!r}; valid: {list(MASS_MATRICES)}")
    if options["init_strategy"] not in INIT_STRATEGIES:
        raise ValueError(f"unknown init_strategy {options['init_strategy']!r}; valid: {list(INIT_STRATEGIES)}")
    if options["chunk_size"] not in (None, "auto"):
        _int(options, "chunk_size", 1)
    ckpt = options["checkpoint"]
    if ckpt is not None and not isinstance(ckpt, (str, os.PathLike)):
        raise TypeError(f"checkpoint must be None or a file path, got {ckpt!r}")
    if ckpt is not None and os.path.isdir(ckpt):
        raise ValueError(f"checkpoint {ckpt!r} is a folder; give a file path (e.g. {os.path.join(ckpt, 'chees.pt')!r})")
    every = options["checkpoint_every_s"]
    if isinstance(every, bool) or not isinstance(every, (int, float)) or not math.isfinite(every) or every < 0:
        raise ValueError(f"checkpoint_every_s must be a finite number >= 0, got {every!r}")
    _check_temperatures(options)
    # the flat log joint refuses what it does not implement, by name, before any work
    from ...flat import _check_supported

    _check_supported(model)


def _check_temperatures(options: Mapping[str, Any]) -> None:
    """``temperatures``: None, or inverse temperatures 1 = beta_0 > beta_1 > ... > 0 whose number
    divides ``num_chains`` into rungs of at least 2 chains."""
    t = options["temperatures"]
    if t is None:
        if options["adapt_temperatures"]:
            raise ValueError("adapt_temperatures=True needs temperatures (the initial ladder whose inner inverse "
                             "temperatures it moves)")
        return
    if isinstance(t, (str, bytes)) or not hasattr(t, "__len__"):
        raise TypeError(f"temperatures must be None or a sequence of inverse temperatures, got {t!r}")
    betas = list(t)
    if any(isinstance(b, bool) or not isinstance(b, numbers.Real) or not math.isfinite(b) for b in betas):
        raise TypeError(f"temperatures must hold finite numbers, got {betas!r}")
    if len(betas) < 2:
        raise ValueError(f"temperatures needs at least 2 inverse temperatures (1 first), got {betas!r}")
    if betas[0] != 1:
        raise ValueError(f"temperatures[0] must be 1 (the posterior's rung), got {betas[0]!r}")
    if any(not a > b for a, b in zip(betas, betas[1:])) or betas[-1] <= 0:
        raise ValueError(f"temperatures must decrease strictly from 1 and stay > 0, got {betas!r}")
    k, r = options["num_chains"], len(betas)
    if k % r or k // r < 2:
        raise ValueError(f"num_chains={k} must be a multiple of len(temperatures)={r} with at least 2 chains "
                         "per temperature")
    if options["superchain_size"] > 1:
        raise ValueError("temperatures and superchain_size > 1 cannot be combined (the rungs' chains swap states "
                         "between superchains)")


# ------------------------------------------------------------------------------- adaptation
def warmup_windows(num_warmup: int) -> list[int]:
    """Iterations (0-based, exclusive ends) at which the mass matrix is re-estimated.

    Stan's schedule: an initial fast buffer of 75 iterations, slow windows of 25, 50, 100, ...
    iterations, and a terminal fast buffer of 50 (the last slow window absorbs the remainder);
    for fewer than 150 warm-up iterations the buffers are 15% / 75% / 10% of them, as in Stan.
    Returns the end of every slow window.
    """
    if num_warmup < 20:
        return []
    if num_warmup < 150:
        init, term = int(0.15 * num_warmup), int(0.1 * num_warmup)
        base = num_warmup - init - term
    else:
        init, term, base = 75, 50, 25
    ends, start, size = [], init, base
    last = num_warmup - term
    while start < last:
        end = start + size
        if end + 2 * size > last:  # the next window would not fit: absorb the remainder
            end = last
        ends.append(end)
        start, size = end, 2 * size
    return ends


class WindowVariance:
    r"""The diagonal of the inverse mass matrix, estimated from the states of one warm-up window.

    Parameters
    ----------
    kind : {"cross-chain", "within-chain", "per-chain"}
        * ``"cross-chain"``: the variance of every parameter over all chains *and* all iterations
          of the window, one ``[P]`` vector.  When the chains sit in different modes (a BNN's
          hidden units permuted, or different functions) this includes the spread *between*
          the modes, so each chain's metric is wider than the posterior it moves in;
        * ``"within-chain"``: each chain's variance over the window's iterations, averaged over
          the chains (the pooled within-chain variance, the W of R-hat), one ``[P]`` vector;
        * ``"per-chain"``: each chain's own variance over the window, ``[K, P]`` — Stan's
          single-chain estimate, K times.
    groups : int, default 1
        With ``G > 1`` the K chains form G equal groups of consecutive rows (the rungs of
        ``temperatures``), each with its own estimate of ``kind`` ("cross-chain" and
        "within-chain" over the group's chains only); the result is then ``[K, P]``, every row
        its group's estimate.

    Every estimate is regularised as Stan regularises its own,
    :math:`\frac{n}{n+5}\hat\sigma^2 + 10^{-3}\frac{5}{n+5}`, with n the number of states
    behind one estimate (K/G times the window's length for ``"cross-chain"`` and
    ``"within-chain"``, the window's length for ``"per-chain"``).  Sums are accumulated in
    float64 about the window's first state, so a variance tiny beside a mean does not cancel.
    """

    def __init__(self, kind: str, groups: int = 1) -> None:
        if kind not in MASS_MATRICES:
            raise ValueError(f"unknown mass_matrix {kind!r}; valid: {list(MASS_MATRICES)}")
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
            raise ValueError(f"groups must be an integer >= 1, got {groups!r}")
        self.kind, self.groups = kind, groups
        self.shift = self.total = self.total_sq = None
        self.n = 0

    def add(self, theta: torch.Tensor) -> None:
        """Record the chains' states ``[K, P]`` of one iteration."""
        t = theta.double()
        if self.shift is None:
            # grouped estimates shift every chain by its own first state (pooled per group later)
            self.shift = t.clone() if self.kind != "cross-chain" or self.groups > 1 else t.mean(0)
            self.total = torch.zeros_like(t)
            self.total_sq = torch.zeros_like(t)
        d = t - self.shift
        self.total += d
        self.total_sq += d * d
        self.n += 1

    def variance(self) -> torch.Tensor:
        """The regularised variance: ``[P]``, or ``[K, P]`` for ``"per-chain"``.

        Raises
        ------
        RuntimeError
            If fewer than two iterations were recorded.
        """
        if self.n < 2:
            raise RuntimeError(f"a warm-up window needs at least 2 iterations, got {self.n}")
        k = self.total.shape[0]
        if self.groups > 1:
            return self._grouped(k)
        if self.kind == "cross-chain":
            n = self.n * k
            mean = self.total.sum(0) / n
            var = (self.total_sq.sum(0) / n - mean * mean).clamp_min(0.0) * n / (n - 1)
        else:
            mean = self.total / self.n
            var = (self.total_sq / self.n - mean * mean).clamp_min(0.0) * self.n / (self.n - 1)
            n = self.n
            if self.kind == "within-chain":
                var, n = var.mean(0), self.n * k
        return (n / (n + 5.0)) * var + 1e-3 * (5.0 / (n + 5.0))

    def _grouped(self, k: int) -> torch.Tensor:
        """:meth:`variance` for ``groups > 1``: ``[K, P]``, each row its group's estimate."""
        g = self.groups
        if k % g:
            raise RuntimeError(f"{k} chains do not form {g} equal groups")
        c = k // g
        total, total_sq = self.total.view(g, c, -1), self.total_sq.view(g, c, -1)
        if self.kind == "cross-chain":
            # the shift is per chain (each its own first state), so pool the sums about it per chain
            # into the group's sums about the group's first-state mean
            n = self.n * c
            base = self.shift.view(g, c, -1)
            centre = base.mean(1, keepdim=True)
            off = base - centre  # each chain's shift relative to the group's
            s1 = (total + self.n * off).sum(1)  # sum of (theta - centre) over the group's states
            s2 = (total_sq + 2.0 * off * total + self.n * off * off).sum(1)
            mean = s1 / n
            var = (s2 / n - mean * mean).clamp_min(0.0) * n / (n - 1)
        else:
            mean = total / self.n
            var = (total_sq / self.n - mean * mean).clamp_min(0.0) * self.n / (self.n - 1)
            n = self.n
            if self.kind == "within-chain":
                var, n = var.mean(1), self.n * c
            else:
                var = var.view(k, -1)
        est = (n / (n + 5.0)) * var + 1e-3 * (5.0 / (n + 5.0))
        return est if self.kind == "per-chain" else est.repeat_interleave(c, 0)


@dataclass
class _DualAveraging:
    """Nesterov dual averaging of log step size (Hoffman & Gelman 2014, Algorithm 5)."""

    mu: float
    log_step: float
    t: int = 0
    h_bar: float = 0.0
    log_step_bar: float = 0.0

    @classmethod
    def start(cls, step_size: float) -> "_DualAveraging":
        return cls(mu=math.log(10.0 * step_size), log_step=math.log(step_size), log_step_bar=math.log(step_size))

    def update(self, accept: float, target: float) -> float:
        self.t += 1
        eta = 1.0 / (self.t + _DA_T0)
        self.h_bar = (1.0 - eta) * self.h_bar + eta * (target - accept)
        self.log_step = self.mu - math.sqrt(self.t) / _DA_GAMMA * self.h_bar
        w = self.t ** -_DA_KAPPA
        self.log_step_bar = w * self.log_step + (1.0 - w) * self.log_step_bar
        return math.exp(self.log_step)


@dataclass
class _TrajectoryAdam:
    """Adam (no momentum) ascent of the ChEES criterion in log T, with a moving average."""

    log_t: float
    lr: float
    v: float = 0.0
    t: int = 0
    log_t_avg: float = 0.0
    updates: int = 0

    def update(self, gradient: float) -> None:
        self.t += 1
        self.updates += 1
        self.v = _ADAM_BETA2 * self.v + (1.0 - _ADAM_BETA2) * gradient * gradient
        v_hat = self.v / (1.0 - _ADAM_BETA2**self.t)
        step = self.lr * gradient / (math.sqrt(v_hat) + _ADAM_EPS)
        self.log_t += max(-_LOG_T_CLIP, min(_LOG_T_CLIP, step))
        w = self.updates ** -_MA_DECAY
        self.log_t_avg = (1.0 - w) * self.log_t_avg + w * self.log_t


def chees_gradient(theta0: torch.Tensor, proposal: torch.Tensor, momentum: torch.Tensor, inv_mass: torch.Tensor,
                   weights: torch.Tensor, jitter: float, trajectory_length: float) -> float:
    r"""Normalised gradient of the ChEES criterion with respect to :math:`\log T`.

    Computed in the coordinates the mass matrix whitens, :math:`z = \theta / \sqrt{M^{-1}}`,
    where the dynamics have unit mass: per chain
    :math:`g_k = h\,T\,(\lVert z'_k-\bar z'\rVert^2 - \lVert z_k-\bar z\rVert^2)\,
    (z'_k-\bar z')^\top \dot z'_k` with velocity :math:`\dot z' = \sqrt{M^{-1}}\,p'`, averaged
    with the acceptance probabilities as weights, then divided by
    :math:`(\overline{\lVert z-\bar z\rVert^2})^2`.  That last factor makes the gradient
    invariant to the overall scale of the posterior: raw, it shrinks by orders of magnitude as
    the chains contract from their prior draws, and Adam's second-moment estimate, still
    remembering the early values, then freezes :math:`\log T` (measured: T moved by 0.001 in
    300 warm-up iterations on Bayesian linear regression).  The sign, which is what Adam mostly
    uses, is unchanged.

    Parameters
    ----------
    theta0 : torch.Tensor
        States at the start of the iteration, ``[K, P]``.
    proposal : torch.Tensor
        End points of the trajectories (before accept/reject), ``[K, P]``.
    momentum : torch.Tensor
        Momenta at the end points, ``[K, P]``.
    inv_mass : torch.Tensor
        Diagonal inverse mass matrix, ``[P]``, or one per chain, ``[K, P]``; then the criterion
        is computed in the coordinates that the chains' mean metric whitens (the cross-chain
        means need one coordinate system) with each chain's own velocity
        :math:`M_k^{-1}p'_k`.
    weights : torch.Tensor
        Acceptance probabilities, 0 for divergent or non-finite chains, ``[K]``.
    jitter, trajectory_length : float
        This iteration's jitter :math:`h` and the (unjittered) T.

    Returns
    -------
    float
        The normalised, acceptance-weighted gradient (0 when every weight is 0).
    """
    ok = (weights > 0) & torch.isfinite(proposal).all(-1) & torch.isfinite(momentum).all(-1)
    if not bool(ok.any()):
        return 0.0
    root = (inv_mass if inv_mass.dim() == 1 else inv_mass.mean(0)).sqrt()
    w = torch.where(ok, weights, torch.zeros_like(weights))
    zero = torch.zeros_like(proposal)
    z1 = torch.where(ok.unsqueeze(-1), proposal / root, zero)
    vel = torch.where(ok.unsqueeze(-1), momentum * inv_mass / root, zero)
    c1 = z1 - (w.unsqueeze(-1) * z1).sum(0) / w.sum()
    z0 = theta0 / root
    c0 = z0 - z0.mean(0)
    sq0 = (c0 * c0).sum(-1)
    per_chain = jitter * trajectory_length * ((c1 * c1).sum(-1) - sq0) * (c1 * vel).sum(-1)
    scale = float(sq0.mean()) ** 2
    if not scale > 0:
        return 0.0
    return float((w * per_chain).sum() / w.sum()) / scale


# ----------------------------------------------------------------------------------- sampler
class _Tempered:
    r"""The log joint of chains at inverse temperatures: :math:`\log p(\theta) + \beta_k \log p(y|\theta)`.

    ``beta`` ``[K]`` is each row's inverse temperature.  One call of the (possibly compiled) full
    log joint and one of the cheap prior give both parts: the likelihood is their difference.
    """

    def __init__(self, lj: FlatLogJoint, beta: torch.Tensor) -> None:
        self.lj, self.beta = lj, beta
        self.size, self.layout = lj.size, lj.layout

    def value_and_grad(self, theta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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


class _Sampler:
    """The state of K lock-step chains and one jittered-HMC transition of all of them."""

    def __init__(self, lj: FlatLogJoint, theta: torch.Tensor, generator: torch.Generator, threshold: float,
                 value_and_grad: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.lj, self.gen, self.threshold = lj, generator, threshold
        self.theta = theta
        # given when they are known (a checkpoint's), so they are not evaluated again
        self.logp, self.grad = value_and_grad if value_and_grad is not None else lj.value_and_grad(theta)
        self.inv_mass = torch.ones(lj.size, dtype=theta.dtype, device=theta.device)
        self.gradients = theta.shape[0]  # chain-gradients evaluated so far

    def momentum(self) -> torch.Tensor:
        z = torch.randn(self.theta.shape, dtype=self.theta.dtype, device=self.theta.device, generator=self.gen)
        return z * self.inv_mass.rsqrt()

    def kinetic(self, p: torch.Tensor) -> torch.Tensor:
        return 0.5 * (p * p * self.inv_mass).sum(-1)

    def leapfrog(self, theta: torch.Tensor, p: torch.Tensor, grad: torch.Tensor, step: float | torch.Tensor, n: int):
        """``n`` leapfrog steps of every chain; ``step`` a number, or ``[K, 1]``: each chain's own."""
        theta, p = theta.clone(), p + (0.5 * step) * grad
        scaled = step * self.inv_mass
        logp = grad = None
        per_row = isinstance(step, torch.Tensor)
        half = 0.5 * step
        for i in range(n):
            theta.addcmul_(scaled, p)
            logp, grad = self.lj.value_and_grad(theta)
            if per_row:
                p.addcmul_(grad, step if i < n - 1 else half)
            else:
                p.add_(grad, alpha=step if i < n - 1 else half)
        self.gradients += n * theta.shape[0]
        return theta, p, logp, grad

    def transition(self, step: float, n: int):
        """One HMC iteration for every chain; returns the statistics of the iteration."""
        p0 = self.momentum()
        energy = -self.logp + self.kinetic(p0)
        theta1, p1, logp1, grad1 = self.leapfrog(self.theta, p0, self.grad, step, n)
        energy1 = -logp1 + self.kinetic(p1)
        delta = energy1 - energy
        finite = torch.isfinite(delta) & torch.isfinite(theta1).all(-1) & torch.isfinite(grad1).all(-1)
        diverging = ~finite | (delta > self.threshold)
        accept_prob = torch.where(finite, torch.exp(torch.clamp(-delta, max=0.0)), torch.zeros_like(delta))
        u = torch.rand(accept_prob.shape, dtype=accept_prob.dtype, device=accept_prob.device, generator=self.gen)
        accept = (u < accept_prob) & finite
        theta0 = self.theta
        self.theta = torch.where(accept.unsqueeze(-1), theta1, self.theta)
        self.logp = torch.where(accept, logp1, self.logp)
        self.grad = torch.where(accept.unsqueeze(-1), grad1, self.grad)
        return theta0, theta1, p1, accept_prob, diverging, energy

    def find_step_size(self, step: float, target: float = 0.5, max_tries: int = 40, rows: int | None = None) -> float:
        """Double or halve ``step`` until one leapfrog step's harmonic-mean acceptance crosses
        ``target`` (the heuristic of Hoffman & Gelman 2014, Algorithm 4, across chains; the first
        ``rows`` chains only when given)."""
        def accept_at(eps: float) -> float:
            p0 = self.momentum()
            h0 = -self.logp + self.kinetic(p0)
            _, p1, logp1, _ = self.leapfrog(self.theta, p0, self.grad, eps, 1)
            delta = -logp1 + self.kinetic(p1) - h0
            prob = torch.where(torch.isfinite(delta), torch.exp(torch.clamp(-delta, max=0.0)), torch.zeros_like(delta))
            return _harmonic_mean(prob[:rows])

        direction = 1.0 if accept_at(step) > target else -1.0
        for _ in range(max_tries):
            nxt = step * (2.0**direction)
            a = accept_at(nxt)
            if (direction > 0 and a < target) or (direction < 0 and a > target):
                return step if direction > 0 else nxt
            step = nxt
        return step


def _compile(lj: FlatLogJoint, k: int, option: bool | str) -> float:
    """Compile ``lj`` for K rows as ``option`` asks; the seconds spent (0 when not compiled).

    ``"auto"`` compiles on CUDA only (measured on an H100: more than 2x faster end to end at
    K = 1,024, against 1.15-1.35x per chain-gradient on CPU, where compiling also needs a C++
    compiler); there a failure of the compiler warns and the run goes on eager.  ``True`` compiles anywhere
    and a failure stops the run (:meth:`FlatLogJoint.compile`).
    """
    if option == "auto":
        if lj.device.type != "cuda":
            return 0.0
        try:
            return lj.compile(k)
        except RuntimeError as err:
            warnings.warn(f"chees: compile='auto' could not compile the log joint on {lj.device} ({err}); "
                          "running eager", RuntimeWarning, stacklevel=3)
            return 0.0
    return lj.compile(k) if option else 0.0


def _rung_rows(values: list[float], per_rung: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[K]``: rung r's value (inverse temperature, step size) for its ``per_rung`` consecutive rows."""
    return torch.tensor(values, dtype=dtype, device=device).repeat_interleave(per_rung)


def _harmonic_mean(prob: torch.Tensor) -> float:
    """Harmonic mean of acceptance probabilities (0 if any is 0)."""
    if bool((prob <= 0).any()):
        return 0.0
    return float(1.0 / (1.0 / prob).mean())


def _map_init(lj: FlatLogJoint, theta: torch.Tensor, num_steps: int, lr: float, strategy: str = "map") -> torch.Tensor:
    """K MAP estimates at once from ``theta`` ``[K, P]``: the ensemble's trainer, i.e. the one
    optimisation loop of every SVI method (Adam, Polyak averaging over the last 10% of steps).

    Raises
    ------
    FloatingPointError
        When a fit's log joint becomes non-finite, naming ``init_strategy`` and what to change.
    """
    from ..ensemble import train_members
    from ..svi import LoopSettings

    try:
        return train_members(lj, theta, LoopSettings(num_steps=num_steps, lr=lr), desc=f"chees {strategy} start").theta
    except FloatingPointError as err:
        raise FloatingPointError(
            f"chees init_strategy={strategy!r}: the MAP fits of the chains' starting points diverged ({err}); "
            "lower map_lr or use init_strategy='prior'"
        ) from err


def _starting_points(model: Any, lj: FlatLogJoint, num: int, options: Mapping[str, Any],
                     gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """``num`` independent starting points ``[num, P]`` by ``init_strategy``, and the chain-gradients
    their MAP or ensemble fits cost."""
    theta = lj.sample_prior(num, generator=gen)
    if options["init_strategy"] == "map":
        return _map_init(lj, theta, options["map_num_steps"], options["map_lr"]), num * options["map_num_steps"]
    if options["init_strategy"] == "ensemble":
        # a deep ensemble (nn.Linear-style starts, the ensemble's trainer), one member per start
        from ..ensemble import init_members

        members = _map_init(lj, init_members(model, lj, num, "linear"), options["map_num_steps"], options["map_lr"],
                            "ensemble")
        return members, num * options["map_num_steps"]
    return theta, 0


def run_chees(model: Any, x: torch.Tensor, y: torch.Tensor, options: Mapping[str, Any], progress: bool) -> Posterior:
    """Run ``num_chains`` lock-step chains of jittered HMC with ChEES adaptation (``fit``'s ``run``).

    Parameters
    ----------
    model : pyrobdl.BayesianMLP
        The model, on the data's device.
    x, y : torch.Tensor
        Validated training data.
    options : Mapping
        Every option of :data:`CHEES_OPTIONS`, plus ``seed``.
    progress : bool
        Show a progress bar over iterations.

    Returns
    -------
    MCMCPosterior
        K chains of ``num_samples`` draws, a :class:`SamplerTrace`, diagnostics (adapted step
        size, trajectory length and mass matrix summary, divergences, steps-cap hits, E-BFMI,
        function-space convergence) and the certification at the first ``diagnostic_points``
        training inputs.

    Raises
    ------
    CheckpointError
        With ``checkpoint`` set: the file belongs to a run of another identity (the message
        names every difference), cannot be read, or is in use by another process; raised
        before any gradient is evaluated.

    Notes
    -----
    With ``checkpoint`` a file path, the whole state of the run (chains, random generators,
    adaptation, the statistics and draws so far) is written there atomically every
    ``checkpoint_every_s`` seconds and after the last iteration; a run given an existing
    checkpoint of the same identity (model, data, seed and every option that shapes the chains)
    continues from it, and gives the same draws, to the bit, as the run never interrupted
    (:mod:`pyrobdl.inference.checkpoint`).  A larger ``num_samples`` than the checkpoint's
    extends a run: the result equals a run started with that ``num_samples``.
    """
    path = options["checkpoint"]
    if path is None:
        return _run_chees(model, x, y, options, progress, None)
    options = {**options, "checkpoint": os.fspath(path)}
    identity = run_identity(model, x, y, options, exclude=_NOT_IDENTITY)
    with SamplerCheckpoint(path, identity, options["checkpoint_every_s"]) as ckpt:
        return _run_chees(model, x, y, options, progress, ckpt)


def _run_chees(model: Any, x: torch.Tensor, y: torch.Tensor, options: Mapping[str, Any], progress: bool,
               ckpt: SamplerCheckpoint | None) -> Posterior:
    """:func:`run_chees` with its checkpoint (None: none) open."""
    device = x.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start, cpu_start = time.perf_counter(), time.process_time()
    k, warm, draws = options["num_chains"], options["num_warmup"], options["num_samples"]
    max_draws = options["max_num_samples"]
    gen = torch.Generator(device=device)
    gen.manual_seed(int(options["seed"]))
    saved = ckpt.load(device) if ckpt is not None else None
    if saved is not None and saved["num_samples"] > draws:
        if max_draws is not None and saved["num_samples"] <= max_draws:
            draws = int(saved["num_samples"])  # extended towards max_num_samples by an earlier process
        else:
            raise CheckpointError(
                f"checkpoint {ckpt.path} holds a run of num_samples={saved['num_samples']}; a resumed run can "
                f"extend it, not shorten it (num_samples={draws}, max_num_samples={max_draws} now): pass "
                f"num_samples or max_num_samples >= {saved['num_samples']}")
    # the inputs the chains are certified at (and, with max_num_samples, extended until they pass)
    points, recorded_points = certification_points(model, x, options)
    lj = FlatLogJoint(model, x, y, chunk_size=options["chunk_size"])
    compile_s = _compile(lj, k, options["compile"])
    if saved is None:
        theta, map_grads = _starting_points(model, lj, k // options["superchain_size"], options, gen)
        # superchains (Margossian et al. 2024): chains c*M .. (c+1)*M - 1 share start c, so that
        # nested R-hat can tell whether they have forgotten it
        theta = theta.repeat_interleave(options["superchain_size"], dim=0)
    else:
        theta, map_grads = saved["theta"], int(saved["map_grads"])
    # replica exchange: rung r is rows r*C .. (r+1)*C - 1 at inverse temperature beta_r; rung 0
    # (beta = 1) is the posterior and the only one kept
    betas = [float(b) for b in options["temperatures"]] if options["temperatures"] is not None else [1.0]
    rungs = len(betas)
    kept = k // rungs
    tempered = None
    if rungs > 1:
        tempered = _Tempered(lj, _rung_rows(betas, kept, x.dtype, device))
    sampler = _Sampler(tempered if tempered is not None else lj, theta, gen, float(options["divergence_threshold"]),
                       (saved["logp"], saved["grad"]) if saved is not None else None)
    # exchange acceptance summed per pair: [warm-up, sampling, current ladder window]
    swap_sum = torch.zeros(3, max(rungs - 1, 0), dtype=torch.float64, device=device)
    swap_count = np.zeros((3, max(rungs - 1, 0)), dtype=np.int64)
    tracker = _ReplicaTracker(k, rungs, device) if tempered is not None else None
    initial_betas = list(betas)
    ladder_ends = set(warmup_windows(warm)) if options["adapt_temperatures"] and rungs > 2 else set()
    ladder_start = _window_start(warm)
    target, cap = float(options["target_accept_prob"]), int(options["max_num_steps"])
    step = options["step_size"]
    search_grads = 0
    if step is None and saved is None:
        before = sampler.gradients
        step = sampler.find_step_size(0.1, rows=kept)
        search_grads += sampler.gradients - before
    step = float(saved["step"]) if saved is not None else float(step)
    # one step size per rung, each adapted on its own rung's acceptance (in its own metric the
    # beta = 0.1 rung of yacht wants a step 60x the beta = 1 rung's: measured); rung 0's is `step`,
    # the posterior's, which also sets the number of leapfrog steps
    steps = [step] * rungs
    das = [_DualAveraging.start(step) for _ in steps]
    step_rows = _rung_rows(steps, kept, x.dtype, device).unsqueeze(-1) if tempered is not None else None
    traj = _TrajectoryAdam(log_t=math.log(options["init_trajectory_length"]), lr=float(options["trajectory_lr"]))
    traj.log_t_avg = traj.log_t
    windows = set(warmup_windows(warm)) if options["adapt_mass_matrix"] else set()
    window_start = _window_start(warm) if windows else 0
    window = WindowVariance(options["mass_matrix"], groups=rungs)

    total = warm + draws
    # per-iteration statistics stay on the device until the end (no host round trip per iteration
    # in the sampling phase; warm-up needs one scalar sync per iteration for the adaptation)
    rows = {name: torch.zeros(total, kept, dtype=torch.float64, device=device)
            for name in ("accept_prob", "energy", "log_joint")}
    diverging_rows = torch.zeros(total, kept, dtype=torch.bool, device=device)
    replica_rows = torch.zeros(total, kept, dtype=torch.int64, device=device) if tracker is not None else None
    step_row = np.zeros(total)
    length_row = np.zeros(total)  # the unjittered trajectory length T of each iteration
    num_steps_row = np.zeros(total, dtype=np.int64)
    cap_hits = np.zeros(total, dtype=bool)
    samples = torch.empty(draws, kept, lj.size, dtype=x.dtype, device=device)
    halton_index = 0
    rng = np.random.default_rng(int(options["seed"]))
    trajectory_length = wanted_length = math.exp(traj.log_t)
    first, elapsed = 0, (0.0, 0.0, 0.0)  # wall, CPU and compile seconds of earlier processes
    resumed_at: list[int] = []
    # one row per certification of a run with max_num_samples: draws per chain, passed, failures
    extensions: list[dict[str, Any]] = []
    if saved is not None:
        first, resumed_at = int(saved["next_iteration"]), [*saved["resumed_at"], int(saved["next_iteration"])]
        extensions = [dict(e) for e in saved.get("extensions", [])]
        elapsed = (float(saved["wall_s"]), float(saved["cpu_s"]), float(saved["compile_s"]))
        search_grads = int(saved["search_grads"])
        # the random streams, the adaptation and the chains where the checkpoint left them
        gen.set_state(saved["generator"].cpu())
        rng.bit_generator.state = json.loads(saved["numpy_rng"])
        sampler.inv_mass, sampler.gradients = saved["inv_mass"], int(saved["gradients"])
        steps = [float(v) for v in saved["steps"]]
        das = [_DualAveraging(**d) for d in saved["dual_averaging"]]
        traj = _TrajectoryAdam(**saved["trajectory_adam"])
        trajectory_length, wanted_length = float(saved["trajectory_length"]), float(saved["wanted_length"])
        window = WindowVariance(options["mass_matrix"], groups=rungs)
        window.shift, window.total, window.total_sq = (saved["window"][n] for n in ("shift", "total", "total_sq"))
        window.n, window_start = int(saved["window"]["n"]), int(saved["window_start"])
        betas, ladder_start = [float(b) for b in saved["betas"]], int(saved["ladder_start"])
        swap_sum, swap_count = saved["swap_sum"], saved["swap_count"].cpu().numpy().copy()
        if tempered is not None:
            tempered.beta = _rung_rows(betas, kept, x.dtype, device)
            step_rows = _rung_rows(steps, kept, x.dtype, device).unsqueeze(-1)
            for name in ("replica", "label", "counts", "lo", "hi"):
                setattr(tracker, name, saved["tracker"][name])
        # a run may be extended (num_samples grown): the arrays are longer, the first rows the same
        for name in rows:
            rows[name][:first] = saved["rows"][name][:first]
        diverging_rows[:first] = saved["diverging_rows"][:first]
        if replica_rows is not None:
            replica_rows[:first] = saved["replica_rows"][:first]
        for arr, name in ((step_row, "step_row"), (length_row, "length_row"), (num_steps_row, "num_steps_row"),
                          (cap_hits, "cap_hits")):
            arr[:first] = saved[name][:first].cpu().numpy()
        samples[: max(0, first - warm)] = saved["samples"]
        halton_index = first
    saved = None  # the loaded tensors are copied; free them

    def snapshot(next_iteration: int) -> dict[str, Any]:
        """Everything the loop carries from one iteration to the next, after ``next_iteration - 1``
        (slices cloned: ``torch.save`` of a view would write the whole array)."""
        wall = elapsed[0] + time.perf_counter() - start
        return {
            "next_iteration": next_iteration, "num_samples": draws, "resumed_at": resumed_at,
            "wall_s": wall, "cpu_s": elapsed[1] + time.process_time() - cpu_start, "compile_s": elapsed[2] + compile_s,
            "map_grads": map_grads, "search_grads": search_grads, "step": step, "steps": steps,
            "generator": gen.get_state(), "numpy_rng": json.dumps(rng.bit_generator.state),
            "theta": sampler.theta, "logp": sampler.logp, "grad": sampler.grad, "inv_mass": sampler.inv_mass,
            "gradients": sampler.gradients,
            "dual_averaging": [dataclasses.asdict(d) for d in das], "trajectory_adam": dataclasses.asdict(traj),
            "trajectory_length": trajectory_length, "wanted_length": wanted_length,
            "window": {"shift": window.shift, "total": window.total, "total_sq": window.total_sq, "n": window.n},
            "window_start": window_start, "betas": betas, "ladder_start": ladder_start,
            "swap_sum": swap_sum, "swap_count": torch.from_numpy(swap_count.copy()),
            "tracker": ({name: getattr(tracker, name) for name in ("replica", "label", "counts", "lo", "hi")}
                        if tracker is not None else None),
            "rows": {name: v[:next_iteration].clone() for name, v in rows.items()},
            "diverging_rows": diverging_rows[:next_iteration].clone(),
            "replica_rows": replica_rows[:next_iteration].clone() if replica_rows is not None else None,
            "step_row": torch.from_numpy(step_row[:next_iteration].copy()),
            "length_row": torch.from_numpy(length_row[:next_iteration].copy()),
            "num_steps_row": torch.from_numpy(num_steps_row[:next_iteration].copy()),
            "cap_hits": torch.from_numpy(cap_hits[:next_iteration].copy()),
            "samples": samples[: max(0, next_iteration - warm)].clone(),
            "extensions": extensions,
        }

    bar = None
    # what the posterior records of its options: the certification inputs by their digest
    settings = {**options, "certify_inputs": given_inputs(recorded_points)}

    def result() -> MCMCPosterior:
        """The chains so far as the posterior, with its diagnostics and certification (not yet the
        convergence summary: its weight-space part costs ~10x the certification)."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        # every process's seconds: a resumed run costs what all its parts cost (work lost after the
        # last checkpoint of a killed process is not counted)
        wall = elapsed[0] + time.perf_counter() - start
        cpu = elapsed[1] + time.process_time() - cpu_start
        stats = {name: v.t().cpu().numpy() for name, v in rows.items()}
        diverging_row = diverging_rows.t().cpu().numpy()

        site_draws = {name: v.transpose(0, 1).contiguous() for name, v in lj.layout.unpack(samples).items()}
        trace = SamplerTrace(
            num_warmup=warm, num_steps=np.tile(num_steps_row, (kept, 1)), step_size=np.tile(step_row, (kept, 1)),
            accept_prob=stats["accept_prob"], diverging=diverging_row, tree_depth=None, log_joint=stats["log_joint"],
            energy=stats["energy"], superchain_size=options["superchain_size"],
        )
        gradients = sampler.gradients + map_grads
        cost = Cost(wall_time_s=wall, gradient_evaluations=int(gradients), epochs=float(gradients),
                    peak_memory_bytes=_peak_memory(device), device=str(device), cpu_time_s=cpu)
        posterior = MCMCPosterior(model, site_draws, trace, method="chees", settings=settings, cost=cost)
        leapfrog = num_steps_row
        diagnostics: dict[str, Any] = {
            "num_chains": kept,
            "num_chains_all_rungs": k,
            "temperatures": betas,
            "temperatures_initial": initial_betas,
            "step_size_rungs": [float(v) for v in steps],
        }
        sums = swap_sum.cpu().numpy()
        rates = [(sums[0] + sums[1]) / np.maximum(swap_count[0] + swap_count[1], 1), sums[1] / np.maximum(swap_count[1], 1)]
        counts = tracker.counts.cpu().numpy() if tracker is not None else np.zeros((2, 2), dtype=np.int64)
        diagnostics.update({
            # mean acceptance probability of the exchanges proposed between rungs r and r + 1, over the
            # whole run and over the sampling phase alone (the ladder's final form when it is adapted)
            "swap_accept_prob": [float(v) for v in rates[0]],
            "swap_accept_prob_sampling": [float(v) for v in rates[1]],
            # replicas that went coldest -> hottest -> coldest, and states reaching the beta = 1 rung
            # after a visit to the hottest one, in the sampling phase (and in warm-up)
            "round_trips": int(counts[1, 0]),
            "round_trips_warmup": int(counts[0, 0]),
            "hot_arrivals": int(counts[1, 1]),
            "hot_arrivals_warmup": int(counts[0, 1]),
            # how many rungs each replica spanned in the sampling phase: median and largest
            "ladder_span": ({"median": float(tracker.span.double().median()), "max": int(tracker.span.max())}
                            if tracker is not None else {"median": 0.0, "max": 0}),
            "num_warmup": warm,
            "num_samples": draws,
            "step_size": float(step),
            "trajectory_length": float(trajectory_length),
            "mean_num_steps_sampling": float(leapfrog[warm:].mean()) if draws else 0.0,
            "inverse_mass_matrix": {"min": float(sampler.inv_mass.min()), "median": float(sampler.inv_mass.median()),
                                    "max": float(sampler.inv_mass.max())},
            "divergences": [int(d) for d in diverging_row[:, warm:].sum(1)],
            "divergences_warmup": int(diverging_row[:, :warm].sum()),
            "accept_prob": [float(a) for a in stats["accept_prob"][:, warm:].mean(1)],
            "num_steps_cap_hits_warmup": int(cap_hits[:warm].sum()),
            "num_steps_cap_hits_sampling": int(cap_hits[warm:].sum()),
            "leapfrog_steps_warmup": int(leapfrog[:warm].sum()),
            "leapfrog_steps_sampling": int(leapfrog[warm:].sum()),
            "chain_gradients": int(gradients),
            "step_size_search_chain_gradients": int(search_grads),
            "map_chain_gradients": int(map_grads),
            "cpu_time_s": cpu,
            "compile_s": float(compile_s + elapsed[2]),
            # iterations at which this run was resumed from its checkpoint, and writes of it
            "resumed_at": resumed_at,
            "checkpoint_saves": ckpt.saves if ckpt is not None else 0,
            "ebfmi": [float(e) for e in ebfmi(stats["energy"][:, warm:])],
        })
        capped_length = wanted_length > cap * step * (1 + 1e-12)
        diagnostics["trajectory_length_wanted"] = float(wanted_length)
        diagnostics["trajectory_length_capped"] = bool(capped_length)
        posterior.diagnostics = diagnostics
        posterior.adaptation = {"step_size": step_row, "trajectory_length": length_row, "num_steps": num_steps_row}
        if replica_rows is not None:
            # [kept chains, iterations]: the replica (0 .. K-1, its starting row) in each beta = 1 slot
            posterior.adaptation["replica"] = replica_rows.t().cpu().numpy()
        _certify(posterior, points, options["certify_rhat"], recorded_points)
        return posterior



    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, initial=first, desc="chees", leave=False)
    while True:
        for it in range(first, total):
            halton_index += 1
            h = {"halton": lambda: halton(halton_index), "uniform": lambda: float(rng.uniform()),
                 "none": lambda: 1.0}[options["jitter"]]()
            wanted = math.ceil(h * trajectory_length / step)
            n = max(1, min(cap, wanted))
            cap_hits[it] = wanted > cap
            theta0, proposal, p1, accept_prob, diverging, energy = sampler.transition(
                step if tempered is None else step_rows, n)
            if tempered is not None:
                lower, prob, perm = _swap(sampler, tempered, rungs, it % 2, gen)
                tracker.update(perm, int(it >= warm))
                replica_rows[it] = tracker.replica[:kept]
                in_ladder_window = bool(ladder_ends) and ladder_start <= it < warm
                for j in (int(it >= warm), 2) if in_ladder_window else (int(it >= warm),):
                    swap_sum[j, lower] += prob.double().sum(-1)
                    swap_count[j, it % 2 : rungs - 1 : 2] += kept  # the pairs proposed: known from the parity
            step_row[it], num_steps_row[it], length_row[it] = step, n, trajectory_length
            rows["accept_prob"][it] = accept_prob[:kept]
            rows["energy"][it] = energy[:kept]
            rows["log_joint"][it] = sampler.logp[:kept]
            diverging_rows[it] = diverging[:kept]
            if it < warm:
                weights = torch.where(diverging, torch.zeros_like(accept_prob), accept_prob)
                # each rung's step size on its own chains' acceptance (one rung without tempering;
                # measured on yacht, one step adapted on all rungs let the beta = 1 rung diverge)
                for r in range(rungs):
                    ap, dv = accept_prob[r * kept : (r + 1) * kept], diverging[r * kept : (r + 1) * kept]
                    steps[r] = das[r].update(_harmonic_mean(ap[~dv]) if bool((~dv).any()) else 0.0, target)
                step = steps[0]
                # the trajectory length is that of the posterior's rung (the number of steps is shared)
                inv_mass = sampler.inv_mass[:kept] if sampler.inv_mass.dim() == 2 else sampler.inv_mass
                g = chees_gradient(theta0[:kept], proposal[:kept], p1[:kept], inv_mass, weights[:kept], h,
                                   trajectory_length)
                if math.isfinite(g):
                    traj.update(g)
                trajectory_length = min(max(math.exp(traj.log_t_avg), step), cap * step)
                if windows and it >= window_start:
                    window.add(sampler.theta)
                if (it + 1) in ladder_ends:
                    # the inner rungs move to equalise the exchange rejection measured since the last
                    # move; every row's tempered log joint and gradient are recomputed (counted)
                    rates = swap_sum[2].cpu().numpy() / np.maximum(swap_count[2], 1)
                    betas = respace_ladder(betas, 1.0 - rates)
                    tempered.beta = _rung_rows(betas, kept, x.dtype, device)
                    sampler.logp, sampler.grad = tempered.value_and_grad(sampler.theta)
                    sampler.gradients += k
                    swap_sum[2].zero_()
                    swap_count[2] = 0
                    ladder_start = it + 1
                if (it + 1) in windows:
                    sampler.inv_mass = window.variance().to(x.dtype)
                    window = WindowVariance(options["mass_matrix"], groups=rungs)
                    window_start = it + 1
                    before = sampler.gradients
                    step = steps[0] = sampler.find_step_size(step, rows=kept)
                    search_grads += sampler.gradients - before
                    das = [_DualAveraging.start(s) for s in steps]
                    # a fresh Adam state in the new metric: the second moment otherwise remembers the
                    # huge gradients of the first iterations, when chains fall from their prior draws,
                    # and freezes log T (measured with a learned noise precision: T stuck at 1.05)
                    traj.v, traj.t = 0.0, 0
                    trajectory_length = min(max(math.exp(traj.log_t_avg), step), cap * step)
                if it == warm - 1:
                    steps = [math.exp(d.log_step_bar) for d in das]
                    step = steps[0]
                    wanted_length = math.exp(traj.log_t_avg)
                    trajectory_length = min(max(wanted_length, step), cap * step)
                if tempered is not None:
                    step_rows = _rung_rows(steps, kept, x.dtype, device).unsqueeze(-1)
            else:
                samples[it - warm] = sampler.theta[:kept]
            if bar is not None:
                bar.update(1)
                if it % 10 == 0:
                    bar.set_postfix(step=f"{step:.3g}", T=f"{trajectory_length:.3g}", steps=n)
            if ckpt is not None and ckpt.due(final=it == total - 1):
                ckpt.save(snapshot(it + 1))
        posterior = result()
        if max_draws is None:
            break
        cert = posterior.certification
        extensions.append({"num_samples": draws, "certified": bool(cert.passed), "failures": list(cert.failures),
                           "rhat_split_max": cert.rhat_split_max, "rhat_nested_max": cert.rhat_nested_max})
        if cert.passed or draws >= max_draws:
            break
        # not certified yet: more draws per chain, every chain going on where it stands, so that
        # the draws are those of a run started with the larger num_samples
        add = min(int(options["extend_by"]), max_draws - draws)
        rows = {name: _grow(v, add) for name, v in rows.items()}
        diverging_rows, samples = _grow(diverging_rows, add), _grow(samples, add)
        if replica_rows is not None:
            replica_rows = _grow(replica_rows, add)
        step_row, length_row, num_steps_row, cap_hits = (
            np.concatenate([a, np.zeros(add, dtype=a.dtype)]) for a in (step_row, length_row, num_steps_row, cap_hits))
        first, draws, total = total, draws + add, total + add
        if bar is not None:
            bar.total = total
            bar.refresh()
    if bar is not None:
        bar.close()
    diagnostics = posterior.diagnostics
    diagnostics.update(posterior.convergence_summary(points))
    if max_draws is not None:
        diagnostics["extensions"] = extensions
    capped_length = diagnostics["trajectory_length_capped"]
    if capped_length:
        warnings.warn(
            f"chees: the adapted trajectory length {wanted_length:.3g} needs more than max_num_steps={cap} "
            f"leapfrog steps of the adapted step size {step:.3g}, so it was cut to {cap * step:.3g}: the "
            "chains move less per iteration than the adaptation asked for; raise max_num_steps (cost) or "
            "expect lower ESS per iteration", UserWarning, stacklevel=3)
    if cap_hits[warm:].any():
        warnings.warn(
            f"chees: the trajectory needed more than max_num_steps={cap} leapfrog steps in "
            f"{int(cap_hits[warm:].sum())} of {draws} sampling iterations, so those trajectories were "
            "shortened; raise max_num_steps or check the adapted step size", UserWarning, stacklevel=3)
    return posterior


def _grow(t: torch.Tensor, add: int) -> torch.Tensor:
    """``t`` with ``add`` rows of zeros appended along its first dimension."""
    return torch.cat([t, t.new_zeros((add, *t.shape[1:]))])


def _window_start(num_warmup: int) -> int:
    """First iteration of the first slow window."""
    if num_warmup < 150:
        return int(0.15 * num_warmup)
    return 75


def _certify(posterior: MCMCPosterior, x_points: torch.Tensor, rhat: str, inputs: Mapping[str, Any]) -> None:
    """Attach the certification against :data:`~pyrobdl.diagnostics.REFERENCE_CRITERIA` with the
    ``certify_rhat`` option's R-hat; ``"auto"``: split and nested R-hat over the superchains the
    trace records when the chains were started in superchains, else split R-hat alone
    (:func:`~pyrobdl.diagnostics.certification.reference_criteria`)."""
    criteria = reference_criteria(posterior.trace.superchain_size)
    if rhat != "auto":
        criteria = dataclasses.replace(criteria, rhat=rhat)
    attach_certification(posterior, x_points, criteria, inputs=inputs)


register_method(Method(
    "chees", CHEES_OPTIONS, run_chees,
    "Many-chain HMC in lock-step with ChEES adaptation (Hoffman, Radul & Sountsov 2021); certified references",
    check_model=_check_options,
))
