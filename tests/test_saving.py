"""Posterior.save / pyrobdl.load_posterior: every registered method, no pickle, equal predictions."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

import pyrobdl
from pyrobdl.inference.registry import get_method

TINY = {
    "bbvi": {"num_steps": 5, "num_particles": 2},
    "hmc": {"num_warmup": 5, "num_samples": 6, "num_chains": 2, "num_steps": 3},
    "nuts": {"num_warmup": 5, "num_samples": 6, "num_chains": 2, "max_tree_depth": 3},
    "chees": {"num_warmup": 5, "num_samples": 6, "num_chains": 4},
}
GENERIC = {"num_steps": 10}


def tiny(name: str) -> dict:
    return TINY.get(name) or {k: v for k, v in GENERIC.items() if k in get_method(name).options}


def model_for(name: str, task: str):
    prior = pyrobdl.priors.LogUniform() if name == "variational_dropout" else pyrobdl.priors.Gaussian([1.0, 0.5])
    if task == "classification":
        return pyrobdl.BayesianMLP(2, (5,), 3, activation="tanh", prior=prior,
                                   likelihood=pyrobdl.likelihoods.Categorical())
    return pyrobdl.BayesianMLP(2, (5,), 1, prior=prior, likelihood=pyrobdl.likelihoods.GaussianLearnedPrecision(),
                               bias=task != "regression-no-bias")


def data(task: str):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 2, generator=g)
    if task == "classification":
        return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return x, x.sum(1) + 0.1 * torch.randn(20, generator=g)


# every method on regression; classification (a Categorical likelihood in the saved spec) for one
# guide and one sampler keeps the default run short
CASES = [(name, "regression") for name in pyrobdl.methods()] + [("dropout", "classification"),
                                                                 ("chees", "classification")]


@pytest.mark.parametrize("name, task", CASES)
def test_round_trip_gives_equal_predictions(tmp_path, name, task):
    x, y = data(task)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # tiny MCMC runs are not certified, and say so
        posterior = pyrobdl.fit(model_for(name, task), x, y, name, seed=0, progress=False, **tiny(name))
    path = posterior.save(tmp_path / "saved")
    assert sorted(p.name for p in path.iterdir()) == ["posterior.json", "tensors.pt"]
    # plain tensors only: loadable with weights_only=True (torch refuses pickled objects there)
    flat = torch.load(path / "tensors.pt", weights_only=True)
    assert all(isinstance(v, torch.Tensor) for v in flat.values())
    meta = json.loads((path / "posterior.json").read_text())
    assert meta["method"] == name and meta["model"]["hidden"] == [5]

    loaded = pyrobdl.load_posterior(path)
    assert type(loaded) is type(posterior) and loaded.method == name
    assert loaded.cost == posterior.cost
    assert loaded.settings == json.loads(json.dumps(posterior.settings))
    np.testing.assert_array_equal(loaded.history, np.asarray(posterior.history, dtype=np.float64))
    assert (loaded.certification is None) == (posterior.certification is None)
    if posterior.certification is not None:
        assert loaded.certification.to_dict() == posterior.certification.to_dict()
    x_new = torch.randn(7, 2, generator=torch.Generator().manual_seed(5))
    a, b = posterior.predict(x_new, 16, seed=3), loaded.predict(x_new, 16, seed=3)
    torch.testing.assert_close(b.samples, a.samples, rtol=0, atol=0)
    torch.testing.assert_close(b.mean, a.mean, rtol=0, atol=0)
    torch.testing.assert_close(b.variance, a.variance, rtol=0, atol=0)


def test_model_without_biases_and_pruned_guide_round_trip(tmp_path):
    x, y = data("regression")
    model = pyrobdl.BayesianMLP(2, (5,), 1, prior=pyrobdl.priors.LogUniform(), bias=False)
    fitted = pyrobdl.fit(model, x, y, "variational_dropout", num_steps=20, progress=False)
    pruned = pyrobdl.guides.pruned_posterior(fitted, threshold=-1.0)  # prunes some weights of a short fit
    loaded = pyrobdl.load_posterior(pruned.save(tmp_path / "p"))
    assert loaded.model.bias is False and "layers.0.bias" not in loaded.sample(1)
    assert loaded.settings["prune_threshold"] == -1.0
    torch.testing.assert_close(loaded.predict(x, 8, seed=1).mean, pruned.predict(x, 8, seed=1).mean, rtol=0, atol=0)


def test_settings_that_json_cannot_hold_fall_back_to_defaults(tmp_path):
    x, y = data("regression")
    model = pyrobdl.BayesianMLP(2, (3,), 1)
    init = {"layers.0.weight": torch.ones(3, 2)}
    posterior = pyrobdl.fit(model, x, y, "map", num_steps=3, init_loc=init, progress=False)
    loaded = pyrobdl.load_posterior(posterior.save(tmp_path / "p"))
    assert "__unserialisable__" in loaded.settings["init_loc"]["layers.0.weight"]
    torch.testing.assert_close(loaded.predict(x, 2).mean, posterior.predict(x, 2).mean, rtol=0, atol=0)


def test_save_and_load_errors(tmp_path):
    x, y = data("regression")
    posterior = pyrobdl.fit(pyrobdl.BayesianMLP(2, (3,), 1), x, y, "map", num_steps=2, progress=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="not a saved posterior"):
        posterior.save(tmp_path / "file")
    with pytest.raises(FileNotFoundError, match="is not a saved posterior"):
        pyrobdl.load_posterior(tmp_path / "nothing")
    path = posterior.save(tmp_path / "p")
    posterior.save(path)  # replacing an earlier save is fine
    meta = json.loads((path / "posterior.json").read_text())
    (path / "posterior.json").write_text(json.dumps({**meta, "class": {"module": "os", "name": "system"}}))
    with pytest.raises(ValueError, match="not part of pyrobdl"):
        pyrobdl.load_posterior(path)
    (path / "posterior.json").write_text(json.dumps({**meta, "format_version": 99}))
    with pytest.raises(ValueError, match="version 99"):
        pyrobdl.load_posterior(path)


def test_an_svi_guide_is_rebuilt_through_the_registry_hook(tmp_path, monkeypatch):
    # the posterior contract does not import the registry (docs/architecture.md): a loaded SVI
    # posterior rebuilds its guide through SVIPosterior.guide_builder, which load_posterior installs
    from pyrobdl.posterior import SVIPosterior

    x, y = data("regression")
    posterior = pyrobdl.fit(model_for("mean_field", "regression"), x, y, "mean_field", seed=0, progress=False,
                            **tiny("mean_field"))
    path = posterior.save(tmp_path / "saved")
    monkeypatch.setattr(SVIPosterior, "guide_builder", None)
    with pytest.raises(RuntimeError, match="needs the method registry"):
        SVIPosterior._from_state(posterior.model, {}, {}, {"method": "mean_field", "settings": {}})
    loaded = pyrobdl.load_posterior(path)
    assert SVIPosterior.guide_builder is not None
    torch.testing.assert_close(loaded.predict(x, 8, seed=1).mean, posterior.predict(x, 8, seed=1).mean)
