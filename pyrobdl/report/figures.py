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
from .verdicts import TOLERANCE

__all__ = [
    "FIGURES", "adaptive_reliability", "calibration", "elbo_curves", "encode", "pareto_front", "predictive_bands",
    "quality_vs_cost", "rank_plots", "training_gap",
]

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


#: Marker shapes, so methods are told apart without colour (with a direct label beside each).
MARKERS = ("o", "s", "D", "^", "v", "P", "X", "*", "h", "<", ">", "p")
#: Axis labels with units, per cost key.
COST_AXES = {
    "gradient_evaluations": "gradient evaluations per fit (count, log scale)",
    "cpu_time_s": "fit CPU time (process seconds, log scale)",
    "wall_time_s": "fit wall time (s, log scale)",
}
#: Units of the quality metrics, for the y axis.
METRIC_UNITS = {"test_ll": "nats per test point", "nll": "nats per test point", "accuracy": "fraction correct",
                "rmse": "target units"}


def pareto_front(points: Sequence[tuple[float, float]], *, higher_is_better: bool) -> list[int]:
    """Indices of the points no other point beats on both cost (lower) and quality, by cost.

    A point is on the front when every cheaper-or-equal point is strictly worse.
    """
    sign = 1.0 if higher_is_better else -1.0
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -sign * points[i][1]))
    front, best = [], -math.inf
    for i in order:
        q = sign * points[i][1]
        if q > best:
            front.append(i)
            best = q
    return front


