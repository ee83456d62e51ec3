"""Tests for ``pyrobdl.datasets``.

Tests that need the real benchmark files are skipped when the shared data
directory is absent.  It is looked up at ``<repo>/../shared/datasets`` and can
be overridden with ``PYROBDL_DATA_DIR``.
"""

from __future__ import annotations

import gzip
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from pyrobdl.datasets import (
    UCI_DATASETS,
    BLRData,
    ClassificationData,
    RegressionData,
    bayesian_linear_regression,
    blr_posterior,
    gap_regression,
    load_mnist,
    load_uci,
    read_idx,
    resolve_data_dir,
    uci_hyperparameter_grid,
    uci_num_splits,
)
import pyrobdl.datasets as datasets_module

DATA_ROOT = Path(
    os.environ.get("PYROBDL_DATA_DIR")
    or Path(__file__).resolve().parents[2] / "shared" / "datasets"
)


def _require(subdir: str) -> Path:
    path = DATA_ROOT / subdir
    if not path.is_dir():
        pytest.skip(f"real data not available: {path} does not exist")
    return path


def _numpy_blr(x: np.ndarray, y: np.ndarray, sw: float, sb: float, beta: float):
    """Independent posterior: solve the ridge-regularised normal equations."""
    phi = np.hstack([x, np.ones((x.shape[0], 1))])
    prior = np.diag([sw**-2] * x.shape[1] + [sb**-2])
    lam = prior + beta * phi.T @ phi
    return np.linalg.solve(lam, beta * phi.T @ y), np.linalg.inv(lam), lam


# --------------------------------------------------------------------- BLR


