"""The report, built from stored records only (hand-written here: no fitting)."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from pyrobdl.compare import ResultsError
from pyrobdl.compare.store import SCHEMA, atomic_save_npz, atomic_write_json, config_hash
from pyrobdl.report import PUBLISHED, build_model, build_report
from pyrobdl.report.tables import mean_se, published_table, reference_metric_keys

REFERENCES_MD = Path(__file__).resolve().parents[2] / "shared" / "REFERENCES.md"
CHROMIUM = Path("/usr/bin/chromium")


def record(dataset, method, split, *, metrics, status="ok", source="uci", name="boston", reference_used=False,
           published=(), diagnostics=None, history=None, band=False, calib=True, gv=None, hidden=(50,)):
    cid = f"{dataset}__{method}__split-{split}__seed-0"
    return cid, {
        "schema": SCHEMA, "id": cid, "status": status, "suite": "fake", "dataset": dataset, "method": method,
        "method_name": method, "split": split, "seed": 0, "is_reference": False, "config_hash": "h",
        "config": {"dataset": {"label": dataset, "source": source, "options": {"name": name}},
                   "model": {"hidden": list(hidden)}, "method": {"label": method, "name": method, "options": {}}},
        "published": list(published), "metrics": metrics,
        "cost": {"wall_time_s": 2.0 + split, "gradient_evaluations": 1000, "epochs": 1000.0,
                 "peak_memory_bytes": 1, "device": "cpu"},
        "reference": {"cell": None, "used": reference_used, "note": ""},
        "diagnostics": diagnostics or {}, "gradient_variance": gv, "warnings": [],
        "error": None if status == "ok" else {"type": "RuntimeError", "message": "boom", "stage": "fit",
                                               "traceback": "Traceback"},
        "artifacts": {"arrays": "arrays.npz"}, "versions": {"torch": "x"}, "host": "h", "wall_time_s": 3.0,
        "data": {"task": "regression", "num_train": 10, "num_test": 5, "in_features": 1},
    }, {
        "history": np.asarray(history if history is not None else np.linspace(-100, -10, 50)),
        **({"band_x": np.linspace(-1, 1, 20), "band_mean": np.zeros(20), "band_sd": np.ones(20),
            "band_sd_epistemic": 0.5 * np.ones(20), "train_x": np.zeros(3), "train_y": np.zeros(3),
            "test_x": np.zeros(3), "test_y": np.zeros(3)} if band else {}),
        **({"calib_level": np.array([0.5, 0.9]), "calib_observed": np.array([0.4, 0.8])} if calib else {}),
    }


def store(out: Path, items) -> Path:
    for cid, rec, arrays in items:
        rec["checksums"] = {"arrays.npz": atomic_save_npz(out / "cells" / cid / "arrays.npz", arrays)}
        rec["config_hash"] = config_hash(rec["config"])
        atomic_write_json(out / "cells" / cid / "result.json", rec)
    return out


@pytest.fixture
def results(tmp_path):
    """Two methods on boston (2 splits), one on a 1-D set, an MCMC-like reference, a failure."""
    items = [
        record("boston", "dropout", 0, metrics={"rmse": 3.0, "test_ll": -2.5, "w2": 0.1}, reference_used=True,
               published=["gal2016_mc_dropout"]),
        record("boston", "dropout", 1, metrics={"rmse": 5.0, "test_ll": -2.3, "w2": 0.3}, reference_used=True,
               published=["gal2016_mc_dropout"]),
        record("boston", "nuts", 0, metrics={"rmse": 2.9, "test_ll": -2.4},
               diagnostics={"divergences": [0, 2], "step_size": [0.1, 0.3], "function_space": {"rhat_max": 1.01}}),
        record("boston", "mean_field", 0, metrics={}, status="failed"),
        record("gap", "mean_field", 0, metrics={"rmse": 0.1, "test_ll": 0.5}, source="gap", name="", band=True,
               gv=[{"estimator": "reparameterization", "variance": 0.5}, {"estimator": "score_function", "variance": 50.0}]),
    ]
    items[-1][1].update(train_metrics={"loo_ll": 0.4, "vi_pareto_k": 0.9}, exact_metrics={"exact_sd_ratio": 0.75})
    return store(tmp_path / "res", items)


def test_mean_and_standard_error():
    m, se, n = mean_se([3.0, 5.0, float("nan")])
    assert (m, n) == (4.0, 2)
    assert se == pytest.approx(np.std([3.0, 5.0], ddof=1) / math.sqrt(2))
    assert math.isnan(mean_se([1.0])[1])


def test_report_from_stored_results(results):
    files = build_report(results)
    html = files.html.read_text()
    md = files.markdown.read_text()
    assert files.cells == 5 and files.failed == 1
    # mean ± s.e. over the two dropout splits: rmse 4 ± 1
    assert "4 ± 1" in md and "4 ± 1" in html
    # the published MC-dropout row sits beside ours, with its source
    assert "MC dropout (Gal 2016) [published; cf. dropout]" in md
    assert "2.97 ± 0.19" in md and "Gal &amp; Ghahramani 2016" in html
    # the failure is listed with its stage and message
    assert "boston__mean_field__split-0__seed-0 | failed | fit | RuntimeError: boom" in md
    # agreement with the reference: w2 only exists where a reference was used
    assert "### Agreement with the reference posterior" in md
    # MCMC diagnostics, nested ones flattened; gradient-variance rows
    assert "divergences" in md and "function_space.rhat_max" in md
    assert "score_function" in md and "Gradient variance" in md
    # training-data fit and exact-posterior tables come from their own metric groups
    assert "### Fit to the training data" in md and "vi_pareto_k | 0.9" in md
    assert "### Distance to the exact posterior" in md and "exact_sd_ratio | 0.75" in md
    # figures: quality vs cost and calibration for boston; bands, calibration, ELBO for gap
    assert len(re.findall(r'<img [^>]*src="data:image/png;base64,', html)) >= 5
    assert "gap: predictive bands" in html and "boston: quality versus cost" in html


def test_html_makes_no_external_requests(results):
    html = build_report(results).html.read_text()
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", html, re.I)
    assert not re.search(r"@import|url\(\s*['\"]?(?:https?:)?//", html, re.I)
    assert "<script" not in html.lower()
    assert "<link" not in html.lower()


def test_verdicts_against_published_numbers(results):
    from pyrobdl.compare import list_results

    recs = [r for r in list_results(results) if r["dataset"] == "boston"]
    table = published_table(recs)
    verdicts = {row[2]: row[5] for row in table.rows}
    # rmse 4 ± 1 vs 2.97 ± 0.19: worse by 1.03 < 2*sqrt(1 + 0.19^2) = 2.04 -> matches
    assert verdicts["rmse"].startswith("matches (−1")
    # test_ll -2.4 ± 0.1 vs -2.46 ± 0.06: better by 0.06 < 2*0.117 -> matches
    assert verdicts["test_ll"].startswith("matches (+0.06")
    assert reference_metric_keys(recs) == ["w2"]


def test_no_results_is_a_clear_error(tmp_path):
    with pytest.raises(ResultsError, match="no results"):
        build_report(tmp_path)
    bad = tmp_path / "cells" / "x"
    bad.mkdir(parents=True)
    (bad / "result.json").write_text("{")
    with pytest.raises(ResultsError, match=r"corrupt result file .*x/result.json"):
        build_model(tmp_path)


def test_published_rows_have_sources_and_plausible_values():
    for row in PUBLISHED.values():
        assert row.source and row.label and row.results
        for ds, metrics in row.results.items():
            assert ds in row.match
            for metric, (mean, se) in metrics.items():
                assert metric in ("rmse", "test_ll", "test_error")
                assert se is None or se >= 0


@pytest.mark.skipif(not REFERENCES_MD.exists(), reason="REFERENCES.md not found beside the repository")
def test_published_numbers_match_references_md():
    """Gal & Ghahramani 2016, Table 1 rows are copied exactly from REFERENCES.md §1."""
    text = REFERENCES_MD.read_text()
    section = text.split("### Gal & Ghahramani 2016")[1].split("###")[0]
    num = r"([−-]?\d+\.\d+)±(\d+\.\d+)"
    checked = 0
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) != 7 or cells[0] not in PUBLISHED["gal2016_mc_dropout"].results:
            continue
        values = [tuple(float(v.replace("−", "-")) for v in re.fullmatch(num, c).groups()) for c in cells[1:]]
        for col, key in enumerate(("gal2016_vi", "gal2016_pbp", "gal2016_mc_dropout")):
            res = PUBLISHED[key].results[cells[0]]
            assert res["rmse"] == values[col] and res["test_ll"] == values[3 + col]
        checked += 1
    assert checked == 9


# ----------------------------------------------------------------------------- certification

FAILURE = "function-space R-hat 1.39 > 1.01 at 48 of 50 points"


def certification(passed: bool, rhat: str = "split") -> dict:
    """A certification record as ``Certification.to_dict()`` writes it (NaN stored as null)."""
    return {"passed": passed, "failures": [] if passed else [FAILURE, "bulk ESS 7 < 400 at 50 of 50 points"],
            "rhat_method": rhat, "rhat_max": 1.003 if passed else 1.39, "ess_bulk_min": 812.0 if passed else 7.0,
            "ess_tail_min": 640.0 if passed else 9.0, "divergences": 0, "ebfmi_min": 0.9, "num_points": 50,
            "num_chains": 4, "num_draws": 500,
            "criteria": {"max_rhat": 1.01, "min_ess_bulk": 400.0, "min_ess_tail": 400.0, "max_divergences": 0,
                         "min_ebfmi": 0.2, "rhat": rhat, "superchain_size": 4}}


def with_reference(tmp_path: Path, passed: bool | None, *, runner_flag: bool = True) -> Path:
    """A nuts reference cell (certified, not, or without any certification recorded: None) and two
    dropout cells evaluated against it; ``runner_flag=False`` leaves out what the runner writes into
    the dependants (``reference.certified``, the ``reference_certified`` metric), as in older records."""
    ref_id, ref, ref_arrays = record("boston", "nuts", 0, metrics={"rmse": 2.9, "test_ll": -2.4})
    ref.update(is_reference=True, certification=None if passed is None else certification(passed))
    ref["diagnostics"] = {"certification": ref["certification"]} if passed is not None else {}
    items = [(ref_id, ref, ref_arrays)]
    for split, w2 in ((0, 0.1), (1, 0.3)):
        cid, rec, arrays = record("boston", "dropout", split, metrics={"rmse": 3.0, "test_ll": -2.5, "w2": w2},
                                  reference_used=True)
        rec["reference"]["cell"] = ref_id
        if runner_flag:
            rec["reference"]["certified"] = bool(passed)
            rec["metrics"]["reference_certified"] = float(bool(passed))
        items.append((cid, rec, arrays))
    return store(tmp_path / "res", items)


def test_report_says_when_the_reference_is_not_certified_and_greys_agreement(tmp_path):
    files = build_report(with_reference(tmp_path, passed=False))
    md, html = files.markdown.read_text(), files.html.read_text()
    agreement = md.split("### Agreement with the reference posterior")[1].split("###")[0]
    # in words, above the table, with the reference's own failures
    # report.md escapes "<" (HTML): "bulk ESS 7 &lt; 400"
    sentence = (f"The reference (nuts) is NOT certified: {FAILURE}; bulk ESS 7 &lt; 400 at 50 of 50 points; "
                "agreement numbers below mean nothing and are greyed (†).")
    assert agreement.lstrip().startswith(f"**{sentence}**")
    # the numbers are marked, with a footnote; the flag key is not an agreement number
    assert "| dropout | 2 | 0.200 ± 0.100 † |" in agreement
    assert "† computed against a reference posterior that is not certified" in agreement
    assert "reference_certified" not in agreement.split("\n\n")[2]  # the header row of the table
    # the reference's row is marked, here and in the main table
    assert "| **nuts (reference)** | 0 |" in agreement
    assert "| **nuts (reference)** | 1 |" in md
    # the same numbers in the table of all test metrics are marked too
    everything = md.split("### All test metrics")[1].split("###")[0]
    assert "| w2 | 0.200 ± 0.100 † |" in everything
    # HTML: the sentence as a warning, greyed cells, a marked row
    assert '<p class="preface warning">' in html and "NOT certified" in html
    assert '<td class="uncertified">0.200 ± 0.100 †</td>' in html
    assert '<tr class="reference"><td>nuts (reference)</td>' in html
    assert "td.uncertified" in html  # styled by the page's own CSS
    # the section says it in words as well
    assert "It is NOT certified as a reference: see the agreement table." in md


def test_report_of_a_certified_reference_marks_nothing(tmp_path):
    files = build_report(with_reference(tmp_path, passed=True))
    md, html = files.markdown.read_text(), files.html.read_text()
    agreement = md.split("### Agreement with the reference posterior")[1].split("###")[0]
    assert agreement.lstrip().startswith("The reference (nuts) is certified: function-space R-hat")
    assert "| dropout | 2 | 0.200 ± 0.100 |" in agreement
    assert "†" not in md and 'class="uncertified"' not in html and "preface warning" not in html
    assert '<p class="preface">The reference (nuts) is certified' in html
    assert "| **nuts (reference)** |" in agreement


@pytest.mark.parametrize("runner_flag", [True, False])
def test_report_of_a_reference_without_certification(tmp_path, runner_flag):
    """Records from before certifications (or a reference method without chains): not certified,
    found from the reference cell's record when the dependants carry no flag."""
    md = build_report(with_reference(tmp_path, passed=None, runner_flag=runner_flag)).markdown.read_text()
    assert ("**The reference (nuts) is NOT certified: no certification recorded; agreement numbers below mean "
            "nothing and are greyed (†).**") in md
    assert "| dropout | 2 | 0.200 ± 0.100 † |" in md


