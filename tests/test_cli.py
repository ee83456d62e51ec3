"""The ``pyrobdl`` command line: help, methods, exit codes."""

from __future__ import annotations

import json
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import pytest

import pyrobdl
from pyrobdl.cli import EXIT_CODES, main

SUITE = """
[suite]
name = "cli"
num_eval_samples = 10
inference_data = false
[model]
hidden = [4]
[methods.map]
num_steps = 10
[datasets.gap]
source = "gap"
num_train = 12
num_test = 10
"""


@pytest.fixture
def suite(tmp_path) -> Path:
    path = tmp_path / "s.toml"
    path.write_text(textwrap.dedent(SUITE))
    return path


def test_console_script_entry_point():
    scripts = [e for e in entry_points(group="console_scripts") if e.name == "pyrobdl"]
    assert scripts and scripts[0].value == "pyrobdl.cli:main"


@pytest.mark.parametrize("argv", [["--help"], ["compare", "--help"], ["report", "--help"], ["methods", "--help"]])
def test_help_everywhere(argv, capsys):
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "usage: pyrobdl" in text and "exit status" in text


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"pyrobdl {pyrobdl.__version__}"


def test_no_command_prints_help_and_is_a_usage_error(capsys):
    assert main([]) == EXIT_CODES["usage"]
    assert "compare" in capsys.readouterr().out


