"""Build the report of a results folder: ``report.html`` (self-contained) and ``report.md``.

Only stored records are read (``cells/*/result.json`` and their ``arrays.npz``); nothing is
refitted, so a report can be rebuilt anywhere from a copied results folder.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..compare.store import atomic_write, scan_results
from . import figures as _figures
from . import tables as _tables
from .model import ReportModel, Section
from .render import to_html, to_markdown
from .verdicts import verdict

__all__ = ["ReportFiles", "build_model", "build_report"]


@dataclass(frozen=True)
class ReportFiles:
    """Paths written by :func:`build_report`.

    Attributes
    ----------
    html : pathlib.Path
    markdown : pathlib.Path
    cells : int
        Records read.
    failed : int
        Failed cells among them.
    """

    html: Path
    markdown: Path
    cells: int
    failed: int


def _overview(records: Sequence[Mapping[str, Any]], out: Path) -> tuple[list[str], Section]:
    oks = _tables.ok_records(records)
    suites = sorted({str(r.get("suite", "")) for r in records})
    fit_time = sum(float((r.get("cost") or {}).get("wall_time_s") or 0.0) for r in oks)
    cell_time = sum(float(r.get("wall_time_s") or 0.0) for r in records)
    cpu_time = sum(float(r.get("cpu_time_s") or 0.0) for r in records)
    versions = next((r.get("versions") for r in records if r.get("versions")), {}) or {}
    hosts = sorted({str(r.get("host", "")) for r in records})
    devices = sorted({str((r.get("cost") or {}).get("device", "")) for r in oks})
    summary = [
        f"Results folder: {out}",
        f"Suite(s): {', '.join(suites)}; {len(records)} cells: {len(oks)} finished, {len(records) - len(oks)} failed",
        f"Total fit time {fit_time:.1f} s; total cell time (fit, evaluation, writing) {cell_time:.1f} s, "
        f"of which {cpu_time:.1f} s of process CPU time",
        f"Machine: {', '.join(hosts)}; device(s): {', '.join(devices) or '—'}; {versions.get('platform', '')}",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items() if k != "platform"),
        f"Generated {time.strftime('%Y-%m-%d %H:%M:%S %Z')} from stored results only",
    ]
    tables = [t for t in [_tables.failures_table(records)] if t is not None]
    section = Section("Run overview", (
        "Each cell is one fit of one method on one split with one seed. Per dataset below: predictive "
        "quality and cost (mean ± standard error over splits and seeds) with published numbers where "
        "the suite names them, agreement with the reference posterior, distance to the exact posterior "
        "(conjugate models), the methods' own diagnostics, and figures. Metric definitions: "
        "docs/diagnostics.md; the suite format and this report: docs/compare.md.",
    ), tuple(tables))
    return summary, section


def _dataset_section(label: str, records: Sequence[Mapping[str, Any]]) -> Section:
    oks = _tables.ok_records(records)
    paragraphs = []
    if oks:
        r = oks[0]
        data, cfg = r.get("data") or {}, r.get("config") or {}
        ds = cfg.get("dataset") or {}
        nin = data.get("in_features")
        paragraphs.append(
            f"Data: {ds.get('source')} ({_readable(ds.get('options', {}))}); {data.get('task', '')}, "
            f"{data.get('num_train')} training and {data.get('num_test')} test points, "
            f"{nin} input{'' if nin == 1 else 's'}; splits {_listing(sorted({x['split'] for x in oks}))}, "
            f"seeds {_listing(sorted({x['seed'] for x in oks}))}."
        )
        models = {m: _model_text((x.get('config') or {}).get('model', {}), nin, data)
                  for m, recs in _tables.by_method(oks).items() for x in recs[:1]}
        counts = Counter(models.values())
        common = counts.most_common(1)[0][0]
        others = [f"{m}: {spec}" for m, spec in models.items() if spec != common]
        paragraphs.append(f"Model: {common}" + (f"; except {'; '.join(others)}." if others else "."))
        settings = _settings_lines(oks)
        if settings:
            paragraphs.append("Method settings (those not at their defaults): " + "; ".join(settings) + ".")
        refs = sorted({x["method"] for x in oks if x.get("is_reference")})
        if refs:
            _, certified = _tables.reference_status(records)
            paragraphs.append(f"Reference posterior: {', '.join(refs)} (first seed of each split); the other cells "
                              "are compared with it in the agreement table."
                              + ("" if certified else " It is NOT certified as a reference: see the agreement table."))
    tables = [_tables.main_table(records)]
    tables.append(_tables.published_table(records))
    ref_keys = _tables.reference_metric_keys(records)
    if ref_keys:
        tables.append(_tables.agreement_table(records, ref_keys))
    tables.append(_tables.exact_table(records))
    tables.extend(_tables.diagnostics_tables(records))
    tables.append(_tables.training_table(records))
    tables.append(_tables.all_metrics_table(records, agreement_keys=ref_keys, collapsed=True))
    tables.extend(_tables.gradient_variance_tables(records))
    figs = []
    for make in _figures.FIGURES:
        made = make(records, label)
        figs.extend(made if isinstance(made, list) else [made] if made is not None else [])
    return Section(f"Dataset {label}", tuple(paragraphs), tuple(t for t in tables if t is not None), tuple(figs),
                   verdict(records))


def _listing(values: Sequence[Any]) -> str:
    return ", ".join(str(v) for v in values)


def _readable(options: Mapping[str, Any]) -> str:
    """``{"noise_sd": 0.1, "num_train": 80}`` -> ``noise_sd 0.1, num_train 80``."""
    def value(v: Any) -> str:
        if isinstance(v, Mapping):
            return "(" + _readable(v) + ")"
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return f"{v:g}" if isinstance(v, float) else str(v)

    return ", ".join(f"{k} {value(v)}" for k, v in sorted(options.items())) or "defaults"


def _model_text(spec: Mapping[str, Any], in_features: Any, data: Mapping[str, Any]) -> str:
    """A model spec in words: ``tanh MLP 1 → 10 → 1; prior gaussian (scale 1); likelihood gaussian (precision 100)``."""
    hidden = list(spec.get("hidden", [50]))
    out = data.get("num_classes") or data.get("out_features") or ("classes" if data.get("task") == "classification" else 1)
    widths = " → ".join(str(w) for w in [in_features, *hidden, out])
    parts = [f"{spec.get('activation', 'relu') if hidden else 'linear'} {'MLP' if hidden else 'model'} {widths}"]
    if spec.get("bias") is False:
        parts[0] += " without biases"
    for part in ("prior", "likelihood"):
        comp = dict(spec.get(part) or {})
        if comp:
            kind = comp.pop("kind", "?")
            parts.append(f"{part} {kind}" + (f" ({_readable(comp)})" if comp else ""))
    return "; ".join(parts)


def _settings_lines(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """Per method label, its options that differ from the registry's defaults, as text."""
    try:
        from ..inference import get_method
    except ImportError:  # pragma: no cover - the registry ships with the package
        return []
    lines = []
    for label, recs in _tables.by_method(records).items():
        meth = (recs[0].get("config") or {}).get("method") or {}
        options = dict(meth.get("options") or {})
        try:
            defaults = dict(get_method(str(meth.get("name", label))).options)
        except ValueError:  # a method no longer registered: show everything
            defaults = {}
        changed = {k: v for k, v in options.items() if k not in defaults or defaults[k] != v}
        lines.append(f"{label}: {_readable(changed)}")
    return lines


