"""Reading stored cell records for the report: finished cells, their metrics and diagnostics by
method, and whether the reference posterior they were evaluated against is certified.

The table builders (:mod:`pyrobdl.report.tables`), the verdicts and the figures read records
through these; every name is importable from ``pyrobdl.report.tables`` as well.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from . import resolution as _resolution
from .formatting import _finite

#: Metrics shown in the main table, in this order, when present.
KEY_METRICS = (
    "rmse", "test_ll", "test_error", "accuracy", "nll", "ece", "brier", "crps",
    "coverage_90", "pit_calibration_error",
)
#: Direction of metrics used in verdicts, in column headers (↑/↓) and in the figures.
HIGHER_IS_BETTER = {
    "rmse": False, "test_ll": True, "test_error": False, "accuracy": True, "nll": False, "ece": False,
    "brier": False, "crps": False, "pit_calibration_error": False, "loo_ll": True,
    "w2_to_reference": False, "w2_function_to_reference": False, "kl_gaussian_to_reference": False,
}
#: The diagnostics a reader must check, as (column header, where it is read from): a flattened
#: ``diagnostics`` key or a ``train_metrics`` key.  Everything else is folded.
KEY_DIAGNOSTICS = (
    ("R-hat (function) ↓", "function_space.rhat_max"),
    ("bulk ESS (function) ↑", "function_space.ess_bulk_min"),
    ("tail ESS (function) ↑", "function_space.ess_tail_min"),
    ("divergences ↓", "divergences"),
    ("tree depth hit (fraction) ↓", "max_tree_depth_fraction"),
    ("step cap hits ↓", "num_steps_cap_hits_sampling"),
    ("trajectory kept (fraction) ↑", "trajectory_length_kept"),
    ("E-BFMI ↑", "ebfmi"),
    ("PSIS-LOO max k̂ ↓", "loo_pareto_k_max"),
    ("VI k̂ ↓", "vi_pareto_k"),
)
def trajectory_length_kept(diagnostics: Mapping[str, Any]) -> float | None:
    """Share of the adapted trajectory length a sampler kept after ``max_num_steps`` cut it
    (chees: ``trajectory_length / trajectory_length_wanted``; 1.0 when not cut), or None when the
    method does not record it.  The one source of the key-diagnostics column and of the verdict's
    flag, which say what the fit's warning says."""
    wanted, kept = diagnostics.get("trajectory_length_wanted"), diagnostics.get("trajectory_length")
    if not (_finite(wanted) and _finite(kept) and wanted > 0):
        return None
    return min(1.0, float(kept) / float(wanted)) if diagnostics.get("trajectory_length_capped") else 1.0


#: Diagnostics computed from stored ones (one function each; the table and the verdict read them).
DERIVED_DIAGNOSTICS = {"trajectory_length_kept": trajectory_length_kept}


def diagnostic_value(record: Mapping[str, Any], key: str) -> Any:
    """A key diagnostic of one cell: a flattened ``diagnostics`` key, a derived one
    (:data:`DERIVED_DIAGNOSTICS`) or a ``train_metrics`` key; None when absent."""
    diags = record.get("diagnostics") or {}
    if key in DERIVED_DIAGNOSTICS:
        return DERIVED_DIAGNOSTICS[key](diags)
    return _flatten(diags).get(key, (record.get("train_metrics") or {}).get(key))


#: Metrics derived from stored ones for comparison with published numbers.
DERIVED = {"test_error": ("accuracy", lambda a: 1.0 - a)}
#: Key of ``pyrobdl.diagnostics.evaluate`` saying whether the reference was certified (1.0 / 0.0):
#: a flag about the agreement numbers, not one of them.
REFERENCE_CERTIFIED = "reference_certified"
#: Appended to a number computed against a reference that is not certified.
UNCERTIFIED_MARK = " †"
UNCERTIFIED_NOTE = "† computed against a reference posterior that is not certified: the number means nothing."
#: The same, when the cells also record the reference's resolution.
UNCERTIFIED_RESOLVED_NOTE = ("† computed against a reference posterior that is not certified: the number alone means "
                             "nothing; the columns in units of the reference's resolution (…_in_resolutions, "
                             "reference_resolved) are not greyed: they say what the reference's own precision resolves.")


