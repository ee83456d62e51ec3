r"""Diagnostic figures.  Every function returns a ``matplotlib.figure.Figure``; nothing is shown or saved.

Figures are created with ``matplotlib.figure.Figure`` directly, not through ``pyplot``: they are
not registered with any GUI backend, render with Agg (``fig.savefig(buf, format="png")``), and are
freed when dropped.  Rank and trace plots are ArviZ's, through the adapter.  Each function also
accepts ``ax`` (where it makes sense) to draw into an existing axes; the figure of that axes is
returned.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.collections import LineCollection
from matplotlib.figure import Figure
from scipy import stats

from .._validation import as_tensor, check_inputs
from ..posterior import Posterior
from . import arviz_adapter
from .metrics import ReliabilityTable

__all__ = ["plot_elbo", "plot_pit", "plot_predictive_bands", "plot_rank", "plot_rank_ecdf", "plot_reliability",
           "plot_trace", "rank_ecdf_difference"]

SPACES = ("function", "weights")


def _axes(ax: Axes | None, figsize: tuple[float, float] = (5.0, 3.5)) -> Axes:
    if ax is not None:
        if not isinstance(ax, Axes):
            raise TypeError(f"ax must be a matplotlib Axes, got {type(ax).__name__}")
        return ax
    return Figure(figsize=figsize, layout="constrained").subplots()


def plot_predictive_bands(
    posterior: Posterior,
    x: Any,
    *,
    x_train: Any = None,
    y_train: Any = None,
    num_samples: int = 500,
    levels: Sequence[float] = (0.5, 0.9),
    seed: int = 0,
    y_mean: float = 0.0,
    y_std: float = 1.0,
    ax: Axes | None = None,
) -> Figure:
    r"""Predictive mean and central bands of a 1-D regression posterior.

    Parameters
    ----------
    posterior : Posterior
        A regression posterior with one input and one output.
    x : array-like
        Inputs ``[N, 1]`` at which to draw the bands (sorted here).
    x_train, y_train : array-like, optional
        Training data, drawn as points.
    num_samples : int, default 500
        Posterior draws.
    levels : sequence of float, default (0.5, 0.9)
        Central-interval probabilities of the shaded predictive bands of :math:`y` (noise
        included).  The widest level is also drawn for the function :math:`f` alone (dashed):
        the gap between the two is the aleatoric part.
    seed : int, default 0
    y_mean, y_std : float
        Target standardisation; the plot is on the original scale.
    ax : matplotlib.axes.Axes, optional

    Returns
    -------
    matplotlib.figure.Figure

    Raises
    ------
    ValueError
        For a classification posterior, more than one input or output, or bad levels.
    """
    if not isinstance(posterior, Posterior):
        raise TypeError(f"posterior must be a pyrobdl Posterior, got {type(posterior).__name__}")
    model = posterior.model
    if model.likelihood.task != "regression" or model.in_features != 1 or model.out_features != 1:
        raise ValueError(
            "predictive bands need a regression model with one input and one output; this one is a "
            f"{model.likelihood.task} model with in_features={model.in_features}, out_features={model.out_features}"
        )
    lv = sorted(float(v) for v in levels)
    if not lv or any(not 0 < v < 1 for v in lv):
        raise ValueError(f"levels must be probabilities in (0, 1), got {levels!r}")
    if not (np.isfinite(y_std) and y_std > 0):
        raise ValueError(f"y_std must be > 0, got {y_std!r}")
    xt = check_inputs(model, x)
    xt = xt[torch.argsort(xt[:, 0])].to(model.device)
    if (x_train is None) != (y_train is None):
        raise ValueError("give both x_train and y_train, or neither")
    if x_train is not None:
        xtr = check_inputs(model, x_train, "x_train")[:, 0].cpu().numpy()
        ytr = as_tensor("y_train", y_train).reshape(-1).double().cpu().numpy() * y_std + y_mean
        if ytr.shape != xtr.shape:
            raise ValueError(f"y_train must have {xtr.shape[0]} values, got {ytr.shape[0]}")
    pred = posterior.predict(xt, num_samples, seed=seed)
    f = pred.samples[..., 0].double().cpu().numpy() * y_std + y_mean  # [S, N]
    sd = pred._likelihood.noise_variance(pred._latents, pred.samples).expand_as(pred.samples)[..., 0]
    sd = np.sqrt(sd.double().cpu().numpy()) * y_std
    y_rep = f + sd * np.random.default_rng(seed).standard_normal(f.shape)
    xs = xt[:, 0].cpu().numpy()

    ax = _axes(ax)
    for i, level in enumerate(reversed(lv)):
        lo, hi = np.quantile(y_rep, [(1 - level) / 2, (1 + level) / 2], axis=0)
        ax.fill_between(xs, lo, hi, color="C0", alpha=0.15 + 0.15 * i, lw=0, label=f"{level:.0%} predictive")
    lo, hi = np.quantile(f, [(1 - lv[-1]) / 2, (1 + lv[-1]) / 2], axis=0)
    ax.plot(xs, lo, "C0--", lw=0.8, label=f"{lv[-1]:.0%} function")
    ax.plot(xs, hi, "C0--", lw=0.8)
    ax.plot(xs, f.mean(0), "C0", lw=1.5, label="mean")
    if x_train is not None:
        ax.plot(xtr, ytr, "k.", ms=3, label="train")
    ax.set_xlabel("x")
    ax.set_ylabel("y")
    ax.set_title(posterior.method)
    ax.legend(fontsize="small", frameon=False)
    return ax.figure


def plot_reliability(table: ReliabilityTable, *, ax: Axes | None = None) -> Figure:
    """Reliability diagram: accuracy against confidence per bin, with the diagonal and the ECE.

    Parameters
    ----------
    table : ReliabilityTable
        From :func:`pyrobdl.diagnostics.metrics.reliability_table`.
    ax : matplotlib.axes.Axes, optional

    Returns
    -------
    matplotlib.figure.Figure
    """
    if not isinstance(table, ReliabilityTable):
        raise TypeError(f"table must be a ReliabilityTable, got {type(table).__name__}")
    ax = _axes(ax, (4.0, 4.0))
    full = table.count > 0
    width = table.bin_upper - table.bin_lower
    ax.bar(table.bin_lower[full], table.accuracy[full], width=width[full], align="edge",
           edgecolor="C0", color="C0", alpha=0.6, label="accuracy")
    ax.bar(table.bin_lower[full], table.confidence[full] - table.accuracy[full], bottom=table.accuracy[full],
           width=width[full], align="edge", color="C3", alpha=0.3, label="gap to confidence")
    ax.plot([0, 1], [0, 1], "k--", lw=0.8)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("confidence")
    ax.set_ylabel("accuracy")
    ax.set_title(f"ECE = {table.ece:.3f}")
    ax.legend(fontsize="small", frameon=False, loc="upper left")
    return ax.figure


def plot_pit(pit: Any, *, bins: int = 20, ax: Axes | None = None) -> Figure:
    r"""Histogram of PIT values with the uniform density and its pointwise 95% band.

    Parameters
    ----------
    pit : array-like
        PIT values ``[N]`` in [0, 1] (e.g. :func:`~pyrobdl.diagnostics.metrics.gaussian_mixture_pit`).
    bins : int, default 20
    ax : matplotlib.axes.Axes, optional

    Returns
    -------
    matplotlib.figure.Figure

    Notes
    -----
    Under calibration each bin count is Binomial(N, 1/bins); the band is its 2.5%-97.5%
    quantiles on the density scale.  A U shape means over-confidence, a hump under-confidence,
    a slope bias.
    """
    u = np.asarray(pit, dtype=float)
    if u.ndim != 1 or u.size == 0 or (u < 0).any() or (u > 1).any():
        raise ValueError("pit must be a non-empty 1-D array of values in [0, 1]")
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 2:
        raise ValueError(f"bins must be an integer >= 2, got {bins!r}")
    ax = _axes(ax)
    n = u.size
    lo, hi = stats.binom.ppf([0.025, 0.975], n, 1 / bins) * bins / n
    ax.axhspan(lo, hi, color="0.85", lw=0, label="95% band (uniform)")
    ax.hist(u, bins=bins, range=(0, 1), density=True, color="C0", alpha=0.7, label="PIT")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xlim(0, 1)
    ax.set_xlabel("PIT")
    ax.set_ylabel("density")
    ax.legend(fontsize="small", frameon=False)
    return ax.figure


def plot_elbo(posterior: Posterior, *, ax: Axes | None = None) -> Figure:
    """The objective trace of a fit (the ELBO per step for SVI) with a running mean.

    Raises
    ------
    ValueError
        If the posterior has no history (e.g. MCMC).
    """
    if not isinstance(posterior, Posterior):
        raise TypeError(f"posterior must be a pyrobdl Posterior, got {type(posterior).__name__}")
    h = np.asarray(posterior.history, dtype=float).reshape(-1)
    if h.size == 0:
        raise ValueError(f"the {posterior.method!r} posterior has no objective history to plot")
    ax = _axes(ax, (6.0, 3.5))
    steps = np.arange(1, h.size + 1)
    window = max(1, h.size // 50)
    smooth = np.convolve(h, np.ones(window) / window, mode="valid")
    ax.plot(steps, h, color="C0", alpha=0.3, lw=0.6, label="ELBO")
    ax.plot(steps[window - 1 :], smooth, color="C0", lw=1.5, label=f"running mean ({window})")
    # the first steps are often orders of magnitude lower; frame the rest of the run
    tail = smooth[len(smooth) // 20 :]
    span = tail.max() - tail.min()
    ax.set_ylim(tail.min() - 0.1 * span - 1e-9, max(h.max(), tail.max()) + 0.05 * span + 1e-9)
    ax.set_xlabel("step")
    ax.set_ylabel("ELBO")
    ax.set_title(posterior.method)
    ax.legend(fontsize="small", frameon=False)
    return ax.figure


def _selection(idata: Any, space: str, max_points: int) -> Any:
    """A small xarray Dataset of scalar quantities with (chain, draw) dims."""
    if space not in SPACES:
        raise ValueError(f"unknown space {space!r}; valid: {list(SPACES)}")
    if isinstance(max_points, bool) or not isinstance(max_points, int) or max_points < 1:
        raise ValueError(f"max_points must be an integer >= 1, got {max_points!r}")
    if space == "weights":
        if not hasattr(idata, "posterior"):
            raise ValueError("idata has no posterior group")
        ds = idata.posterior
        return ds.isel({d: 0 for d in ds.dims if d not in ("chain", "draw")})
    if not hasattr(idata, "posterior_predictive") or "f" not in idata.posterior_predictive:
        raise ValueError("idata has no posterior_predictive 'f' (use Posterior.to_inference_data)")
    f = idata.posterior_predictive["f"]
    n = f.sizes["obs"]
    obs = np.unique(np.linspace(0, n - 1, min(max_points, n)).round().astype(int))
    f = f.isel(obs=obs)
    if "class" in f.dims:
        # logits are not identifiable (a constant shift changes nothing): use the probability of
        # the most probable class at each point
        logits = f.values
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        top = probs.mean((0, 1)).argmax(-1)
        values = np.take_along_axis(probs, top[None, None, :, None], -1)[..., 0]
        out = f.isel({"class": 0}, drop=True).copy(data=values)
        return out.rename("p_top").to_dataset()
    return f.isel(output=0, drop=True).to_dataset()


def plot_rank(idata: Any, *, space: str = "function", max_points: int = 4) -> Figure:
    """Rank plots of a few scalars of an ``InferenceData`` (ArviZ's ``plot_rank``).

    Parameters
    ----------
    idata : arviz.InferenceData
        From :meth:`Posterior.to_inference_data`.
    space : {"function", "weights"}, default "function"
        ``"function"``: the network output at up to ``max_points`` evenly spaced points (the
        top-class probability for classification), the meaningful space for BNNs; ``"weights"``:
        the first element of every site (weights of an MLP are not identifiable).
    max_points : int, default 4

    Returns
    -------
    matplotlib.figure.Figure
        Uniform ranks in every chain mean the chains mix over the same distribution.
    """
    return arviz_adapter.plot_rank(_selection(idata, space, max_points))


def rank_ecdf_difference(values: np.ndarray, num_points: int = 100, prob: float = 0.95
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per-chain ECDF of the fractional ranks minus the uniform CDF, with a simultaneous band.

    Parameters
    ----------
    values : numpy.ndarray
        Draws ``[chain, draw]`` of one scalar.
    num_points : int, default 100
        Evaluation points ``z`` in (0, 1].
    prob : float, default 0.95
        Chance that *every* chain stays inside the band at every ``z`` when all chains sample
        the same distribution (each chain's band is ArviZ's optimised simultaneous ECDF band,
        Säilynoja, Bürkner & Vehtari 2022, at ``prob ** (1 / chains)``), so a chain outside it
        is a real outlier rather than the 1 in 20 a per-chain 95% band lets out by chance.

    Returns
    -------
    z, diff, lower, upper : numpy.ndarray
        ``z`` ``[P]``; ``diff`` ``[chain, P]``, ECDF minus ``z`` per chain; the band's
        ``lower`` and ``upper`` ``[P]`` in the same units.
    """
    values = np.asarray(values, dtype=float)
    chains, draws = values.shape
    ranks = stats.rankdata(values.ravel(), method="average").reshape(chains, draws) / values.size
    z = np.linspace(0.0, 1.0, num_points + 1)[1:]
    diff = (ranks[:, :, None] <= z).mean(1) - z
    lower, upper = _ecdf_band(draws, num_points, prob ** (1.0 / chains))
    return z, diff, lower - z, upper - z


@functools.lru_cache(maxsize=16)
def _ecdf_band(draws: int, num_points: int, prob: float) -> tuple[np.ndarray, np.ndarray]:
    import warnings

    from .arviz_adapter import az

    z = np.linspace(0.0, 1.0, num_points + 1)[1:]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ArviZ's note that its optimiser is approximate
        return az.stats.ecdf_utils.ecdf_confidence_band(draws, z, z, prob=prob, method="optimized")


def plot_rank_ecdf(idata: Any, *, space: str = "function", max_points: int = 4, prob: float = 0.95) -> Figure:
    """Rank-ECDF difference plots of the same scalars as :func:`plot_rank`, readable with many chains.

    Each chain is one line, the ECDF of its draws' ranks among all chains' draws minus the
    uniform CDF; when all chains sample the same distribution, every line stays inside the
    shaded band with probability ``prob`` (see :func:`rank_ecdf_difference`).  Lines inside it
    are thin and grey (fainter the more chains there are); a chain that leaves it is drawn in red
    and counted in the panel's title.

    Parameters
    ----------
    idata : arviz.InferenceData
        From :meth:`Posterior.to_inference_data`.
    space : {"function", "weights"}, default "function"
        As in :func:`plot_rank`.
    max_points : int, default 4
    prob : float, default 0.95

    Returns
    -------
    matplotlib.figure.Figure
    """
    ds = _selection(idata, space, max_points)
    panels = [(f"{name}[{i}]", a) for name, da in ds.data_vars.items()
              for i, a in enumerate(np.asarray(da.transpose("chain", "draw", ...).values).reshape(
                  da.sizes["chain"], da.sizes["draw"], -1).transpose(2, 0, 1))]
    cols = min(len(panels), 4)
    rows = -(-len(panels) // cols)
    fig = Figure(figsize=(3.4 * cols, 2.7 * rows), layout="constrained")
    axes = np.atleast_1d(fig.subplots(rows, cols, sharey=True, squeeze=False)).ravel()
    for ax, (title, values) in zip(axes, panels):
        z, diff, lower, upper = rank_ecdf_difference(values, prob=prob)
        out = np.any((diff < lower - 1e-12) | (diff > upper + 1e-12), axis=1)
        ax.fill_between(z, lower, upper, color="C0", alpha=0.2, lw=0, label=f"all chains inside: {100 * prob:.0f}%")
        alpha = 0.8 if len(diff) <= 8 else max(0.06, min(0.5, 8.0 / len(diff)))
        # one collection per colour, not a line per chain: 64 chains drew 4x slower as lines
        for rows, style in ((diff[~out], {"color": "0.35", "lw": 0.7, "alpha": alpha}),
                            (diff[out], {"color": "C3", "lw": 1.0})):
            if len(rows):
                ax.add_collection(LineCollection(np.stack([np.broadcast_to(z, rows.shape), rows], axis=-1),
                                                 capstyle="projecting", joinstyle="round", **style))
        ax.axhline(0.0, color="k", lw=0.5)
        ax.set_title(f"{title}: {int(out.sum())} of {len(diff)} chains outside", fontsize=9)
        ax.set_xlabel("fractional rank")
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    axes[0].set_ylabel("ECDF − uniform")
    axes[0].legend(fontsize=7, loc="lower left")
    return fig


def plot_trace(idata: Any, *, space: str = "function", max_points: int = 4) -> Figure:
    """Trace plots (per-chain densities and draws) of the same scalars as :func:`plot_rank`,
    with divergent transitions marked when ``idata`` has ``sample_stats.diverging``."""
    stats_group = getattr(idata, "sample_stats", None)
    return arviz_adapter.plot_trace(_selection(idata, space, max_points), stats_group)