#: Appended to a *copy* of the page (the report itself has no scripts): checks that every image
#: decoded, and reports the outcome in the DOM and, for a broken image, on the console.
PROBE = """<script>
window.addEventListener("load", () => {
  const imgs = Array.from(document.images);
  const broken = imgs.filter(i => !(i.complete && i.naturalWidth > 0));
  broken.forEach(i => console.error("broken image: " + i.alt));
  const out = document.createElement("pre");
  out.id = "probe";
  out.textContent = "images=" + imgs.length + " broken=" + broken.length;
  document.body.appendChild(out);
});
</script>"""


def render_in_chromium(page: Path, tmp_path: Path) -> tuple[str, list[str]]:
    """Load ``page`` (with :data:`PROBE`) in headless Chromium; return the DOM after load and the
    console messages Chromium logged."""
    probed = tmp_path / "probed.html"
    probed.write_text(page.read_text(encoding="utf-8").replace("</body>", PROBE + "\n</body>"), encoding="utf-8")
    done = subprocess.run(
        [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}",
         "--enable-logging=stderr", "--v=0", "--virtual-time-budget=10000", "--dump-dom", probed.as_uri()],
        capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    console = [line for line in done.stderr.splitlines() if "CONSOLE" in line]
    return done.stdout, console


def check_page_in_chromium(page: Path, tmp_path: Path, min_images: int) -> str:
    dom, console = render_in_chromium(page, tmp_path)
    match = re.search(r"images=(\d+) broken=(\d+)", dom)
    assert match, "the probe did not run: the page did not finish loading"
    assert int(match.group(1)) >= min_images and match.group(2) == "0", match.group(0)
    assert console == [], console  # no console errors (nor any other console message)
    return dom


