r"""The verdict that opens each dataset section: which method, for what cost, and what to distrust.

Computed from stored records only (like every table), as short sentences:

* the reference posterior and whether it is certified (with the certification's own reasons);
* the best method on the headline metric (test log-likelihood when present), with its value;
* the method closest to the reference on the first agreement distance (function-space
  Wasserstein-2 when present; total variation for classification), greyed in words when the
  reference is not certified; with the reference's resolution (``reference_replicates = 2``) the
  distance in units of it and whether the closest method is resolved from the next one
  (:mod:`pyrobdl.report.resolution`);
* the cheapest method (process CPU seconds of the fit; gradient evaluations where CPU time was
  not recorded) whose headline metric is within :data:`TOLERANCE` of the best.  CPU seconds
  within the noise of the cheapest (:func:`cost_band`) are a tie, broken by gradient
  evaluations, and the sentence says "tie"; methods equal on both are named together;
* every method flagged, each with its reasons in words (see :func:`method_flags`).

Thresholds are named here so the report's words and the docs agree:
:data:`TOLERANCE`, :data:`COST_TIE`, :data:`COST_TIE_S`, :data:`LOW_COVERAGE`, :data:`BAD_PARETO_K`,
:data:`STILL_IMPROVING`, :data:`STILL_IMPROVING_NATS` (with :data:`STILL_IMPROVING_WINDOW`,
:data:`STILL_IMPROVING_BLOCKS`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from ..inference.svi import LR_SCHEDULES
from .resolution import closest_sentence, meaningful_without_certificate, resolution_sentence
from .tables import (
    HIGHER_IS_BETTER,
    by_method,
    diagnostic_value,
    mean_se,
    metric_values,
    ok_records,
    reference_extensions,
    reference_methods,
    reference_metric_keys,
    reference_rhat,
    reference_rhat_max,
    reference_status,
)

__all__ = [
    "BAD_PARETO_K",
    "COST_TIE",
    "COST_TIE_S",
    "HEADLINE_METRICS",
    "LOW_COVERAGE",
    "STILL_IMPROVING",
    "STILL_IMPROVING_BLOCKS",
    "STILL_IMPROVING_NATS",
    "STILL_IMPROVING_WINDOW",
    "Improvement",
    "TOLERANCE",
    "cheapest",
    "cost_band",
    "cost_of",
    "headline_metric",
    "beyond_chance",
    "method_flags",
    "still_improving",
    "verdict",
]

#: Headline metric of a dataset: the first of these the records have.
HEADLINE_METRICS = ("test_ll", "accuracy", "nll", "rmse")
#: "Within tolerance of the best", per headline metric (test LL: nats per test point).
TOLERANCE = {"test_ll": 0.1, "accuracy": 0.01, "nll": 0.1, "rmse": 0.05}
#: Fit costs in CPU seconds within this share of the cheapest one are a tie (see :func:`cost_band`).
COST_TIE = 0.25
#: ... or within this many CPU seconds: the CPU time of a sub-second fit moves by tenths of a
#: second between repeats on a loaded machine (docs/compare.md, "Verdict"), which once named
#: ``ensemble`` (0.62 CPU s) and once ``map`` as the cheapest of the same suite.
COST_TIE_S = 0.5
#: A 90% central predictive interval covering fewer test points than this is overconfident.
LOW_COVERAGE = 0.7
#: Pareto k-hat above this: importance weights unreliable (Vehtari et al. 2017; Yao et al. 2018).
BAD_PARETO_K = 0.7
#: "Still improving" (:func:`still_improving`) reads the trend of the objective over this final
#: share of the run's learning-rate mass (the sum of the learning rate over the steps): under a
#: decaying schedule the objective moves in proportion to the step size, so the steps where it
#: can still move are judged, not the last ones where the schedule has all but stopped it.
STILL_IMPROVING_WINDOW = 0.25
#: ... split into this many blocks of equal steps, whose means are regressed on their position
#: in learning-rate mass: the scatter of the block means about the line is the noise the rise is
#: judged against (a minibatch or Monte Carlo ELBO, averaged per block).
STILL_IMPROVING_BLOCKS = 10
#: ... flagged when the rise over the window exceeds this many of its standard errors: the
#: one-sided 1% point of Student's t with BLOCKS - 2 = 8 degrees of freedom, so an objective
#: that has stopped improving, however noisy, is flagged in about 1 run in 100.
STILL_IMPROVING = 2.896
#: ... and exceeds this many nats: on a noiseless objective (full-batch MAP) any creep is
#: significant; a rise under one nat over the window changes the fit's log density by less than
#: the smallest difference worth a mention on the log-evidence scale (Kass & Raftery 1995).
STILL_IMPROVING_NATS = 1.0


def headline_metric(records: Sequence[Mapping[str, Any]]) -> str | None:
    """The dataset's headline metric (see :data:`HEADLINE_METRICS`), or None."""
    oks = ok_records(records)
    return next((m for m in HEADLINE_METRICS if any(metric_values([r], m) for r in oks)), None)


