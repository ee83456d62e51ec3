r"""Tables of the report, computed from stored cell records only.

Every number is a mean over the finished cells of a (dataset, method) pair — splits and seeds —
with its standard error :math:`s/\sqrt n` (sample standard deviation :math:`s`, ``ddof = 1``;
shown as "—" for a single cell).  Published numbers come from
:data:`pyrobdl.compare.published.PUBLISHED`.

Verdict against a published number (for metrics with a direction): with :math:`d` the
difference in our favour and :math:`\sigma = \sqrt{se_{ours}^2 + se_{pub}^2}`, "beats" when
:math:`d > 2\sigma`, "matches" when :math:`|d| \le 2\sigma`, "misses" when :math:`d < -2\sigma`.

A number computed against a reference posterior that is not certified (see
:func:`reference_certified`) is marked with :data:`UNCERTIFIED_MARK` and the cell kind
``"uncertified"`` (greyed in the HTML), and the agreement table says so in words above it.

Reading the records (finished cells, metrics by method, the reference's certification) lives in
:mod:`pyrobdl.report.records`; its names are importable from here too.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from ..compare.published import PUBLISHED, PublishedRow
from .formatting import _finite, decimals_for, fmt, fmt_column, fmt_fixed, fmt_mean_se, mean_se
from .model import Table
from . import resolution as _resolution
from .records import (DERIVED, HIGHER_IS_BETTER, KEY_DIAGNOSTICS, KEY_METRICS, METRIC_GROUPS, REFERENCE_CERTIFIED,
                      RHAT_DECIMALS, UNCERTIFIED_MARK, UNCERTIFIED_NOTE, UNCERTIFIED_RESOLVED_NOTE, _flatten, _index,
                      _metric_keys, by_method, diagnostic_value, metric_values, ok_records, reference_certified,
                      reference_methods, reference_metric_keys, reference_rhat_max, reference_status)
# re-exported: read through ``pyrobdl.report.tables`` by the verdicts and older callers
from .records import (DERIVED_DIAGNOSTICS, reference_extensions, reference_rhat,  # noqa: F401
                      trajectory_length_kept)

__all__ = [
    "HIGHER_IS_BETTER",
    "KEY_DIAGNOSTICS",
    "KEY_METRICS",
    "METRIC_GROUPS",
    "REFERENCE_CERTIFIED",
    "UNCERTIFIED_MARK",
    "agreement_table",
    "all_metrics_table",
    "arrow",
    "cost_rows",
    "decimals_for",
    "diagnostics_table",
    "diagnostics_tables",
    "exact_table",
    "failures_table",
    "fmt",
    "fmt_column",
    "fmt_fixed",
    "gradient_variance_tables",
    "main_table",
    "mean_se",
    "metric_values",
    "published_rows",
    "published_table",
    "reference_certified",
    "reference_rhat_max",
    "reference_metric_keys",
    "reference_methods",
    "reference_status",
    "training_table",
]

def arrow(metric: str) -> str:
    """``metric`` with ↑ (higher is better) or ↓ (lower is better) when its direction is known."""
    if metric in HIGHER_IS_BETTER:
        return f"{metric} {'↑' if HIGHER_IS_BETTER[metric] else '↓'}"
    if metric.endswith(_resolution.IN_RESOLUTIONS):  # a distance in units of the resolution
        return f"{metric} ↓"
    if metric.startswith("coverage_"):
        return f"{metric} (→ {int(metric.split('_')[1]) / 100:g})"
    return metric


def se_note(groups: Mapping[str, Sequence[Any]]) -> str:
    """How to read the numbers: a single cell each, or mean ± s.e. over how many."""
    counts = sorted({len(v) for v in groups.values()})
    if counts == [1]:
        return "One cell (split and seed) per method: single values, no standard error."
    return (f"Mean over splits and seeds ({', '.join(map(str, counts))} cells per method) ± standard error "
            "where there is more than one cell.")


def _flag(text: str, uncertified: bool) -> tuple[str, str]:
    return (text + UNCERTIFIED_MARK, "uncertified") if uncertified and text != "—" else (text, "")


def _uncertified(recs: Sequence[Mapping[str, Any]], key: str, index: Mapping[str, Mapping[str, Any]]) -> bool:
    """Some record with metric ``key`` was computed against a reference that is not certified (the
    keys read in units of the reference's resolution are meaningful all the same)."""
    if _resolution.meaningful_without_certificate(key):
        return False
    return any(reference_certified(r, index) is False for r in recs if key in (r.get("metrics") or {}))


def _matches(row: PublishedRow, record: Mapping[str, Any]) -> str | None:
    cfg = record.get("config") or {}
    ds = cfg.get("dataset") or {}
    values = {"source": ds.get("source"), "name": str((ds.get("options") or {}).get("name", "")).lower(),
              "hidden": list((cfg.get("model") or {}).get("hidden", [50]))}
    for key, items in row.match.items():
        if all(values.get(k) == (v.lower() if isinstance(v, str) and k == "name" else v) for k, v in items.items()):
            return key
    return None


def published_rows(records: Sequence[Mapping[str, Any]]) -> list[tuple[PublishedRow, str, list[str]]]:
    """Published rows that apply to ``records``: (row, its dataset key, our method labels naming it)."""
    found: dict[str, tuple[PublishedRow, str, list[str]]] = {}
    for r in records:
        for key in r.get("published") or []:
            row = PUBLISHED.get(key)
            ds_key = _matches(row, r) if row else None
            if row is None or ds_key is None:
                continue
            entry = found.setdefault(key, (row, ds_key, []))
            if r["method"] not in entry[2]:
                entry[2].append(r["method"])
    return list(found.values())


def cost_rows(records: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, tuple[float, float, int]]]:
    """Per method: mean/s.e./n of wall time and gradient evaluations of the fits."""
    out = {}
    for label, recs in by_method(ok_records(records)).items():
        costs = [r.get("cost") or {} for r in recs]
        out[label] = {
            "wall_time_s": mean_se([c.get("wall_time_s") for c in costs]),
            "gradient_evaluations": mean_se([c.get("gradient_evaluations") for c in costs]),
        }
    return out


