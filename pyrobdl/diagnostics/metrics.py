r"""Posterior-quality metrics as pure functions of numpy arrays.

Nothing here knows about models, posteriors or ArviZ: every function takes arrays (anything
``numpy.asarray`` accepts, e.g. CPU tensors) and returns floats or arrays, so each one can be
checked against a hand computation.  :func:`pyrobdl.diagnostics.evaluate` turns a posterior into
these arrays.  Conventions: ``S`` draws, ``N`` points, ``K`` classes; logarithms are natural.

The formulas, how to read each number and the sources are collected in ``docs/diagnostics.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import special, stats

__all__ = [
    "COVERAGE_LEVELS",
    "ReliabilityTable",
    "accuracy",
    "agreement",
    "brier_score",
    "categorical_nll",
    "crps_ensemble",
    "crps_gaussian",
    "expected_calibration_error",
    "expected_entropy",
    "gaussian_kl",
    "gaussian_mixture_pit",
    "interval_coverage",
    "log_predictive_density",
    "mutual_information",
    "pit_calibration_error",
    "predictive_entropy",
    "reliability_table",
    "rmse",
    "total_variation",
    "wasserstein2_empirical",
    "wasserstein2_gaussian",
]

#: Central-interval levels reported by :func:`pyrobdl.diagnostics.evaluate` (``coverage_50`` ...).
COVERAGE_LEVELS = (0.5, 0.8, 0.9, 0.95)

# Rows of class probabilities must sum to one up to this tolerance: a float32 softmax over a few
# thousand classes is off by ~1e-6, while regression outputs fed by mistake are off by O(1).
_PROB_SUM_TOL = 1e-4


# ----------------------------------------------------------------------------- validation


def _as_float(name: str, value: Any, ndim: int | tuple[int, ...] | None = None) -> np.ndarray:
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} must be a numeric array, got {type(value).__name__}") from e
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else ndim
        if arr.ndim not in allowed:
            raise ValueError(f"{name} must have {' or '.join(map(str, allowed))} dimension(s), got shape {arr.shape}")
    if np.isnan(arr).any():
        raise ValueError(f"{name} contains NaN")
    return arr


def _same_shape(**arrays: np.ndarray) -> None:
    shapes = {k: v.shape for k, v in arrays.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"shapes must match, got {shapes}")


def _check_probs(name: str, probs: Any) -> np.ndarray:
    p = _as_float(name, probs)
    if p.ndim != 2 or p.shape[1] < 2:
        raise ValueError(
            f"{name} must be class probabilities of shape [N, K] with K >= 2 (a classification "
            f"prediction), got shape {p.shape}"
        )
    if (p < 0).any() or (p > 1).any() or not np.allclose(p.sum(-1), 1.0, rtol=0, atol=_PROB_SUM_TOL):
        raise ValueError(
            f"{name} must hold class probabilities (rows in [0, 1] summing to 1); these look like "
            "regression outputs or logits"
        )
    return p


def _check_draw_probs(name: str, probs: Any) -> np.ndarray:
    p = _as_float(name, probs, ndim=3)
    _check_probs(name, p.reshape(-1, p.shape[-1]))
    return p


def _check_labels(labels: Any, num_points: int, num_classes: int) -> np.ndarray:
    y = np.asarray(labels)
    if y.ndim != 1 or y.shape[0] != num_points:
        raise ValueError(f"labels must have shape [{num_points}] (one class label per point), got {y.shape}")
    if y.dtype.kind == "f":
        if not np.all(y == np.round(y)):
            raise TypeError("labels must be integer class labels; got non-integer values (regression targets?)")
    elif y.dtype.kind not in "iub":
        raise TypeError(f"labels must be integer class labels, got dtype {y.dtype}")
    y = y.astype(np.int64)
    if (y < 0).any() or (y >= num_classes).any():
        raise ValueError(f"labels must lie in 0..{num_classes - 1}")
    return y


# ----------------------------------------------------------------------------- regression


def log_predictive_density(log_lik: Any) -> np.ndarray:
    r"""Log posterior-predictive density of each point from per-draw log-likelihoods.

    Parameters
    ----------
    log_lik : array-like
        ``[S, N]``: :math:`\log p(y_n \mid w_s)` for draws :math:`w_s` of the posterior.

    Returns
    -------
    numpy.ndarray
        ``[N]``: :math:`\log \frac1S \sum_s p(y_n \mid w_s)`, computed with logsumexp.

    Notes
    -----
    .. math:: \mathrm{lpd}_n = \operatorname{logsumexp}_s \log p(y_n\mid w_s) - \log S.

    The mean over points is the "test log-likelihood" of the UCI benchmark (Hernández-Lobato &
    Adams 2015; Gal & Ghahramani 2016).
    """
    ll = _as_float("log_lik", log_lik, ndim=2)
    return special.logsumexp(ll, axis=0) - math.log(ll.shape[0])


def rmse(prediction: Any, target: Any) -> float:
    r"""Root mean squared error :math:`\sqrt{\frac1N\sum_n (\hat y_n - y_n)^2}` over all entries.

    Parameters
    ----------
    prediction, target : array-like
        Same shape (``[N]`` or ``[N, out]``); ``prediction`` is usually the predictive mean.
    """
    p, t = _as_float("prediction", prediction), _as_float("target", target)
    _same_shape(prediction=p, target=t)
    return float(np.sqrt(np.mean((p - t) ** 2)))


def gaussian_mixture_pit(y: Any, loc: Any, scale: Any) -> np.ndarray:
    r"""Probability integral transform of ``y`` under an equal-weight Gaussian mixture.

    Parameters
    ----------
    y : array-like
        Observations ``[N]``.
    loc : array-like
        Component means ``[S, N]`` (the network output of each draw).
    scale : array-like
        Component standard deviations, broadcastable to ``[S, N]`` (observation noise per draw).

    Returns
    -------
    numpy.ndarray
        ``[N]``: :math:`u_n = F_n(y_n) = \frac1S\sum_s \Phi\big((y_n-\mu_{sn})/\sigma_{sn}\big)`.

    Notes
    -----
    For a calibrated predictive the :math:`u_n` are uniform on [0, 1] (Dawid 1984; Gneiting,
    Balabdaoui & Raftery 2007).  The mixture is exactly the predictive a Gaussian likelihood
    gives from ``S`` posterior draws, so no quantile has to be inverted.
    """
    y_, m = _as_float("y", y, ndim=1), _as_float("loc", loc, ndim=2)
    if m.shape[1] != y_.shape[0]:
        raise ValueError(f"loc must have shape [S, {y_.shape[0]}], got {m.shape}")
    s = _as_float("scale", scale)
    if (s <= 0).any():
        raise ValueError("scale must be > 0")
    try:
        s = np.broadcast_to(s, m.shape)
    except ValueError as e:
        raise ValueError(f"scale of shape {s.shape} does not broadcast to loc's {m.shape}") from e
    return special.ndtr((y_ - m) / s).mean(0)


def interval_coverage(pit: Any, level: float) -> float:
    r"""Fraction of points inside the central ``level`` predictive interval.

    Parameters
    ----------
    pit : array-like
        PIT values :math:`u_n = F_n(y_n)` ``[N]`` (see :func:`gaussian_mixture_pit`).
    level : float
        Interval probability in (0, 1), e.g. 0.9.

    Returns
    -------
    float
        :math:`\frac1N\sum_n \mathbb 1\big[|u_n - \tfrac12| \le \tfrac{\text{level}}2\big]`: the
        central interval :math:`[F^{-1}(\frac{1-\ell}2), F^{-1}(\frac{1+\ell}2)]` contains
        :math:`y` iff :math:`F(y)` lies in :math:`[\frac{1-\ell}2, \frac{1+\ell}2]` (continuous,
        increasing :math:`F`).  A calibrated predictive gives ``level``.
    """
    u = _as_float("pit", pit, ndim=1)
    if not (isinstance(level, (int, float)) and 0 < level < 1):
        raise ValueError(f"level must be a number in (0, 1), got {level!r}")
    return float(np.mean(np.abs(u - 0.5) <= level / 2))


def pit_calibration_error(pit: Any) -> float:
    r"""L1 distance between the empirical CDF of PIT values and the uniform CDF.

    Parameters
    ----------
    pit : array-like
        PIT values ``[N]`` in [0, 1].

    Returns
    -------
    float
        :math:`\int_0^1 |\hat G(p) - p|\,dp` with :math:`\hat G(p) = \frac1N\#\{u_n \le p\}`,
        computed exactly (the step function is integrated piece by piece).  0 for a perfectly
        calibrated predictive, at most 0.5.

    Notes
    -----
    This is the Wasserstein-1 distance between the PIT distribution and U(0, 1), the continuous
    analogue of the calibration error of Kuleshov, Fenner & Ermon (2018), who sum
    :math:`(p_j - \hat G(p_j))^2` over a grid of levels :math:`p_j`.  Over-confident predictives
    pile PIT values near 0 and 1, under-confident ones near 0.5; both raise it.
    """
    u = np.sort(_as_float("pit", pit, ndim=1))
    if u.size == 0:
        raise ValueError("pit must not be empty")
    if (u < 0).any() or (u > 1).any():
        raise ValueError("pit values must lie in [0, 1]")
    edges = np.concatenate([[0.0], u, [1.0]])
    a, b = edges[:-1], edges[1:]
    c = np.arange(u.size + 1) / u.size  # value of the step CDF on [a, b)
    # integral of |c - p| over [a, b], split at p = c when c lies inside
    below = np.where(c <= a, ((b - c) ** 2 - (a - c) ** 2) / 2, 0.0)
    above = np.where(c >= b, ((c - a) ** 2 - (c - b) ** 2) / 2, 0.0)
    inside = np.where((c > a) & (c < b), ((c - a) ** 2 + (b - c) ** 2) / 2, 0.0)
    return float(np.sum(below + above + inside))


def crps_ensemble(samples: Any, y: Any) -> np.ndarray:
    r"""Continuous ranked probability score of the empirical distribution of samples.

    Parameters
    ----------
    samples : array-like
        Draws from the predictive distribution ``[S, N]`` (observations, noise included).
    y : array-like
        Observations ``[N]``.

    Returns
    -------
    numpy.ndarray
        ``[N]``: CRPS of each point (lower is better, in the units of ``y``).

    Notes
    -----
    The energy form of Gneiting & Raftery (2007, eq. 21),

    .. math:: \mathrm{CRPS}(F, y) = \mathbb E|X - y| - \tfrac12\,\mathbb E|X - X'|,
              \qquad X, X' \sim F \text{ independent},

    evaluated for the empirical distribution :math:`\hat F` of the samples, which equals
    :math:`\int (\hat F(t) - \mathbb 1[t \ge y])^2 dt`.  The pair term uses the sorted samples
    :math:`x_{(1)} \le \dots \le x_{(S)}`:
    :math:`\sum_{s,t} |x_s - x_t| = 2\sum_{i=1}^S (2i - S - 1)\,x_{(i)}`, so the cost is
    :math:`O(S \log S)` per point instead of :math:`O(S^2)`.  The estimator is biased by
    :math:`O(1/S)` against the CRPS of the underlying :math:`F` (Zamo & Naveau 2018).

    References
    ----------
    T. Gneiting, A. E. Raftery. Strictly proper scoring rules, prediction, and estimation.
    JASA 102(477), 2007.
    """
    x = _as_float("samples", samples, ndim=2)
    y_ = _as_float("y", y, ndim=1)
    if x.shape[1] != y_.shape[0]:
        raise ValueError(f"samples must have shape [S, {y_.shape[0]}], got {x.shape}")
    s = x.shape[0]
    first = np.abs(x - y_).mean(0)
    xs = np.sort(x, axis=0)
    weights = 2.0 * np.arange(1, s + 1) - s - 1
    pair_sum = 2.0 * (weights[:, None] * xs).sum(0)
    return first - pair_sum / (2.0 * s * s)


def crps_gaussian(loc: Any, scale: Any, y: Any) -> np.ndarray:
    r"""Closed-form CRPS of a Gaussian predictive :math:`\mathcal N(\mu, \sigma^2)`.

    Returns
    -------
    numpy.ndarray
        :math:`\sigma\big[z(2\Phi(z) - 1) + 2\varphi(z) - 1/\sqrt\pi\big]`,
        :math:`z = (y-\mu)/\sigma` (Gneiting et al. 2005, eq. 5), broadcast over the inputs.

    References
    ----------
    T. Gneiting, A. E. Raftery, A. H. Westveld, T. Goldman. Calibrated probabilistic
    forecasting using ensemble model output statistics. Monthly Weather Review 133, 2005.
    """
    m, s, y_ = _as_float("loc", loc), _as_float("scale", scale), _as_float("y", y)
    if (s <= 0).any():
        raise ValueError("scale must be > 0")
    z = (y_ - m) / s
    return s * (z * (2 * special.ndtr(z) - 1) + 2 * stats.norm.pdf(z) - 1 / math.sqrt(math.pi))


# ----------------------------------------------------------------------------- distances


def wasserstein2_empirical(a: Any, b: Any) -> np.ndarray:
    r"""Wasserstein-2 distance between 1-D empirical distributions, one per column.

    Parameters
    ----------
    a : array-like
        Samples ``[S1, N]`` (``N`` independent 1-D distributions, e.g. one per test point).
    b : array-like
        Samples ``[S2, N]``; ``S2`` may differ from ``S1``.

    Returns
    -------
    numpy.ndarray
        ``[N]``: :math:`W_2 = \big(\int_0^1 (F_a^{-1}(u) - F_b^{-1}(u))^2 du\big)^{1/2}`.

    Notes
    -----
    In one dimension the optimal coupling is monotone, so :math:`W_2` is the L2 distance between
    quantile functions.  Both empirical quantile functions are step functions with jumps at
    :math:`i/S_1` and :math:`j/S_2`; the integral is computed exactly on the merged grid (for
    :math:`S_1 = S_2` it is the root mean squared difference of the sorted samples).
    """
    xa = np.sort(_as_float("a", a, ndim=2), axis=0)
    xb = np.sort(_as_float("b", b, ndim=2), axis=0)
    if xa.shape[1] != xb.shape[1]:
        raise ValueError(f"a and b must describe the same number of distributions, got {xa.shape} and {xb.shape}")
    sa, sb = xa.shape[0], xb.shape[0]
    if sa == sb:
        return np.sqrt(np.mean((xa - xb) ** 2, axis=0))
    grid = np.union1d(np.arange(1, sa + 1) / sa, np.arange(1, sb + 1) / sb)
    widths = np.diff(np.concatenate([[0.0], grid]))
    mid = grid - widths / 2  # a point inside each piece, away from the jumps
    ia = np.minimum(np.floor(mid * sa).astype(int), sa - 1)
    ib = np.minimum(np.floor(mid * sb).astype(int), sb - 1)
    return np.sqrt(np.sum(widths[:, None] * (xa[ia] - xb[ib]) ** 2, axis=0))


def wasserstein2_gaussian(mean_a: Any, sd_a: Any, mean_b: Any, sd_b: Any) -> np.ndarray:
    r"""Closed-form :math:`W_2` between 1-D Gaussians: :math:`\sqrt{(\mu_a-\mu_b)^2 + (\sigma_a-\sigma_b)^2}`."""
    ma, sa = _as_float("mean_a", mean_a), _as_float("sd_a", sd_a)
    mb, sb = _as_float("mean_b", mean_b), _as_float("sd_b", sd_b)
    if (sa < 0).any() or (sb < 0).any():
        raise ValueError("standard deviations must be >= 0")
    return np.sqrt((ma - mb) ** 2 + (sa - sb) ** 2)


def gaussian_kl(mean_p: Any, var_p: Any, mean_q: Any, var_q: Any) -> np.ndarray:
    r"""Elementwise :math:`\mathrm{KL}(\mathcal N(\mu_p, v_p)\,\|\,\mathcal N(\mu_q, v_q))`.

    Returns
    -------
    numpy.ndarray
        :math:`\tfrac12\big[\log(v_q/v_p) + (v_p + (\mu_p-\mu_q)^2)/v_q - 1\big]`, broadcast.
    """
    mp, vp = _as_float("mean_p", mean_p), _as_float("var_p", var_p)
    mq, vq = _as_float("mean_q", mean_q), _as_float("var_q", var_q)
    if (vp <= 0).any() or (vq <= 0).any():
        raise ValueError("variances must be > 0")
    return 0.5 * (np.log(vq / vp) + (vp + (mp - mq) ** 2) / vq - 1.0)


# ----------------------------------------------------------------------------- classification


def accuracy(probs: Any, labels: Any) -> float:
    r"""Fraction of points whose most probable class is the label.

    :math:`\frac1N\sum_n \mathbb 1[\arg\max_k p_{nk} = y_n]`.

    Parameters
    ----------
    probs : array-like
        Predictive class probabilities ``[N, K]`` (the mean over draws).
    labels : array-like
        Integer labels ``[N]``.
    """
    p = _check_probs("probs", probs)
    y = _check_labels(labels, *p.shape)
    return float(np.mean(p.argmax(-1) == y))


def categorical_nll(probs: Any, labels: Any) -> float:
    r"""Mean negative log predictive probability of the labels, :math:`-\frac1N\sum_n \log p_{n y_n}` (nats).

    Infinite when a label gets probability 0.  From per-draw log-likelihoods,
    :func:`log_predictive_density` gives the same number more stably (``-mean(lpd)``).
    """
    p = _check_probs("probs", probs)
    y = _check_labels(labels, *p.shape)
    with np.errstate(divide="ignore"):
        return float(-np.mean(np.log(p[np.arange(y.size), y])))


def brier_score(probs: Any, labels: Any) -> float:
    r"""Multi-class Brier score :math:`\frac1N\sum_n\sum_k (p_{nk} - \mathbb 1[y_n = k])^2` (Brier 1950).

    0 is perfect, 2 the worst; it sums over classes (not divided by ``K``).
    """
    p = _check_probs("probs", probs)
    y = _check_labels(labels, *p.shape)
    onehot = np.zeros_like(p)
    onehot[np.arange(y.size), y] = 1.0
    return float(np.mean(np.sum((p - onehot) ** 2, axis=-1)))


@dataclass(frozen=True)
class ReliabilityTable:
    """Reliability-diagram table: points binned by confidence (the top class probability).

    Attributes
    ----------
    bin_lower, bin_upper : numpy.ndarray
        Edges of each bin ``[M]``; a bin holds confidences in ``(lower, upper]``.
    count : numpy.ndarray
        Number of points per bin ``[M]``.
    confidence : numpy.ndarray
        Mean confidence per bin (NaN for an empty bin).
    accuracy : numpy.ndarray
        Accuracy per bin (NaN for an empty bin).
    """

    bin_lower: np.ndarray
    bin_upper: np.ndarray
    count: np.ndarray
    confidence: np.ndarray
    accuracy: np.ndarray

    @property
    def ece(self) -> float:
        r"""Expected calibration error :math:`\sum_b \frac{n_b}{N}|\mathrm{acc}_b - \mathrm{conf}_b|`."""
        n = self.count.sum()
        full = self.count > 0
        return float(np.sum(self.count[full] / n * np.abs(self.accuracy[full] - self.confidence[full])))

    def to_dict(self) -> dict[str, list]:
        """Plain lists (JSON-serialisable; empty bins give None)."""

        def clean(a: np.ndarray) -> list:
            return [None if isinstance(v, float) and math.isnan(v) else v for v in a.tolist()]

        return {
            "bin_lower": self.bin_lower.tolist(),
            "bin_upper": self.bin_upper.tolist(),
            "count": self.count.tolist(),
            "confidence": clean(self.confidence),
            "accuracy": clean(self.accuracy),
        }


def reliability_table(probs: Any, labels: Any, num_bins: int = 15) -> ReliabilityTable:
    r"""Bin points by confidence :math:`\max_k p_{nk}` into ``num_bins`` equal-width bins.

    Parameters
    ----------
    probs : array-like
        Predictive class probabilities ``[N, K]``.
    labels : array-like
        Integer labels ``[N]``.
    num_bins : int, default 15
        Number of bins on [0, 1] (15 as Guo et al. 2017).

    Returns
    -------
    ReliabilityTable
    """
    if isinstance(num_bins, bool) or not isinstance(num_bins, int) or num_bins < 1:
        raise ValueError(f"num_bins must be an integer >= 1, got {num_bins!r}")
    p = _check_probs("probs", probs)
    y = _check_labels(labels, *p.shape)
    conf = p.max(-1)
    correct = (p.argmax(-1) == y).astype(np.float64)
    edges = np.linspace(0.0, 1.0, num_bins + 1)
    # bin b holds (edges[b], edges[b+1]]; searchsorted on the edges themselves avoids the
    # rounding of ceil(conf * M) (0.7 * 10 = 7.000000000000001 would land in the next bin)
    index = np.clip(np.searchsorted(edges, conf, side="left") - 1, 0, num_bins - 1)
    count = np.bincount(index, minlength=num_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_conf = np.bincount(index, weights=conf, minlength=num_bins) / count
        mean_acc = np.bincount(index, weights=correct, minlength=num_bins) / count
    return ReliabilityTable(edges[:-1], edges[1:], count, mean_conf, mean_acc)


def expected_calibration_error(probs: Any, labels: Any, num_bins: int = 15) -> float:
    r"""Expected calibration error with equal-width confidence bins.

    Returns
    -------
    float
        :math:`\mathrm{ECE} = \sum_{b=1}^M \frac{|B_b|}{N}\,\big|\mathrm{acc}(B_b) - \mathrm{conf}(B_b)\big|`.

    References
    ----------
    M. P. Naeini, G. Cooper, M. Hauskrecht. Obtaining well calibrated probabilities using
    Bayesian binning. AAAI 2015.  C. Guo, G. Pleiss, Y. Sun, K. Q. Weinberger. On calibration of
    modern neural networks. ICML 2017, eq. (3).
    """
    return reliability_table(probs, labels, num_bins).ece


def predictive_entropy(probs: Any) -> np.ndarray:
    r"""Entropy of the predictive :math:`H[\bar p_n] = -\sum_k \bar p_{nk}\log \bar p_{nk}` ``[N]`` (nats)."""
    p = _check_probs("probs", probs)
    return special.entr(p).sum(-1)


def expected_entropy(draw_probs: Any) -> np.ndarray:
    r"""Mean entropy of the per-draw predictives :math:`\frac1S\sum_s H[p_{sn}]` ``[N]`` (the aleatoric part).

    Parameters
    ----------
    draw_probs : array-like
        Class probabilities of each draw ``[S, N, K]``.
    """
    p = _check_draw_probs("draw_probs", draw_probs)
    return special.entr(p).sum(-1).mean(0)


def mutual_information(draw_probs: Any) -> np.ndarray:
    r"""Mutual information between the label and the weights, ``[N]`` (the epistemic part).

    Notes
    -----
    .. math:: I[y; w \mid x_n] = H\Big[\frac1S\sum_s p_{sn}\Big] - \frac1S\sum_s H[p_{sn}] \ge 0,

    the BALD score of Houlsby et al. (2011); the predictive entropy splits into this epistemic
    part and the expected entropy (aleatoric part) (Depeweg et al. 2018).
    """
    p = _check_draw_probs("draw_probs", draw_probs)
    mi = special.entr(p.mean(0)).sum(-1) - special.entr(p).sum(-1).mean(0)
    return np.maximum(mi, 0.0)  # rounding can give -1e-17


def agreement(probs: Any, reference_probs: Any) -> float:
    r"""Top-1 agreement with a reference: :math:`\frac1N\sum_n \mathbb 1[\arg\max p_n = \arg\max p^{\mathrm{ref}}_n]`.

    References
    ----------
    P. Izmailov, S. Vikram, M. D. Hoffman, A. G. Wilson. What are Bayesian neural network
    posteriors really like? ICML 2021.
    """
    p, r = _check_probs("probs", probs), _check_probs("reference_probs", reference_probs)
    _same_shape(probs=p, reference_probs=r)
    return float(np.mean(p.argmax(-1) == r.argmax(-1)))


def total_variation(probs: Any, reference_probs: Any) -> float:
    r"""Mean total-variation distance to a reference.

    :math:`\frac1N\sum_n \frac12\sum_k |p_{nk} - p^{\mathrm{ref}}_{nk}|`.

    Izmailov et al. (2021), as :func:`agreement`.
    """
    p, r = _check_probs("probs", probs), _check_probs("reference_probs", reference_probs)
    _same_shape(probs=p, reference_probs=r)
    return float(np.mean(0.5 * np.abs(p - r).sum(-1)))