@pytest.mark.skipif(not CHROMIUM.exists(), reason="headless Chromium (/usr/bin/chromium) not installed "
                                                  "(Debian: apt-get install chromium; .ci/run does)")
def test_html_renders_in_headless_chromium(tmp_path):
    """The page loads in a real browser with no console message, every figure decodes, and the
    verdict and the certification warning are on it."""
    page = build_report(verdict_results(tmp_path)).html
    dom = check_page_in_chromium(page, tmp_path, min_images=3)
    assert "Verdict" in dom and "Cheapest within 0.1 of the best test_ll" in dom
    assert "NOT certified" in dom and 'class="preface warning"' in dom
    shutil.rmtree(tmp_path / "profile", ignore_errors=True)


QUICKSTART_RESULTS = os.environ.get("PYROBDL_QUICKSTART_RESULTS")


@pytest.mark.skipif(not CHROMIUM.exists(), reason="headless Chromium (/usr/bin/chromium) not installed")
@pytest.mark.skipif(not QUICKSTART_RESULTS, reason="set PYROBDL_QUICKSTART_RESULTS to a results folder of "
                                                   "`pyrobdl compare comparisons/quickstart.toml`")
def test_quickstart_report_renders_in_headless_chromium(tmp_path):
    """The real quickstart report (results produced beforehand; .ci/run does when asked)."""
    page = Path(str(QUICKSTART_RESULTS)) / "report.html"
    if not page.exists():
        page = build_report(str(QUICKSTART_RESULTS)).html
    dom = check_page_in_chromium(page, tmp_path, min_images=8)
    for dataset in ("blr", "gap"):
        assert f"Dataset {dataset}" in dom
    assert dom.count('class="verdict"') == 2 and "Reference posterior: chees" in dom
    assert "certified" in dom
    # 64 chains: rank-ECDF differences, not 64 overlapping histograms; two-chain samplers keep histograms
    for dataset in ("blr", "gap"):
        assert f"<h3>{dataset}: chees rank-ECDF differences (function space)</h3>" in dom
        assert f"<h3>{dataset}: nuts rank plots (function space)</h3>" in dom
    # the quality-versus-cost figure names what is off its scale; the key diagnostics say what the
    # trajectory-cut warning says
    assert "Off the scale (hollow triangles in the grey strip at the edge, value beside them)" in dom
    assert "trajectory kept (fraction)" in dom
    assert "where a good posterior is more uncertain" not in dom  # captions state what is shown