def test_methods_lists_registry_with_defaults(capsys):
    assert main(["methods"]) == 0
    text = capsys.readouterr().out
    for name in pyrobdl.methods():
        meth = pyrobdl.inference.get_method(name)
        assert f"{name}: {meth.summary}" in text
        for key, default in meth.options.items():
            assert f"{key}" in text and repr(default) in text
    assert main(["methods", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert set(table) == set(pyrobdl.methods())
    assert table["map"]["options"]["num_steps"] == pyrobdl.inference.get_method("map").options["num_steps"]


def test_usage_errors_exit_2_and_name_the_problem(suite, tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text(textwrap.dedent(SUITE).replace("num_steps = 10", "num_stepz = 10"))
    assert main(["compare", str(bad), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "methods.map.num_stepz" in err and str(bad) in err and "'num_steps'" in err
    assert main(["compare", str(tmp_path / "missing.toml"), "--out", str(tmp_path / "o")]) == 2
    assert main(["compare", str(suite), "--out", str(tmp_path / "o"), "--only", "datset=gap"]) == 2
    assert "valid keys" in capsys.readouterr().err
    assert main(["compare", str(suite), "--out", str(tmp_path / "o"), "--device", "tpu9"]) == 2
    assert main(["compare", str(suite)]) == 2  # --out is required
    assert not (tmp_path / "o" / "cells").exists() or not list((tmp_path / "o" / "cells").iterdir())


def test_compare_dry_run_then_run_then_report(suite, tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["compare", str(suite), "--out", str(out), "--dry-run"]) == 0
    assert "  new      gap__map__split-0__seed-0\n" in capsys.readouterr().out
    assert main(["compare", str(suite), "--out", str(out), "--no-progress", "--threads", "1"]) == 0
    assert "1 cell(s) ran ok, 0 failed, 0 already done" in capsys.readouterr().out
    assert main(["compare", str(suite), "--out", str(out), "--no-progress"]) == 0
    assert "0 cell(s) ran ok, 0 failed, 1 already done" in capsys.readouterr().out
    assert main(["report", str(out)]) == 0
    assert (out / "report.html").exists() and (out / "report.md").exists()


def test_compare_report_builds_the_report_in_the_same_process(suite, tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["compare", str(suite), "--out", str(out), "--no-progress", "--report"]) == 0
    text = capsys.readouterr().out
    assert "1 cell(s) ran ok" in text and f"wrote {out / 'report.html'}" in text
    html = (out / "report.html").read_text()
    (out / "report.html").unlink()
    assert main(["report", str(out)]) == 0  # the same page as `pyrobdl report`, up to its time stamp
    assert _without_dates((out / "report.html").read_text()) == _without_dates(html)


def _without_dates(html: str) -> str:
    import re

    return re.sub(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d(:\d\d)?( UTC)?", "DATE", html)


def test_compare_report_after_failed_cells_still_reports_and_exits_1(suite, tmp_path, capsys):
    path = tmp_path / "f.toml"
    path.write_text(textwrap.dedent(SUITE).replace("num_steps = 10", "num_steps = 10\nlr = -1.0"))
    out = tmp_path / "o"
    assert main(["compare", str(path), "--out", str(out), "--no-progress", "--report"]) == EXIT_CODES["cells_failed"]
    assert "(1 cells, 1 failed)" in capsys.readouterr().out and (out / "report.html").exists()


def test_compare_report_with_dry_run_is_a_usage_error(suite, tmp_path, capsys):
    assert main(["compare", str(suite), "--out", str(tmp_path / "o"), "--dry-run", "--report"]) == EXIT_CODES["usage"]
    assert "--report needs a run" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_results_errors_exit_3(suite, tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == EXIT_CODES["results"]
    assert "no results" in capsys.readouterr().err
    out = tmp_path / "o"
    assert main(["compare", str(suite), "--out", str(out), "--no-progress"]) == 0
    (out / "cells" / "gap__map__split-0__seed-0" / "result.json").write_text("garbage")
    assert main(["compare", str(suite), "--out", str(out), "--no-progress"]) == 3
    assert "gap__map__split-0__seed-0/result.json" in capsys.readouterr().err
    assert main(["compare", str(suite), "--out", str(out), "--no-progress", "--rerun-invalid"]) == 0


def test_failed_cell_exits_1(suite, tmp_path, capsys):
    # a value error only the method sees (lr must be > 0): the cell fails when it runs
    path = tmp_path / "f.toml"
    path.write_text(textwrap.dedent(SUITE).replace("num_steps = 10", "num_steps = 10\nlr = -1.0"))
    assert main(["compare", str(path), "--out", str(tmp_path / "o"), "--no-progress"]) == EXIT_CODES["cells_failed"]
    assert "lr must be" in capsys.readouterr().err


@pytest.mark.slow
def test_worker_processes(suite, tmp_path, capsys):
    """--workers runs cells in spawned processes (with --threads applied there too)."""
    path = tmp_path / "two.toml"
    path.write_text(textwrap.dedent(SUITE).replace('source = "gap"', 'source = "gap"\nsplits = [0, 1]'))
    out = tmp_path / "o"
    assert main(["compare", str(path), "--out", str(out), "--no-progress", "--workers", "2", "--threads", "1"]) == 0
    assert "2 cell(s) ran ok" in capsys.readouterr().out
    threads = {json.loads(p.read_text())["versions"]["torch_threads"] for p in out.glob("cells/*/result.json")}
    assert threads == {"1"}


REFERENCED = SUITE.replace('name = "cli"', 'name = "cli"\nreference = "map"').replace(
    "[datasets.gap]", "[methods.mean_field]\nnum_steps = 10\n[datasets.gap]")


def test_dry_run_labels_cells_and_the_plan_names_what_only_added(tmp_path, capsys):
    path = tmp_path / "r.toml"
    path.write_text(textwrap.dedent(REFERENCED))
    out = tmp_path / "o"
    assert main(["compare", str(path), "--out", str(out), "--dry-run", "--only", "method=mean_field"]) == 0
    text = capsys.readouterr().out
    assert ("cli: 2 cells: 1 dataset(s) x 2 method(s) x 1 split(s) x 1 seed(s) (1 reference); --only matched 1 and "
            "added 1 reference cell(s) (map) because the matched cells are scored against them") in text
    assert "  new      gap__map__split-0__seed-0 (reference, added by --only)\n" in text
    assert "  new      gap__mean_field__split-0__seed-0\n" in text
    assert "2 new; compare would run 2 cell(s)" in text
    # the same words in the plan line of the run itself
    assert main(["compare", str(path), "--out", str(out), "--no-progress", "--only", "method=mean_field"]) == 0
    assert "--only matched 1 and added 1 reference cell(s) (map)" in capsys.readouterr().out
    # done, stale (configuration changed), damaged (a file gone)
    assert main(["compare", str(path), "--out", str(out), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "  done     gap__map__split-0__seed-0 (reference)\n" in text and "2 done" in text
    changed = tmp_path / "c.toml"
    changed.write_text(textwrap.dedent(REFERENCED).replace("num_steps = 10\n[datasets", "num_steps = 11\n[datasets"))
    (out / "cells" / "gap__map__split-0__seed-0" / "arrays.npz").unlink()
    assert main(["compare", str(changed), "--out", str(out), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "  stale    gap__mean_field__split-0__seed-0: configuration changed: stops the run unless " in text
    assert "  damaged  gap__map__split-0__seed-0 (reference): runs again; " in text
    assert "1 damaged, 1 stale; compare would run 2 cell(s)" in text