def _cost_key(groups: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    """CPU seconds when every cell recorded them, else wall seconds (older records)."""
    cpu = [(r.get("cost") or {}).get("cpu_time_s") for recs in groups.values() for r in recs]
    return "cpu_time_s" if cpu and all(isinstance(c, (int, float)) and c > 0 for c in cpu) else "wall_time_s"


def quality_vs_cost(records: Sequence[Mapping[str, Any]], dataset: str) -> Figure | None:
    """Quality against cost, one panel per cost (gradient evaluations; CPU seconds), with the
    Pareto front; every method a marker shape and a direct label; off-scale methods drawn as
    hollow triangles at the edge with their value written beside them."""
    groups = by_method(ok_records(records))
    metric = next((m for m in QUALITY_METRICS if any(metric_values(g, m) for g in groups.values())), None)
    if metric is None:
        return None
    up = HIGHER_IS_BETTER[metric]
    colors = _colors(list(groups))
    markers = {label: MARKERS[i % len(MARKERS)] for i, label in enumerate(groups)}
    ys = {label: mean_se(metric_values(recs, metric)) for label, recs in groups.items()}
    lo, hi = _robust_range([m for m, _, n in ys.values() if n], higher_is_better=up, keep_within=TOLERANCE.get(metric))
    pad = 0.08 * (hi - lo) if hi > lo else 1.0
    # off-scale methods: each its own row beyond the edge (the worst outermost), so that two of
    # similar cost do not write their values over each other
    below = sorted((k for k, (m, _, n) in ys.items() if n and m < lo), key=lambda k: -ys[k][0])
    above = sorted((k for k, (m, _, n) in ys.items() if n and m > hi), key=lambda k: ys[k][0])
    edges = {k: lo - (0.8 + _ROW * i) * pad for i, k in enumerate(below)}
    edges.update({k: hi + (0.8 + _ROW * i) * pad for i, k in enumerate(above)})
    fig = _new(13, 5.2 + 0.25 * max(len(below) + len(above) - 1, 0))
    axes = fig.subplots(1, 2, sharey=True)
    clipped: list[str] = []
    style = {"colors": colors, "markers": markers, "up": up}
    panels = [_cost_panel(ax, key, groups, ys, (lo, hi), edges, style, clipped if ax is axes[0] else None,
                          legend=ax is axes[0])
              for ax, key in zip(axes, ("gradient_evaluations", _cost_key(groups)))]
    _off_scale_strips(axes, lo, hi, pad, len(below), len(above))
    if any(panels):
        renderer = _laid_out(fig)  # once for both panels: a label stays inside its own panel's frame
        for names in panels:
            _spread_labels(names, renderer)
    unit = METRIC_UNITS.get(metric, "")
    axes[0].set_ylabel(f"{metric}{' (' + unit + ')' if unit else ''}, {'higher' if up else 'lower'} is better")
    note = (f" Off the scale (hollow triangles in the grey strip at the edge, value beside them): {', '.join(clipped)}."
            if clipped else "")
    return encode(fig, f"{dataset}: quality versus cost",
                  f"{metric}, mean ± s.e. over splits and seeds, against the mean cost of a fit: gradient evaluations "
                  f"(left) and {'process CPU seconds' if _cost_key(groups) == 'cpu_time_s' else 'wall seconds'} (right; "
                  "on a shared machine wall time also measures other jobs). Dashed: the Pareto front, the methods no "
                  f"other method beats on both quality and cost.{note}")


def _cost_panel(ax: Any, key: str, groups: Mapping[str, Any], ys: Mapping[str, tuple], limits: tuple[float, float],
                edges: Mapping[str, float], style: Mapping[str, Any], clipped: list[str] | None, legend: bool) -> list:
    """One panel of :func:`quality_vs_cost`: each method's mean quality against its mean ``key`` cost,
    off-scale methods as hollow triangles at ``edges`` (appended to ``clipped`` when given), the
    Pareto front dashed; returns the label annotations (for :func:`_spread_labels`)."""
    from matplotlib.ticker import NullFormatter

    lo, hi = limits
    colors, markers, up = style["colors"], style["markers"], style["up"]
    pts: dict[str, tuple[float, float]] = {}
    names: list = []
    for label, recs in groups.items():
        y, yse, n = ys[label]
        x, xse, _ = mean_se([(r.get("cost") or {}).get(key) for r in recs])
        if n == 0 or not (x > 0):
            continue
        pts[label] = (x, y)
        if not lo <= y <= hi:  # far off the others: a hollow triangle at the edge, value beside it
            edge = edges[label]
            ax.plot([x], [edge], "v" if y < lo else "^", ms=11, mfc="white", mec=colors[label], mew=2)
            ax.annotate(f"{label}: {y:.3g} (off scale)", (x, edge), xytext=(8, 0), textcoords="offset points",
                        va="center", fontsize=9, color=colors[label], style="italic")
            if clipped is not None:
                clipped.append(f"{label} = {y:.3g}")
            continue
        ax.errorbar([x], [y], yerr=[0 if math.isnan(yse) else yse], xerr=[0 if math.isnan(xse) else xse],
                    fmt=markers[label], color=colors[label], ms=8, capsize=3)
        names.append(ax.annotate(label, (x, y), xytext=(7, 4), textcoords="offset points", fontsize=9,
                                 color=colors[label]))
    on_scale = {k: v for k, v in pts.items() if lo <= v[1] <= hi}
    labels = list(on_scale)
    front = [labels[i] for i in pareto_front([on_scale[k] for k in labels], higher_is_better=up)]
    if len(front) > 1:
        fx, fy = zip(*(on_scale[k] for k in front))
        ax.step(fx, fy, where="post", color="0.35", lw=1.2, ls="--", zorder=0, label="Pareto front")
        if legend:  # one legend: in the right panel it covered an off-scale method's value
            ax.legend(fontsize=9, loc="lower right" if up else "upper right")
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(NullFormatter())
    xs = [v[0] for v in pts.values()]
    if xs:  # whole decades, so the log axis always has labelled ticks; room for labels on the right
        ax.set_xlim(10 ** math.floor(math.log10(min(xs) / 1.5)), 10 ** math.ceil(math.log10(max(xs) * 4)))
    ax.set_xlabel(COST_AXES[key])
    ax.grid(alpha=0.3)
    return names


def _off_scale_strips(axes: Sequence[Any], lo: float, hi: float, pad: float, below: int, above: int) -> None:
    """The shared y range of :func:`quality_vs_cost`: ticks only inside ``[lo, hi]``, and the rows of
    ``below``/``above`` off-scale methods in a grey strip without ticks (their height is no value)."""
    bottom, top = lo - (1.4 + _ROW * max(below - 1, 0)) * pad, hi + (1.4 + _ROW * max(above - 1, 0)) * pad
    axes[0].set_ylim(bottom, top)
    ticks = [t for t in axes[0].get_yticks() if lo - 0.3 * pad <= t <= hi + 0.3 * pad]
    for ax in axes:
        if below:
            ax.axhspan(bottom, lo - 0.3 * pad, color="0.93", lw=0, zorder=0)
        if above:
            ax.axhspan(hi + 0.3 * pad, top, color="0.93", lw=0, zorder=0)
    axes[0].set_yticks(ticks)
    axes[0].set_ylim(bottom, top)


#: Methods worse than this many median absolute deviations from the median are off scale.
OFF_SCALE_MADS = 5

#: Distance between two rows of off-scale methods, in units of the plot's padding (8% of the range).
_ROW = 1.0


#: Where a method's label may go, in points from its marker, tried in this order: right, left,
#: above, below, then the diagonals farther out (drawn with a thin leader line).
_LABEL_OFFSETS = ((7, 3), (7, -11), ("left", 3), ("left", -11), (-8, 10), (-8, -18),
                  (16, 16), (16, -24), ("left2", 16), ("left2", -24), (24, 30), (24, -38), ("left2", 30),
                  ("left2", -38))


def _laid_out(fig: Any) -> Any:
    """A renderer of ``fig`` after its constrained layout has run, so that extents are final."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw_without_rendering()
    return renderer


def _spread_labels(labels: Sequence[Any], renderer: Any, gap_px: float = 2.0) -> None:
    """Place a panel's method labels so that none overlaps another label or any method's marker.

    Each label tries the offsets of :data:`_LABEL_OFFSETS` in turn and takes the first whose box
    is clear of the markers (a square of 12 px around each) and of the labels placed before it;
    one placed away from its marker gets a thin leader line.  When every offset collides the
    label goes up, past the labels it overlaps (it still overlaps no other label).  ``renderer``
    comes from :func:`_laid_out` of the labels' figure.
    """
    if not labels:
        return
    from matplotlib.transforms import Bbox

    ax = labels[0].axes
    px_per_point = ax.figure.dpi / 72.0
    frame = ax.get_window_extent(renderer)
    anchors = {id(t): ax.transData.transform(t.xy) for t in labels}
    markers = [Bbox.from_extents(x - 6, y - 6, x + 6, y + 6) for x, y in anchors.values()]
    placed: list = []
    for text in sorted(labels, key=lambda t: anchors[id(t)][1]):
        width = text.get_window_extent(renderer).width / px_per_point
        ax_x, ax_y = anchors[id(text)]
        box = None
        for dx, dy in _LABEL_OFFSETS:
            dx = {"left": -7 - width, "left2": -16 - width}.get(dx, dx) if isinstance(dx, str) else dx
            text.xyann = (dx, dy)
            cand = text.get_window_extent(renderer).padded(gap_px / 2)
            if (not any(cand.overlaps(b) for b in markers + placed)
                    and frame.x0 <= cand.x0 and cand.x1 <= frame.x1 and frame.y0 <= cand.y0 and cand.y1 <= frame.y1):
                box = cand
                break
        if box is None:  # crowded: first offset, moved up past the labels it overlaps
            text.xyann = _LABEL_OFFSETS[0]
            box = text.get_window_extent(renderer).padded(gap_px / 2)
            for _ in range(len(placed)):
                hits = [b for b in placed if b.overlaps(box)]
                if not hits:
                    break
                step = max(b.y1 for b in hits) - box.y0 + gap_px
                box = box.translated(0, step)
                text.xyann = (text.xyann[0], text.xyann[1] + step / px_per_point)
        if abs(text.xyann[1]) > 12 or abs(text.xyann[0]) > 8 + width:  # a leader line back to the marker
            end = (min(max(ax_x, box.x0), box.x1), min(max(ax_y, box.y0), box.y1))  # the box's nearest point
            (x0, y0), (x1, y1) = ax.transData.inverted().transform([(ax_x, ax_y), end])
            ax.plot([x0, x1], [y0, y1], color=text.get_color(), lw=0.5, zorder=1)
        placed.append(box)


def _robust_range(values: Sequence[float], *, higher_is_better: bool,
                  keep_within: float | None = None) -> tuple[float, float]:
    """A y range holding the bulk of ``values``: points worse than :data:`OFF_SCALE_MADS` median
    absolute deviations from the median (on the bad side only) are left out, so that poor fits
    (test LL -1 or -41 beside values near 0.6) do not squash the good methods into a line; they
    are drawn at the axis edge with their values.  Values within ``keep_within`` of the best
    (the verdict's :data:`~pyrobdl.report.verdicts.TOLERANCE`) always stay on the scale."""
    v = np.asarray([x for x in values if np.isfinite(x)], dtype=float)
    if v.size == 0:
        return 0.0, 1.0
    med = float(np.median(v))
    mad = float(np.median(np.abs(v - med)))
    limit = OFF_SCALE_MADS * max(mad, 1e-3 * max(abs(med), 1.0))
    tol = keep_within if keep_within is not None else 0.0
    kept = v[(v >= med - limit) | (v >= v.max() - tol)] if higher_is_better else v[(v <= med + limit) | (v <= v.min() + tol)]
    return float(kept.min()), float(kept.max())


def predictive_bands(records: Sequence[Mapping[str, Any]], dataset: str) -> Figure | None:
    """Predictive mean with ±2 sd bands (total and function-only) per method, for 1-D inputs."""
    panels = []
    for label, recs in by_method(ok_records(records)).items():
        arr = _arrays(_first(recs))
        if "band_x" in arr:
            panels.append((label, arr, _certified_at(_first(recs), arr)))
    if not panels:
        return None
    rows, cols = _grid(len(panels))
    fig = _new(3.4 * cols, 2.8 * rows)
    axes = np.atleast_1d(fig.subplots(rows, cols, sharex=True, sharey=True, squeeze=False)).ravel()
    gap = training_gap(panels[0][1]["train_x"])
    marked = False
    for ax, (label, a, checked) in zip(axes, panels):
        x, m = a["band_x"], a["band_mean"]
        if gap is not None:
            ax.axvspan(*gap, color="#f2d7a6", alpha=0.5, lw=0, label="no training data")
        ax.fill_between(x, m - 2 * a["band_sd"], m + 2 * a["band_sd"], color="C0", alpha=0.2, label="±2 sd (total)")
        ax.fill_between(x, m - 2 * a["band_sd_epistemic"], m + 2 * a["band_sd_epistemic"], color="C0", alpha=0.35,
                        label="±2 sd (function)")
        ax.plot(x, m, color="C0", lw=1.5, label="mean")
        ax.plot(a["test_x"], a["test_y"], ".", color="0.6", ms=2, label="test")
        ax.plot(a["train_x"], a["train_y"], ".", color="k", ms=3, label="train")
        if checked is not None:  # ticks on the x-axis: where the chains were certified
            ax.plot(checked, np.zeros_like(checked), "|", color="C3", ms=9, mew=1.2,
                    transform=ax.get_xaxis_transform(), label="certification inputs")
            marked = True
        ax.set_title(label, fontsize=10)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    for ax in axes[: len(panels)]:
        ax.set_xlabel("input x")
        ax.set_ylabel("target y")
        ax.tick_params(labelbottom=True, labelleft=True)
    axes[0].legend(fontsize=7, loc="best")
    if marked:
        next(ax for ax, (_, _, c) in zip(axes, panels) if c is not None).legend(fontsize=7, loc="best")
    gap_note = (f" Shaded: the gap in the training inputs ({gap[0]:.2g} to {gap[1]:.2g})." if gap is not None else "")
    cert_note = (" Red ticks on the x-axis: the held-back inputs the chains were certified at." if marked else "")
    return encode(fig, f"{dataset}: predictive bands",
                  "First split and seed of each method; inputs and targets on the original scale; bands ±2 sd of the "
                  f"predictive (total) and of the function (epistemic).{gap_note}{cert_note}")


def _certified_at(record: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> np.ndarray | None:
    """The test inputs a chain method's certification was checked at (its recorded rows of the
    held-back split), or None (no certification, or inputs not recorded as rows of it)."""
    inputs = (record.get("certification") or {}).get("inputs") or {}
    rows = inputs.get("indices")
    if inputs.get("source") != "held-back inputs" or not rows or "test_x" not in arrays:
        return None
    x = np.asarray(arrays["test_x"], dtype=float).ravel()
    rows = [int(i) for i in rows if 0 <= int(i) < x.size]
    return x[rows] if rows else None


def training_gap(train_x: np.ndarray) -> tuple[float, float] | None:
    """The widest interval between consecutive training inputs when it is much wider (over 5x)
    than their median spacing: the region with no training data; None otherwise."""
    x = np.sort(np.asarray(train_x, dtype=float).ravel())
    if x.size < 4:
        return None
    d = np.diff(x)
    i = int(np.argmax(d))
    med = float(np.median(d))
    if not d[i] > 5 * max(med, 1e-12):
        return None
    return float(x[i]), float(x[i + 1])


def calibration(records: Sequence[Mapping[str, Any]], dataset: str) -> Figure | None:
    """Observed vs nominal interval coverage (regression) or a reliability diagram (classification)."""
    groups = by_method(ok_records(records))
    colors = _colors(list(groups))
    curves: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    counts: dict[str, np.ndarray] = {}
    classification = False
    for label, recs in groups.items():
        arrs = [a for a in (_arrays(r) for r in recs) if "calib_level" in a or "reliab_confidence" in a]
        if not arrs:
            continue
        if "calib_level" in arrs[0]:
            curves[label] = (arrs[0]["calib_level"], np.mean([a["calib_observed"] for a in arrs], axis=0))
        else:
            classification = True
            if all("reliab_top_prob" in a for a in arrs):
                conf, acc, count = adaptive_reliability(np.concatenate([a["reliab_top_prob"] for a in arrs]),
                                                        np.concatenate([a["reliab_correct"] for a in arrs]))
            else:  # older records: the stored equal-width bins
                count = np.sum([a["reliab_count"] for a in arrs], axis=0).astype(float)
                with np.errstate(invalid="ignore", divide="ignore"):
                    conf = np.nansum([a["reliab_confidence"] * a["reliab_count"] for a in arrs], axis=0) / count
                    acc = np.nansum([a["reliab_accuracy"] * a["reliab_count"] for a in arrs], axis=0) / count
            counts[label] = count
            curves[label] = (conf, acc)
    if not curves:
        return None
    fig = _new(6.0, 5.0)
    ax = fig.subplots()
    ax.plot([0, 1], [0, 1], ls="--", color="0.5", lw=1, label="calibrated")
    markers = {label: MARKERS[i % len(MARKERS)] for i, label in enumerate(groups)}
    for label, (x, y) in curves.items():
        keep = np.isfinite(x) & np.isfinite(y)
        ax.plot(x[keep], y[keep], "-", marker=markers[label], ms=5, color=colors[label], label=label)
        if label in counts:  # how many test points each bin holds
            for xi, yi, ni in zip(x[keep], y[keep], np.asarray(counts[label])[keep]):
                ax.annotate(f"{int(ni)}", (xi, yi), xytext=(3, -9), textcoords="offset points", fontsize=6,
                            color=colors[label])
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    if classification:
        ax.set_xlabel("confidence (mean top-class probability in the bin)")
        ax.set_ylabel("accuracy (fraction of the bin's test points correct)")
        caption = ("Reliability diagram pooled over splits and seeds: equal-count bins of the test points by "
                   "confidence (at least 20 points a bin, at most 10 bins), each labelled with its count.")
    else:
        ax.set_xlabel("nominal central-interval level")
        ax.set_ylabel("observed coverage on the test set")
        caption = "Coverage of central predictive intervals (from PIT values), averaged over splits and seeds."
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return encode(fig, f"{dataset}: calibration", caption)


def adaptive_reliability(top_prob: np.ndarray, correct: np.ndarray, *, min_count: int = 20,
                         max_bins: int = 10) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Equal-count reliability bins: ``(mean confidence, accuracy, count)`` per bin.

    With N points, ``clip(N // min_count, 1, max_bins)`` bins of (nearly) equal count, in order
    of confidence: unlike equal-width bins, none is empty and none rests on a handful of
    points (57 test points in 15 equal-width bins zig-zag).
    """
    p = np.asarray(top_prob, dtype=float)
    c = np.asarray(correct, dtype=float)
    order = np.argsort(p, kind="stable")
    bins = int(np.clip(p.size // min_count, 1, max_bins))
    parts = np.array_split(order, bins)
    conf = np.array([p[i].mean() for i in parts])
    acc = np.array([c[i].mean() for i in parts])
    return conf, acc, np.array([i.size for i in parts], dtype=float)


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
    from ..diagnostics.arviz_adapter import read_inference_data, stored_dims

    out = []
    for label, recs in by_method(ok_records(records)).items():
        first = _first(recs)
        name = (first.get("artifacts") or {}).get("inference_data")
        if not name or "_dir" not in first or not (Path(first["_dir"]) / name).exists():
            continue
        dims = stored_dims(Path(first["_dir"]) / name)  # from the file's metadata: variational fits skipped unopened
        if "sample_stats" not in dims or dims.get("posterior", {}).get("chain", 1) < 2:
            continue
        # reads only what is drawn: the one group, lazily
        with read_inference_data(Path(first["_dir"]) / name, [g for g in ("posterior_predictive",) if g in dims]) as idata:
            out.append(_rank_figure(idata, first, dataset, label, dims["posterior"]["chain"]))
    return out


def _rank_figure(idata: Any, first: Mapping[str, Any], dataset: str, label: str, chains: int) -> Figure:
    """One method's function-space rank figure from the ``posterior_predictive`` of its open ``idata``."""
    from ..diagnostics import plots

    what = ("the top-class probability" if "class" in idata.posterior_predictive["f"].dims
            else "the network output")
    if chains > MAX_RANK_HISTOGRAMS:
        fig = plots.plot_rank_ecdf(idata, space="function", max_points=4)
        return encode(fig, f"{dataset}: {label} rank-ECDF differences (function space)",
                      f"Split {first['split']}, seed {first['seed']}, {chains} chains: for {what} at 4 test "
                      "inputs, each line is one chain's ECDF of its draws' ranks among all chains' draws minus "
                      "the uniform CDF. When every chain samples the same distribution, all lines stay inside "
                      "the shaded band with 95% probability; chains outside it are drawn in red and counted "
                      "in each panel's title.")
    fig = plots.plot_rank(idata, space="function", max_points=4)
    return encode(fig, f"{dataset}: {label} rank plots (function space)",
                  f"Split {first['split']}, seed {first['seed']}, {chains} chains: histograms of the ranks of "
                  f"{what} at 4 test inputs, one per chain; when the chains sample the same distribution "
                  "each histogram is flat up to noise.")


#: Above this many chains the rank plots are rank-ECDF differences (histograms overlap into a block).
MAX_RANK_HISTOGRAMS = 4


FIGURES: tuple[Callable[[Sequence[Mapping[str, Any]], str], Figure | list[Figure] | None], ...] = (
    quality_vs_cost, predictive_bands, calibration, elbo_curves, rank_plots,
)