def test_blr_posterior_matches_numpy_normal_equations():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(30, 4))
    y = x @ np.array([0.5, -1.0, 2.0, 0.0]) + 0.3 + rng.normal(scale=0.5, size=30)
    post = blr_posterior(torch.from_numpy(x), torch.from_numpy(y),
                         weight_prior_scale=0.7, bias_prior_scale=2.0, precision=4.0)
    mean, cov, lam = _numpy_blr(x, y, 0.7, 2.0, 4.0)
    assert post.mean.dtype == torch.float64 and post.mean.shape == (5,)
    np.testing.assert_allclose(post.mean.numpy(), mean, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(post.covariance.numpy(), cov, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(post.precision_matrix.numpy(), lam, rtol=1e-12)
    np.testing.assert_allclose(post.mean_field_sd.numpy(), 1 / np.sqrt(np.diag(lam)), rtol=1e-12)
    np.testing.assert_allclose(post.posterior_sd.numpy(), np.sqrt(np.diag(cov)), rtol=1e-10)
    # Helpers slice (w_1..w_D, b) consistently.
    assert torch.equal(post.weight_mean, post.mean[:4]) and post.bias_mean.dim() == 0
    assert torch.equal(post.bias_mean_field_sd, post.mean_field_sd[4])
    assert torch.equal(post.weight_mean_field_sd, post.mean_field_sd[:4])
    assert torch.equal(post.weight_sd, post.posterior_sd[:4])
    # Mean-field variance never exceeds the exact marginal variance.
    assert bool((post.mean_field_sd <= post.posterior_sd + 1e-15).all())
    # numpy input and bias scale defaulting to the weight scale.
    post_np = blr_posterior(x, y, weight_prior_scale=0.7, precision=4.0)
    np.testing.assert_allclose(post_np.mean.numpy(), _numpy_blr(x, y, 0.7, 0.7, 4.0)[0],
                               rtol=1e-10)


def test_blr_posterior_concentrates_on_true_weights_with_lots_of_data():
    data = bayesian_linear_regression(20000, 10, 5, prior_scale=1.0, precision=10.0, seed=3)
    post = data.posterior
    err = (post.weight_mean.float() - data.true_weight).abs()
    assert bool((err < 0.03).all()), err
    assert abs(float(post.bias_mean) - data.true_bias) < 0.03
    assert bool((post.posterior_sd < 0.01).all())


def test_bayesian_linear_regression_reproducible_and_leaves_global_rng_alone():
    state = torch.random.get_rng_state()
    a = bayesian_linear_regression(50, 20, 2, seed=7)
    b = bayesian_linear_regression(50, 20, 2, seed=7)
    c = bayesian_linear_regression(50, 20, 2, seed=8)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert isinstance(a, BLRData) and isinstance(a, RegressionData)
    assert a.x_train.shape == (50, 2) and a.y_test.shape == (20,) and a.num_features == 2
    assert a.x_train.dtype == torch.float32
    for field in ("x_train", "y_train", "x_test", "y_test", "true_weight"):
        assert torch.equal(getattr(a, field), getattr(b, field))
        assert not torch.equal(getattr(a, field), getattr(c, field))
    assert torch.equal(a.posterior.mean, b.posterior.mean)
    # The stored posterior is the posterior of the stored training data.
    direct = blr_posterior(a.x_train, a.y_train, weight_prior_scale=1.0, precision=10.0)
    assert torch.allclose(direct.mean, a.posterior.mean)
    moved = a.to("cpu")
    assert isinstance(moved, BLRData) and torch.equal(moved.posterior.covariance,
                                                       a.posterior.covariance)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"x": torch.zeros(5), "y": torch.zeros(5)}, ValueError, "`x`"),
        ({"x": torch.zeros(5, 2), "y": torch.zeros(5, 1)}, ValueError, "`y`"),
        ({"x": torch.zeros(5, 2), "y": torch.zeros(4)}, ValueError, "`y` has 4"),
        ({"x": torch.full((5, 2), float("nan")), "y": torch.zeros(5)}, ValueError, "`x`"),
        ({"x": torch.zeros(5, 2), "y": torch.full((5,), float("inf"))}, ValueError, "`y`"),
        ({"x": [[1.0]], "y": torch.zeros(1)}, TypeError, "`x`"),
        ({"weight_prior_scale": 0.0}, ValueError, "weight_prior_scale"),
        ({"bias_prior_scale": -1.0}, ValueError, "bias_prior_scale"),
        ({"precision": 0.0}, ValueError, "precision"),
        ({"precision": "10"}, TypeError, "precision"),
    ],
)
def test_blr_posterior_validation(kwargs, exc, match):
    args = {"x": torch.zeros(5, 2), "y": torch.zeros(5), "weight_prior_scale": 1.0,
            "precision": 1.0}
    args.update(kwargs)
    x, y = args.pop("x"), args.pop("y")
    with pytest.raises(exc, match=match):
        blr_posterior(x, y, **args)


def test_synthetic_argument_validation():
    with pytest.raises(ValueError, match="num_train"):
        bayesian_linear_regression(0)
    with pytest.raises(TypeError, match="seed"):
        bayesian_linear_regression(seed=1.5)
    with pytest.raises(ValueError, match="prior_scale"):
        bayesian_linear_regression(prior_scale=-1.0)
    with pytest.raises(ValueError, match="noise_sd"):
        gap_regression(noise_sd=-0.1)
    with pytest.raises(ValueError, match="num_train"):
        gap_regression(num_train=1)


# --------------------------------------------------------------------- gap


