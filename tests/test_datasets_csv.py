"""pyrobdl.datasets.load_csv: a table of your own as a train/test split, from Python."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pyrobdl


@pytest.fixture
def table(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 2)) * [1.0, 10.0] + [0.0, 5.0]
    y = x[:, 0] - 0.1 * x[:, 1] + 3.0
    path = tmp_path / "t.csv"
    np.savetxt(path, np.column_stack([x, y, (y > 3).astype(int)]), delimiter=",", header="a,b,y,label", comments="")
    return path, x, y


def test_regression_split_and_standardisation(table):
    path, x, y = table
    data = pyrobdl.datasets.load_csv(path, "y", test_fraction=0.25, split=2)
    assert isinstance(data, pyrobdl.datasets.RegressionData)
    # the label column stays a feature here: 3 inputs, 30 train / 10 test rows
    assert data.x_train.shape == (30, 3) and data.x_test.shape == (10, 3)
    assert data.x_train.dtype == torch.float32
    # standardised with training statistics; unstandardising gives the file's values back
    torch.testing.assert_close(data.x_train.mean(0), torch.zeros(3), atol=1e-5, rtol=0)
    back = np.sort(data.unstandardize_y(torch.cat([data.y_train, data.y_test])).numpy())
    np.testing.assert_allclose(back, np.sort(y), rtol=1e-5)
    # the split seed decides the partition
    other = pyrobdl.datasets.load_csv(path, "y", test_fraction=0.25, split=3)
    assert not torch.equal(other.y_test, data.y_test)


def test_classification_by_column_index(table):
    path, _, y = table
    data = pyrobdl.datasets.load_csv(path, 3, task="classification", standardize=False)
    assert data.num_classes == 2 and data.y_train.dtype == torch.int64
    assert int(data.y_train.sum() + data.y_test.sum()) == int((y > 3).sum())


def test_same_data_as_a_suites_file_source(table, tmp_path):
    from pyrobdl.compare.sources import SOURCES, load_dataset

    path, _, _ = table
    suite = load_dataset("file", {**SOURCES["file"].options, "path": path.name, "target": "y"}, 1, None, tmp_path)
    mine = pyrobdl.datasets.load_csv(path, "y", split=1)
    assert torch.equal(suite.x_train, mine.x_train) and torch.equal(suite.y_test, mine.y_test)


@pytest.mark.parametrize("kwargs, err, match", [
    ({"target": "nope"}, ValueError, "no column named 'nope'"),
    ({"target": "y", "task": "survival"}, ValueError, "unknown task 'survival'"),
    ({"target": "y", "test_fraction": 1.0}, ValueError, r"test_fraction must be a number in \(0, 1\)"),
    ({"target": "b", "task": "classification"}, ValueError, "integer labels"),
])
def test_errors_name_the_problem(table, kwargs, err, match):
    with pytest.raises(err, match=match):
        pyrobdl.datasets.load_csv(table[0], **kwargs)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such data file"):
        pyrobdl.datasets.load_csv(tmp_path / "none.csv", "y")


def _csv(tmp_path, y, name="c.csv"):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(len(y), 2))
    path = tmp_path / name
    np.savetxt(path, np.column_stack([x, y]), delimiter=",", header="a,b,y", comments="", fmt="%.6g")
    return path


def test_a_continuous_looking_target_is_refused_as_classification(tmp_path):
    rng = np.random.default_rng(0)
    # shaped like scikit-learn's diabetes target: whole numbers 25..346, 442 rows, ~200 distinct values
    diabetes = rng.integers(25, 347, size=442)
    distinct = len(np.unique(diabetes))
    with pytest.raises(ValueError, match=rf"{distinct} distinct target values in 442 rows .*looks continuous.*"
                                         r"task = \"regression\""):
        pyrobdl.datasets.load_csv(_csv(tmp_path, diabetes), "y", task="classification")
    # non-integer values: refused with how many
    values = rng.normal(size=60)
    with pytest.raises(ValueError, match=r"60 of 60 values are not whole numbers \(60 distinct values\)"):
        pyrobdl.datasets.load_csv(_csv(tmp_path, values, "f.csv"), "y", task="classification")
    with pytest.raises(ValueError, match=r"integer labels >= 0, got -1"):
        pyrobdl.datasets.load_csv(_csv(tmp_path, np.r_[np.zeros(9), -1.0], "n.csv"), "y", task="classification")
    # as regression the same columns load
    assert isinstance(pyrobdl.datasets.load_csv(_csv(tmp_path, diabetes, "r.csv"), "y"), pyrobdl.datasets.RegressionData)


def test_many_classes_with_enough_rows_each_are_classes(tmp_path):
    from pyrobdl.datasets.tabular import CONTINUOUS_DISTINCT, MIN_ROWS_PER_LABEL

    k = CONTINUOUS_DISTINCT + 10
    labels = np.repeat(np.arange(k), MIN_ROWS_PER_LABEL)  # exactly enough rows per label
    data = pyrobdl.datasets.load_csv(_csv(tmp_path, labels), "y", task="classification")
    assert data.num_classes == k
    with pytest.raises(ValueError, match="looks continuous"):  # one row fewer: refused
        pyrobdl.datasets.load_csv(_csv(tmp_path, labels[1:], "s.csv"), "y", task="classification")
    # few distinct values are classes whatever the row count (e.g. wine quality 3..8)
    assert pyrobdl.datasets.load_csv(_csv(tmp_path, np.arange(3, 9), "w.csv"), "y",
                                     task="classification").num_classes == 9
