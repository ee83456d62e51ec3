"""Every registered method on a model without biases (``BayesianMLP(bias=False)``).

The method list comes from the registry, with the tiny settings and special priors of
``test_inference_data``: a method registered tomorrow is held to this contract the same day.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from test_inference_data import MODEL_FACTORIES, tiny_settings

import pyrobdl


#: Methods whose tiny fit takes more than a few seconds on the 2-core machine (measured 4-5 s each).
SLOW = {"bbvi", "nuts"}


@pytest.mark.parametrize("name", [pytest.param(m, marks=pytest.mark.slow) if m in SLOW else m
                                  for m in pyrobdl.methods()])
def test_every_method_fits_and_predicts_a_model_without_biases(name):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(24, 2, generator=g)
    y = torch.sin(2 * x[:, 0]) + 0.1 * torch.randn(24, generator=g)
    prior = MODEL_FACTORIES.get(name, lambda: pyrobdl.priors.Gaussian(1.0))()
    model = pyrobdl.BayesianMLP(2, (5,), 1, prior=prior, likelihood=pyrobdl.likelihoods.Gaussian(10.0), bias=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # tiny MCMC runs are announced as uncertified
        post = pyrobdl.fit(model, x, y, name, seed=0, progress=False, **tiny_settings(name))
    draws = post.sample(4, seed=0)
    assert set(draws) == {"layers.0.weight", "layers.1.weight"}
    assert draws["layers.0.weight"].shape == (4, 5, 2) and draws["layers.1.weight"].shape == (4, 1, 5)
    pred = post.predict(x[:6], 4, seed=0)
    assert pred.samples.shape == (4, 6, 1) and bool(torch.isfinite(pred.samples).all())
    # the network has no bias: f(0) = 0 at every draw
    assert float(post.predict(torch.zeros(1, 2), 4, seed=0).samples.abs().max()) == 0.0
