"""``to_inference_data`` for every registered method, PSIS-LOO on it, and the diagnostic plots.

The method list comes from the registry, so a method is tested the day it is registered: its
tiny settings come from ``TINY_SETTINGS`` when it has an entry, else from ``GENERIC_TINY``
filtered to the options it takes; a method that needs a special model has an entry in
``MODEL_FACTORIES``.
"""

from __future__ import annotations

import io
import json
import warnings
from functools import lru_cache

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from conftest import DEVICES
from matplotlib.figure import Figure

import pyrobdl
from pyrobdl.diagnostics import fit_diagnostics, metrics, plots
from pyrobdl.diagnostics.arviz_adapter import az, pointwise_log_likelihood
from pyrobdl.inference.registry import get_method
from pyrobdl.posterior import Cost, Posterior

#: Per-method tiny settings (a few seconds at most on a busy 2-core machine).
TINY_SETTINGS = {
    "bbvi": {"num_steps": 10, "num_particles": 2},
    "hmc": {"num_warmup": 10, "num_samples": 10, "num_chains": 2, "num_steps": 4},
    "nuts": {"num_warmup": 10, "num_samples": 10, "num_chains": 2, "max_tree_depth": 4},
    "chees": {"num_warmup": 10, "num_samples": 10, "num_chains": 4},
}
#: Fallback for methods without an entry: whichever of these options the method takes.
GENERIC_TINY = {"num_steps": 30, "num_warmup": 10, "num_samples": 10, "num_chains": 2}
#: Methods whose results must carry sampler statistics (the ``sample_stats`` group).
MCMC_METHODS = {"nuts", "hmc", "chees"}
GROUPS = ("posterior", "posterior_predictive", "log_likelihood", "observed_data", "constant_data")


def _log_uniform():
    return pyrobdl.priors.LogUniform()


#: Methods that need a prior other than the default Gaussian.
MODEL_FACTORIES = {"variational_dropout": _log_uniform}


def tiny_settings(name: str) -> dict:
    if name in TINY_SETTINGS:
        return TINY_SETTINGS[name]
    options = get_method(name).options
    return {k: v for k, v in GENERIC_TINY.items() if k in options}


def data(task: str):
    g = torch.Generator().manual_seed(1)
    if task == "classification":
        x = torch.randn(24, 2, generator=g)
        y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
        return x, y
    x = torch.randn(24, 1, generator=g)
    return x, torch.sin(2 * x[:, 0]) + 0.1 * torch.randn(24, generator=g)


def make_model(name: str, task: str):
    prior = MODEL_FACTORIES.get(name, lambda: pyrobdl.priors.Gaussian(1.0))()
    if task == "classification":
        return pyrobdl.BayesianMLP(2, (6,), 3, prior=prior, likelihood=pyrobdl.likelihoods.Categorical())
    return pyrobdl.BayesianMLP(1, (6,), 1, prior=prior, likelihood=pyrobdl.likelihoods.Gaussian(10.0))


@lru_cache(maxsize=None)
def fitted(name: str, task: str):
    """One tiny fit per (method, task), shared by the tests of this module.

    Tiny MCMC runs are not certified as references, and their samplers saturate: ``fit`` says so
    with UserWarnings, recorded here (and checked: a failed certification must have been announced).
    """
    x, y = data(task)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        posterior = pyrobdl.fit(make_model(name, task), x, y, name, seed=0, progress=False, **tiny_settings(name))
    assert all(issubclass(w.category, UserWarning) for w in caught), [str(w.message) for w in caught]
    cert = posterior.certification
    announced = any("not certified as a reference" in str(w.message) for w in caught)
    assert announced == (cert is not None and not cert.passed), [str(w.message) for w in caught]
    return posterior, x, y


@lru_cache(maxsize=None)
def idata_of(name: str, task: str):
    posterior, x, y = fitted(name, task)
    return posterior.to_inference_data(x, y, num_samples=40, seed=0)


def no_default_dims(idata) -> list[str]:
    return [d for g in idata.groups() for d in getattr(idata, g).dims if "dim_" in str(d)]