def main_table(records: Sequence[Mapping[str, Any]]) -> Table:
    """Methods x key metrics and cost, best first on the headline metric, the reference marked;
    applicable published rows below."""
    oks = ok_records(records)
    present = set(_metric_keys(oks)) | {k for k, (src, _) in DERIVED.items() if src in _metric_keys(oks)}
    keys = [k for k in KEY_METRICS if k in present]
    groups = by_method(oks)
    headline = next((k for k in ("test_ll", "accuracy", "nll", "rmse") if k in keys), None)
    if headline is not None:
        sign = -1.0 if HIGHER_IS_BETTER[headline] else 1.0

        def order(label: str) -> tuple[float, str]:
            m = mean_se(metric_values(groups[label], headline))[0]
            return (sign * m if _finite(m) else math.inf, label)

        groups = {label: groups[label] for label in sorted(groups, key=order)}
    columns = ("method", "cells", *[arrow(k) for k in keys], "CPU time (s) ↓", "wall time (s)", "gradient evals ↓",
               "device")
    refs = set(reference_methods(records))
    stats = {k: [mean_se(metric_values(recs, k)) for recs in groups.values()] for k in keys}
    cost_keys = ("cpu_time_s", "wall_time_s", "gradient_evaluations")
    for c in cost_keys:
        stats[c] = [mean_se([(r.get("cost") or {}).get(c) for r in recs]) for recs in groups.values()]
    cells = {k: fmt_column(v) for k, v in stats.items()}
    cells["gradient_evaluations"] = [fmt_fixed(m, 0) if _finite(m) else "—" for m, _, _ in stats["gradient_evaluations"]]
    rows, kinds = [], []
    for i, (label, recs) in enumerate(groups.items()):
        devices = sorted({str((r.get("cost") or {}).get("device", "")) for r in recs})
        rows.append((f"{label} (reference)" if label in refs else label, str(len(recs)),
                     *[cells[k][i] for k in keys], *[cells[c][i] for c in cost_keys], ", ".join(devices)))
        kinds.append("reference" if label in refs else "ours")
    pubs = published_rows(oks)
    for row, ds_key, labels in pubs:
        vals = row.results.get(ds_key, {})
        pcells = [fmt_mean_se(*vals[k]) if k in vals else "" for k in keys]
        rows.append((f"{row.label} [published; cf. {', '.join(labels)}]", "", *pcells, "", "", "", ""))
        kinds.append("published")
    note = (f"Best first on {headline}. " if headline else "") + se_note(groups) + (
        " ↑ higher is better, ↓ lower is better; coverage_p should be near p. CPU time: the fit's process "
        "CPU seconds (wall time on a shared machine also measures other jobs).")
    if pubs:
        note += " Published rows: " + "; ".join(f"{row.label}: {row.source}" for row, _, _ in pubs)
    return Table("Predictive quality and cost", columns, tuple(rows), tuple(kinds), note)