def build_model(out: str | Path, title: str | None = None) -> ReportModel:
    """The report of ``out`` as a :class:`~pyrobdl.report.model.ReportModel` (no files written).

    Raises
    ------
    pyrobdl.compare.ResultsError
        If ``out`` holds no results, or a record or an artifact is corrupt (naming the file).
        Only the cells of the suite stored with the results are read
        (:func:`pyrobdl.compare.store.scan_results`); the others are listed in the summary.
    """
    out = Path(out)
    records, skipped = scan_results(out)
    summary, overview = _overview(records, out)
    if skipped:
        summary.append(f"Skipped {len(skipped)} cell folder(s): " + "; ".join(skipped[:20])
                       + ("; ..." if len(skipped) > 20 else ""))
    datasets: dict[str, list[Mapping[str, Any]]] = {}
    for r in records:
        # a reference's second run is not a method: its disagreement with the first is in every
        # dependent cell's record (the resolution), and the overview counts it
        if not r.get("is_replicate"):
            datasets.setdefault(r["dataset"], []).append(r)
    sections = [overview] + [_dataset_section(label, recs) for label, recs in datasets.items()]
    suites = sorted({str(r.get("suite", "")) for r in records})
    return ReportModel(title or f"pyrobdl report: {', '.join(suites)}", tuple(summary), tuple(sections))


def build_report(out: str | Path, *, title: str | None = None) -> ReportFiles:
    """Write ``out/report.html`` and ``out/report.md`` from the stored results in ``out``.

    Parameters
    ----------
    out : str or pathlib.Path
        A results folder written by :func:`pyrobdl.compare.run_suite`.
    title : str, optional
        Page title; default names the suite(s).

    Returns
    -------
    ReportFiles

    Raises
    ------
    pyrobdl.compare.ResultsError
        If ``out`` holds no results or a record is corrupt (naming the file).
    """
    out = Path(out)
    model = build_model(out, title)
    html_path = atomic_write(out / "report.html", lambda tmp: tmp.write_text(to_html(model), encoding="utf-8"))
    md_path = atomic_write(out / "report.md", lambda tmp: tmp.write_text(to_markdown(model), encoding="utf-8"))
    records, _ = scan_results(out)
    failed = sum(r.get("status") != "ok" for r in records)
    return ReportFiles(html_path, md_path, len(records), failed)