def cost_of(recs: Sequence[Mapping[str, Any]]) -> tuple[float, str]:
    """Mean fit cost of a method's cells: CPU seconds if every cell recorded them, else gradient
    evaluations; returns ``(value, unit)``."""
    costs = [r.get("cost") or {} for r in recs]
    cpu = [c.get("cpu_time_s") for c in costs]
    if cpu and all(isinstance(v, (int, float)) and math.isfinite(v) for v in cpu):
        return float(np.mean(cpu)), "CPU s"
    return mean_se([c.get("gradient_evaluations") for c in costs])[0], "gradient evaluations"


def cost_band(recs: Sequence[Mapping[str, Any]], value: float) -> float:
    """CPU seconds above ``value`` (the cheapest method's mean cost) that are still a tie with it.

    The largest of :data:`COST_TIE` times ``value``, :data:`COST_TIE_S`, and twice the standard
    deviation of the cheapest method's CPU seconds over its cells (its repeat-to-repeat spread,
    where it has several).
    """
    cpu = [float((r.get("cost") or {}).get("cpu_time_s")) for r in recs]
    spread = 2 * float(np.std(cpu, ddof=1)) if len(cpu) > 1 else 0.0
    return max(COST_TIE * value, COST_TIE_S, spread)


def cheapest(groups: Mapping[str, Sequence[Mapping[str, Any]]]) -> tuple[list[str], list[str], str]:
    """The cheapest of ``groups`` (method -> its cells), robust to timing noise.

    Returns ``(winners, tied, unit)``: ``winners`` is the cheapest method, or several (sorted by
    name) when they tie on every measure; ``tied`` the other methods whose CPU seconds were within
    :func:`cost_band` of the cheapest, beaten on gradient evaluations; ``unit`` the cost read
    first ("CPU s", or "gradient evaluations" where some cell did not record CPU time).
    """
    costs = {m: cost_of(recs) for m, recs in groups.items()}
    grads = {m: mean_se([(r.get("cost") or {}).get("gradient_evaluations") for r in recs])[0]
             for m, recs in groups.items()}
    grads = {m: g if math.isfinite(g) else math.inf for m, g in grads.items()}
    if any(unit != "CPU s" for _, unit in costs.values()):  # exact counts: only equal ones tie
        low = min(grads.values())
        return sorted(m for m in groups if grads[m] == low), [], "gradient evaluations"
    first = min(groups, key=lambda m: costs[m][0])
    band = cost_band(groups[first], costs[first][0])
    near = [m for m in groups if costs[m][0] <= costs[first][0] + band]
    low = min(grads[m] for m in near)
    winners = sorted(m for m in near if grads[m] == low)
    return winners, sorted(set(near) - set(winners), key=lambda m: grads[m]), "CPU s"


def _cheapest_sentence(metric: str, tol: float, groups: Mapping[str, Sequence[Mapping[str, Any]]],
                       means: Mapping[str, tuple[float, float, int]]) -> str:
    winners, beaten, unit = cheapest(groups)
    costs = {m: cost_of(groups[m])[0] for m in groups}
    grads = {m: mean_se([(r.get("cost") or {}).get("gradient_evaluations") for r in groups[m]])[0] for m in groups}

    def what(m: str) -> str:
        cpu = f"{_num(costs[m])} CPU s, " if unit == "CPU s" else ""
        return f"{metric} {_num(means[m][0])}, {cpu}{_count(grads[m])} gradient evaluations per fit"

    head = f"Cheapest within {tol} of the best {metric}: "
    if len(winners) > 1:
        on = "CPU seconds within noise and equal gradient evaluations" if unit == "CPU s" else "equal gradient evaluations"
        names = f"{', '.join(winners[:-1])} and {winners[-1]}"
        return head + f"a tie between {names} ({on}; " + "; ".join(
            f"{m}: {what(m)}" for m in winners) + ")."
    line = head + f"{winners[0]} ({what(winners[0])})."
    if beaten:
        line += (f" A tie on CPU time with {', '.join(f'{m} ({_num(costs[m])} CPU s)' for m in beaten)} (CPU seconds "
                 f"within {100 * COST_TIE:.0f}%, {COST_TIE_S} s or twice the cells' spread of the cheapest are a tie), broken by gradient "
                 "evaluations (" + ", ".join(f"{m}: {_count(grads[m])}" for m in beaten) + ").")
    return line