def published_table(records: Sequence[Mapping[str, Any]]) -> Table | None:
    """Each method against the published rows its suite entry names, metric by metric."""
    oks = ok_records(records)
    groups = by_method(oks)
    rows = []
    for row, ds_key, labels in published_rows(oks):
        for label in labels:
            for metric, (pub, pub_se) in row.results.get(ds_key, {}).items():
                mean, se, n = mean_se(metric_values(groups[label], metric))
                if n == 0:
                    continue
                verdict = ""
                if metric in HIGHER_IS_BETTER:
                    d = (mean - pub) * (1 if HIGHER_IS_BETTER[metric] else -1)
                    sigma = 2 * math.sqrt((se if _finite(se) else 0.0) ** 2 + (pub_se or 0.0) ** 2)
                    verdict = "beats" if d > sigma else "matches" if d >= -sigma else "misses"
                    verdict += f" ({'+' if d >= 0 else '−'}{fmt(abs(d), 2)})"
                rows.append((label, row.label, metric, fmt_mean_se(mean, se), fmt_mean_se(pub, pub_se if pub_se is not None else math.nan), verdict))
    if not rows:
        return None
    return Table(
        "Against published numbers",
        ("method", "published", "metric", "ours", "published value", "verdict (difference in our favour)"),
        tuple(rows), tuple("ours" for _ in rows),
        "beats / matches / misses: difference in our favour above / within / below 2 combined standard "
        "errors. Published settings may differ from the suite's (see docs/results.md).",
    )


def all_metrics_table(records: Sequence[Mapping[str, Any]], keys: Sequence[str] | None = None,
                      title: str = "All test metrics", note: str = "", group: str = "metrics",
                      agreement_keys: Iterable[str] = (), collapsed: bool = False) -> Table | None:
    """Metrics (rows) x methods (columns), mean ± s.e.; ``keys`` restricts the metrics of ``group``.

    Cells of ``agreement_keys`` computed against a reference that is not certified are marked
    (:data:`UNCERTIFIED_MARK`, cell kind ``"uncertified"``).
    """
    oks = ok_records(records)
    groups = by_method(oks)
    keys = list(keys) if keys is not None else _metric_keys(oks, group)
    if not keys or not groups:
        return None
    flagged, index = set(agreement_keys), _index(records)
    rows, cell_kinds = [], []
    for k in keys:
        texts = fmt_column([mean_se(metric_values(recs, k)) for recs in groups.values()])
        cells = [_flag(t, k in flagged and _uncertified(recs, k, index)) for t, recs in zip(texts, groups.values())]
        rows.append((arrow(k), *[c for c, _ in cells]))
        cell_kinds.append(("", *[kind for _, kind in cells]))
    note = (note + " " if note else "") + se_note(groups)
    if any("uncertified" in kinds for kinds in cell_kinds):
        note += " " + UNCERTIFIED_NOTE
    return Table(title, ("metric", *groups), tuple(rows), (), note, tuple(cell_kinds), collapsed=collapsed)


