r"""Figures of the report, drawn from stored records and their ``arrays.npz`` only.

Figures are built with :class:`matplotlib.figure.Figure` directly (no pyplot, no global backend
change) and returned as :class:`~pyrobdl.report.model.Figure` objects holding a base64 PNG, so
the HTML page embeds them and needs no network.
"""

from __future__ import annotations

import base64
import io
import math
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .model import Figure
from .tables import HIGHER_IS_BETTER, by_method, mean_se, metric_values, ok_records

__all__ = ["FIGURES", "calibration", "elbo_curves", "encode", "predictive_bands", "quality_vs_cost", "rank_plots"]

DPI = 80
#: Quality metric of the quality-versus-cost figure: the first one present.
QUALITY_METRICS = ("test_ll", "nll", "accuracy", "rmse")


def _new(width: float, height: float) -> Any:
    from matplotlib.figure import Figure as MplFigure

    return MplFigure(figsize=(width, height), layout="constrained")


def encode(fig: Any, title: str, caption: str = "") -> Figure:
    """Render a matplotlib figure to an embedded PNG."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return Figure(title, base64.b64encode(buf.getvalue()).decode("ascii"), caption)


def _arrays(record: Mapping[str, Any]) -> dict[str, np.ndarray]:
    name = (record.get("artifacts") or {}).get("arrays")
    if not name or "_dir" not in record:
        return {}
    path = Path(record["_dir"]) / name
    if not path.exists():
        return {}
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


def _first(records: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    return min(records, key=lambda r: (r["split"], r["seed"]))


def _colors(labels: Sequence[str]) -> dict[str, Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return {label: cmap(i % 10) for i, label in enumerate(labels)}


def _grid(n: int, cols: int = 3) -> tuple[int, int]:
    cols = min(cols, n)
    return math.ceil(n / cols), cols


def quality_vs_cost(records: Sequence[Mapping[str, Any]], dataset: str) -> Figure | None:
    """Test quality against fit wall time and against gradient evaluations (log scales)."""
    groups = by_method(ok_records(records))
    metric = next((m for m in QUALITY_METRICS if any(metric_values(g, m) for g in groups.values())), None)
    if metric is None:
        return None
    from matplotlib.ticker import NullFormatter

    colors = _colors(list(groups))
    ys = {label: mean_se(metric_values(recs, metric)) for label, recs in groups.items()}
    lo, hi = _robust_range([m for m, _, n in ys.values() if n], higher_is_better=HIGHER_IS_BETTER[metric])
    fig = _new(9, 3.6)
    axes = fig.subplots(1, 2, sharey=True)
    clipped = []
    for ax, key, xlabel in ((axes[0], "wall_time_s", "fit wall time (s)"),
                            (axes[1], "gradient_evaluations", "gradient evaluations")):
        xs = [mean_se([(r.get("cost") or {}).get(key) for r in recs])[0] for recs in groups.values()]
        xs = [x for x in xs if x > 0]
        for label, recs in groups.items():
            y, yse, n = ys[label]
            x, xse, _ = mean_se([(r.get("cost") or {}).get(key) for r in recs])
            if n == 0 or not (x > 0):
                continue
            if not lo <= y <= hi:  # far off the others: drawn at the edge, value in the caption
                edge = lo if y < lo else hi
                ax.plot([x], [edge], "v" if y < lo else "^", color=colors[label], label=label, ms=8)
                if key == "wall_time_s":
                    clipped.append(f"{label} = {y:.3g}")
                continue
            ax.errorbar([x], [y], yerr=[0 if math.isnan(yse) else yse], xerr=[0 if math.isnan(xse) else xse],
                        fmt="o", color=colors[label], label=label, capsize=3)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        if xs:  # whole decades, so the log axis always has labelled ticks
            ax.set_xlim(10 ** math.floor(math.log10(min(xs) / 1.5)), 10 ** math.ceil(math.log10(max(xs) * 1.5)))
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    pad = 0.05 * (hi - lo) if hi > lo else 1.0
    axes[0].set_ylim(lo - pad, hi + pad)
    axes[0].set_ylabel(f"{metric} ({'higher' if HIGHER_IS_BETTER[metric] else 'lower'} is better)")
    axes[1].legend(fontsize=8, loc="best")
    note = f" Off the scale (triangles at the edge): {', '.join(clipped)}." if clipped else ""
    return encode(fig, f"{dataset}: quality versus cost",
                  f"{metric}, mean ± s.e. over splits and seeds, against the mean cost of a fit.{note}")


def _robust_range(values: Sequence[float], *, higher_is_better: bool) -> tuple[float, float]:
    """A y range holding the bulk of ``values``: points worse than 5 IQR beyond the quartiles are left out."""
    v = np.asarray([x for x in values if np.isfinite(x)], dtype=float)
    if v.size == 0:
        return 0.0, 1.0
    if v.size < 4:
        return float(v.min()), float(v.max())
    q1, q3 = np.percentile(v, [25, 75])
    spread = max(q3 - q1, 1e-12)
    lo, hi = (q1 - 5 * spread, np.inf) if higher_is_better else (-np.inf, q3 + 5 * spread)
    kept = v[(v >= lo) & (v <= hi)]
    return float(kept.min()), float(kept.max())


def predictive_bands(records: Sequence[Mapping[str, Any]], dataset: str) -> Figure | None:
    """Predictive mean with ±2 sd bands (total and function-only) per method, for 1-D inputs."""
    panels = []
    for label, recs in by_method(ok_records(records)).items():
        arr = _arrays(_first(recs))
        if "band_x" in arr:
            panels.append((label, arr))
    if not panels:
        return None
    rows, cols = _grid(len(panels))
    fig = _new(3.4 * cols, 2.8 * rows)
    axes = np.atleast_1d(fig.subplots(rows, cols, sharex=True, sharey=True, squeeze=False)).ravel()
    for ax, (label, a) in zip(axes, panels):
        x, m = a["band_x"], a["band_mean"]
        ax.fill_between(x, m - 2 * a["band_sd"], m + 2 * a["band_sd"], color="C0", alpha=0.2, label="±2 sd (total)")
        ax.fill_between(x, m - 2 * a["band_sd_epistemic"], m + 2 * a["band_sd_epistemic"], color="C0", alpha=0.35,
                        label="±2 sd (function)")
        ax.plot(x, m, color="C0", lw=1.5, label="mean")
        ax.plot(a["test_x"], a["test_y"], ".", color="0.6", ms=2, label="test")
        ax.plot(a["train_x"], a["train_y"], ".", color="k", ms=3, label="train")
        ax.set_title(label, fontsize=10)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    axes[0].legend(fontsize=7, loc="best")
    return encode(fig, f"{dataset}: predictive bands",
                  "First split and seed of each method; targets on the original scale.")


def calibration(records: Sequence[Mapping[str, Any]], dataset: str) -> Figure | None:
    """Observed vs nominal interval coverage (regression) or a reliability diagram (classification)."""
    groups = by_method(ok_records(records))
    colors = _colors(list(groups))
    curves: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    classification = False
    for label, recs in groups.items():
        arrs = [a for a in (_arrays(r) for r in recs) if "calib_level" in a or "reliab_confidence" in a]
        if not arrs:
            continue
        if "calib_level" in arrs[0]:
            curves[label] = (arrs[0]["calib_level"], np.mean([a["calib_observed"] for a in arrs], axis=0))
        else:
            classification = True
            count = np.sum([a["reliab_count"] for a in arrs], axis=0).astype(float)
            with np.errstate(invalid="ignore", divide="ignore"):
                conf = np.nansum([a["reliab_confidence"] * a["reliab_count"] for a in arrs], axis=0) / count
                acc = np.nansum([a["reliab_accuracy"] * a["reliab_count"] for a in arrs], axis=0) / count
            curves[label] = (conf, acc)
    if not curves:
        return None
    fig = _new(4.6, 4.0)
    ax = fig.subplots()
    ax.plot([0, 1], [0, 1], ls="--", color="0.5", lw=1, label="calibrated")
    for label, (x, y) in curves.items():
        keep = np.isfinite(x) & np.isfinite(y)
        ax.plot(x[keep], y[keep], "o-", ms=3, color=colors[label], label=label)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    if classification:
        ax.set_xlabel("confidence (top-class probability)")
        ax.set_ylabel("accuracy")
        caption = "Reliability diagram pooled over splits and seeds."
    else:
        ax.set_xlabel("nominal central-interval level")
        ax.set_ylabel("observed coverage on the test set")
        caption = "Coverage of central predictive intervals (from PIT values), averaged over splits and seeds."
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return encode(fig, f"{dataset}: calibration", caption)


def elbo_curves(records: Sequence[Mapping[str, Any]], dataset: str) -> Figure | None:
    """Objective trace (``posterior.history``) per method, first split and seed."""
    panels = []
    for label, recs in by_method(ok_records(records)).items():
        h = _arrays(_first(recs)).get("history")
        if h is not None and h.size > 1 and np.isfinite(h).any():
            panels.append((label, h))
    if not panels:
        return None
    rows, cols = _grid(len(panels))
    fig = _new(3.4 * cols, 2.5 * rows)
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
    for ax, (label, h) in zip(axes, panels):
        steps = np.arange(1, h.size + 1)
        ax.plot(steps, h, lw=0.6, color="C0", alpha=0.5)
        window = max(1, h.size // 50)
        if window > 1:
            smooth = np.convolve(h, np.ones(window) / window, mode="valid")
            ax.plot(steps[window - 1:], smooth, lw=1.2, color="C1")
        finite = h[np.isfinite(h)]
        lo, hi = np.percentile(finite, [2, 100])
        pad = 0.05 * (hi - lo) if hi > lo else 1.0
        ax.set_ylim(lo - pad, hi + pad)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    return encode(fig, f"{dataset}: objective traces",
                  "posterior.history of the first split and seed (the ELBO for SVI methods), with a moving average; "
                  "the y range drops the lowest 2% of values (early steps).")


def rank_plots(records: Sequence[Mapping[str, Any]], dataset: str) -> list[Figure]:
    """Function-space rank plots of multi-chain samplers, from their stored ArviZ data.

    Drawn for every method whose first cell stored an ``InferenceData`` with a ``sample_stats``
    group and more than one chain (MCMC), with :func:`pyrobdl.diagnostics.plots.plot_rank`.
    """
    from ..diagnostics import plots
    from ..diagnostics.arviz_adapter import az

    out = []
    for label, recs in by_method(ok_records(records)).items():
        first = _first(recs)
        name = (first.get("artifacts") or {}).get("inference_data")
        if not name or "_dir" not in first or not (Path(first["_dir"]) / name).exists():
            continue
        idata = az.from_netcdf(str(Path(first["_dir"]) / name))
        if "sample_stats" not in idata.groups() or idata.posterior.sizes.get("chain", 1) < 2:
            continue
        fig = plots.plot_rank(idata, space="function", max_points=4)
        out.append(encode(fig, f"{dataset}: {label} rank plots (function space)",
                          f"Split {first['split']}, seed {first['seed']}: ranks of the network output at 4 test "
                          "inputs, per chain; uniform histograms mean the chains agree."))
    return out


FIGURES: tuple[Callable[[Sequence[Mapping[str, Any]], str], Figure | list[Figure] | None], ...] = (
    quality_vs_cost, predictive_bands, calibration, elbo_curves, rank_plots,
)