def _count(v: float) -> str:
    return f"{v:,.0f}" if math.isfinite(v) else "—"


def _num(v: float) -> str:
    if not math.isfinite(v):
        return "—"
    return f"{v:.3g}" if abs(v) < 1e4 else f"{v:,.0f}"


def _history(record: Mapping[str, Any]) -> np.ndarray | None:
    name = (record.get("artifacts") or {}).get("arrays")
    if not name or "_dir" not in record or not (Path(record["_dir"]) / name).exists():
        return None
    with np.load(Path(record["_dir"]) / name) as data:
        return np.asarray(data["history"], dtype=float) if "history" in data.files else None


class Improvement(NamedTuple):
    """The trend of an objective at the end of its run (see :func:`still_improving`).

    Attributes
    ----------
    gain : float
        Rise of the objective over the final window, from the fitted line (nats).
    se : float
        Its standard error, from the scatter of the block means about the line.
    steps : int
        Steps in the window.
    mass : float
        The window's share of the run's learning-rate mass (:data:`STILL_IMPROVING_WINDOW`, to
        the step).
    """

    gain: float
    se: float
    steps: int
    mass: float

    @property
    def flagged(self) -> bool:
        """True when the rise is both significant and material: above :data:`STILL_IMPROVING`
        standard errors and :data:`STILL_IMPROVING_NATS` nats."""
        return self.gain > STILL_IMPROVING * self.se and self.gain > STILL_IMPROVING_NATS


def _lr_mass(steps: int, lr_schedule: str | None) -> np.ndarray:
    """Cumulative learning-rate multiplier after each step, scaled to end at 1 (the SVI loop's
    schedule, :data:`pyrobdl.inference.svi.LR_SCHEDULES`; constant when unknown)."""
    mult = LR_SCHEDULES.get(lr_schedule or "constant", LR_SCHEDULES["constant"])
    m = np.array([mult(min(t / max(steps - 1, 1), 1.0)) for t in range(steps)])
    mass = np.cumsum(m)
    return mass / mass[-1]


def still_improving(history: np.ndarray, lr_schedule: str | None = "constant") -> Improvement | None:
    """Was the objective still rising when its learning-rate schedule ended?

    The steps holding the final :data:`STILL_IMPROVING_WINDOW` of the run's learning-rate mass
    (the last quarter of the steps at a constant rate; the last half under the loop's cosine
    schedule, whose last steps run at a tenth of the rate) are cut into
    :data:`STILL_IMPROVING_BLOCKS` blocks of equal steps; the block means are fitted by a straight
    line in learning-rate mass, the rise over the window read from the line and its standard
    error from the block means' scatter about it.  A converged objective, noisy or not, has no
    rise beyond its noise; one cut short by its budget does.  The rise is measured in the
    objective's own units (nats for an ELBO or a log joint).

    Parameters
    ----------
    history : numpy.ndarray
        The objective per step, higher is better (``posterior.history``); non-finite steps are
        left out.
    lr_schedule : str, optional
        The run's ``lr_schedule`` setting ("constant", "linear" or "cosine"; None or unknown:
        constant).

    Returns
    -------
    Improvement or None
        None when the window holds fewer than 5 steps per block.
    """
    h = np.asarray(history, dtype=float).reshape(-1)
    mass = _lr_mass(h.size, lr_schedule) if h.size else h
    finite = np.isfinite(h)
    k = STILL_IMPROVING_BLOCKS
    start = int(np.searchsorted(mass, 1.0 - STILL_IMPROVING_WINDOW, side="right"))
    width = 1.0 - (float(mass[start - 1]) if start > 0 else 0.0)  # the window's learning-rate mass
    h, mass = h[start:][finite[start:]], mass[start:][finite[start:]]
    if h.size < 5 * k:
        return None
    blocks = np.array_split(np.arange(h.size), k)
    y = np.array([h[b].mean() for b in blocks])
    x = np.array([mass[b].mean() for b in blocks])
    x = x - x.mean()
    slope = float((x * y).sum() / (x * x).sum())
    resid = y - y.mean() - slope * x
    se_slope = math.sqrt(float((resid * resid).sum()) / (k - 2) / float((x * x).sum()))
    return Improvement(gain=slope * width, se=se_slope * width, steps=int(h.size), mass=width)


