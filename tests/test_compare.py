"""The comparison suite: config validation, grid, sources, runner (resume, failures, executors).

Fits use tiny settings; what is tested is the machinery (records, resume, isolation), not the
quality of the fits.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import pyrobdl
from pyrobdl.compare import (
    ConfigError,
    FuturesExecutor,
    ResultsError,
    expand,
    load_suite,
    parse_only,
    parse_suite,
    read_result,
    run_suite,
    select,
)
from pyrobdl.compare.config import tomllib
from pyrobdl.compare.grid import build_model, check_plan
from pyrobdl.compare.sources import SOURCES, load_dataset
from pyrobdl.compare.store import RESULT_FILE, WriteError, atomic_write
from pyrobdl.inference import registry
from pyrobdl.inference.registry import Method

REPO = Path(__file__).resolve().parents[1]

TINY = """
[suite]
name = "tiny"
seeds = [0]
num_eval_samples = 20
inference_data = false

[model]
hidden = [5]
likelihood = { kind = "gaussian", precision = 50.0 }

[methods.mean_field]
num_steps = 30

[methods.map]
num_steps = 30

[datasets.gap]
source = "gap"
num_train = 20
num_test = 30
splits = [0, 1]
"""


def write(tmp_path: Path, text: str, name: str = "suite.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def raw(text: str) -> dict:
    return tomllib.loads(textwrap.dedent(text))


def errors_of(text: str, path: str = "/x/my_suite.toml") -> str:
    with pytest.raises(ConfigError) as info:
        parse_suite(raw(text), path)
    return str(info.value)


# ----------------------------------------------------------------------------- config


def test_tiny_suite_parses():
    suite = parse_suite(raw(TINY), "/x/tiny.toml")
    assert [m.label for m in suite.methods] == ["mean_field", "map"]
    assert suite.datasets[0].splits == (0, 1)
    assert suite.datasets[0].options["num_train"] == 20
    assert suite.datasets[0].options["noise_sd"] == 0.1  # source default filled in


def test_unknown_method_option_names_key_file_and_valid_keys():
    msg = errors_of(TINY.replace("num_steps = 30\n\n[methods.map]", "num_step = 30\n\n[methods.map]"))
    assert "/x/my_suite.toml" in msg
    assert "methods.mean_field.num_step" in msg
    assert "'num_steps'" in msg and "'lr'" in msg  # the valid keys are listed


@pytest.mark.parametrize(
    "change, key, valid",
    [
        (("[suite]", "[suite]\nseed = [1]"), "suite.seed", "'seeds'"),
        (("[suite]", "[plots]\nx = 1\n[suite]"), "plots", "'datasets'"),
        (("source = \"gap\"", "source = \"gapp\""), "datasets.gap.source", "'gap'"),
        (("num_train = 20", "num_trian = 20"), "datasets.gap.num_trian", "'num_train'"),
        (("hidden = [5]", "hiden = [5]"), "model.hiden", "'hidden'"),
        (("kind = \"gaussian\", precision", "kind = \"gausian\", precision"), "model.likelihood.kind", "'gaussian'"),
        (("precision = 50.0", "precison = 50.0"), "model.likelihood.precison", "'precision'"),
        (("[methods.map]", "[methods.mapp]"), "methods.mapp", "'map'"),
    ],
)
def test_typos_are_named_with_valid_keys(change, key, valid):
    msg = errors_of(TINY.replace(*change))
    assert key in msg and valid in msg and "/x/my_suite.toml" in msg


def test_all_problems_are_reported_together():
    text = TINY.replace("num_steps = 30", "num_stepz = 30").replace("splits = [0, 1]", "splits = [-1]")
    msg = errors_of(text)
    assert "3 problems" in msg  # two method typos and one bad split list
    assert "datasets.gap.splits" in msg


@pytest.mark.parametrize(
    "change, fragment",
    [
        (("num_steps = 30", 'num_steps = "30"'), "must be a number"),
        (("seeds = [0]", "seeds = []"), "suite.seeds"),
        (("splits = [0, 1]", 'splits = "some"'), "datasets.gap.splits"),
        (("[datasets.gap]", "[datasets.gap]\nmethods = [\"nope\"]"), "unknown method label 'nope'"),
        (("[datasets.gap]", "[datasets.gap]\nreference = \"nuts\""), "datasets.gap.reference"),
        (("[datasets.gap]", "[datasets.gap]\noverrides = { nope = { lr = 0.1 } }"), "datasets.gap.overrides.nope"),
        (("hidden = [5]", "hidden = [0]"), "model.hidden"),
        (("hidden = [5]", 'hidden = [5]\nactivation = "gelu"'), "model.activation"),
    ],
)
def test_invalid_values(change, fragment):
    assert fragment in errors_of(TINY.replace(*change))


def test_invalid_toml_and_missing_file(tmp_path):
    bad = write(tmp_path, "[suite\nname = 1")
    with pytest.raises(ConfigError, match="not valid TOML") as info:
        load_suite(bad)
    assert str(bad) in str(info.value)
    with pytest.raises(FileNotFoundError, match="nope.toml"):
        load_suite(tmp_path / "nope.toml")


def test_every_prior_and_likelihood_is_configurable():
    from pyrobdl.compare.config import model_components

    comps = model_components()
    assert {"gaussian"} <= set(comps["prior"])
    assert {"gaussian", "gaussian_learned_precision", "categorical"} <= set(comps["likelihood"])


def test_plan_check_runs_method_model_checks_before_anything(tmp_path):
    """MAP refuses an improper prior: the plan check says so, naming dataset and method."""
    from pyrobdl.compare.config import model_components

    improper = [k for k, cls in model_components()["prior"].items() if not getattr(cls, "proper", True)]
    if not improper:
        pytest.skip("no improper prior registered")
    text = TINY.replace("[methods.map]", f'[methods.map]\nmodel = {{ prior = {{ kind = "{improper[0]}" }} }}')
    suite = parse_suite(raw(text), tmp_path / "s.toml")
    cells = expand(suite)
    with pytest.raises(ConfigError, match="datasets.gap x methods.map"):
        check_plan(suite, cells, None)


def test_precision_in_original_units_is_standardised():
    data = load_dataset("blr", SOURCES["blr"].options, 0, None, REPO)
    model = build_model({"hidden": [], "likelihood": {"kind": "gaussian", "precision": 4.0,
                                                     "precision_units": "original"}}, data)
    assert model.likelihood.precision == pytest.approx(4.0 * data.y_std**2)
    with pytest.raises(ValueError, match="classification"):
        build_model({"likelihood": {"kind": "categorical"}}, data)


# ----------------------------------------------------------------------------- grid


def test_grid_ids_references_and_hashes():
    text = TINY.replace("[suite]", '[suite]\nreference = "map"').replace("seeds = [0]", "seeds = [0, 1]")
    suite = parse_suite(raw(text), "/x/s.toml")
    cells = expand(suite)
    assert len(cells) == 2 * 2 * 2  # splits x methods x seeds
    assert len({c.id for c in cells}) == len(cells)
    refs = [c for c in cells if c.is_reference]
    assert [c.id for c in refs] == ["gap__map__split-0__seed-0", "gap__map__split-1__seed-0"]
    # every other cell points at the reference of its own split (the map seed-1 cells included)
    for c in cells:
        if not c.is_reference:
            assert c.reference == f"gap__map__split-{c.split}__seed-0"
    # full method options are resolved from the registry
    mf = next(c for c in cells if c.method == "mean_field")
    assert set(mf.spec["method"]["options"]) == set(pyrobdl.inference.get_method("mean_field").options)
    again = expand(parse_suite(raw(text), "/x/s.toml"))
    assert [c.config_hash for c in cells] == [c.config_hash for c in again]
    changed = expand(parse_suite(raw(text.replace("num_steps = 30", "num_steps = 31", 1)), "/x/s.toml"))
    assert {c.id for c, d in zip(cells, changed) if c.config_hash != d.config_hash} == {
        c.id for c in cells if c.method == "mean_field"}


def test_dataset_overrides_set_options_and_model_of_one_method():
    over = 'overrides = { map = { lr = 0.05, model = { prior = { kind = "gaussian", scale = 3.0 } } } }'
    cells = expand(parse_suite(raw(TINY.replace('source = "gap"', 'source = "gap"\n' + over)), "/x/s.toml"))
    by_method = {c.method: c.spec for c in cells if c.split == 0}
    assert by_method["map"]["method"]["options"]["lr"] == 0.05
    assert by_method["map"]["model"]["prior"] == {"kind": "gaussian", "scale": 3.0}
    assert by_method["map"]["model"]["hidden"] == [5]  # the rest of the model is kept
    assert by_method["mean_field"]["method"]["options"]["lr"] == 0.01
    assert "prior" not in by_method["mean_field"]["model"]
    msg = errors_of(TINY.replace('source = "gap"', 'source = "gap"\noverrides = { map = { lrr = 0.05 } }'))
    assert "datasets.gap.overrides.map.lrr" in msg and "'lr'" in msg


def test_only_filter_adds_needed_references():
    text = TINY.replace("[suite]", '[suite]\nreference = "map"')
    cells = expand(parse_suite(raw(text), "/x/s.toml"))
    chosen = select(cells, parse_only("method=mean_field,split=1"))
    assert {c.id for c in chosen} == {"gap__map__split-1__seed-0", "gap__mean_field__split-1__seed-0"}
    assert len(select(cells, parse_only("split=0,split=1"))) == len(cells)
    with pytest.raises(ValueError, match="valid keys"):
        parse_only("methd=map")
    with pytest.raises(ValueError, match="valid values of method"):
        select(cells, parse_only("method=nuts"))
    with pytest.raises(ValueError, match="key=value"):
        parse_only("map")


# ----------------------------------------------------------------------------- sources


def test_file_source_csv_and_npz(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 3))
    y = x @ np.array([1.0, -2.0, 0.5]) + 3.0
    lines = ["a,b,target,c"] + [f"{r[0]},{r[1]},{t},{r[2]}" for r, t in zip(x, y)]
    (tmp_path / "d.csv").write_text("\n".join(lines))
    opts = {**SOURCES["file"].options, "path": "d.csv", "target": "target", "test_fraction": 0.2}
    data = load_dataset("file", opts, 3, None, tmp_path)
    assert data.x_train.shape == (40, 3) and data.x_test.shape == (10, 3)
    # targets are standardised with training statistics and map back exactly
    back = data.unstandardize_y(data.y_train).numpy()
    assert np.isin(np.round(back, 4), np.round(y, 4).astype(np.float32)).all()
    labels = (y > 3).astype(int)
    np.savez(tmp_path / "c.npz", x=x, y=labels)
    copts = {**opts, "path": "c.npz", "task": "classification"}
    cdata = load_dataset("file", copts, 0, None, tmp_path)
    assert cdata.num_classes == 2 and cdata.y_train.dtype.is_floating_point is False
    with pytest.raises(ValueError, match="no column named 'nope'"):
        load_dataset("file", {**opts, "target": "nope"}, 0, None, tmp_path)
    msg = errors_of('[methods.map]\n[datasets.mine]\nsource = "file"\npath = "missing.csv"\n', str(tmp_path / "s.toml"))
    assert "datasets.mine.path" in msg and "datasets.mine.target" in msg


# ----------------------------------------------------------------------------- runner


def run(suite_path: Path, out: Path, **kwargs):
    return run_suite(load_suite(suite_path), out, progress=False, **kwargs)


def test_run_writes_records_and_resumes(tmp_path):
    path = write(tmp_path, TINY.replace("[suite]", '[suite]\nreference = "map"'))
    out = tmp_path / "out"
    summary = run(path, out)
    assert summary.success and len(summary.ok) == 4 and not summary.skipped
    rec = read_result(out / "cells" / "gap__mean_field__split-1__seed-0" / RESULT_FILE)
    assert rec["status"] == "ok" and rec["reference"]["used"] is True
    # MAP holds no chains, so no certification: agreement with it is flagged as meaningless
    assert rec["reference"]["certified"] is False and rec["certification"] is None
    assert any("not certified (no certification recorded)" in w for w in rec["warnings"])
    assert {"wall_time_s", "gradient_evaluations", "device"} <= set(rec["cost"])
    assert rec["config"]["method"]["options"]["num_steps"] == 30
    assert {"torch", "pyro", "arviz", "pyrobdl"} <= set(rec["versions"])
    assert rec["metrics"] and all(isinstance(k, str) for k in rec["metrics"])
    with np.load(out / "cells" / rec["id"] / "arrays.npz") as arrays:
        assert arrays["history"].shape == (30,)
        assert arrays["band_x"].ndim == 1 and arrays["calib_observed"].shape == arrays["calib_level"].shape
    assert (out / "cells" / "gap__map__split-0__seed-0" / "reference_draws.pt").exists()
    assert (out / "suite.toml").read_text() == path.read_text()
    again = run(path, out)
    assert again.success and not again.ok and len(again.skipped) == 4


def test_mcmc_certification_is_recorded_and_an_uncertified_reference_flagged(tmp_path):
    """A short HMC reference: its record holds its (failed) certification and fit's warning, as
    text; the cells evaluated against it say the agreement means nothing (nothing escapes as an
    error: pytest turns warnings into errors)."""
    text = (TINY.replace("[suite]", '[suite]\nreference = "hmc"').replace("splits = [0, 1]", "splits = [0]")
            + "\n[methods.hmc]\nnum_warmup = 5\nnum_samples = 8\nnum_chains = 2\nnum_steps = 3\n")
    out = tmp_path / "out"
    assert run(write(tmp_path, text), out).success
    ref = read_result(out / "cells" / "gap__hmc__split-0__seed-0" / RESULT_FILE)
    assert ref["is_reference"] and ref["certification"]["passed"] is False
    # certified on held-back inputs (all 30 test points: fewer than 50): the runner hands them to every
    # method that takes certify_inputs, so the fit's own certification is the record's
    assert ref["certification"]["num_points"] == 30 and ref["diagnostics"]["certification"] == ref["certification"]
    assert ref["settings"]["certify_inputs"]["points"] == 30
    assert ref["certification"]["num_chains"] == 2 and ref["certification"]["num_draws"] == 8
    # one warning, the fit's, saying where it was certified (the runner adds none of its own for it)
    [warning] = [w for w in ref["warnings"] if "not certified" in w]
    assert warning.startswith("fit: UserWarning: the hmc posterior is not certified as a reference: ")
    assert "(at the 30 certify_inputs). Agreement with it means nothing" in warning, warning
    rec = read_result(out / "cells" / "gap__mean_field__split-0__seed-0" / RESULT_FILE)
    assert rec["certification"] is None  # an SVI method holds no chains
    assert rec["reference"] == {"cell": ref["id"], "used": True, "note": "", "certified": False,
                                "draws_sha256": ref["checksums"]["reference_draws.pt"]}
    assert rec["metrics"]["reference_certified"] == 0.0 and "w2_to_reference" in rec["metrics"]
    [sentence] = [w for w in rec["warnings"] if "not certified" in w]
    assert sentence.startswith(f"the reference {ref['id']} is not certified ({ref['certification']['failures'][0]}")
    assert sentence.endswith("agreement with it means nothing")


def test_training_diagnostics_are_a_separate_metric_group(tmp_path):
    path = write(tmp_path, TINY.replace("inference_data = false", "inference_data = true\nfit_diagnostics = true")
                 .replace("splits = [0, 1]", "splits = [0]"))
    run(path, tmp_path / "out")
    rec = read_result(tmp_path / "out" / "cells" / "gap__mean_field__split-0__seed-0" / RESULT_FILE)
    assert "loo_ll" in rec["train_metrics"] and "loo_ll" not in rec["metrics"]
    assert rec["exact_metrics"] == {}  # not a conjugate model
    assert rec["artifacts"]["inference_data"] == "inference_data.nc"
    from pyrobdl.diagnostics.arviz_adapter import az

    idata = az.from_netcdf(str(tmp_path / "out" / "cells" / rec["id"] / "inference_data.nc"))
    assert "posterior" in idata.groups() and "log_likelihood" in idata.groups()


def test_resume_after_simulated_crash(tmp_path):
    """A cell killed before its record was renamed into place is rerun; the others are not."""
    path = write(tmp_path, TINY)
    out = tmp_path / "out"
    run(path, out)
    victim = out / "cells" / "gap__map__split-1__seed-0"
    (victim / RESULT_FILE).unlink()
    # a torn write of a run whose process is gone (pids are below 2**22 on Linux)
    (victim / ".result.json.tmp-r0123456789ab-999999999-abcdef01").write_text('{"schema": "trunc')
    mtimes = {p: p.stat().st_mtime_ns for p in out.glob(f"cells/*/{RESULT_FILE}")}
    summary = run(path, out)
    assert summary.ok == ("gap__map__split-1__seed-0",) and len(summary.skipped) == 3
    assert not list(out.glob("cells/*/.*.tmp-*"))
    assert all(p.stat().st_mtime_ns == t for p, t in mtimes.items())


def test_corrupt_and_stale_records_stop_the_run_or_are_set_aside(tmp_path):
    path = write(tmp_path, TINY)
    out = tmp_path / "out"
    run(path, out)
    bad = out / "cells" / "gap__map__split-0__seed-0" / RESULT_FILE
    bad.write_text("{ not json")
    with pytest.raises(ResultsError, match="corrupt result file .*gap__map__split-0__seed-0"):
        run(path, out)
    summary = run(path, out, rerun_invalid=True)
    assert summary.ok == ("gap__map__split-0__seed-0",)
    assert list(bad.parent.glob("result.json.invalid-*"))
    changed = write(tmp_path, TINY.replace("num_steps = 30\n\n[datasets", "num_steps = 31\n\n[datasets"))
    with pytest.raises(ResultsError, match="different configuration"):
        run(changed, out)


@pytest.fixture
def failing_method(monkeypatch):
    """A registered method that raises on split 1 only (the data seed shows in y_train)."""
    base = pyrobdl.inference.get_method("map")
    first = {}

    def run_fn(model, x, y, options, progress):
        key = float(y[0])
        first.setdefault("split0", key)
        if key != first["split0"]:
            raise RuntimeError("boom on purpose")
        return base.run(model, x, y, {**options, "num_steps": 5}, progress)

    monkeypatch.setitem(registry._REGISTRY, "flaky", Method("flaky", dict(base.options), run_fn, "test only"))
    return "flaky"


def test_failing_cell_is_recorded_and_others_continue(tmp_path, failing_method):
    path = write(tmp_path, TINY + "\n[methods.flaky]\nnum_steps = 5\n")
    out = tmp_path / "out"
    summary = run(path, out)
    assert not summary.success
    assert summary.failed == ("gap__flaky__split-1__seed-0",)
    assert len(summary.ok) == 5
    rec = read_result(out / "cells" / "gap__flaky__split-1__seed-0" / RESULT_FILE)
    assert rec["status"] == "failed" and rec["error"]["stage"] == "fit"
    assert "boom on purpose" in rec["error"]["message"] and "Traceback" in rec["error"]["traceback"]


def test_failed_reference_leaves_cells_incomplete_then_resumes(tmp_path, failing_method):
    text = TINY.replace("[suite]", '[suite]\nreference = "flaky"') + "\n[methods.flaky]\nnum_steps = 5\n"
    path = write(tmp_path, text)
    out = tmp_path / "out"
    summary = run(path, out)
    assert "gap__flaky__split-1__seed-0" in summary.failed
    rec = read_result(out / "cells" / "gap__map__split-1__seed-0" / RESULT_FILE)
    assert rec["status"] == "ok" and rec["reference"]["used"] is False and "unavailable" in rec["reference"]["note"]
    # the reference fails again on resume, so its dependants stay incomplete and are retried
    summary = run(path, out)
    assert set(summary.ok) == {"gap__map__split-1__seed-0", "gap__mean_field__split-1__seed-0"}


def test_futures_executor_gives_the_same_records(tmp_path):
    path = write(tmp_path, TINY)
    with cf.ThreadPoolExecutor(max_workers=1) as pool:
        summary = run(path, tmp_path / "a", executor=FuturesExecutor(pool))
    run(path, tmp_path / "b")
    assert summary.success and len(summary.ok) == 4
    for cell in (tmp_path / "a" / "cells").iterdir():
        a = read_result(cell / RESULT_FILE)
        b = read_result(tmp_path / "b" / "cells" / cell.name / RESULT_FILE)
        assert a["metrics"] == b["metrics"]  # same seeds, same numbers
    with pytest.raises(TypeError, match="concurrent.futures.Executor"):
        FuturesExecutor(object())


from pyrobdl.compare import runner as _runner_module  # noqa: E402

_REAL_COMPUTE = _runner_module.compute_cell
_KILLER = "gap__map__split-0__seed-0"


def _dies_on_one_cell(task):
    """compute_cell, except that the worker process running one cell dies (as if killed)."""
    if task.cell.id == _KILLER:
        os._exit(1)
    return _REAL_COMPUTE(task)


def test_a_dead_process_pool_worker_fails_its_cells_and_they_rerun(tmp_path, monkeypatch):
    """A worker process that dies breaks a ProcessPoolExecutor: the cell it ran and every cell
    not finished yet are recorded failed (stage ``worker``) instead of the run crashing; the
    finished cells are kept, and rerunning the same command completes the rest."""
    import multiprocessing

    path = write(tmp_path, TINY)
    out = tmp_path / "out"
    monkeypatch.setattr(_runner_module, "compute_cell", _dies_on_one_cell)
    with cf.ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("fork")) as pool:
        summary = run(path, out, executor=FuturesExecutor(pool))
    assert _KILLER in summary.failed and not summary.success
    assert len(summary.ok) + len(summary.failed) == 4
    for cid in summary.failed:
        rec = read_result(out / "cells" / cid / RESULT_FILE)
        assert rec["status"] == "failed" and rec["error"]["stage"] == "worker"
        assert "worker process of the pool died" in rec["error"]["message"]
    monkeypatch.setattr(_runner_module, "compute_cell", _REAL_COMPUTE)
    again = run(path, out)
    assert set(again.ok) == set(summary.failed) and again.success


def test_atomic_write_leaves_old_file_on_error(tmp_path):
    target = tmp_path / "f.json"
    target.write_text("old")

    def broken(tmp: Path) -> None:
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(WriteError, match=f"cannot write {target}: disk full"):
        atomic_write(target, broken)
    assert target.read_text() == "old" and list(tmp_path.iterdir()) == [target]


SLEEPY = """
import sys, time
import pyrobdl
from pyrobdl.inference import registry
from pyrobdl.inference.registry import Method
base = pyrobdl.inference.get_method("map")
def run_fn(model, x, y, options, progress):
    if {sleep} and float(y[0]) != {y0}:
        time.sleep(60)
    return base.run(model, x, y, options, progress)