# ----------------------------------------------------------------------------- verdicts and tables
def verdict_results(tmp_path: Path, *, label_b: str = "cheap", warning: str | None = None) -> Path:
    """A nuts reference (not certified, tree depth saturated) and three methods on one dataset:
    'good' best on test LL, ``label_b`` within 0.1 of it at a fifth of the CPU time, 'bad'
    overconfident with a still-rising ELBO."""
    ref_id, ref, ref_arrays = record("toy", "nuts", 0, metrics={"test_ll": 0.60, "coverage_90": 0.9},
                                     diagnostics={"max_tree_depth_fraction": [1.0, 0.5], "divergences": [0, 0]})
    ref.update(is_reference=True, certification=certification(False))
    items = [(ref_id, ref, ref_arrays)]
    converged = -10 - 90 * np.exp(-np.arange(200) / 10)
    for method, ll, cov, cpu, hist in (("good", 0.70, 0.88, 10.0, converged), (label_b, 0.65, 0.91, 2.0, converged),
                                       ("bad", -40.0, 0.14, 5.0, np.linspace(-500, -10, 200))):
        cid, rec, arrays = record("toy", method, 0, metrics={"test_ll": ll, "coverage_90": cov, "w2": abs(ll) / 10},
                                  reference_used=True, history=hist)
        rec["reference"].update(cell=ref_id, certified=False)
        rec["cost"]["cpu_time_s"] = cpu
        if warning is not None and method == label_b:
            rec["warnings"] = [warning]
        items.append((cid, rec, arrays))
    items[0][1]["cost"]["cpu_time_s"] = 50.0
    return store(tmp_path / "res", items)


