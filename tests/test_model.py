"""BayesianMLP, priors and likelihoods: sites, shapes, minibatch scaling, and input errors."""

from __future__ import annotations

import math

import pyro
import pyro.poutine as poutine
import pytest
import torch

import pyrobdl
from pyrobdl.priors import Gaussian, Site


def test_sites_have_stable_names_and_shapes():
    model = pyrobdl.BayesianMLP(8, (50, 20), 2)
    assert [s.name for s in model.sites] == [
        "layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias", "layers.2.weight", "layers.2.bias",
    ]
    trace = poutine.trace(model).get_trace(torch.randn(7, 8))
    shapes = {n: tuple(s["value"].shape) for n, s in trace.nodes.items() if s["type"] == "sample"}
    assert shapes == {
        "layers.0.weight": (50, 8), "layers.0.bias": (50,), "layers.1.weight": (20, 50), "layers.1.bias": (20,),
        "layers.2.weight": (2, 20), "layers.2.bias": (2,), "data": (7,), "obs": (7, 2),
    }


def test_hidden_empty_is_linear_regression():
    model = pyrobdl.BayesianMLP(3, (), 1)
    params = {"layers.0.weight": torch.tensor([[1.0, 2.0, 3.0]]), "layers.0.bias": torch.tensor([0.5])}
    x = torch.tensor([[1.0, 0.0, 1.0]])
    assert model.network(params, x).item() == 4.5


@pytest.mark.parametrize("activation, fn", [("relu", torch.relu), ("tanh", torch.tanh)])
def test_network_with_particles(activation, fn):
    model = pyrobdl.BayesianMLP(3, (4,), 2, activation=activation)
    draws = {n: torch.randn(5, *s.shape) for n, s in zip(model.prior_distributions(), model.sites)}
    x = torch.randn(6, 3)
    out = model.network(draws, x)
    assert out.shape == (5, 6, 2)
    p = {n: v[2] for n, v in draws.items()}
    manual = fn(x @ p["layers.0.weight"].T + p["layers.0.bias"]) @ p["layers.1.weight"].T + p["layers.1.bias"]
    assert torch.allclose(out[2], manual, atol=1e-6)


def test_subsample_scales_likelihood_by_dataset_size():
    model = pyrobdl.BayesianMLP(2, (), 1, likelihood=pyrobdl.likelihoods.Gaussian(1.0))
    x, y = torch.randn(40, 2), torch.randn(40)
    idx = torch.arange(10)
    trace = poutine.trace(model).get_trace(x, y, idx)
    assert trace.nodes["obs"]["scale"] == pytest.approx(4.0)
    assert trace.nodes["obs"]["value"].shape == (10, 1)


def test_prior_scale_conventions():
    model = pyrobdl.BayesianMLP(4, (9,), 1, prior=Gaussian("fan_in", gain=2.0))
    p = model.prior_distributions()
    assert p["layers.0.weight"].base_dist.scale[0, 0].item() == pytest.approx(2.0 / math.sqrt(4))
    assert p["layers.1.weight"].base_dist.scale[0, 0].item() == pytest.approx(2.0 / 3.0)
    model = pyrobdl.BayesianMLP(4, (9,), 1, prior=Gaussian([1.0, 0.5], bias_scale=3.0))
    p = model.prior_distributions()
    assert p["layers.1.weight"].base_dist.scale.unique().tolist() == [0.5]
    assert p["layers.0.bias"].base_dist.scale.unique().tolist() == [3.0]
    assert p["layers.0.weight"].event_shape == (9, 4) and p["layers.0.weight"].batch_shape == ()


def test_prior_hook_is_the_only_extension_point():
    class Laplace(pyrobdl.priors.Prior):
        def site_distribution(self, site: Site, device=None):
            return pyro.distributions.Laplace(torch.zeros(site.shape, device=device), 1.0).to_event(len(site.shape))

    model = pyrobdl.BayesianMLP(2, (3,), 1, prior=Laplace())
    trace = poutine.trace(model).get_trace(torch.randn(4, 2))
    assert isinstance(trace.nodes["layers.1.weight"]["fn"].base_dist, pyro.distributions.Laplace)


def test_learned_precision_site_and_categorical_obs():
    model = pyrobdl.BayesianMLP(2, (3,), 1, likelihood=pyrobdl.likelihoods.GaussianLearnedPrecision(2.0, 3.0))
    trace = poutine.trace(model).get_trace(torch.randn(4, 2), torch.randn(4))
    assert isinstance(trace.nodes["precision"]["fn"], pyro.distributions.Gamma)
    clf = pyrobdl.BayesianMLP(2, (3,), 5, likelihood=pyrobdl.likelihoods.Categorical())
    trace = poutine.trace(clf).get_trace(torch.randn(4, 2), torch.tensor([0, 4, 2, 1]))
    assert isinstance(trace.nodes["obs"]["fn"], pyro.distributions.Categorical)