def ok_records(records: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The records of finished cells."""
    return [r for r in records if r.get("status") == "ok"]


#: Groups of metrics in a cell record: test-set scores (``pyrobdl.diagnostics.evaluate``, with
#: the agreement keys when a reference was used), training-data fit (``fit_diagnostics``), and
#: the distance to an exact posterior (conjugate models).
METRIC_GROUPS = ("metrics", "train_metrics", "exact_metrics")


def _all_metrics(record: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for group in METRIC_GROUPS:
        out.update(record.get(group) or {})
    return out


def metric_values(records: Iterable[Mapping[str, Any]], key: str) -> list[float]:
    """Values of metric ``key`` (or its derivation, see :data:`DERIVED`) over ``records``."""
    out = []
    for r in records:
        m = _all_metrics(r)
        if key in m:
            out.append(m[key])
        elif key in DERIVED and DERIVED[key][0] in m and _finite(m[DERIVED[key][0]]):
            out.append(DERIVED[key][1](m[DERIVED[key][0]]))
    return out


def by_method(records: Iterable[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """Records grouped by method label, labels sorted."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for r in records:
        groups.setdefault(r["method"], []).append(r)
    return dict(sorted(groups.items()))


def _metric_keys(records: Iterable[Mapping[str, Any]], group: str | None = None) -> list[str]:
    """Metric names present in ``records`` (in one group, or in all)."""
    keys: set[str] = set()
    for r in records:
        m = (r.get(group) or {}) if group else _all_metrics(r)
        keys.update(k for k, v in m.items() if _finite(v) or v is None)
    return sorted(keys)


def reference_metric_keys(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """Metrics that only cells evaluated against a reference have (agreement with it).

    Found from the records themselves, without knowing metric names: the keys present in some
    record that used a reference and absent from every record that did not.
    """
    used = [r for r in ok_records(records) if (r.get("reference") or {}).get("used")]
    unused = [r for r in ok_records(records) if not (r.get("reference") or {}).get("used")]
    if not used or not unused:
        return []
    keys = set(_metric_keys(used, "metrics")) - set(_metric_keys(unused, "metrics")) - {REFERENCE_CERTIFIED}
    # the reference's own resolution is one number per split: said in a sentence, not a column
    return sorted(k for k in keys if not _resolution.is_resolution_value(k))


def _index(records: Iterable[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    return {str(r["id"]): r for r in records if "id" in r}


def reference_certified(record: Mapping[str, Any], index: Mapping[str, Mapping[str, Any]]) -> bool | None:
    """Whether the reference ``record`` was evaluated against is certified; None if it used none.

    Read from, in order: the record's ``reference.certified`` (written by the runner), its
    ``reference_certified`` metric, and the ``certification`` of the reference cell's own record
    in ``index`` (cell id -> record).  Older records with none of these count as not certified:
    no certification was recorded.
    """
    ref = record.get("reference") or {}
    if not ref.get("used"):
        return None
    if isinstance(ref.get("certified"), bool):
        return ref["certified"]
    flag = (record.get("metrics") or {}).get(REFERENCE_CERTIFIED)
    if _finite(flag):
        return flag == 1.0
    cert = (index.get(str(ref.get("cell"))) or {}).get("certification")
    return bool(cert.get("passed")) if isinstance(cert, Mapping) else False


def _reference_cells(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Finished reference cells: flagged ``is_reference`` or named by another cell's ``reference``."""
    named = {str((r.get("reference") or {}).get("cell")) for r in records}
    cells = {str(r["id"]): r for r in ok_records(records) if r.get("is_reference") or str(r.get("id")) in named}
    return sorted(cells.values(), key=lambda r: (r.get("split", 0), r.get("seed", 0)))


def reference_methods(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """Method labels of the reference cells among ``records``."""
    return sorted({r["method"] for r in _reference_cells(records)})


def _failures(record: Mapping[str, Any]) -> list[str]:
    cert = record.get("certification")
    if not isinstance(cert, Mapping):
        return ["no certification recorded"]
    return [str(f) for f in cert.get("failures") or []] or ([] if cert.get("passed") else ["failed"])


def reference_rhat(records: Sequence[Mapping[str, Any]]) -> str:
    """Which R-hat certified the reference cells, in words: ``"function-space R-hat"`` (split),
    ``"function-space nested R-hat (superchains of 8)"`` or ``"function-space split and nested
    R-hat (superchains of 8)"``; several, joined by "or", when the cells differ."""
    kinds = []
    for r in _reference_cells(records):
        cert = r.get("certification")
        if not isinstance(cert, Mapping):
            continue
        method = cert.get("rhat_method", "split")
        size = (cert.get("criteria") or {}).get("superchain_size")
        of = f" (superchains of {size})" if size else ""
        words = {"nested": f"nested R-hat{of}", "both": f"split and nested R-hat{of}"}.get(method, "R-hat")
        if words not in kinds:
            kinds.append(words)
    return "function-space " + (" or ".join(kinds) if kinds else "R-hat")


def reference_status(records: Sequence[Mapping[str, Any]]) -> tuple[str, bool]:
    """A sentence on whether the reference posterior is certified, and whether every cell's is.

    Returns ``("", True)`` when no cell used a reference.
    """
    oks = ok_records(records)
    index = _index(records)
    flags = [reference_certified(r, index) for r in oks]
    flags = [f for f in flags if f is not None]
    if not flags:
        return "", True
    methods = reference_methods(records)
    name = f"The reference ({', '.join(methods)})" if methods else "The reference"
    if all(flags):
        largest = reference_rhat_max(records)
        return (f"{name} is certified: {reference_rhat(records)}, bulk and tail ESS, divergences and E-BFMI "
                "meet the reference-posterior criteria (docs/diagnostics.md, Certification)"
                + (f"; largest R-hat {largest}." if largest else ".")), True
    refs = _reference_cells(records)
    bad = [r for r in refs if not isinstance(r.get("certification"), Mapping)
           or not r["certification"].get("passed")]
    if len(refs) == 1 and bad:
        why = "; ".join(_failures(bad[0]))
    elif bad:
        why = f"in {len(bad)} of {len(refs)} splits: " + " | ".join(
            f"split {r.get('split')}: {'; '.join(_failures(r))}" for r in bad)
    elif refs:
        why = "some cells were evaluated against a reference whose certification was not recorded"
    else:
        why = "no certification recorded"
    return (f"{name} is NOT certified: {why}; agreement numbers below mean nothing and are greyed "
            f"({UNCERTIFIED_MARK.strip()})."), False


def reference_extensions(records: Sequence[Mapping[str, Any]]) -> str:
    """How many draws per chain the reference needed, for references sampled until certified
    (``chees`` with ``max_num_samples``: ``diagnostics["extensions"]``); "" for the others."""
    rows = [(r.get("split"), (r.get("diagnostics") or {}).get("extensions")) for r in _reference_cells(records)]
    rows = [(split, ext) for split, ext in rows if isinstance(ext, list) and ext]
    if not rows:
        return ""
    if len(rows) == 1:
        ext = rows[0][1]
        last, before = ext[-1], ", ".join(str(e.get("num_samples")) for e in ext[:-1])
        if last.get("certified"):
            return (f"Sampled until certified: {last.get('num_samples')} draws per chain"
                    + (f" (not certified at {before})." if before else "."))
        return (f"Sampled until certified, up to max_num_samples: not certified at {last.get('num_samples')} "
                "draws per chain either.")
    return "Sampled until certified, draws per chain: " + ", ".join(
        f"split {split}: {ext[-1].get('num_samples')} "
        + ("(certified)" if ext[-1].get("certified") else "(not certified: max_num_samples)")
        for split, ext in rows) + "."


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


#: Decimals an R-hat is shown with (at least): near the 1.01 threshold, 1.009 (passes) and 1.012
#: (fails) must not both read "1.01" (``pyrobdl.diagnostics.certification.RHAT_DECIMALS``).
RHAT_DECIMALS = 3


def reference_rhat_max(records: Sequence[Mapping[str, Any]]) -> str:
    """The largest R-hat the reference cells' certifications checked, with :data:`RHAT_DECIMALS`
    decimals (``"1.004"``); "" when none was recorded."""
    values = [float(c["rhat_max"]) for c in (r.get("certification") for r in _reference_cells(records))
              if isinstance(c, Mapping) and _finite(c.get("rhat_max"))]
    return f"{max(values):.{RHAT_DECIMALS}f}" if values else ""