def extended_references(tmp_path: Path, splits: dict, rhat: str = "nested") -> list:
    """chees references sampled until certified (``diagnostics["extensions"]``), one per split,
    and a method evaluated against each: ``splits`` maps split -> [(draws, certified), ...]."""
    from pyrobdl.compare import list_results

    items = []
    for split, rounds in splits.items():
        ext = [{"num_samples": n, "certified": ok, "failures": [] if ok else [FAILURE]} for n, ok in rounds]
        ref_id, ref, arrays = record("toy", "chees", split, metrics={"test_ll": 0.6}, diagnostics={"extensions": ext})
        ref.update(is_reference=True, certification=certification(rounds[-1][1], rhat))
        cid, rec, arrays_b = record("toy", "map", split, metrics={"test_ll": 0.5}, reference_used=True)
        rec["reference"].update(cell=ref_id, certified=rounds[-1][1])
        items += [(ref_id, ref, arrays), (cid, rec, arrays_b)]
    return list_results(store(tmp_path / "res", items))


def test_the_verdict_says_how_many_draws_the_reference_needed(tmp_path):
    from pyrobdl.compare import list_results
    from pyrobdl.report.verdicts import verdict

    line = verdict(extended_references(tmp_path / "a", {0: [(150, False), (250, False), (350, True)]}))[0]
    assert line.startswith("Reference posterior: chees, certified (")
    assert line.endswith(" Sampled until certified: 350 draws per chain (not certified at 150, 250).")
    line = verdict(extended_references(tmp_path / "b", {0: [(300, False), (1000, False)]}))[0]
    assert line.startswith("Reference posterior: chees, NOT certified (")
    assert line.endswith("Sampled until certified, up to max_num_samples: not certified at 1000 draws per chain "
                         "either.")
    line = verdict(extended_references(tmp_path / "c", {0: [(300, True)], 1: [(300, False), (400, False)]}))[0]
    assert line.endswith("Sampled until certified, draws per chain: split 0: 300 (certified), split 1: 400 "
                         "(not certified: max_num_samples).")
    # references of a fixed length say nothing of it
    assert "Sampled" not in verdict(list_results(verdict_results(tmp_path / "d")))[0]


def test_the_report_says_which_rhat_certified_the_reference(tmp_path):
    """Split, nested (with its superchains) or both: the verdict and the agreement section name it."""
    from pyrobdl.report.tables import reference_status
    from pyrobdl.report.verdicts import verdict

    for i, (rhat, words) in enumerate([("nested", "function-space nested R-hat (superchains of 4)"),
                                       ("both", "function-space split and nested R-hat (superchains of 4)"),
                                       ("split", "function-space R-hat")]):
        records = extended_references(tmp_path / str(i), {0: [(300, True)]}, rhat)
        assert verdict(records)[0].startswith(f"Reference posterior: chees, certified ({words}, ESS, ")
        assert reference_status(records)[0].startswith(f"The reference (chees) is certified: {words}, bulk")
    # splits certified differently are both named
    mixed = extended_references(tmp_path / "m", {0: [(300, True)]}, "both") + [
        r for r in extended_references(tmp_path / "n", {1: [(300, True)]}, "nested")]
    assert verdict(mixed)[0].startswith(
        "Reference posterior: chees, certified (function-space split and nested R-hat (superchains of 4) or "
        "nested R-hat (superchains of 4), ESS, ")


def test_each_dataset_opens_with_a_verdict(tmp_path):
    files = build_report(verdict_results(tmp_path))
    md, html = files.markdown.read_text(), files.html.read_text()
    section = md.split("## Dataset toy")[1]
    verdict = section.split("**Verdict**")[1].split("\n\n")[1]
    lines = verdict.splitlines()
    assert section.lstrip().startswith("**Verdict**")  # before anything else of the section
    assert lines[0].startswith(f"- Reference posterior: nuts, NOT certified ({FAILURE}; bulk ESS 7 &lt; 400")
    assert "- Best test_ll (higher is better): good, 0.7." in lines
    # 'cheap' is within 0.1 nats of the best and costs 2 CPU s against 10
    assert ("- Cheapest within 0.1 of the best test_ll: cheap (test_ll 0.65, 2 CPU s, 1,000 gradient evaluations "
            "per fit).") in lines
    assert any(x.startswith("- Closest to the reference (w2, lower is better): cheap, 0.065 (against an uncertified")
               for x in lines)
    flags = {x.split(" — ")[0]: x for x in lines if x.startswith("- Flagged: ")}
    assert set(flags) == {"- Flagged: bad", "- Flagged: nuts"}
    assert "overconfident: its 90% predictive intervals cover 14% of test points" in flags["- Flagged: bad"]
    assert "not converged: the objective still rose by" in flags["- Flagged: bad"]
    assert "not certified (1 of 1 cells)" in flags["- Flagged: nuts"]
    assert "maximum tree depth on up to 100% of sampling iterations" in flags["- Flagged: nuts"]
    assert '<div class="verdict">' in html and "Cheapest within 0.1" in html


def test_main_table_is_ordered_marked_and_formatted(tmp_path):
    md = build_report(verdict_results(tmp_path)).markdown.read_text()
    table = md.split("### Predictive quality and cost")[1].split("\n\n")[1].splitlines()
    assert table[0].startswith("| method | cells | test_ll ↑ | coverage_90 (→ 0.9) | CPU time (s) ↓ |")
    # best first on test LL, the reference marked wherever it falls; one number format per column
    assert [r.split(" | ")[0] for r in table[2:]] == ["| good", "| cheap", "| **nuts (reference)**", "| bad"]
    assert [r.split(" | ")[2] for r in table[2:]] == ["0.700", "0.650", "0.600", "-40.000"]
    assert "±" not in "\n".join(table)  # one cell per method: no standard errors
    assert "One cell (split and seed) per method: single values, no standard error." in md


