"""Bad input to ``fit``/``predict`` is refused before any work, with the argument named."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pyrobdl


@pytest.fixture
def model():
    return pyrobdl.BayesianMLP(3, (4,), 1)


X = torch.randn(20, 3)
Y = torch.randn(20)


@pytest.mark.parametrize("x, y, match", [
    (torch.randn(20), Y, "x must be 2-D"),
    (torch.randn(20, 4), Y, "x has 4 features"),
    (X, torch.randn(19), "y must have one row per row of x"),
    (X, torch.randn(20, 2), r"y must have shape \[N\] or \[N, 1\]"),
    (torch.where(torch.arange(60).reshape(20, 3) == 7, float("nan"), X), Y, "x contains 1 NaN"),
    (X, torch.where(torch.arange(20) == 3, float("inf"), Y), "y contains 1 NaN or infinite"),
    ("abc", Y, "x must be a torch.Tensor or numpy array"),
])
def test_data_errors(model, x, y, match):
    with pytest.raises((ValueError, TypeError), match=match):
        pyrobdl.fit(model, x, y, num_steps=1, progress=False)


def test_numpy_input_is_accepted(model):
    p = pyrobdl.fit(model, X.numpy().astype(np.float64), Y.numpy(), num_steps=2, progress=False)
    assert p.predict(X.numpy(), 3).mean.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_torch_tensors_of_any_float_dtype_are_converted_like_numpy(model, dtype):
    """A float64 tensor used to fail deep inside with a dtype error while float64 numpy worked."""
    xs, ys = X.to(dtype), Y.to(dtype)
    from_torch = pyrobdl.fit(model, xs, ys, num_steps=3, progress=False, seed=0)
    pred = from_torch.predict(xs, 4, seed=1)
    assert pred.mean.dtype == torch.float32
    from_numpy = pyrobdl.fit(model, xs.float().numpy(), ys.float().numpy(), num_steps=3, progress=False, seed=0)
    # the same float32 values in, so the same fit out
    torch.testing.assert_close(from_numpy.predict(xs.float().numpy(), 4, seed=1).mean, pred.mean)


@pytest.mark.parametrize("x, y, match", [
    (X.to(torch.complex64), Y, "x must be real-valued, got complex"),
    (X, Y.to(torch.complex64), "y must be real-valued, got complex"),
    (X.numpy().astype(np.complex128), Y, "x must be numeric, got dtype complex128"),
    (X, torch.arange(20), "y holds torch.int64 values, but a regression likelihood needs real-valued"),
    (X, np.arange(20), "y holds torch.int64 values, but a regression likelihood needs real-valued"),
    (X, torch.ones(20, dtype=torch.bool), "y holds torch.bool values"),
])
def test_complex_input_and_integer_regression_targets_are_refused(model, x, y, match):
    with pytest.raises(TypeError, match=match):
        pyrobdl.fit(model, x, y, num_steps=1, progress=False)


def test_classification_label_errors():
    clf = pyrobdl.BayesianMLP(3, (), 3, likelihood=pyrobdl.likelihoods.Categorical())
    with pytest.raises(ValueError, match="labels outside 0..2"):
        pyrobdl.fit(clf, X, torch.full((20,), 3), progress=False)
    with pytest.raises(TypeError, match="integer class labels"):
        pyrobdl.fit(clf, X, torch.full((20,), 0.5), progress=False)


def test_unknown_method_lists_valid_ones(model):
    with pytest.raises(ValueError, match=r"unknown method 'mean-field'; valid methods: \[.*'mean_field'"):
        pyrobdl.fit(model, X, Y, method="mean-field")


def test_unknown_option_lists_valid_ones(model):
    with pytest.raises(ValueError, match=r"does not take option\(s\) \['learning_rate'\].*'lr'"):
        pyrobdl.fit(model, X, Y, learning_rate=0.1)
    with pytest.raises(ValueError, match="does not take"):
        pyrobdl.fit(model, X, Y, method="map", init_scale=0.1)  # a mean-field option


@pytest.mark.parametrize("option, match", [
    ({"num_steps": 0}, "num_steps"), ({"lr": -1.0}, "lr"), ({"batch_size": 0}, "batch_size"),
    ({"lr_schedule": "step"}, "lr_schedule"), ({"kl_warmup": -1}, "kl_warmup"),
    ({"average_last": 1.0}, "average_last"), ({"num_particles": 0}, "num_particles"),
    ({"elbo": "fast"}, "elbo"), ({"init_scale": -1.0}, "init_scale"), ({"device": "tpu"}, "device"),
])
def test_option_errors_before_training(model, option, match):
    with pytest.raises(ValueError, match=match):
        pyrobdl.fit(model, X, Y, progress=False, **option)


def test_predict_checks_inputs(model):
    p = pyrobdl.fit(model, X, Y, num_steps=2, progress=False)
    with pytest.raises(ValueError, match="x has 2 features"):
        p.predict(torch.randn(5, 2))
    with pytest.raises(ValueError, match="num_samples"):
        p.predict(X, num_samples=0)


def test_map_refuses_an_improper_prior():
    class Flat(pyrobdl.priors.Gaussian):
        proper = False

    model = pyrobdl.BayesianMLP(3, (), 1, prior=Flat(1.0))
    with pytest.raises(ValueError, match=r"improper.*mean_field"):
        pyrobdl.fit(model, X, Y, method="map")