def agreement_table(records: Sequence[Mapping[str, Any]], keys: Sequence[str] | None = None) -> Table | None:
    """Agreement with the reference posterior: methods (rows) x agreement metrics, mean ± s.e.

    Only cells that were evaluated against a reference count.  A sentence above the table says
    whether the reference is certified (:func:`reference_status`); numbers computed against an
    uncertified reference are marked and greyed; the reference's own row is marked.
    """
    keys = list(keys) if keys is not None else reference_metric_keys(records)
    oks = ok_records(records)
    if not keys or not oks:
        return None
    index = _index(records)
    refs = set(reference_methods(records))
    rows, kinds, cell_kinds = [], [], []
    kept = {label: [r for r in recs if (r.get("reference") or {}).get("used")] for label, recs in by_method(oks).items()}
    kept = {label: used for label, used in kept.items() if used or label in refs}
    # closest first on the first key
    kept = dict(sorted(kept.items(), key=lambda kv: (kv[0] not in refs,
                                                     _sort_value(mean_se(metric_values(kv[1], keys[0]))[0]), kv[0])))
    texts = {k: fmt_column([mean_se(metric_values(used, k)) for used in kept.values()]) for k in keys}
    for i, (label, used) in enumerate(kept.items()):
        cells = [_flag(texts[k][i], _uncertified(used, k, index)) for k in keys]
        rows.append((f"{label} (reference)" if label in refs else label, str(len(used)), *[c for c, _ in cells]))
        kinds.append("reference" if label in refs else "ours")
        cell_kinds.append(("", "", *[kind for _, kind in cells]))
    if not rows:
        return None
    preface, certified = reference_status(records)
    note = ("Metrics computed against the reference's predictive (see docs/diagnostics.md); mean ± s.e. over "
            "the cells evaluated against it (the reference method's own row: its other seeds, the noise floor).")
    primary = next((k for k in ("w2_function_to_reference", "total_variation") if k in keys), keys[0])
    sentence = _resolution.resolution_sentence(records, primary)
    if sentence:
        note += " " + sentence
    if not certified:
        note += " " + (UNCERTIFIED_RESOLVED_NOTE if sentence else UNCERTIFIED_NOTE)
        if sentence:
            preface = preface.replace("agreement numbers below mean nothing and are greyed",
                                      "agreement numbers below alone mean nothing and are greyed; those in units of "
                                      "its resolution are not")
    return Table("Agreement with the reference posterior", ("method", "cells", *[arrow(k) for k in keys]),
                 tuple(rows), tuple(kinds),
                 note, tuple(cell_kinds), preface, "" if certified else "warning")


def _sort_value(v: float) -> float:
    return v if _finite(v) else math.inf


def exact_table(records: Sequence[Mapping[str, Any]]) -> Table | None:
    """Distance to the exact posterior (conjugate models only)."""
    keys = _metric_keys(ok_records(records), "exact_metrics")
    return all_metrics_table(
        records, keys, "Distance to the exact posterior",
        "Bayesian linear regression has a closed-form posterior. exact_mean_error_sd: RMS error of the "
        "posterior mean in exact-posterior sds; exact_sd_ratio: sd / exact sd (1 is exact); "
        "exact_mf_sd_ratio: sd / optimal mean-field sd (1 is the mean-field optimum); exact_kl: KL of a "
        "Gaussian fitted to the draws from the exact posterior.",
    ) if keys else None


def training_table(records: Sequence[Mapping[str, Any]]) -> Table | None:
    """Fit to the training data (PSIS-LOO, the VI Pareto k̂), when the suite computed it."""
    keys = _metric_keys(ok_records(records), "train_metrics")
    return all_metrics_table(
        records, keys, "Fit to the training data", group="train_metrics",
        note="pyrobdl.diagnostics.fit_diagnostics on the training split: loo_ll is the PSIS-LOO log "
             "predictive density per point (original scale); Pareto k̂ above 0.7 flags unreliable "
             "importance weights; vi_pareto_k is Yao et al. (2018)'s check of a variational fit.",
    ) if keys else None


def _summarise(value: Any) -> float | None:
    if _finite(value):
        return float(value)
    if isinstance(value, (list, tuple)):
        flat = np.asarray([v for v in np.ravel(np.asarray(value, dtype=object)) if _finite(v)], dtype=float)
        return float(flat.mean()) if flat.size else None
    return None