def test_long_tables_are_folded_and_key_diagnostics_come_first(tmp_path):
    files = build_report(verdict_results(tmp_path))
    html, md = files.html.read_text(), files.markdown.read_text()
    assert "<details>\n<summary>All test metrics" in html
    assert "### Key diagnostics" in md and md.index("### Key diagnostics") < md.index("### All test metrics (details)")
    key = md.split("### Key diagnostics")[1].split("\n\n")[1]
    # methods x the diagnostics to check; saturation is the worst chain's (1.0 and 0.5 -> 1)
    assert key.splitlines()[0] == "| method | divergences ↓ | tree depth hit (fraction) ↓ |"
    assert "| nuts | 0 | 1 |" in key
    assert "max_tree_depth_fraction" in md.split("### All method diagnostics (details)")[1]


def test_markdown_escapes_html(tmp_path):
    # labels can no longer carry markup (issue 15's label grammar); free text such as a fit's
    # warning still can, and must come out as text
    md = build_report(verdict_results(tmp_path, warning="<img src=x onerror=alert(1)>")).markdown.read_text()
    assert "<img" not in md, [line for line in md.splitlines() if "<img" in line]
    assert "&lt;img src=x onerror=alert(1)>" in md  # the warning is there, as text


# ----------------------------------------------------------------------------- figure helpers
def test_pareto_front():
    from pyrobdl.report.figures import pareto_front

    # (cost, quality): 0 cheap and poor, 1 dominated by 0 (dearer and worse), 2 dear and best,
    # 3 between; equal cost: the better one only
    pts = [(1.0, 0.1), (2.0, 0.0), (100.0, 0.9), (10.0, 0.5), (10.0, 0.4)]
    assert pareto_front(pts, higher_is_better=True) == [0, 3, 2]
    assert pareto_front([(c, -q) for c, q in pts], higher_is_better=False) == [0, 3, 2]


def test_adaptive_reliability_bins_have_equal_counts():
    from pyrobdl.report.figures import adaptive_reliability

    rng = np.random.default_rng(0)
    p = rng.uniform(0.5, 1.0, 57)
    correct = (rng.uniform(size=57) < p).astype(float)
    conf, acc, count = adaptive_reliability(p, correct)
    assert count.tolist() == [19.0, 19.0] or count.tolist() == [29.0, 28.0]  # 57 // 20 = 2 bins
    assert count.sum() == 57 and np.all(np.diff(conf) > 0)
    np.testing.assert_allclose((acc * count).sum(), correct.sum())
    assert len(adaptive_reliability(rng.uniform(size=1000), np.ones(1000))[2]) == 10


def test_training_gap():
    from pyrobdl.report.figures import training_gap

    x = np.concatenate([np.linspace(-1, -0.4, 30), np.linspace(0.4, 1, 30)])
    assert training_gap(x) == pytest.approx((-0.4, 0.4))
    assert training_gap(np.linspace(-1, 1, 60)) is None


def drawn_quality_vs_cost(tmp_path, monkeypatch, test_ll: dict):
    """The quality-versus-cost figure of one method per ``test_ll`` entry (all at the same cost),
    as matplotlib drew it, and the renderer that measures its texts."""
    import pyrobdl.report.figures as figures
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from pyrobdl.compare import list_results

    items = [record("toy", m, 0, metrics={"test_ll": ll}) for m, ll in test_ll.items()]
    captured = []
    monkeypatch.setattr(figures, "encode", lambda fig, title, caption="": captured.append(fig) or caption)
    figures.quality_vs_cost(list_results(store(tmp_path / "res", items)), "toy")
    [fig] = captured
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return fig, canvas.get_renderer()


def test_off_scale_methods_of_equal_cost_get_their_own_rows(tmp_path, monkeypatch):
    """Two methods far below the rest at the same cost: each triangle and its value in a row of
    its own below the data (the worst outermost), so the two texts do not overlap (they did, one
    over the other, in a quickstart report: bbvi and Gaussian dropout)."""
    fig, renderer = drawn_quality_vs_cost(tmp_path, monkeypatch,
                                          {"a": 0.70, "b": 0.65, "c": 0.60, "worse": -4.0, "worst": -40.0})
    for ax in fig.axes:
        texts = {t.get_text().split(":")[0]: t for t in ax.texts if "off scale" in t.get_text()}
        assert sorted(texts) == ["worse", "worst"]
        boxes = {k: t.get_window_extent(renderer) for k, t in texts.items()}
        assert not boxes["worse"].overlaps(boxes["worst"])
        assert boxes["worst"].y1 <= boxes["worse"].y0  # the worst below (pixel y grows upwards)
        low, _ = ax.get_ylim()
        assert all(low < t.xy[1] < 0.60 for t in texts.values())  # inside the axes, below the data