def test_gap_regression_has_gap_in_training_inputs_and_grid_covers_it():
    data = gap_regression(160, 200, noise_sd=0.1, seed=0)
    x = data.x_train.squeeze(-1)
    assert data.name == "gap" and data.x_train.shape == (160, 1) and data.x_test.shape == (200, 1)
    assert bool(((x <= -0.35) | (x >= 0.35)).all())
    assert bool((x.abs() <= 1.0).all())
    assert int((x < 0).sum()) == 80
    grid = data.x_test.squeeze(-1)
    assert float(grid.min()) == pytest.approx(-1.5) and float(grid.max()) == pytest.approx(1.5)
    assert int((grid.abs() < 0.35).sum()) > 10  # many test points inside the gap
    assert bool((grid[1:] > grid[:-1]).all())
    # Noise is small: the test targets follow sin(3x) + 0.3 x^2.
    resid = data.y_test - (torch.sin(3 * grid) + 0.3 * grid**2)
    assert 0.05 < float(resid.std()) < 0.15
    assert torch.equal(gap_regression(seed=0).y_train, data.y_train)
    assert not torch.equal(gap_regression(seed=1).y_train, data.y_train)


# --------------------------------------------------------------------- containers


def test_regression_data_validation_and_unstandardize():
    with pytest.raises(ValueError, match="x_train"):
        RegressionData("t", torch.zeros(3), torch.zeros(3), torch.zeros(2, 1), torch.zeros(2))
    with pytest.raises(ValueError, match="y_test"):
        RegressionData("t", torch.zeros(3, 1), torch.zeros(3), torch.zeros(2, 1), torch.zeros(3))
    data = RegressionData("t", torch.zeros(3, 1), torch.tensor([0.0, 1.0, -1.0]),
                          torch.zeros(2, 1), torch.zeros(2), y_mean=5.0, y_std=2.0)
    assert torch.equal(data.unstandardize_y(data.y_train), torch.tensor([5.0, 7.0, 3.0]))
    with pytest.raises(TypeError, match="num_classes"):
        ClassificationData("c", torch.zeros(2, 3), torch.zeros(2, dtype=torch.int64),
                           torch.zeros(1, 3), torch.zeros(1, dtype=torch.int64), 2.0)


# --------------------------------------------------------------------- data dir


def test_resolve_data_dir_errors_and_layouts(tmp_path, monkeypatch):
    monkeypatch.delenv("PYROBDL_DATA_DIR", raising=False)
    with pytest.raises(ValueError, match="data_dir") as info:
        resolve_data_dir(None, "uci")
    assert "PYROBDL_DATA_DIR" in str(info.value)
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match="data_dir") as info:
        resolve_data_dir(missing, "uci")
    assert str(missing) in str(info.value)
    (tmp_path / "uci").mkdir()
    assert resolve_data_dir(tmp_path, "uci") == tmp_path / "uci"
    assert resolve_data_dir(tmp_path / "uci", "uci") == tmp_path / "uci"
    monkeypatch.setenv("PYROBDL_DATA_DIR", str(tmp_path))
    assert resolve_data_dir(None, "uci") == tmp_path / "uci"
    with pytest.raises(TypeError, match="data_dir"):
        resolve_data_dir(3, "uci")


# --------------------------------------------------------------------- UCI


def _write_fake_uci(root: Path) -> Path:
    folder = root / "uci" / "yacht"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    data = np.column_stack([
        rng.normal(size=12),
        np.full(12, 7.0),          # exactly constant column
        np.full(12, 0.998),        # constant, but its float mean is not exact
        rng.normal(size=12) * 3 + 10,
    ])
    np.savetxt(folder / "data.txt", data)
    np.savetxt(folder / "index_features.txt", [0, 1, 2], fmt="%d")
    np.savetxt(folder / "index_target.txt", [3], fmt="%d")
    for k, test in enumerate(([0, 1, 2], [9, 10, 11])):
        train = [i for i in range(12) if i not in test]
        np.savetxt(folder / f"index_train_{k}.txt", train, fmt="%d")
        np.savetxt(folder / f"index_test_{k}.txt", test, fmt="%d")
    return folder