def beyond_chance(flagged: int, cells: int, level: float = 0.01) -> bool:
    """Are ``flagged`` of ``cells`` "still improving" flags more than converged fits would raise?

    Each cell's test raises a false alarm with probability ``level`` (the one-sided level of
    :data:`STILL_IMPROVING`); True when at least ``flagged`` alarms among ``cells`` converged
    cells have binomial probability at most ``level``: one flagged cell of one, two of 2 to 15,
    three of 16 to 44 (a method run on 20 splits is flagged from 3 cells).
    """
    tail = sum(math.comb(cells, j) * level**j * (1 - level) ** (cells - j) for j in range(flagged, cells + 1))
    return flagged > 0 and tail <= level * (1 + 1e-9)


def method_flags(recs: Sequence[Mapping[str, Any]]) -> list[str]:
    """Reasons, in words, not to trust one method's cells (empty when none).

    Read from the records: a failed certification (Markov chains), tree-depth or step-cap
    saturation, an adapted trajectory length cut by ``max_num_steps``, divergences, 90% coverage below :data:`LOW_COVERAGE`, Pareto k-hat of PSIS-LOO
    or of the variational fit above :data:`BAD_PARETO_K`, and an optimised objective (ELBO, or
    log joint of a MAP-type fit) still rising when its learning-rate schedule ended
    (:func:`still_improving`).
    """
    flags: list[str] = []
    certs = [r.get("certification") for r in recs if isinstance(r.get("certification"), Mapping)]
    failed = [c for c in certs if not c.get("passed")]
    if failed:
        reasons = sorted({str(f) for c in failed for f in c.get("failures") or []})
        flags.append(f"not certified ({len(failed)} of {len(recs)} cells): " + "; ".join(reasons[:3]))
    diags = [r.get("diagnostics") or {} for r in recs]
    depth = [f for d in diags for f in (d.get("max_tree_depth_fraction") or [])]
    if depth and max(depth) > 0:
        flags.append(f"hit the maximum tree depth on up to {100 * max(depth):.0f}% of sampling iterations")
    caps = [c for d in diags for c in (d.get("num_steps_cap_hits_sampling") or [])]
    if caps and max(caps) > 0:
        flags.append(f"leapfrog-step cap cut {sum(caps)} sampling trajectories")
    kept = [k for k in (diagnostic_value(r, "trajectory_length_kept") for r in recs) if k is not None]
    if kept and min(kept) < 1:
        flags.append(f"max_num_steps cut the adapted trajectory length to {100 * min(kept):.2g}% of what the "
                     "adaptation wanted (every draw moves less than intended; column 'trajectory kept')")
    div = [c for d in diags for c in (d.get("divergences") or [])] if all(
        isinstance(d.get("divergences"), list) for d in diags if "divergences" in d) else []
    if div and sum(div) > 0 and not failed:  # a failed certification already names divergences
        flags.append(f"{sum(div)} divergent transition{'s' if sum(div) > 1 else ''}")
    cov = mean_se(metric_values(recs, "coverage_90"))[0]
    if math.isfinite(cov) and cov < LOW_COVERAGE:
        flags.append(f"overconfident: its 90% predictive intervals cover {100 * cov:.0f}% of test points")
    for key, what in (("vi_pareto_k", "the variational fit's Pareto k̂"), ("loo_pareto_k_max", "PSIS-LOO's largest Pareto k̂")):
        k = mean_se(metric_values(recs, key))[0]
        if math.isfinite(k) and k > BAD_PARETO_K:
            flags.append(f"{what} {k:.2f} > {BAD_PARETO_K}")
    if not certs:  # an objective trace that is not a Markov chain's log density
        trends = [t for t in (still_improving(h, (r.get("settings") or {}).get("lr_schedule"))
                              for r, h in ((r, _history(r)) for r in recs) if h is not None) if t is not None]
        rising = [t for t in trends if t.flagged]
        if rising and beyond_chance(len(rising), len(trends)):
            t = max(rising, key=lambda t: t.gain / t.se if t.se > 0 else math.inf)
            cells = f" in {len(rising)} of {len(recs)} cells" if len(recs) > 1 else ""
            flags.append(f"not converged{cells}: the objective still rose by {_num(t.gain)} nats "
                         + (f"({t.gain / t.se:.1f} standard errors) " if t.se > 0 else "")
                         + f"over the last {t.steps:,} steps (the final {100 * t.mass:.0f}% of its learning-rate schedule)")
    return flags