def test_labels_of_methods_close_in_cost_and_quality_do_not_overlap(tmp_path, monkeypatch):
    """Methods at nearly the same cost and quality (hmc and nuts in a quickstart report wrote
    their names over each other): the labels are moved apart, each still beside its point."""
    fig, renderer = drawn_quality_vs_cost(tmp_path, monkeypatch,
                                          {"first": 0.600, "second": 0.6001, "third": 0.5999, "apart": 0.590})
    for ax in fig.axes:
        boxes = {t.get_text(): t.get_window_extent(renderer) for t in ax.texts}
        assert {"first", "second", "third", "apart"} <= set(boxes)
        names = ["first", "second", "third"]
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                assert not boxes[a].overlaps(boxes[b]), (a, b)
        for t in ax.texts:  # beside its own point: a few label heights from it at most
            assert abs(t.xyann[1]) <= 40


def test_quality_vs_cost_draws_off_scale_methods_with_their_value(tmp_path):
    from pyrobdl.compare import list_results
    from pyrobdl.report.figures import quality_vs_cost

    fig = quality_vs_cost(list_results(verdict_results(tmp_path)), "toy")
    assert ("Off the scale (hollow triangles in the grey strip at the edge, value beside them): bad = -40."
            in fig.caption)
    assert "process CPU seconds" in fig.caption and "Pareto front" in fig.caption


def _cost_records(costs: dict) -> dict:
    """method -> cells with the given ``[(cpu_time_s, gradient_evaluations), ...]``."""
    return {m: [{"cost": {"cpu_time_s": cpu, "gradient_evaluations": g}} for cpu, g in cells]
            for m, cells in costs.items()}


def test_costs_within_noise_are_a_tie_broken_by_gradient_evaluations():
    from pyrobdl.report.verdicts import COST_TIE, COST_TIE_S, cheapest

    # the two runs of the issue: ensemble 0.62 CPU s once, map cheaper the other time
    run_a = _cost_records({"map": [(0.70, 2000)], "ensemble": [(0.62, 10000)], "chees": [(31.0, 900000)]})
    run_b = _cost_records({"map": [(0.50, 2000)], "ensemble": [(0.66, 10000)], "chees": [(29.0, 900000)]})
    assert cheapest(run_a) == (["map"], ["ensemble"], "CPU s")
    assert cheapest(run_b) == (["map"], ["ensemble"], "CPU s")
    # beyond the band the CPU time decides: 10 s against 2 s is no tie
    assert cheapest(_cost_records({"a": [(10.0, 100)], "b": [(2.0, 5000)]})) == (["b"], [], "CPU s")
    edge = 4.0 * (1 + COST_TIE)
    assert cheapest(_cost_records({"a": [(edge, 100)], "b": [(4.0, 5000)]}))[0] == ["a"]
    assert cheapest(_cost_records({"a": [(edge + 0.01, 100)], "b": [(4.0, 5000)]}))[0] == ["b"]
    assert cheapest(_cost_records({"a": [(0.1 + COST_TIE_S, 100)], "b": [(0.1, 5000)]}))[0] == ["a"]
    # a method's own spread over its cells widens the band: 1 +- 1 CPU s ties with 2.5
    spread = _cost_records({"a": [(2.5, 100)], "b": [(0.0, 5000), (2.0, 5000)]})
    assert cheapest(spread)[0] == ["a"]
    # equal on both measures: both named, in name order
    assert cheapest(_cost_records({"map": [(0.4, 2000)], "dropout": [(0.5, 2000)]})) == (
        ["dropout", "map"], [], "CPU s")
    # without CPU time, gradient evaluations alone (exact counts: only equal ones tie)
    no_cpu = {"a": [{"cost": {"gradient_evaluations": 300}}], "b": [{"cost": {"cpu_time_s": 0.1,
                                                                            "gradient_evaluations": 200}}]}
    assert cheapest(no_cpu) == (["b"], [], "gradient evaluations")


def test_the_verdict_says_tie(tmp_path):
    from pyrobdl.report.verdicts import _cheapest_sentence

    means = {"map": (0.66, math.nan, 1), "ensemble": (0.71, math.nan, 1), "dropout": (0.7, math.nan, 1)}
    line = _cheapest_sentence("test_ll", 0.1, _cost_records({"map": [(0.7, 2000)], "ensemble": [(0.62, 10000)]}), means)
    assert line == ("Cheapest within 0.1 of the best test_ll: map (test_ll 0.66, 0.7 CPU s, 2,000 gradient evaluations "
                    "per fit). A tie on CPU time with ensemble (0.62 CPU s) (CPU seconds within 25%, 0.5 s or twice the "
                    "cells' spread of the cheapest are a tie), broken by gradient evaluations (ensemble: 10,000).")
    both = _cheapest_sentence("test_ll", 0.1, _cost_records({"map": [(0.4, 2000)], "dropout": [(0.5, 2000)]}), means)
    assert both.startswith("Cheapest within 0.1 of the best test_ll: a tie between dropout and map (CPU seconds "
                           "within noise and equal gradient evaluations; dropout: test_ll 0.7, 0.5 CPU s")