def test_load_uci_zero_std_guard_on_fake_dataset(tmp_path):
    folder = _write_fake_uci(tmp_path)
    assert uci_num_splits("yacht", tmp_path) == 2  # counted from files, no n_splits.txt
    assert uci_hyperparameter_grid("yacht", tmp_path) == {"dropout_rates": [], "tau_values": []}
    data = load_uci("yacht", 1, data_dir=tmp_path)
    assert data.x_train.shape == (9, 3) and data.x_test.shape == (3, 3)
    assert bool(torch.isfinite(data.x_train).all() and torch.isfinite(data.x_test).all())
    assert torch.equal(data.x_std[1:], torch.ones(2))
    assert torch.equal(data.x_train[:, 1:], torch.zeros(9, 2))
    assert torch.equal(data.x_test[:, 1:], torch.zeros(3, 2))
    assert float(data.x_train[:, 0].std(unbiased=False)) == pytest.approx(1.0, abs=1e-5)
    raw = np.loadtxt(folder / "data.txt")
    np.testing.assert_allclose(data.unstandardize_y(data.y_test).numpy(), raw[9:, 3], rtol=1e-5)
    (folder / "index_test_1.txt").unlink()
    with pytest.raises(FileNotFoundError, match="index_test_1.txt"):
        load_uci("yacht", 1, data_dir=tmp_path)


def test_load_uci_errors(tmp_path, monkeypatch):
    _write_fake_uci(tmp_path)
    with pytest.raises(ValueError, match="name") as info:
        load_uci("bostn", data_dir=tmp_path)
    assert all(name in str(info.value) for name in UCI_DATASETS)
    with pytest.raises(ValueError, match="split") as info:
        load_uci("yacht", 2, data_dir=tmp_path)
    assert "0..1" in str(info.value)
    with pytest.raises(TypeError, match="split"):
        load_uci("yacht", 0.0, data_dir=tmp_path)
    monkeypatch.delenv("PYROBDL_DATA_DIR", raising=False)
    with pytest.raises(ValueError, match="data_dir"):
        load_uci("yacht")
    with pytest.raises(ValueError, match="data_dir"):
        load_uci("yacht", data_dir=tmp_path / "missing")
    with pytest.raises(ValueError, match="concrete"):  # folder absent under uci/
        load_uci("concrete", data_dir=tmp_path)


def test_load_uci_boston_real_split():
    folder = _require("uci") / "bostonHousing"
    train_rows = [int(v) for v in (folder / "index_train_0.txt").read_text().split()]
    test_rows = [int(v) for v in (folder / "index_test_0.txt").read_text().split()]
    raw = np.array([[float(v) for v in line.split()]
                    for line in (folder / "data.txt").read_text().splitlines() if line.strip()])
    data = load_uci("boston", 0, data_dir=DATA_ROOT)
    assert (len(train_rows), len(test_rows)) == (455, 51)
    assert data.name == "boston" and data.num_features == 13
    assert data.x_train.shape == (455, 13) and data.x_test.shape == (51, 13)
    assert data.y_train.shape == (455,) and data.x_train.dtype == torch.float32
    assert torch.allclose(data.x_train.mean(0), torch.zeros(13), atol=1e-5)
    assert torch.allclose(data.x_train.std(0, unbiased=False), torch.ones(13), atol=1e-5)
    np.testing.assert_allclose(data.unstandardize_y(data.y_train).numpy(), raw[train_rows, 13],
                               rtol=1e-5)
    np.testing.assert_allclose(data.unstandardize_y(data.y_test).numpy(), raw[test_rows, 13],
                               rtol=1e-5)
    np.testing.assert_allclose((data.x_test * data.x_std + data.x_mean).numpy(),
                               raw[test_rows, :13], rtol=1e-5, atol=1e-4)
    plain = load_uci("bostonHousing", 0, data_dir=DATA_ROOT / "uci", standardize=False)
    assert plain.x_mean is None and plain.y_std == 1.0
    np.testing.assert_allclose(plain.y_test.numpy(), raw[test_rows, 13], rtol=1e-6)
    assert uci_num_splits("boston", DATA_ROOT) == 20
    assert uci_hyperparameter_grid("boston", DATA_ROOT)["tau_values"] == [0.1, 0.15, 0.2]


