"""ChEES adaptation of the shared tuning parameters: the jitter sequence, the Stan-style warm-up
windows and the diagonal mass matrix estimated in them, dual averaging of the step size, and Adam
ascent of the ChEES criterion in log T (the maths is in :mod:`pyrobdl.inference.chees`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: How the diagonal mass matrix is estimated from a warm-up window (:class:`WindowVariance`).
MASS_MATRICES = ("cross-chain", "within-chain", "per-chain")
#: How the step size is adapted over the warm-up: a fresh dual averaging in every mass-matrix
#: window, the last one's average kept (Stan's), or one dual averaging over the whole warm-up,
#: the moving average of its log iterates kept (BlackJAX's ChEES).
STEP_SIZE_ADAPTATIONS = ("windowed", "continuous")
#: How Adam's log T is kept within reach of the consumed T: not at all, projected onto
#: [log step, log(max_num_steps * step)] after every update, or re-anchored before every update at
#: the consumed (clamped moving-average) T, as BlackJAX's ChEES; ``"ceiling"``: free, but Adam's
#: iterate and the consumed T at most a quarter period of the slowest direction of the last
#: mass-matrix window (:func:`quarter_period`); ``"eigen"``: T that quarter period once a window has
#: ended (BlackJAX's slow-direction floor, which sets its T in practice), ChEES's Adam before.
TRAJECTORY_ADAPTATIONS = ("free", "projected", "anchored", "ceiling", "eigen")
#: The trajectory adaptations that need each window's dense second moment (:func:`quarter_period`).
QUARTER_PERIOD_ADAPTATIONS = ("ceiling", "eigen")
#: The most parameters for which "ceiling" and "eigen" keep a window's dense second moment ([P, P]
#: in float64: 134 MB at this size; its eigenvalues once per window).
DENSE_WINDOW_LIMIT = 4096

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


def _window_start(num_warmup: int) -> int:
    """First iteration of the first slow window."""
    if num_warmup < 150:
        return int(0.15 * num_warmup)
    return 75


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

    def __init__(self, kind: str, groups: int = 1, outer: bool = False) -> None:
        if kind not in MASS_MATRICES:
            raise ValueError(f"unknown mass_matrix {kind!r}; valid: {list(MASS_MATRICES)}")
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
            raise ValueError(f"groups must be an integer >= 1, got {groups!r}")
        self.kind, self.groups, self.outer = kind, groups, outer
        self.shift = self.total = self.total_sq = None
        self.total_outer: torch.Tensor | None = None  # [P, P], with outer=True
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
        if self.outer:
            self.total_outer = d.t() @ d if self.total_outer is None else self.total_outer.addmm_(d.t(), d)
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


def quarter_period(window: WindowVariance, inv_mass: torch.Tensor) -> float:
    r"""A quarter period :math:`\frac{\pi}{2}\sqrt{\lambda_{max}}` of the slowest direction of ``window``.

    :math:`\lambda_{max}` is the largest eigenvalue of the window's cross-chain covariance in the
    coordinates that the diagonal ``inv_mass`` whitens, :math:`D^{-1/2} C D^{-1/2}`; under unit-mass
    Hamiltonian dynamics a Gaussian direction of variance :math:`\lambda` oscillates with period
    :math:`2\pi\sqrt{\lambda}` (BlackJAX's ChEES floors its trajectory length at this quarter
    period).  The covariance is over all chains and iterations whatever the window's ``kind``.
    ``window`` (one group) must have been built with ``outer=True`` over at least two iterations.
    """
    if window.total_outer is None or window.n < 2:
        raise RuntimeError("quarter_period needs a window with outer=True and at least 2 iterations")
    n = window.n * window.total.shape[0]
    second, first = window.total_outer, window.total.sum(0)
    if window.shift.dim() == 2:  # each chain summed about its own first state: pool about their mean
        off = window.shift - window.shift.mean(0)
        cross = window.total.t() @ off
        second = second + cross + cross.t() + window.n * (off.t() @ off)
        first = first + window.n * off.sum(0)
    mean = first / n
    cov = (second / n - torch.outer(mean, mean)) * (n / (n - 1))
    root = inv_mass.double().sqrt()
    lam = float(torch.linalg.eigvalsh(cov / root.unsqueeze(0) / root.unsqueeze(1))[-1])
    return 0.5 * math.pi * math.sqrt(max(lam, 1e-12))


@dataclass
class _DualAveraging:
    """Nesterov dual averaging of log step size (Hoffman & Gelman 2014, Algorithm 5)."""

    mu: float
    log_step: float
    t: int = 0
    h_bar: float = 0.0
    log_step_bar: float = 0.0
    # moving average of the log iterates with weight t ** -0.5 (BlackJAX's step-size average)
    log_step_ma: float = 0.0

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
        v = self.t ** -_MA_DECAY
        self.log_step_ma = v * self.log_step + (1.0 - v) * self.log_step_ma
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
        """One clipped Adam step of ``log_t`` up the ChEES ``gradient``; the moving average follows."""
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