TWO_RUNS = """
[suite]
name = "twice"
seeds = [0]
num_eval_samples = 20
inference_data = false

[model]
hidden = [10]
activation = "tanh"
likelihood = { kind = "gaussian", precision = 100.0 }

[methods.map]
num_steps = 400
lr = 0.01

[methods.ensemble]
num_members = 3
num_steps = 400
lr = 0.01

[methods.dropout]
num_steps = 400
lr = 0.01
p = 0.05

[datasets.gap]
source = "gap"
num_train = 40
num_test = 50
"""


@pytest.mark.slow
def test_the_same_suite_run_twice_names_the_same_cheapest(tmp_path):
    """Sub-second fits whose CPU times move with the machine's load: the verdict names the same
    cheapest method (or the same tie) in two runs."""
    from pyrobdl.compare import list_results, load_suite, run_suite
    from pyrobdl.report.verdicts import verdict

    (tmp_path / "suite.toml").write_text(TWO_RUNS)
    named = []
    for out in ("a", "b"):
        assert run_suite(load_suite(tmp_path / "suite.toml"), tmp_path / out, progress=False).success
        line = next(x for x in verdict(list_results(tmp_path / out)) if x.startswith("Cheapest within"))
        named.append(re.match(r"Cheapest within [^:]*: (a tie between )?(.*?) \(", line).group(2))
    assert named[0] == named[1], named


#: The 11-method quickstart as measured (test LL, gradient evaluations, CPU s per fit), 2026-11-27.
QUICKSTART = {
    "gap": {"bbvi": (-30.8274, 4000, 26.811), "chees": (0.7584, 5603200, 47.674), "dropout": (-1.1431, 2000, 1.66),
            "ensemble": (0.7151, 10000, 1.04), "gaussian_dropout": (-4.0814, 2000, 2.473),
            "hmc": (0.6324, 12034, 13.892), "laplace": (0.5194, 2000, 0.852), "map": (0.6644, 2000, 0.882),
            "mean_field": (-0.9844, 3000, 1.61), "nuts": (0.6456, 17567, 27.486),
            "variational_dropout": (0.3327, 3000, 5.16)},
    "blr": {"bbvi": (-0.5425, 4000, 16.583), "chees": (-0.5451, 176064, 0.902), "dropout": (-0.5615, 2000, 0.806),
            "ensemble": (-0.5533, 10000, 0.5), "gaussian_dropout": (-0.7205, 2000, 0.901),
            "hmc": (-0.5428, 11872, 8.08), "laplace": (-0.5476, 2000, 0.454), "map": (-0.5533, 2000, 0.567),
            "mean_field": (-0.5498, 3000, 0.986), "nuts": (-0.5507, 3546, 4.597),
            "variational_dropout": (-0.5503, 3000, 2.271)},
}


@pytest.mark.parametrize("dataset", sorted(QUICKSTART))
def test_quickstart_quality_vs_cost_labels_never_overlap(tmp_path, monkeypatch, dataset):
    """The 11 methods of the quickstart: no label overlaps another label or a marker, every label
    is inside its panel, and the poor methods sit off scale with their values instead of
    stretching the axis (on gap, test LL -0.98 to -30.8 beside 0.33 to 0.76)."""
    import pyrobdl.report.figures as figures
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from pyrobdl.compare import list_results

    items = []
    for method, (ll, grads, cpu) in QUICKSTART[dataset].items():
        cid, rec, arrays = record(dataset, method, 0, metrics={"test_ll": ll})
        rec["cost"].update(gradient_evaluations=grads, cpu_time_s=cpu)
        items.append((cid, rec, arrays))
    captured = []
    monkeypatch.setattr(figures, "encode", lambda fig, title, caption="": captured.append((fig, caption)))
    figures.quality_vs_cost(list_results(store(tmp_path / "res", items)), dataset)
    [(fig, caption)] = captured
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    off = {"gap": ["bbvi", "dropout", "gaussian_dropout", "mean_field"], "blr": ["gaussian_dropout"]}[dataset]
    assert caption.endswith(", ".join(f"{m} = {QUICKSTART[dataset][m][0]:.3g}" for m in off) + ".")
    for ax in fig.axes:
        names = [t for t in ax.texts if "off scale" not in t.get_text()]
        assert sorted(t.get_text() for t in names) == sorted(set(QUICKSTART[dataset]) - set(off))
        boxes = [t.get_window_extent(renderer) for t in ax.texts]
        for i, a in enumerate(boxes):
            assert all(not a.overlaps(b) for b in boxes[i + 1:]), ax.texts[i].get_text()
        frame = ax.get_window_extent(renderer)
        for t, box in zip(names, boxes):
            assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
            for other in names:
                x, y = ax.transData.transform(other.xy)
                assert not (box.x0 < x < box.x1 and box.y0 < y < box.y1), (t.get_text(), "covers", other.get_text())
        low, high = ax.get_ylim()
        assert high - low < 1.0  # not stretched by the poor methods