def test_load_uci_naval_constant_columns_are_guarded():
    _require("uci")
    data = load_uci("naval", 0, data_dir=DATA_ROOT)
    assert data.x_train.shape == (10741, 16)
    assert bool(torch.isfinite(data.x_train).all() and torch.isfinite(data.x_test).all())
    assert torch.equal(data.x_std[[8, 11]], torch.ones(2))
    assert float(data.x_test[:, [8, 11]].abs().max()) == 0.0


# --------------------------------------------------------------------- IDX / MNIST


def test_read_idx_roundtrip_and_corruption(tmp_path):
    values = (np.arange(6).reshape(2, 3) - 2).astype(">i4")  # big-endian on disk
    good = tmp_path / "good.idx"
    good.write_bytes(bytes([0, 0, 0x0C, 2]) + struct.pack(">II", 2, 3) + values.tobytes())
    np.testing.assert_array_equal(read_idx(good), values.astype(np.int32))
    gz = tmp_path / "good.idx.gz"
    gz.write_bytes(gzip.compress(good.read_bytes()))
    np.testing.assert_array_equal(read_idx(gz), values.astype(np.int32))

    bad_cases = {
        "badgzip.gz": b"\x1f\x8b" + b"not really gzip data",
        "magic.idx": bytes([1, 0, 0x08, 1]) + struct.pack(">I", 2) + b"\x00\x01",
        "dtype.idx": bytes([0, 0, 0x07, 1]) + struct.pack(">I", 2) + b"\x00\x01",
        "short.idx": bytes([0, 0, 0x08, 1]) + struct.pack(">I", 5) + b"\x00\x01",
        "long.idx": bytes([0, 0, 0x08, 1]) + struct.pack(">I", 1) + b"\x00\x01",
        "header.idx": bytes([0, 0, 0x08, 3]) + struct.pack(">I", 1),
        "tiny.idx": b"\x00\x00",
    }
    for file_name, content in bad_cases.items():
        path = tmp_path / file_name
        path.write_bytes(content)
        with pytest.raises(ValueError) as info:
            read_idx(path)
        assert str(path) in str(info.value), file_name


def test_load_mnist_shapes_and_labels():
    _require("mnist")
    full = load_mnist(data_dir=DATA_ROOT)
    assert full.x_train.shape == (60000, 784) and full.x_test.shape == (10000, 784)
    assert full.y_train.shape == (60000,) and full.y_test.dtype == torch.int64
    assert full.num_classes == 10 and full.x_train.dtype == torch.float32
    assert int(full.y_train.min()) == 0 and int(full.y_train.max()) == 9
    assert set(full.y_test.unique().tolist()) == set(range(10))
    assert float(full.x_train.min()) == 0.0 and float(full.x_train.max()) == 1.0
    small = load_mnist(data_dir=DATA_ROOT / "mnist", flatten=False, max_train=500)
    assert small.x_train.shape == (500, 1, 28, 28) and small.y_train.shape == (500,)
    assert small.x_test.shape == (10000, 1, 28, 28)
    assert torch.equal(small.x_train.reshape(500, -1), full.x_train[:500])
    assert torch.equal(small.y_train, full.y_train[:500])
    with pytest.raises(ValueError, match="max_train"):
        load_mnist(data_dir=DATA_ROOT, max_train=0)
    with pytest.raises(ValueError, match="name"):
        load_mnist(data_dir=DATA_ROOT, name="cifar10")


def test_public_api_is_sorted_and_complete():
    assert datasets_module.__all__ == sorted(datasets_module.__all__)
    assert all(hasattr(datasets_module, name) for name in datasets_module.__all__)
    assert UCI_DATASETS["naval"] == "naval-propulsion-plant" and len(UCI_DATASETS) == 9