@pytest.mark.parametrize("task", ["regression", "classification"])
@pytest.mark.parametrize("name", pyrobdl.methods())
def test_inference_data_groups_dims_and_loo(name, task):
    posterior, x, y = fitted(name, task)
    idata = idata_of(name, task)
    draws = posterior.sample(3, seed=0)
    point = all(bool((v == v[:1]).all()) for v in draws.values())
    assert idata.attrs["point_estimate"] == int(point)
    if point:  # a point estimate: one draw, no log_likelihood for ArviZ to misread (test below)
        assert not hasattr(idata, "log_likelihood")
        assert idata.posterior.sizes["chain"] == 1 and idata.posterior.sizes["draw"] == 1
        return
    for group in GROUPS:
        assert hasattr(idata, group), f"{name}: missing group {group}"
    n = x.shape[0]
    ll = idata.log_likelihood["y"]
    c, d = ll.sizes["chain"], ll.sizes["draw"]
    # the DESIGN.md trap: exactly (chain, draw, obs), nothing else
    assert ll.dims == ("chain", "draw", "obs") and ll.shape == (c, d, n)
    assert no_default_dims(idata) == []
    assert set(idata.posterior.data_vars) == set(posterior.model.prior_distributions())
    w0 = idata.posterior["layers.0.weight"]
    assert w0.dims == ("chain", "draw", "hidden_0", "feature")
    out = "class" if task == "classification" else "output"
    assert idata.posterior_predictive["f"].dims == ("chain", "draw", "obs", out)
    assert idata.posterior_predictive["y"].shape == (c, d, n)
    np.testing.assert_array_equal(idata.observed_data["y"].values, y.numpy())
    np.testing.assert_allclose(idata.constant_data["x"].values, x.numpy())
    assert idata.attrs["method"] == name
    assert json.loads(idata.attrs["settings"])["seed"] == 0
    assert json.loads(idata.attrs["cost"])["gradient_evaluations"] == posterior.cost.gradient_evaluations
    for lib in ("pyrobdl_version", "pyro_version", "torch_version", "arviz_version"):
        assert isinstance(idata.attrs[lib], str)

    with warnings.catch_warnings():
        # ArviZ warns about large Pareto k; k-hat is a property of the (tiny) fit, not the contract
        warnings.simplefilter("ignore", UserWarning)
        loo = az.loo(idata, pointwise=True)
    assert np.isfinite(loo["elpd_loo"])
    # plausibility: each point's PSIS-LOO density is a weighted mean of its per-draw likelihoods,
    # so it lies between their minimum and maximum
    lls = ll.values.reshape(c * d, n)
    assert np.all(loo["loo_i"].values >= lls.min(0) - 1e-9) and np.all(loo["loo_i"].values <= lls.max(0) + 1e-9)

    if name in MCMC_METHODS:
        assert hasattr(idata, "sample_stats") and "diverging" in idata.sample_stats
        assert idata.sample_stats["diverging"].dims == ("chain", "draw")
        assert idata.sample_stats["diverging"].shape == (c, d)
    else:
        assert not hasattr(idata, "sample_stats")


def test_map_is_exported_as_a_point_estimate_that_arviz_refuses_to_score():
    """A point mass with a log_likelihood group made az.waic report the in-sample fit with
    p_waic = 0 and az.compare rank MAP first (issue 14); without the group ArviZ refuses."""
    posterior, x, y = fitted("map", "regression")
    idata = posterior.to_inference_data(x, y, num_samples=40, seed=0)
    assert idata.attrs["point_estimate"] == 1 and "log_likelihood" not in idata.groups()
    np.testing.assert_array_equal(idata.posterior["layers.0.weight"].values[0, 0],
                                  posterior.sample(1)["layers.0.weight"][0].numpy())
    for score in (az.loo, az.waic):
        with pytest.raises(TypeError, match="log likelihood"):
            score(idata)