def test_predictive_vectorized_matches_layout():
    model = pyrobdl.BayesianMLP(2, (3,), 1, likelihood=pyrobdl.likelihoods.GaussianLearnedPrecision())
    guide = pyrobdl.guides.MeanField(model)
    out = pyro.infer.Predictive(model, guide=guide, num_samples=7, parallel=True,
                                return_sites=["obs", "_RETURN"])(torch.randn(5, 2))
    assert out["obs"].shape == (7, 5, 1)
    assert out["_RETURN"].shape == (7, 5, 1)


@pytest.mark.parametrize("kwargs, match", [
    ({"activation": "sigmoid"}, "unknown activation"),
    ({"hidden": (0,)}, r"hidden\[0\]"),
    ({"in_features": 2.5}, "in_features"),
    ({"prior": Gaussian([1.0, 1.0, 1.0])}, "3 entries"),
    ({"prior": "gaussian"}, "prior must be"),
    ({"likelihood": pyrobdl.likelihoods.Categorical(), "out_features": 1}, "out_features"),
])
def test_model_errors(kwargs, match):
    args = {"in_features": 3, "hidden": (4,), "out_features": 1, **kwargs}
    with pytest.raises((ValueError, TypeError), match=match):
        pyrobdl.BayesianMLP(**args)


@pytest.mark.parametrize("make, match", [
    (lambda: Gaussian(0.0), "scale"),
    (lambda: Gaussian(-1.0), "scale"),
    (lambda: Gaussian([1.0, -2.0]), r"scale\[1\]"),
    (lambda: Gaussian(float("nan")), "scale"),
    (lambda: Gaussian("he"), "fan_in"),
    (lambda: Gaussian(1.0, bias_scale=0), "bias_scale"),
    (lambda: pyrobdl.likelihoods.Gaussian(0.0), "precision"),
    (lambda: pyrobdl.likelihoods.Gaussian(-3), "precision"),
    (lambda: pyrobdl.likelihoods.GaussianLearnedPrecision(concentration=0), "concentration"),
    (lambda: pyrobdl.likelihoods.GaussianLearnedPrecision(rate=-1), "rate"),
    (lambda: pyrobdl.guides.MeanField(pyrobdl.BayesianMLP(2, (), 1), init_scale=0.0), "init_scale"),
    (lambda: pyrobdl.guides.MeanField(pyrobdl.BayesianMLP(2, (), 1), init_loc="zero"), "init_loc"),
    (lambda: pyrobdl.guides.MeanField(pyrobdl.BayesianMLP(2, (), 1), init_loc={"w": torch.zeros(1)}), "unknown sites"),
])
def test_component_errors(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_mean_field_init_options():
    model = pyrobdl.BayesianMLP(4, (), 1)
    w = torch.arange(4.0).reshape(1, 4)
    guide = pyrobdl.guides.MeanField(model, init_scale=0.3, init_loc={"layers.0.weight": w})
    q = guide.variational_distributions()["layers.0.weight"].base_dist
    assert torch.equal(q.loc.detach(), w)
    assert torch.allclose(q.scale, torch.full((1, 4), 0.3))
    guide = pyrobdl.guides.MeanField(pyrobdl.BayesianMLP(16, (), 1), init_loc="linear")
    loc = guide.variational_distributions()["layers.0.weight"].base_dist.loc
    assert loc.abs().max() <= 0.25 and loc.std() > 0  # U(-1/sqrt(16), 1/sqrt(16)), like nn.Linear


def test_model_without_biases():
    """``bias=False``: no bias sites anywhere (trace, priors, guides, draws); the output is x W^T."""
    model = pyrobdl.BayesianMLP(2, (3,), 1, activation="tanh", bias=False)
    names = [s.name for s in model.sites]
    assert names == ["layers.0.weight", "layers.1.weight"] and list(model.prior_distributions()) == names
    x = torch.randn(6, 2)
    trace = pyro.poutine.trace(model).get_trace(x)
    latents = [n for n, site in trace.nodes.items() if site["type"] == "sample" and n not in ("data", "obs")]
    assert latents == names
    w0, w1 = trace.nodes["layers.0.weight"]["value"], trace.nodes["layers.1.weight"]["value"]
    torch.testing.assert_close(trace.nodes["_RETURN"]["value"], torch.tanh(x @ w0.T) @ w1.T)
    assert "bias=False" in repr(model)
    posterior = pyrobdl.fit(model, x, torch.randn(6), "mean_field", num_steps=3, progress=False)
    assert set(posterior.sample(2)) == set(names)
    assert posterior.predict(x, 4).mean.shape == (6, 1)
    with pytest.raises(TypeError, match="bias must be True or False"):
        pyrobdl.BayesianMLP(2, (3,), 1, bias=0)