def where_checked(records: Sequence[Mapping[str, Any]]) -> str:
    """Where the reference cells' certificates were checked, in words ("" without reference cells)."""
    infos = [(r.get("certification") or {}).get("inputs") for r in ok_records(records) if r.get("is_reference")]
    if not infos:
        return ""
    if not all(isinstance(i, Mapping) for i in infos):
        return ("Where it was checked is not recorded (records written before certification inputs were spread over "
                "the data were checked at the first inputs in file order).")
    counts = sorted({int(i.get("points", 0)) for i in infos})
    sources = sorted({str(i.get("source")) for i in infos})
    n = "/".join(str(c) for c in counts)
    if sources == ["certify_inputs"]:
        return f"Certificate checked at the {n} inputs the method was given."
    spread = " spread over the data (farthest-point sampling)" if all(i.get("indices") for i in infos) else ""
    one_d = all((r.get("data") or {}).get("in_features") == 1 for r in ok_records(records) if r.get("is_reference"))
    marked = "; they are marked on the predictive-bands figure" if one_d else ""  # drawn for 1-D inputs only
    return f"Certificate checked at {n} {' and '.join(sources)}{spread}{marked}."


def _agreement_key(records: Sequence[Mapping[str, Any]]) -> str | None:
    """The agreement metric the verdict reads: function-space W2 when present (a distance: lower is closer)."""
    # distances only: not top-1 agreement (higher is closer), not the keys in units of the resolution
    agree = [k for k in reference_metric_keys(records)
             if k != "agreement" and not HIGHER_IS_BETTER.get(k, False) and not meaningful_without_certificate(k)]
    if not agree:
        return None
    return "w2_function_to_reference" if "w2_function_to_reference" in agree else agree[0]


def verdict(records: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    """The sentences that open a dataset section (see the module docstring)."""
    oks = ok_records(records)
    groups = by_method(oks)
    if not groups:
        return ("No finished cells: nothing to compare.",)
    lines = []
    refs = reference_methods(records)
    status, certified = reference_status(records)
    if refs:
        if certified:
            largest = reference_rhat_max(records)
            lines.append(f"Reference posterior: {', '.join(refs)}, certified ({reference_rhat(records)}, ESS, "
                         "divergences and E-BFMI meet the reference criteria"
                         + (f"; largest R-hat {largest}" if largest else "") + ").")
        else:
            why = status.split("is NOT certified: ", 1)[-1].split("; agreement numbers below", 1)[0]
            resolved = resolution_sentence(records, _agreement_key(records) or "")
            lines.append(f"Reference posterior: {', '.join(refs)}, NOT certified ({why}): "
                         + (f"agreement is read in units of its resolution. {resolved}" if resolved else
                            "every agreement number below is greyed and means nothing."))
        for note in (where_checked(records), reference_extensions(records)):
            if note:
                lines[-1] += " " + note
    else:
        lines.append("No reference posterior in this suite: agreement with one is not measured.")
    metric = headline_metric(records)
    if metric is not None:
        up = HIGHER_IS_BETTER[metric]
        means = {m: mean_se(metric_values(recs, metric)) for m, recs in groups.items()}
        means = {m: v for m, v in means.items() if v[2]}
        if means:
            best = (max if up else min)(means, key=lambda m: means[m][0])
            lines.append(f"Best {metric} ({'higher' if up else 'lower'} is better): {best}, {_num(means[best][0])}.")
            tol = TOLERANCE[metric]
            near = [m for m, v in means.items() if (means[best][0] - v[0]) * (1 if up else -1) <= tol]
            lines.append(_cheapest_sentence(metric, tol, {m: groups[m] for m in near}, means))
    key = _agreement_key(records)
    if key is not None:
        dist = {m: mean_se(metric_values([r for r in recs if (r.get("reference") or {}).get("used")], key))
                for m, recs in groups.items() if m not in refs}
        dist = {m: v[0] for m, v in dist.items() if v[2]}
        if dist:
            lines.append(closest_sentence(dist, records, key, certified, _num))
    flagged = {m: method_flags(recs) for m, recs in groups.items()}
    flagged = {m: f for m, f in flagged.items() if f}
    if flagged:
        lines.extend(f"Flagged: {m} — {'; '.join(f)}." for m, f in flagged.items())
    else:
        lines.append("No method flagged (certification, sampler saturation, coverage, Pareto k̂, convergence).")
    return tuple(lines)
