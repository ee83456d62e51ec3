"""A suite's second reference run (``reference_replicates = 2``): the replicate cell, the resolution
every dependent cell is scored with, resumption and staleness, and bad configurations."""

from __future__ import annotations

import pytest

from pyrobdl.compare import ConfigError, expand, load_suite, parse_suite, read_result, run_suite, select
from pyrobdl.compare.config import tomllib
from pyrobdl.compare.grid import REPLICATE_SEED_OFFSET, parse_only
from pyrobdl.compare.store import RESULT_FILE
from pyrobdl.diagnostics import Resolution

SUITE = """
[suite]
name = "rep"
seeds = [0]
num_eval_samples = 40
inference_data = false
fit_diagnostics = false
reference = "hmc"
reference_replicates = 2

[model]
hidden = [5]
likelihood = { kind = "gaussian", precision = 50.0 }

[methods.map]
num_steps = 30

[methods.hmc]
num_warmup = 5
num_samples = 10
num_chains = 2
num_steps = 3

[datasets.gap]
source = "gap"
num_train = 20
num_test = 12
"""


def suite(text: str = SUITE, path: str = "rep.toml"):
    return parse_suite(tomllib.loads(text), path)


def test_replicates_add_one_reference_run_per_split_and_point_every_dependent_to_it():
    cells = expand(suite())
    ref, rep = "gap__hmc__split-0__seed-0", f"gap__hmc__split-0__seed-{REPLICATE_SEED_OFFSET}"
    by_id = {c.id: c for c in cells}
    assert set(by_id) == {ref, rep, "gap__map__split-0__seed-0"}
    assert by_id[ref].is_reference and not by_id[ref].is_replicate and by_id[ref].replicate is None
    assert by_id[rep].is_replicate and not by_id[rep].is_reference and by_id[rep].reference is None
    assert by_id[rep].spec["replicate_of"] == ref and by_id[rep].spec["seed"] == REPLICATE_SEED_OFFSET
    dep = by_id["gap__map__split-0__seed-0"]
    assert dep.reference == ref and dep.replicate == rep and dep.spec["reference_replicate"] == rep
    # --only a dependent brings both runs of its reference
    assert {c.id for c in select(cells, parse_only("method=map"))} == set(by_id)
    # without replicates the grid (and every hash) is what it was
    plain = {c.id: c for c in expand(suite(SUITE.replace("reference_replicates = 2\n", "")))}
    assert set(plain) == {ref, "gap__map__split-0__seed-0"}
    assert "reference_replicate" not in plain["gap__map__split-0__seed-0"].spec