@pytest.mark.parametrize("name", pyrobdl.methods())
def test_fit_diagnostics_for_every_method(name):
    posterior, x, y = fitted(name, "regression")
    scores = fit_diagnostics(posterior, x, y, num_samples=40, seed=0)
    ll = pointwise_log_likelihood(posterior, x, y, 40, seed=0)
    point_mass = np.ptp(ll.reshape(-1, ll.shape[-1]), axis=0).max() == 0
    loo_keys = {"loo_ll", "loo_ll_se", "loo_p", "loo_pareto_k_max", "loo_pareto_k_bad_fraction"}
    assert loo_keys.isdisjoint(scores) if point_mass else loo_keys <= set(scores)
    assert all(isinstance(v, float) for v in scores.values())
    if "loo_ll" in scores:
        assert np.isfinite(scores["loo_ll"])
        # per-point LOO density never exceeds the in-sample lpd by much (importance weights
        # favour draws that fit the point worse)
        assert scores["loo_ll"] <= metrics.log_predictive_density(ll.reshape(-1, ll.shape[-1])).mean() + 1e-6


def test_summary_works_without_warnings_for_pseudo_chains():
    idata = idata_of("mean_field", "regression")
    assert idata.posterior.sizes["chain"] == 4  # 40 draws -> 4 pseudo-chains of 10
    summary = az.summary(idata, var_names=["layers.1.bias"])
    assert np.isfinite(summary["r_hat"]).all()


def test_learned_precision_and_multiple_outputs():
    x, y1 = data("regression")
    y = torch.stack([y1, -y1], -1)
    model = pyrobdl.BayesianMLP(1, (4,), 2, likelihood=pyrobdl.likelihoods.GaussianLearnedPrecision())
    posterior = pyrobdl.fit(model, x, y, "mean_field", num_steps=20, progress=False)
    idata = posterior.to_inference_data(x, y, num_samples=8, seed=0)
    assert idata.posterior["precision"].dims == ("chain", "draw")
    assert idata.observed_data["y"].dims == ("obs", "output")
    assert idata.posterior_predictive["y"].dims == ("chain", "draw", "obs", "output")
    assert idata.log_likelihood["y"].dims == ("chain", "draw", "obs")
    assert no_default_dims(idata) == []


def test_netcdf_round_trip(tmp_path):
    idata = idata_of("mean_field", "classification")
    path = tmp_path / "idata.nc"
    idata.to_netcdf(str(path))
    back = az.from_netcdf(str(path))
    assert back.attrs["method"] == "mean_field"
    np.testing.assert_allclose(back.log_likelihood["y"].values, idata.log_likelihood["y"].values)


def test_read_inference_data_is_lazy_equal_and_closed(tmp_path):
    """The report's reader: the same values as an eager read, nothing loaded until accessed, and
    the file closed when the block ends (it can be replaced, as a resumed suite does)."""
    from pyrobdl.diagnostics.arviz_adapter import read_inference_data

    idata = idata_of("mean_field", "classification")
    path = tmp_path / "idata.nc"
    idata.to_netcdf(str(path))
    with read_inference_data(path) as back:
        var = back.posterior_predictive["f"].variable
        assert not isinstance(var._data, np.ndarray)  # still on disk
        np.testing.assert_array_equal(back.posterior_predictive["f"].values, idata.posterior_predictive["f"].values)
        assert back.attrs["method"] == "mean_field"
    path.unlink()
    idata.to_netcdf(str(path))  # rewritten after the block: no handle left open on it
    with read_inference_data(path) as back:
        np.testing.assert_array_equal(back.log_likelihood["y"].values, idata.log_likelihood["y"].values)


def test_read_inference_data_opens_only_the_groups_asked_for(tmp_path):
    """The rank plots' reader: one group, lazily, with the values of the whole-file read; no other
    group; the file closed when the block ends."""
    from pyrobdl.diagnostics.arviz_adapter import read_inference_data

    idata = idata_of("nuts", "regression")
    path = tmp_path / "idata.nc"
    idata.to_netcdf(str(path))
    with read_inference_data(path, ["posterior_predictive"]) as back:
        assert back.groups() == ["posterior_predictive"]
        f = back.posterior_predictive["f"]
        assert not isinstance(f.variable._data, np.ndarray)  # still on disk
        np.testing.assert_array_equal(f.values, idata.posterior_predictive["f"].values)
        assert f.dims == idata.posterior_predictive["f"].dims
    path.unlink()
    idata.to_netcdf(str(path))  # no handle left open
    with read_inference_data(path, []) as back:
        assert back.groups() == []


