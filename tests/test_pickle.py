"""pickle.dumps / pickle.loads of every registered method's posterior: equal predictions.

joblib, multiprocessing and Ray move fitted objects between processes with pickle; on disk the
safe format stays :meth:`pyrobdl.Posterior.save` / :func:`pyrobdl.load_posterior` (no pickle,
tested in test_saving.py).
"""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch

import pyrobdl

from test_saving import data, model_for, tiny

CASES = [(name, "regression") for name in pyrobdl.methods()] + [("dropout", "classification"),
                                                                 ("chees", "classification")]


@pytest.mark.parametrize("name, task", CASES)
def test_pickle_round_trip_gives_equal_predictions(name, task):
    x, y = data(task)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # tiny MCMC runs are not certified, and say so
        posterior = pyrobdl.fit(model_for(name, task), x, y, name, seed=0, progress=False, **tiny(name))
    loaded = pickle.loads(pickle.dumps(posterior))
    assert type(loaded) is type(posterior) and loaded.method == name and loaded is not posterior
    assert loaded.cost == posterior.cost and loaded.settings.keys() == posterior.settings.keys()
    assert (loaded.certification is None) == (posterior.certification is None)
    x_new = torch.randn(7, 2, generator=torch.Generator().manual_seed(5))
    a, b = posterior.predict(x_new, 16, seed=3), loaded.predict(x_new, 16, seed=3)
    torch.testing.assert_close(b.samples, a.samples, rtol=0, atol=0)
    torch.testing.assert_close(b.mean, a.mean, rtol=0, atol=0)
    torch.testing.assert_close(b.variance, a.variance, rtol=0, atol=0)


def test_model_pickles_to_the_same_prior():
    model = model_for("map", "regression")
    copy = pickle.loads(pickle.dumps(model))
    assert repr(copy) == repr(model)
    for (name, p), (name2, q) in zip(model.prior_distributions().items(), copy.prior_distributions().items()):
        assert name == name2
        v = p.sample()
        torch.testing.assert_close(q.log_prob(v), p.log_prob(v), rtol=0, atol=0)