registry.register_method(Method("sleepy", dict(base.options), run_fn, "test only"))
from pyrobdl.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_kill_dash_nine_mid_cell_loses_only_that_cell(tmp_path):
    """A real SIGKILL while the second cell is fitting: a rerun keeps the first, reruns the second."""
    path = write(tmp_path, TINY.replace("[methods.mean_field]\nnum_steps = 30\n\n[methods.map]\nnum_steps = 30",
                                        "[methods.sleepy]\nnum_steps = 5"))
    from pyrobdl.datasets import gap_regression

    y0 = float(gap_regression(20, 30, seed=0).y_train[0])
    out = tmp_path / "out"
    script = tmp_path / "sleepy.py"
    script.write_text(SLEEPY.replace("{sleep}", "True").replace("{y0}", repr(y0)))
    proc = subprocess.Popen([sys.executable, str(script), "compare", str(path), "--out", str(out), "--no-progress"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = out / "cells" / "gap__sleepy__split-0__seed-0" / RESULT_FILE
    deadline = time.time() + 120
    while not first.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    time.sleep(1.0)  # well inside the second cell's 60 s fit
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert first.exists()
    assert not (out / "cells" / "gap__sleepy__split-1__seed-0" / RESULT_FILE).exists()
    script.write_text(SLEEPY.replace("{sleep}", "False").replace("{y0}", repr(y0)))
    done = subprocess.run([sys.executable, str(script), "compare", str(path), "--out", str(out), "--no-progress"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "1 cell(s) ran ok, 0 failed, 1 already done" in done.stdout


# ----------------------------------------------------------------------------- quickstart


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(v)


def dump_toml(doc: dict) -> str:
    """Just enough TOML for suites: top-level tables of scalars, lists and inline tables."""
    lines = []
    for top, body in doc.items():
        nested = {k: v for k, v in body.items() if isinstance(v, dict) and top in ("methods", "datasets")}
        plain = {k: v for k, v in body.items() if k not in nested}
        if plain:
            lines.append(f"[{top}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in plain.items()]
        for name, table in nested.items():
            lines.append(f"[{top}.{name}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def small_quickstart(tmp_path: Path) -> Path:
    """comparisons/quickstart.toml with CI-sized settings (same datasets, methods and reference)."""
    doc = tomllib.loads((REPO / "comparisons" / "quickstart.toml").read_text())
    doc["suite"]["num_eval_samples"] = 30
    if "gradient_variance" in doc:
        doc["gradient_variance"].update(num_draws=10, baseline_warmup=5)
    for ds in doc["datasets"].values():
        ds.update({k: v for k, v in {"num_train": 30, "num_test": 40}.items() if k in ds})
    overrides = [t for ds in doc["datasets"].values() for t in ds.get("overrides", {}).values()]
    for table in [*doc["methods"].values(), *overrides]:
        for key, small in {"num_steps": 40, "num_warmup": 15, "num_samples": 15, "num_chains": 2,
                           "max_tree_depth": 3, "map_num_steps": 20, "num_particles": 4,
                           "max_num_samples": 25}.items():
            if key in table:
                table[key] = small
    return write(tmp_path, dump_toml(doc), "quickstart_small.toml")


def test_quickstart_names_every_registered_method():
    doc = tomllib.loads((REPO / "comparisons" / "quickstart.toml").read_text())
    named = {t.get("method", label) for label, t in doc["methods"].items()}
    assert set(pyrobdl.methods()) <= named, f"quickstart.toml misses {set(pyrobdl.methods()) - named}"


@pytest.mark.slow  # over 20 s on a loaded core: the slow run (CI runs it too) keeps the default run under 5 minutes
def test_quickstart_suite_end_to_end_small(tmp_path):
    """The README's job (``compare --report``) on the quickstart suite, CI-sized (< ~30 s)."""
    from pyrobdl.cli import main

    path = small_quickstart(tmp_path)
    out = tmp_path / "results"
    assert main(["compare", str(path), "--out", str(out), "--no-progress", "--report"]) == 0
    records = [read_result(p) for p in out.glob(f"cells/*/{RESULT_FILE}")]
    suite = load_suite(path)
    assert len(records) == len(expand(suite))
    assert all(r["status"] == "ok" for r in records), [r["error"] for r in records if r["status"] != "ok"]
    html = (out / "report.html").read_text()
    for label in (m.label for m in suite.methods):
        assert label in html


# ----------------------------------------------------------------------------- artifacts


def test_exact_posterior_metrics_of_exact_draws():
    """Draws from the exact BLR posterior itself score (near) perfectly; a shifted mean does not."""
    import torch

    from pyrobdl.compare.artifacts import StoredPosterior, exact_posterior_metrics

    data = load_dataset("blr", SOURCES["blr"].options, 0, None, REPO)
    model = build_model({"hidden": [], "likelihood": {"kind": "gaussian", "precision": 10.0}}, data)
    exact = pyrobdl.datasets.blr_posterior(data.x_train, data.y_train, weight_prior_scale=1.0, precision=10.0)
    gen = torch.Generator().manual_seed(0)
    s = 4000
    theta = exact.mean + torch.randn(s, exact.mean.shape[0], generator=gen, dtype=torch.float64) @ \
        torch.linalg.cholesky(exact.covariance).T
    draws = {"layers.0.weight": theta[:, :-1].float().unsqueeze(1), "layers.0.bias": theta[:, -1:].float()}
    scores = exact_posterior_metrics(model, StoredPosterior(model, draws, "exact"), data, s, 0)
    # Monte Carlo error with S = 4000 draws: ~0.016 sd per coordinate for the mean, ~1% for the
    # sds, and a KL bias of about d(d+1)/(4S) ~ 0.001; the tolerances are ~4x those.
    assert scores["exact_mean_error_sd"] < 0.06
    assert abs(scores["exact_sd_ratio"] - 1) < 0.05
    assert scores["exact_mf_sd_ratio"] > 1  # exact marginals are wider than the mean-field optimum
    assert scores["exact_kl"] < 0.01
    shifted = {k: v + 3 * float(exact.posterior_sd.max()) for k, v in draws.items()}
    assert exact_posterior_metrics(model, StoredPosterior(model, shifted, "x"), data, s, 0)["exact_mean_error_sd"] > 1
    # a non-conjugate model gets no exact metrics
    mlp = build_model({"hidden": [3]}, data)
    assert exact_posterior_metrics(mlp, None, data, 10, 0) == {}


def test_stored_posterior_cycles_its_draws():
    import torch

    from pyrobdl.compare.artifacts import StoredPosterior

    data = load_dataset("gap", SOURCES["gap"].options, 0, None, REPO)
    model = build_model({"hidden": [2]}, data)
    draws = {s.name: torch.randn(3, *s.shape) for s in model.sites}
    post = StoredPosterior(model, draws, "x")
    out = post.sample(7)
    assert out["layers.0.weight"].shape == (7, 2, 1)
    assert torch.equal(out["layers.0.weight"][3], draws["layers.0.weight"][0])
    assert post.predict(data.x_test, 3).samples.shape == (3, data.x_test.shape[0], 1)


def test_a_run_killed_inside_a_chees_reference_resumes_that_cell(tmp_path, monkeypatch):
    """The runner gives an in-process chees cell a checkpoint in OUT/checkpoints: a run killed
    inside the fit (Ctrl-C here) resumes the cell at its last checkpoint, to the same draws as a
    run never interrupted; the checkpoint is removed once the record is written."""
    import pyrobdl.inference.chees as chees

    text = (TINY.replace("[suite]", '[suite]\nreference = "chees"').replace("splits = [0, 1]", "splits = [0]")
            + "\n[methods.chees]\nnum_chains = 4\nnum_warmup = 30\nnum_samples = 10\ncheckpoint_every_s = 0\n")
    path = write(tmp_path, text)
    ref_id = "gap__chees__split-0__seed-0"
    whole = tmp_path / "whole"
    assert run(path, whole).success
    assert not list((whole / "checkpoints").iterdir())  # removed after the record was written
    real, calls = chees._Sampler.transition, {"n": 0}

    def transition(self, *a, **kw):
        if calls["n"] == 17:
            raise KeyboardInterrupt
        calls["n"] += 1
        return real(self, *a, **kw)

    out = tmp_path / "out"
    with monkeypatch.context() as m:
        m.setattr(chees._Sampler, "transition", transition)
        with pytest.raises(KeyboardInterrupt):
            run(path, out)
    [ckpt] = (out / "checkpoints").glob(f"{ref_id}--*.pt")
    assert not (out / "cells" / ref_id / RESULT_FILE).exists()
    assert run(path, out).success
    rec, rec_whole = (read_result(o / "cells" / ref_id / RESULT_FILE) for o in (out, whole))
    assert rec["diagnostics"]["resumed_at"] == [17] and rec_whole["diagnostics"]["resumed_at"] == []
    assert rec["checksums"]["reference_draws.pt"] == rec_whole["checksums"]["reference_draws.pt"]
    assert rec["metrics"] == rec_whole["metrics"]
    assert not ckpt.exists() and not list((out / "checkpoints").iterdir())


def test_a_chain_method_without_certify_inputs_is_certified_by_the_runner(tmp_path, monkeypatch):
    """A registered chain method that does not take certify_inputs (a plugin's own sampler) is
    certified by the runner at the held-back inputs: its fit certified at training inputs."""
    from pyrobdl.inference import registry
    from pyrobdl.inference.registry import Method

    hmc = registry.get_method("hmc")
    options = {k: v for k, v in hmc.options.items() if k != "certify_inputs"}
    monkeypatch.setitem(registry._REGISTRY, "plain_hmc", Method("plain_hmc", options, hmc.run, "test only",
                                                               check_model=lambda model, opts: None))
    text = (TINY.replace("[suite]", '[suite]\nreference = "plain_hmc"').replace("splits = [0, 1]", "splits = [0]")
            + "\n[methods.plain_hmc]\nnum_warmup = 5\nnum_samples = 8\nnum_chains = 2\nnum_steps = 3\n")
    out = tmp_path / "out"
    assert run(write(tmp_path, text), out).success
    ref = read_result(out / "cells" / "gap__plain_hmc__split-0__seed-0" / RESULT_FILE)
    assert ref["certification"]["num_points"] == 30  # the 30 test points
    assert ref["diagnostics"]["certification"]["num_points"] == 20  # the fit's: the 20 training points
    assert ref["settings"].get("certify_inputs") is None
    assert any(w.startswith("certify: the plain_hmc posterior is not certified on held-back inputs")
               for w in ref["warnings"])
    fit_warning = [w for w in ref["warnings"] if w.startswith("fit: UserWarning: the plain_hmc posterior is not")]
    assert fit_warning and "certify_inputs" not in fit_warning[0]  # certified at training inputs: not named


def test_a_chees_reference_is_certified_and_extended_at_held_back_inputs(tmp_path):
    """The runner hands a method that takes ``certify_inputs`` the test split's first points: the
    fit's own certification, the extension of max_num_samples and the record's certification are
    all on held-back inputs (here all 30 test points, fewer than diagnostic_points)."""
    text = (TINY.replace("[suite]", '[suite]\nreference = "chees"').replace("splits = [0, 1]", "splits = [0]")
            + "\n[methods.chees]\nnum_chains = 4\nnum_warmup = 10\nnum_samples = 4\nmax_num_samples = 10\n"
            + "extend_by = 3\n")
    out = tmp_path / "out"
    assert run(write(tmp_path, text), out).success
    ref = read_result(out / "cells" / "gap__chees__split-0__seed-0" / RESULT_FILE)
    assert ref["certification"]["passed"] is False and ref["certification"]["num_points"] == 30
    assert ref["diagnostics"]["certification"] == ref["certification"]
    assert [e["num_samples"] for e in ref["diagnostics"]["extensions"]] == [4, 7, 10]
    assert ref["certification"]["num_draws"] == 10
    assert ref["settings"]["certify_inputs"]["points"] == 30 and ref["settings"]["max_num_samples"] == 10


def test_a_suite_refuses_a_certify_inputs_option(tmp_path):
    text = (TINY.replace("splits = [0, 1]", "splits = [0]")
            + "\n[methods.chees]\nnum_chains = 4\nnum_warmup = 5\nnum_samples = 5\ncertify_inputs = [[0.0]]\n")
    with pytest.raises(ConfigError, match=r"methods.chees.certify_inputs: a suite certifies each posterior itself, at "
                                          r"diagnostic_points test inputs spread over the test split"):
        run(write(tmp_path, text), tmp_path / "out")


def test_a_suite_refuses_a_checkpoint_option(tmp_path):
    text = (TINY.replace("splits = [0, 1]", "splits = [0]")
            + '\n[methods.chees]\nnum_chains = 4\nnum_warmup = 5\nnum_samples = 5\ncheckpoint = "mine.pt"\n')
    with pytest.raises(ConfigError, match=r"methods.chees.checkpoint: a suite keeps each cell's checkpoint itself"):
        run(write(tmp_path, text), tmp_path / "out")


CLASSES = """
[suite]
name = "cls"
num_eval_samples = 10
inference_data = false
[model]
hidden = [4]
LIKELIHOOD
[methods.map]
num_steps = 10
[methods.mean_field]
num_steps = 10
[datasets.mine]
source = "file"
path = "c.csv"
target = "label"
TASK
"""


def test_the_datas_task_chooses_the_likelihood_and_a_wrong_one_is_one_line(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 2))
    lines = ["a,b,label"] + [f"{a},{b},{int(a > 0) + int(b > 0)}" for a, b in x]
    (tmp_path / "c.csv").write_text("\n".join(lines))

    def suite(likelihood: str, task: str):
        return parse_suite(raw(CLASSES.replace("LIKELIHOOD", likelihood).replace("TASK", task)), tmp_path / "s.toml")

    # no likelihood anywhere: the CSV's task chooses a categorical one, one output per class
    ok = suite("", 'task = "classification"')
    cells = expand(ok)
    check_plan(ok, cells, None)
    data = load_dataset("file", cells[0].spec["dataset"]["options"], 0, None, tmp_path)
    model = build_model(cells[0].spec["model"], data)
    assert model.likelihood.task == "classification" and model.out_features == 3
    assert build_model({"hidden": [4]}, load_dataset("gap", SOURCES["gap"].options, 0, None, tmp_path)
                       ).likelihood.task == "regression"
    # a regression likelihood on class labels, and the other way round: one line each, naming the fix
    for likelihood, task, fix in [('likelihood = { kind = "gaussian", precision = 10.0 }', 'task = "classification"',
                                   'add model = { likelihood = { kind = "categorical" } } to the dataset\'s table'),
                                  ('likelihood = { kind = "categorical" }', "",
                                   'set task = "classification" in the dataset\'s table')]:
        bad = suite(likelihood, task)
        with pytest.raises(ConfigError) as info:
            check_plan(bad, expand(bad), None)
        msg = str(info.value).splitlines()
        assert len(msg) == 2 and "(1 problem(s))" in msg[0]
        assert "datasets.mine x methods.map, mean_field: model.likelihood: " in msg[1] and fix in msg[1]