@pytest.mark.parametrize("name", ["mean_field", "nuts"])
def test_stored_dims_are_those_of_the_written_groups(tmp_path, name):
    """The report's cheap look into a stored file (which cells get rank plots): every group and
    every dimension size that ArviZ writes, read back from the file's metadata alone."""
    from pyrobdl.diagnostics.arviz_adapter import stored_dims

    idata = idata_of(name, "regression")
    path = tmp_path / "idata.nc"
    idata.to_netcdf(str(path))
    want = {g: {d: int(n) for d, n in getattr(idata, g).sizes.items()} for g in idata.groups()}
    assert stored_dims(path) == want
    assert ("sample_stats" in want) == (name == "nuts")  # what rank_plots selects on


def test_to_inference_data_is_reproducible_from_the_seed():
    posterior, x, y = fitted("mean_field", "regression")
    a = posterior.to_inference_data(x, y, num_samples=8, seed=3)
    b = posterior.to_inference_data(x, y, num_samples=8, seed=3)
    np.testing.assert_array_equal(a.posterior_predictive["y"].values, b.posterior_predictive["y"].values)


def test_to_inference_data_bad_input():
    posterior, x, y = fitted("mean_field", "regression")
    with pytest.raises(ValueError, match="features"):
        posterior.to_inference_data(torch.zeros(5, 3), torch.zeros(5))
    with pytest.raises(ValueError, match="one row per row of x"):
        posterior.to_inference_data(x, y[:-1])
    with pytest.raises(ValueError, match="num_samples"):
        posterior.to_inference_data(x, y, num_samples=0)
    clf, xc, _ = fitted("mean_field", "classification")
    with pytest.raises(ValueError, match="labels outside"):
        clf.to_inference_data(xc, torch.full((xc.shape[0],), 7))


# ----------------------------------------------------------------------------- MCMC-shaped hooks


class ChainsPosterior(Posterior):
    """Stored [chain, draw] draws and sampler statistics, as an MCMC result provides them."""

    def __init__(self, model, chains, stats):
        cost = Cost(wall_time_s=0.0, gradient_evaluations=0, epochs=0.0, peak_memory_bytes=0, device="cpu")
        super().__init__(model, method="chains", settings={}, cost=cost)
        self.chains, self.stats = chains, stats

    def _draw(self, num_samples):
        flat = {k: v.reshape(-1, *v.shape[2:]) for k, v in self.chains.items()}
        return {k: v[torch.arange(num_samples) % v.shape[0]] for k, v in flat.items()}

    def _chains(self, num_samples):
        return self.chains

    def _sample_stats(self, num_samples):
        return self.stats


def chains_posterior(stats_shape=(3, 7)):
    model = pyrobdl.BayesianMLP(1, (), 1, likelihood=pyrobdl.likelihoods.Gaussian(4.0))
    g = torch.Generator().manual_seed(0)
    chains = {"layers.0.weight": 1 + 0.1 * torch.randn(3, 7, 1, 1, generator=g),
              "layers.0.bias": 0.1 * torch.randn(3, 7, 1, generator=g)}
    diverging = np.zeros(stats_shape, dtype=bool)
    diverging[1, 2] = True
    stats = {"diverging": diverging, "step_size": np.full(stats_shape, 0.1), "tree_depth": np.full(stats_shape, 3)}
    return ChainsPosterior(model, chains, stats)


def test_chains_and_sample_stats_hooks():
    posterior = chains_posterior()
    x = torch.linspace(-1, 1, 5)[:, None]
    idata = posterior.to_inference_data(x, x[:, 0], num_samples=1000)  # stored chains win
    assert idata.posterior.sizes["chain"] == 3 and idata.posterior.sizes["draw"] == 7
    assert idata.sample_stats["diverging"].dims == ("chain", "draw")
    assert int(idata.sample_stats["diverging"].sum()) == 1
    fig = plots.plot_trace(idata, space="weights")
    assert isinstance(fig, Figure)


def test_misaligned_sample_stats_are_rejected():
    posterior = chains_posterior(stats_shape=(3, 6))
    x = torch.linspace(-1, 1, 5)[:, None]
    with pytest.raises(ValueError, match="_sample_stats"):
        posterior.to_inference_data(x, x[:, 0])


