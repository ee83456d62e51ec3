"""One predictive per posterior: every consumer of a posterior's draws scores the same predictive.

``evaluate`` (the tables), the ArviZ export (``to_inference_data``), the training-data PSIS-LOO
(``pointwise_log_likelihood``, used by ``fit_diagnostics``) and the report's calibration curve
(``compare.artifacts.calibration_curve``) all go through ``Posterior.function``; with the same
draws (same ``num_samples`` and ``seed``) they must give the same numbers, for every registered
method — and for Laplace with ``predictive="linearized"``, whose function is not the network.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from scipy.special import logsumexp
from test_inference_data import MODEL_FACTORIES, tiny_settings

import pyrobdl
from pyrobdl.compare.artifacts import calibration_curve
from pyrobdl.datasets._data import RegressionData
from pyrobdl.diagnostics import evaluate
from pyrobdl.diagnostics.arviz_adapter import pointwise_log_likelihood

#: The draws are the same, so the numbers differ only by float32 round-off of the network outputs.
ROUND_OFF = 1e-5
CASES = [(m, {}) for m in pyrobdl.methods()] + [("laplace", {"predictive": "linearized"}),
                                                 ("laplace", {"predictive": "linearized", "hessian": "kron"})]
SLOW = {"bbvi", "nuts"}


def _data() -> RegressionData:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 1, generator=g)
    y = torch.sin(2 * x[:, 0]) + 0.1 * torch.randn(40, generator=g)
    return RegressionData("toy", x[:24], y[:24], x[24:], y[24:])


def _draw_count(post) -> int:
    """Draws every consumer sees: an MCMC posterior's stored draws (its ArviZ export ignores
    ``num_samples``), else 40."""
    return post.num_chains * post.num_draws if hasattr(post, "num_draws") else 40


@pytest.mark.parametrize("name, options", [
    pytest.param(m, o, marks=pytest.mark.slow, id=m) if m in SLOW else
    pytest.param(m, o, id="-".join([m, *map(str, o.values())])) for m, o in CASES])
def test_every_consumer_scores_the_posteriors_own_predictive(name, options):
    data = _data()
    prior = MODEL_FACTORIES.get(name, lambda: pyrobdl.priors.Gaussian(1.0))()
    model = pyrobdl.BayesianMLP(1, (8,), 1, activation="tanh", prior=prior,
                                likelihood=pyrobdl.likelihoods.Gaussian(20.0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # tiny MCMC runs are announced as uncertified
        post = pyrobdl.fit(model, data.x_train, data.y_train, name, seed=0, progress=False,
                           **{**tiny_settings(name), **options})
    s, seed = _draw_count(post), 3
    table = evaluate(post, data.x_test, data.y_test, num_samples=s, seed=seed)

    # PSIS-LOO's input (fit_diagnostics) and the ArviZ export's test log-likelihood equal evaluate's
    ll = pointwise_log_likelihood(post, data.x_test, data.y_test, s, seed=seed)
    lpd = logsumexp(ll.reshape(-1, ll.shape[-1]), 0) - np.log(ll.shape[0] * ll.shape[1])
    assert abs(float(lpd.mean()) - table["test_ll"]) < ROUND_OFF
    idata = post.to_inference_data(data.x_test, data.y_test, num_samples=s, seed=seed)
    f_export = idata.posterior_predictive["f"].values.reshape(-1, data.x_test.shape[0])
    pred = post.predict(data.x_test, s, seed=seed)
    if hasattr(idata, "log_likelihood"):  # a point estimate is exported without one
        ll = idata.log_likelihood["y"].values
        lpd = logsumexp(ll.reshape(-1, ll.shape[-1]), 0) - np.log(ll.shape[0] * ll.shape[1])
        assert abs(float(lpd.mean()) - table["test_ll"]) < ROUND_OFF
        np.testing.assert_allclose(np.sort(f_export, 0), np.sort(pred.samples[..., 0].numpy(), 0), atol=ROUND_OFF)

    # the calibration figure's coverage equals the table's at the table's levels
    curve = calibration_curve(post, data, s, seed)
    for level, observed in zip(curve["calib_level"], curve["calib_observed"]):
        key = f"coverage_{round(100 * level)}"
        if key in table:
            assert observed == pytest.approx(table[key], abs=1e-12), key