def _diagnostic_rows(recs: Sequence[Mapping[str, Any]]) -> list[tuple[str, str, str, str]]:
    """(name, mean ± s.e., range, cells) of every diagnostic of one method's cells."""
    flat = [{k: v for k, v in _flatten(r.get("diagnostics") or {}).items()
             if not k.startswith("certification.criteria.")} for r in recs]
    rows = []
    for key in sorted({k for f in flat for k in f}):
        vals = [f[key] for f in flat if key in f]
        summ = [s for s in (_summarise(v) for v in vals) if s is not None]
        if not summ:
            continue
        entries = np.asarray([x for v in vals for x in np.ravel(np.asarray(v, dtype=object)) if _finite(x)], dtype=float)
        m, se, n = mean_se(summ)
        rows.append((key, fmt_mean_se(m, se), f"[{fmt(entries.min())}, {fmt(entries.max())}]", str(n)))
    return rows


def _is_rhat(key: str) -> bool:
    return "rhat" in key.rsplit(".", 1)[-1]


def _rhat_column(stats: Sequence[tuple[float, float, int]]) -> list[str]:
    """Cells of an R-hat column: :func:`fmt_column`'s, with at least :data:`RHAT_DECIMALS` decimals."""
    d = decimals_for([m for m, _, _ in stats], [se for _, se, n in stats if n > 1])
    d = RHAT_DECIMALS if d is None else max(d, RHAT_DECIMALS)
    return ["—" if not _finite(m) else fmt_fixed(m, d) + (f" ± {fmt_fixed(se, d)}" if n > 1 and _finite(se) else "")
            for m, se, n in stats]


def diagnostics_tables(records: Sequence[Mapping[str, Any]]) -> list[Table]:
    """Method diagnostics: the key ones (:data:`KEY_DIAGNOSTICS`: function-space R-hat and ESS,
    divergences, tree-depth and step-cap saturation, E-BFMI, Pareto k̂) as methods x columns,
    and every diagnostic each method reports, folded.

    Per-chain lists are averaged over chains, then over cells; ranges run over cells and chains.
    For the saturation and divergence columns the worst chain is shown instead (a single
    saturated chain matters).
    """
    groups = by_method(ok_records(records))
    worst = {"divergences", "max_tree_depth_fraction", "num_steps_cap_hits_sampling"}
    present = []
    for header, key in KEY_DIAGNOSTICS:
        if any(diagnostic_value(r, key) is not None for recs in groups.values() for r in recs):
            present.append((header, key))
    columns = []
    for _, key in present:
        stats = []
        for recs in groups.values():
            vals = []
            for r in recs:
                v = diagnostic_value(r, key)
                flat = [x for x in np.ravel(np.asarray(v, dtype=object)) if _finite(x)] if v is not None else []
                if flat:
                    vals.append(max(flat) if key in worst else float(np.mean(flat)))
            stats.append(mean_se(vals))
        columns.append(fmt_column(stats) if not _is_rhat(key) else _rhat_column(stats))  # one format per column
    key_rows = [(label, *cells) for label, *cells in zip(groups, *columns) if any(c != "—" for c in cells)]
    other_rows = [(label, *row) for label, recs in groups.items() for row in _diagnostic_rows(recs)]
    tables = []
    if key_rows and present:
        tables.append(Table(
            "Key diagnostics", ("method", *[h for h, _ in present]), tuple(key_rows), (),
            "Certification wants function-space R-hat below 1.01, bulk and tail ESS of at least 400, no divergences "
            "and E-BFMI above 0.2 (docs/diagnostics.md); any tree-depth or step-cap hit shortens trajectories, and so does "
            "a trajectory length cut by max_num_steps (trajectory kept below 1: the share of the adapted length "
            "kept); "
            "Pareto k̂ above 0.7 makes importance weights unreliable. Divergences and saturation: worst chain."))
    if other_rows:
        tables.append(Table("All method diagnostics", ("method", "diagnostic", "mean (± s.e. over cells)", "range", "cells"),
                            tuple(other_rows), (), "As reported by each method in posterior.diagnostics "
                            "(per-chain lists averaged).", collapsed=True))
    return tables


def diagnostics_table(records: Sequence[Mapping[str, Any]]) -> Table | None:
    """Every method diagnostic in one table, per method (see :func:`diagnostics_tables`)."""
    rows = tuple((label, *row) for label, recs in by_method(ok_records(records)).items()
                 for row in _diagnostic_rows(recs))
    if not rows:
        return None
    return Table("Method diagnostics", ("method", "diagnostic", "mean (± s.e. over cells)", "range", "cells"), rows, (),
                 "As reported by each method in posterior.diagnostics (per-chain lists averaged).")