# ----------------------------------------------------------------------------- plots


def _rendered(fig) -> bool:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=30)
    return buf.tell() > 500


def _bands():
    posterior, x, y = fitted("mean_field", "regression")
    return plots.plot_predictive_bands(posterior, torch.linspace(-3, 3, 40)[:, None], x_train=x, y_train=y,
                                       num_samples=50)


def _pit():
    posterior, x, y = fitted("mean_field", "regression")
    pred = posterior.predict(x, 50, seed=0)
    pit = metrics.gaussian_mixture_pit(y.numpy(), pred.samples[..., 0].numpy(), 10.0**-0.5)
    return plots.plot_pit(pit, bins=5)


def _reliability():
    clf, xc, yc = fitted("mean_field", "classification")
    return plots.plot_reliability(metrics.reliability_table(clf.predict(xc, 50).mean.numpy(), yc.numpy(), num_bins=5))


PLOTS = {
    "bands": _bands,
    "pit": _pit,
    "reliability": _reliability,
    "elbo": lambda: plots.plot_elbo(fitted("mean_field", "regression")[0]),
    "rank_function": lambda: plots.plot_rank(idata_of("mean_field", "regression")),
    "rank_weights": lambda: plots.plot_rank(idata_of("mean_field", "regression"), space="weights"),
    "rank_classification": lambda: plots.plot_rank(idata_of("mean_field", "classification")),
    "trace_function": lambda: plots.plot_trace(idata_of("nuts", "regression")),
}


@pytest.mark.parametrize("kind", sorted(PLOTS))
def test_plots_return_figures_and_register_nothing_with_pyplot(kind):
    before = plt.get_fignums()
    fig = PLOTS[kind]()
    assert isinstance(fig, Figure) and fig.axes and _rendered(fig)
    assert plt.get_fignums() == before


def test_plot_into_existing_axes():
    posterior, _, _ = fitted("map", "regression")
    fig = Figure()
    ax = fig.subplots()
    assert plots.plot_elbo(posterior, ax=ax) is fig


def test_plot_bad_input():
    clf, xc, _ = fitted("mean_field", "classification")
    with pytest.raises(ValueError, match="one input and one output"):
        plots.plot_predictive_bands(clf, xc)
    with pytest.raises(ValueError, match="no objective history"):
        plots.plot_elbo(chains_posterior())
    with pytest.raises(ValueError, match="unknown space"):
        plots.plot_rank(idata_of("mean_field", "regression"), space="latent")
    with pytest.raises(ValueError, match="pit"):
        plots.plot_pit(np.array([0.2, 1.5]))


@pytest.mark.parametrize("device", DEVICES)
def test_diagnostics_on_every_device(device):
    x, y = data("regression")
    model = make_model("mean_field", "regression")
    posterior = pyrobdl.fit(model, x, y, "mean_field", num_steps=5, device=device, progress=False)
    xd, yd = x.to(device), y.to(device)
    idata = posterior.to_inference_data(xd, yd, num_samples=8, seed=0)
    assert idata.log_likelihood["y"].shape == (2, 4, x.shape[0])
    scores = pyrobdl.diagnostics.evaluate(posterior, xd, yd, reference=posterior, num_samples=8)
    assert all(np.isfinite(v) for v in scores.values())
    assert "vi_pareto_k" in fit_diagnostics(posterior, xd, yd, num_samples=8)


def test_the_adapter_refuses_what_is_not_a_posterior():
    # the adapter sits below the posterior contract (docs/architecture.md) and checks the hooks it
    # reads instead of the class: a guide, a dict or a posterior class itself is refused
    from pyrobdl.diagnostics.arviz_adapter import chain_draws, to_inference_data
    from pyrobdl.posterior import SVIPosterior

    x, y = torch.zeros(3, 1), torch.zeros(3)
    for wrong in ({"model": None}, SVIPosterior, object()):
        with pytest.raises(TypeError, match="must be a pyrobdl Posterior"):
            to_inference_data(wrong, x, y, 8)
        with pytest.raises(TypeError, match="must be a pyrobdl Posterior"):
            chain_draws(wrong, 8)