def test_bad_replicate_settings_are_config_errors_naming_the_key():
    with pytest.raises(ConfigError, match="suite.reference_replicates: must be 1 .* or 2"):
        suite(SUITE.replace("reference_replicates = 2", "reference_replicates = 3"))
    with pytest.raises(ConfigError, match="suite.reference_replicates: a second reference run needs a reference"):
        suite(SUITE.replace('reference = "hmc"\n', ""))
    # a dataset that names the reference itself is enough (comparisons/uci.toml's layout)
    per_dataset = suite(SUITE.replace('reference = "hmc"\n', "") + 'reference = "hmc"\n')
    assert any(c.is_replicate for c in expand(per_dataset))
    with pytest.raises(ConfigError, match="datasets.gap.reference_replicates: must be 1"):
        suite(SUITE + 'reference_replicates = "two"\n')
    with pytest.raises(ConfigError, match=f"seed {REPLICATE_SEED_OFFSET} is the reference replicate's"):
        expand(suite(SUITE.replace("seeds = [0]", f"seeds = [0, {REPLICATE_SEED_OFFSET}]")))
    # a dataset may turn it off
    cells = expand(suite(SUITE + "reference_replicates = 1\n"))
    assert not any(c.is_replicate or c.replicate for c in cells)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_suite_with_a_replicate_scores_every_cell_in_units_of_the_resolution(tmp_path):
    path = tmp_path / "rep.toml"
    path.write_text(SUITE)
    out = tmp_path / "out"
    summary = run_suite(load_suite(path), out, progress=False)
    assert summary.success and len(summary.ok) == 3
    cells = out / "cells"
    ref = read_result(cells / "gap__hmc__split-0__seed-0" / RESULT_FILE)
    rep = read_result(cells / f"gap__hmc__split-0__seed-{REPLICATE_SEED_OFFSET}" / RESULT_FILE)
    assert rep["is_replicate"] and not rep["is_reference"] and "reference_draws.pt" in rep["checksums"]
    rec = read_result(cells / "gap__map__split-0__seed-0" / RESULT_FILE)
    res = Resolution.from_dict(rec["reference"]["resolution"])
    assert res.num_samples == 40 and res.num_points == 12 and res.w2_function > 0
    m = rec["metrics"]
    assert m["w2_function_to_reference_resolution"] == res.w2_function
    assert m["w2_function_to_reference_in_resolutions"] == pytest.approx(
        m["w2_function_to_reference"] / res.w2_function)
    assert m["reference_resolved"] in (0.0, 1.0)
    # the record names both runs' draws: a refitted replicate makes the cell stale
    assert rec["reference"]["draws_sha256"] == (ref["checksums"]["reference_draws.pt"] + "+"
                                                + rep["checksums"]["reference_draws.pt"])
    # an uncertified reference with a resolution: the warning says how agreement is read, not "means nothing"
    [sentence] = [w for w in rec["warnings"] if "is not certified" in w]
    assert "read in units of its resolution" in sentence
    # a rerun resumes everything
    again = run_suite(load_suite(path), out, progress=False)
    assert again.success and len(again.skipped) == 3 and not again.ok


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_report_reads_agreement_in_units_of_the_resolution(tmp_path):
    from pyrobdl.report.build import build_model
    from pyrobdl.report.verdicts import verdict

    path = tmp_path / "rep.toml"
    path.write_text(SUITE)
    out = tmp_path / "out"
    assert run_suite(load_suite(path), out, progress=False).success
    model = build_model(out)
    [section] = [s for s in model.sections if s.title == "Dataset gap"]
    [table] = [t for t in section.tables if t.title == "Agreement with the reference posterior"]
    # the replicate is not a method row; the resolution is a sentence, the distance in units of it a column
    assert [row[0] for row in table.rows] == ["hmc (reference)", "map"]
    assert "w2_function_to_reference_in_resolutions ↓" in table.columns
    assert not any(h.startswith("w2_function_to_reference_resolution") for h in table.columns)
    assert "Two independent runs of the reference disagree by function-space W2" in table.note
    # the columns in units of the resolution are not greyed against the uncertified reference
    col = table.columns.index("w2_function_to_reference_in_resolutions ↓")
    raw = table.columns.index("w2_function_to_reference ↓")
    assert table.cell_kinds[1][col] == "" and table.cell_kinds[1][raw] == "uncertified"
    text = " ".join(section.verdict)
    assert "NOT certified" in text and "read in units of its resolution" in text
    assert "means nothing" not in text
    rec = read_result(out / "cells" / "gap__map__split-0__seed-0" / RESULT_FILE)
    res = rec["metrics"]["w2_function_to_reference_resolution"]
    # one method: its distance in resolutions, and nothing to resolve it from
    [closest] = [line for line in verdict([r for r in _records(out)]) if line.startswith("Closest")]
    assert closest.startswith("Closest to the reference (w2_function_to_reference, lower is better): map, ")
    assert "resolutions)" in closest and res > 0


def _records(out):
    from pyrobdl.compare.store import scan_results

    return [r for r in scan_results(out)[0] if not r.get("is_replicate")]


def test_closest_sentence_says_whether_the_order_is_resolved():
    from pyrobdl.report.resolution import closest_sentence

    recs = [{"status": "ok", "dataset": "d", "split": 0, "reference": {"used": True},
             "metrics": {"w2_function_to_reference_resolution": 0.1}}]
    num = "{:.3g}".format
    near = closest_sentence({"a": 0.5, "b": 0.65}, recs, "w2_function_to_reference", False, num)
    far = closest_sentence({"a": 0.5, "b": 0.75}, recs, "w2_function_to_reference", False, num)
    assert "a, 0.5 (5 resolutions), not resolved of an uncertified reference: the next closest, b (0.65)" in near
    assert "resolved at this precision of an uncertified reference: the next closest, b (0.75)" in far
    # without a resolution: today's words
    bare = closest_sentence({"a": 0.5, "b": 0.75}, [], "w2_function_to_reference", False, num)
    assert bare.endswith("a, 0.5 (against an uncertified reference: this means nothing).")
    assert closest_sentence({"a": 0.5}, [], "w2_function_to_reference", True, num).endswith("a, 0.5.")
