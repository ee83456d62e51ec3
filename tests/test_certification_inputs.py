"""Where a certificate is checked: inputs spread over the data (never the first rows in file order),
recorded on the certification, chosen alike by fit and by the suite."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import pyrobdl
from pyrobdl.compare import load_suite, read_result, run_suite
from pyrobdl.compare.store import RESULT_FILE
from pyrobdl.diagnostics import Certification
from pyrobdl.diagnostics.inputs import spread_indices

SUITE = """
[suite]
name = "s"
num_eval_samples = 10
inference_data = false
fit_diagnostics = false
reference = "chees"
[model]
hidden = [3]
likelihood = { kind = "gaussian", precision = 100.0 }
[methods.chees]
num_chains = 4
num_warmup = 5
num_samples = 5
diagnostic_points = 12
[datasets.gap]
source = "gap"
num_train = 20
num_test = 60
"""


def gap():
    return pyrobdl.datasets.gap_regression(num_train=80, num_test=200, seed=0)


def test_spread_inputs_cover_the_gap_that_the_first_rows_miss():
    x = gap().x_test[:, 0].numpy()
    first = x[:50]
    assert first.max() < -0.7  # the hole: the first 50 test inputs all lie on the left edge
    rows = spread_indices(gap().x_test, 50)
    chosen = np.sort(x[rows])
    assert len(rows) == 50 and rows == sorted(set(rows))
    # both edges, the middle (the gap between the training clusters), and no hole wider than
    # twice the even spacing of 50 points over the test range
    assert chosen[0] == x.min() and chosen[-1] == x.max()
    assert np.abs(chosen).min() < 0.05
    assert np.diff(chosen).max() < 2 * (x.max() - x.min()) / 49
    assert spread_indices(gap().x_test, 50) == rows  # deterministic


def test_spread_inputs_in_several_dimensions_and_edge_cases():
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(190, 2, generator=gen), torch.tensor([[8.0, 8.0]] * 10)])  # a far cluster
    rows = spread_indices(x, 5)
    assert any(r >= 190 for r in rows)  # the sparse far cluster is visited
    # standardised space: a feature in other units does not dominate
    scaled = x * torch.tensor([1000.0, 1.0])
    assert spread_indices(scaled, 5) == rows
    assert spread_indices(x[:3], 10) == [0, 1, 2]
    assert spread_indices(torch.ones(4, 2), 2) == [0, 1]  # constant inputs: ties to the lowest rows
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        spread_indices(x, 0)
    with pytest.raises(ValueError, match="finite"):
        spread_indices(torch.tensor([[float("nan")]]), 1)
    with pytest.raises(ValueError, match=r"inputs \[N, in_features\]"):
        spread_indices(torch.zeros(0, 2), 1)


def test_fit_certifies_at_training_inputs_spread_over_the_data_and_records_them():
    data = gap()
    model = pyrobdl.BayesianMLP(1, (5,), 1, activation="tanh", likelihood=pyrobdl.likelihoods.Gaussian(100.0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        post = pyrobdl.fit(model, data.x_train, data.y_train, method="chees", num_chains=4, num_warmup=10,
                           num_samples=8, diagnostic_points=20, progress=False)
    inputs = post.certification.inputs
    assert inputs["source"] == "training inputs" and inputs["points"] == 20
    assert inputs["indices"] == spread_indices(data.x_train, 20) != list(range(20))
    assert post.settings["certify_inputs"] is None  # the option was not given
    assert Certification.from_dict(post.certification.to_dict()).inputs == inputs
    old = {k: v for k, v in post.certification.to_dict().items() if k != "inputs"}
    assert Certification.from_dict(old).inputs is None  # a record written before it: not recorded


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_suite_certifies_at_held_back_inputs_spread_over_the_test_split(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text(SUITE)
    out = tmp_path / "out"
    assert run_suite(load_suite(path), out, progress=False).success
    rec = read_result(out / "cells" / "gap__chees__split-0__seed-0" / RESULT_FILE)
    data = pyrobdl.datasets.gap_regression(num_train=20, num_test=60, seed=0)
    inputs = rec["certification"]["inputs"]
    assert inputs["source"] == "held-back inputs" and inputs["indices"] == spread_indices(data.x_test, 12)
    assert rec["diagnostics"]["certification"]["inputs"] == inputs
    assert rec["settings"]["certify_inputs"]["points"] == 12  # what the fit was given: their digest


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_report_says_where_the_certificate_was_checked_and_marks_it_on_1d_data(tmp_path):
    from pyrobdl.report.build import build_model
    from pyrobdl.report.figures import _certified_at
    from pyrobdl.report.verdicts import where_checked

    path = tmp_path / "s.toml"
    path.write_text(SUITE.replace("[methods.chees]", "[methods.map]\nnum_steps = 20\n\n[methods.chees]"))
    out = tmp_path / "out"
    assert run_suite(load_suite(path), out, progress=False).success
    [section] = [s for s in build_model(out).sections if s.title == "Dataset gap"]
    text = " ".join(section.verdict)
    assert "Certificate checked at 12 held-back inputs spread over the data" in text
    [fig] = [f for f in section.figures if f.title == "gap: predictive bands"]
    assert "Red ticks on the x-axis: the held-back inputs the chains were certified at." in fig.caption
    rec = read_result(out / "cells" / "gap__chees__split-0__seed-0" / RESULT_FILE)
    data = pyrobdl.datasets.gap_regression(num_train=20, num_test=60, seed=0)
    marks = _certified_at(rec, {"test_x": data.x_test[:, 0].numpy()})
    assert np.array_equal(np.sort(marks), np.sort(data.x_test[spread_indices(data.x_test, 12), 0].numpy()))
    # a record from before: said, not guessed
    old = dict(rec, certification={k: v for k, v in rec["certification"].items() if k != "inputs"})
    assert where_checked([old]).startswith("Where it was checked is not recorded")
    assert _certified_at(old, {"test_x": data.x_test[:, 0].numpy()}) is None