def gradient_variance_tables(records: Sequence[Mapping[str, Any]]) -> list[Table]:
    """One table per stored gradient-variance result (a list of row dicts or a dict of dicts)."""
    tables = []
    for r in ok_records(records):
        gv = r.get("gradient_variance")
        if not gv:
            continue
        if isinstance(gv, Mapping) and "rows" in gv and isinstance(gv["rows"], list):
            gv = gv["rows"]
        if isinstance(gv, Mapping) and all(isinstance(v, Mapping) for v in gv.values()):
            gv = [{"name": k, **v} for k, v in gv.items()]
        side = _gradient_variance_side_by_side(gv)
        if side is not None:
            cols, rows, note = side
            tables.append(Table(f"Gradient variance — {r['method']} (split {r['split']}, seed {r['seed']})",
                                cols, rows, note=note))
        elif isinstance(gv, list) and gv and all(isinstance(x, Mapping) for x in gv):
            cols = list(dict.fromkeys(k for row in gv for k in row))
            rows = tuple(tuple(fmt(row.get(c)) if not isinstance(row.get(c), str) else row.get(c) for c in cols) for row in gv)
            tables.append(Table(f"Gradient variance — {r['method']} (split {r['split']}, seed {r['seed']})",
                                tuple(cols), rows))
        else:
            tables.append(Table(f"Gradient variance — {r['method']}", ("value",), ((str(gv)[:2000],),)))
    return tables


def _gradient_variance_side_by_side(gv: Any) -> tuple[tuple[str, ...], tuple[tuple[str, ...], ...], str] | None:
    """Rows of ``GradientVarianceTable.to_records()`` pivoted: one row per parameter group, one
    column per estimator, each cell "variance (x ratio to reparameterization)"; None when the
    records do not have that shape."""
    if not (isinstance(gv, list) and gv and all(isinstance(x, Mapping) and "estimator" in x and "variance" in x
                                                  for x in gv)):
        return None
    estimators = list(dict.fromkeys(str(x["estimator"]) for x in gv))
    groups = list(dict.fromkeys(str(x.get("group", "")) for x in gv))
    cell = {(str(x["estimator"]), str(x.get("group", ""))): x for x in gv}
    ref = "reparameterization" if "reparameterization" in estimators else None
    rows = []
    for g in groups:
        d = next((cell[(e, g)].get("num_elements") for e in estimators if (e, g) in cell), None)
        cells = [g or "all", fmt(d) if d is not None else "—"]
        for e in estimators:
            x = cell.get((e, g))
            if x is None:
                cells.append("—")
                continue
            text = fmt(x["variance"], 3)
            den = cell.get((ref, g), {}).get("variance") if ref is not None else None
            if ref is not None and e != ref and _finite(den) and den > 0 and _finite(x["variance"]):
                text += f" (×{fmt(x['variance'] / den, 3)})"
            cells.append(text)
        rows.append(tuple(cells))
    note = ("Per parameter group: mean per-element variance of one gradient draw"
            + (", and in brackets its ratio to the reparameterization estimator's." if ref else "."))
    return ("group", "d", *estimators), tuple(rows), note


def failures_table(records: Sequence[Mapping[str, Any]]) -> Table | None:
    """Failed cells and warnings of finished ones."""
    rows, kinds = [], []
    for r in records:
        if r.get("status") != "ok":
            err = r.get("error") or {}
            rows.append((r["id"], "failed", str(err.get("stage", "")), f"{err.get('type', '')}: {err.get('message', '')}"[:500]))
            kinds.append("failed")
        for w in r.get("warnings") or []:
            rows.append((r["id"], "warning", "", str(w)[:500]))
            kinds.append("")
    if not rows:
        return None
    # warnings alone are folded (each dataset's verdict already names what they say); failures are not
    return Table("Failures and warnings", ("cell", "status", "stage", "message"), tuple(rows), tuple(kinds),
                 "Full tracebacks are in each cell's result.json.", collapsed="failed" not in kinds)
