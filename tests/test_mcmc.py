"""NUTS and HMC: exact posteriors of Bayesian linear regression, the posterior contract, the
sampler's bookkeeping (gradient counts, seeds), and reference posteriors on disk."""

from __future__ import annotations

import contextlib

import json
import math
import re
import warnings

import numpy as np
import pyro
import pytest
import torch
from conftest import DEVICES
from pyro.infer.autoguide.initialization import init_to_sample
from pyro.infer.mcmc.util import initialize_model

import pyrobdl
from pyrobdl.datasets import bayesian_linear_regression
from pyrobdl.diagnostics import convergence
from pyrobdl.inference import MCMCPosterior, load_reference, run_reference
from pyrobdl.inference.mcmc import chain_seeds
from pyrobdl.inference.mcmc_kernels import _direct_potential, _flat_potential

PRECISION = 10.0
PRIOR_SCALE = 1.0
# Monte Carlo tolerance: an estimate may be Z standard errors (sd / sqrt(ESS), with ArviZ's bulk
# ESS of the very quantity averaged) from the exact value.  Z = 4 is a 6e-5 two-sided chance per
# check, about 1e-3 over the ~15 checks of one test, leaving room for ESS estimation error.
Z = 4.0
# ... and the check is only meaningful if the standard error is small: with ESS >= 100 the
# tolerance on a mean is at most 0.4 posterior sd.
MIN_ESS = 100.0
# The convergence requirement.
GOOD_RHAT = 1.05
# Short runs for the bookkeeping tests (shapes, counts, seeds): statistics are not checked there.
TINY = dict(num_warmup=10, num_samples=8, progress=False)


def depth_saturated():
    """The bookkeeping tests cap NUTS's tree depth at 3-4 to stay cheap; from a prior draw of a
    small MLP every such iteration reaches the cap, and ``fit`` says so (the warning is tested on
    its own in ``test_nuts_warns_when_the_tree_depth_saturates``)."""
    return pytest.warns(UserWarning, match=r"hit max_tree_depth=")


def uncertified():
    """Every run of this module is too short to be certified as a reference posterior (function-space
    R-hat and ESS, divergences, E-BFMI: tests/test_certification.py), and ``fit`` says so."""
    return pytest.warns(UserWarning, match=r"posterior is not certified as a reference: ")


@pytest.fixture(scope="module")
def blr():
    return bayesian_linear_regression(100, 20, 3, prior_scale=PRIOR_SCALE, precision=PRECISION, seed=0)


def blr_model(likelihood=None) -> pyrobdl.BayesianMLP:
    return pyrobdl.BayesianMLP(
        3, (), 1, prior=pyrobdl.priors.Gaussian(PRIOR_SCALE),
        likelihood=likelihood or pyrobdl.likelihoods.Gaussian(PRECISION),
    )


def small_mlp(likelihood=None, out_features: int = 1) -> pyrobdl.BayesianMLP:
    return pyrobdl.BayesianMLP(2, (4,), out_features, activation="tanh", likelihood=likelihood)


def small_data(n: int = 20, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=g)
    return x, torch.sin(x[:, 0]) + 0.1 * torch.randn(n, generator=g)


def blr_draws(posterior: MCMCPosterior) -> np.ndarray:
    """Draws of (w_1, w_2, w_3, b), the exact posterior's coordinate order, ``[C, D, 4]``."""
    s = posterior.samples
    c, d = posterior.num_chains, posterior.num_draws
    return torch.cat([s["layers.0.weight"].reshape(c, d, -1), s["layers.0.bias"].reshape(c, d, -1)], -1).double().numpy()


def assert_moments(draws: np.ndarray, mean: np.ndarray, cov: np.ndarray) -> None:
    """Posterior mean and covariance within Z Monte Carlo standard errors, and R-hat < 1.05."""
    conv = convergence(draws)
    assert conv["rhat"].max() < GOOD_RHAT, conv["rhat"]
    assert conv["ess_bulk"].min() >= MIN_ESS, conv["ess_bulk"]
    sd = np.sqrt(np.diag(cov))
    err = np.abs(draws.mean((0, 1)) - mean)
    assert (err <= Z * sd / np.sqrt(conv["ess_bulk"])).all(), (err / sd, conv["ess_bulk"])
    # Sigma_ij = E[(t_i - mu_i)(t_j - mu_j)] with the exact mu: the Monte Carlo average of the
    # products estimates it, with standard error sd(product) / sqrt(ESS of the product).
    i, j = np.triu_indices(len(mean))
    centred = draws - mean
    prods = centred[..., i] * centred[..., j]
    conv_p = convergence(prods)
    assert conv_p["ess_bulk"].min() >= MIN_ESS, conv_p["ess_bulk"]
    mcse = prods.std((0, 1)) / np.sqrt(conv_p["ess_bulk"])
    err_p = np.abs(prods.mean((0, 1)) - cov[i, j])
    assert (err_p <= Z * mcse).all(), (err_p / mcse, cov[i, j])


# --------------------------------------------------------------------- exact posteriors (BLR)
# HMC with a fixed trajectory length spends ~90% of a short warm-up's gradients before the mass
# matrix is adapted (~50 steps per iteration at the unscaled step size); three (jittered) steps
# per iteration keep the default test cheap, the slow test below covers the default trajectory.
# These settings passed for seeds 0-8 for both samplers (a 600-draw HMC test without jitter
# failed for 3 of seeds 1-8: second moments mix badly when a fixed length is near half a period).
@pytest.mark.parametrize("method, extra", [("nuts", {}), ("hmc", {"num_steps": 3})])
def test_blr_exact_posterior(blr, method, extra):
    # the direct potential keeps this fast; test_direct_potential_* prove it equals Pyro's
    with uncertified():  # tail ESS ~250 < 400: exact enough for these checks, too short for a reference
        posterior = pyrobdl.fit(blr_model(), blr.x_train, blr.y_train, method=method, num_warmup=100,
                                num_samples=250, num_chains=2, potential="direct", progress=False, **extra)
    assert_moments(blr_draws(posterior), blr.posterior.mean.numpy(), blr.posterior.covariance.numpy())
    assert posterior.diagnostics["weight_space"]["rhat_max"] < GOOD_RHAT
    assert posterior.diagnostics["function_space"]["rhat_max"] < GOOD_RHAT
    assert sum(posterior.diagnostics["divergences"]) == 0


@pytest.mark.slow
@pytest.mark.parametrize("method", ["nuts", "hmc"])
def test_blr_exact_posterior_default_settings(blr, method):
    """Pyro's traced potential, four chains, the default init, longer runs."""
    posterior = pyrobdl.fit(blr_model(), blr.x_train, blr.y_train, method=method, num_warmup=300,
                            num_samples=500, progress=False)
    assert posterior.num_chains == 4
    assert_moments(blr_draws(posterior), blr.posterior.mean.numpy(), blr.posterior.covariance.numpy())


def exact_precision_posterior(x: torch.Tensor, y: torch.Tensor, a: float, b: float) -> tuple[float, float]:
    r"""Mean and sd of p(tau | y) for BLR with N(0, s^2) weights and bias, Gamma(a, b) on tau.

    y | tau ~ N(0, K + I / tau) with K = s^2 Phi Phi^T; quadrature on a fine grid of tau.
    """
    phi = np.concatenate([x.double().numpy(), np.ones((x.shape[0], 1))], 1)
    lam, u = np.linalg.eigh(PRIOR_SCALE**2 * phi @ phi.T)
    r2 = (u.T @ y.double().numpy()) ** 2
    tau = np.linspace(0.5, 40.0, 20000)
    var = lam[None, :] + 1.0 / tau[:, None]
    log_post = (a - 1) * np.log(tau) - b * tau - 0.5 * np.log(var).sum(1) - 0.5 * (r2 / var).sum(1)
    w = np.exp(log_post - log_post.max())
    w /= w.sum()
    mean = float((w * tau).sum())
    return mean, float(np.sqrt((w * (tau - mean) ** 2).sum()))


@pytest.mark.slow  # over 20 s on a loaded core: the slow run (CI runs it too) keeps the default run under 5 minutes
def test_learned_precision_posterior():
    data = bayesian_linear_regression(200, 10, 3, prior_scale=PRIOR_SCALE, precision=PRECISION, seed=1)
    a, b = 2.0, 0.2  # prior mean 10, sd 7: weak next to 200 points
    model = blr_model(pyrobdl.likelihoods.GaussianLearnedPrecision(a, b))
    with uncertified():
        posterior = pyrobdl.fit(model, data.x_train, data.y_train, method="nuts", num_warmup=75,
                                num_samples=150, num_chains=2, potential="direct", progress=False)
    tau = posterior.samples["precision"].double().numpy()
    assert tau.shape == (2, 150) and (tau > 0).all()
    exact_mean, exact_sd = exact_precision_posterior(data.x_train, data.y_train, a, b)
    conv = convergence(tau)
    assert conv["rhat"] < GOOD_RHAT and conv["ess_bulk"] >= MIN_ESS
    assert abs(tau.mean() - exact_mean) <= Z * tau.std() / math.sqrt(conv["ess_bulk"])
    assert abs(tau.std() / exact_sd - 1) < 0.25  # sd of an sd estimate ~ 1/sqrt(2 ESS) <= 0.07
    # easy data: the truth lies within 3 posterior sd
    assert abs(exact_mean - PRECISION) < 3 * exact_sd
    assert set(posterior.diagnostics["latents"]) == {"precision"}


# ------------------------------------------------------------------------- posterior contract
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["nuts", "hmc"])
def test_small_mlp_contract(method, device):
    x, y = small_data()
    model = small_mlp(pyrobdl.likelihoods.GaussianLearnedPrecision())
    if method == "nuts":
        with uncertified(), depth_saturated():
            posterior = pyrobdl.fit(model, x, y, method=method, num_chains=2, max_tree_depth=4, device=device, **TINY)
    else:
        with uncertified():
            posterior = pyrobdl.fit(model, x, y, method=method, num_chains=2, num_steps=5, device=device, **TINY)
    assert isinstance(posterior, MCMCPosterior) and posterior.method == method
    x_test = torch.randn(7, 2)
    for s in (5, 16, 40):  # fewer than, exactly, and more than the 16 stored draws
        pred = posterior.predict(x_test, num_samples=s)
        assert pred.samples.shape == (s, 7, 1)
        for t in (pred.mean, pred.variance, pred.epistemic_variance, pred.aleatoric_variance):
            assert t.shape == (7, 1) and torch.isfinite(t).all()
        assert pred.log_likelihood(torch.zeros(7)).shape == (s, 7)
    draws = posterior.sample(16)
    assert draws["layers.0.weight"].shape == (16, 4, 2) and draws["precision"].shape == (16,)
    # 16 draws of 16: every stored draw once, in chain-major order; deterministic
    assert torch.equal(draws["layers.1.bias"], posterior.samples["layers.1.bias"].reshape(16, 1))
    assert torch.equal(posterior.sample(40)["precision"][16:32], draws["precision"])
    cost = posterior.cost
    assert cost.device.startswith(device) and cost.wall_time_s > 0 and cost.peak_memory_bytes > 0
    d = posterior.diagnostics
    for key in ("divergences", "step_size", "accept_prob", "acceptance_rate", "leapfrog_steps_warmup",
                "leapfrog_steps_sampling", "other_gradient_evaluations", "ebfmi"):
        assert len(d[key]) == 2, key
    assert ("mean_tree_depth" in d) == (method == "nuts")
    assert ("num_steps_cap_hits_warmup" in d) == ("num_steps_cap_hits_sampling" in d) == (method == "hmc")
    assert posterior.trace.energy.shape == (2, 18) and np.isfinite(posterior.trace.energy).all()
    assert d["function_space"]["num_points"] == 20 and d["weight_space"]["num_quantities"] == 8 + 4 + 4 + 1 + 1
    assert posterior.trace.num_steps.shape == (2, 18)
    # history: the per-iteration log joint averaged over chains, warm-up included (was empty)
    np.testing.assert_allclose(posterior.history, posterior.trace.log_joint.mean(0))
    assert posterior.history.shape == (18,) and np.isfinite(posterior.history).all()
    conv = posterior.function_space_convergence(x_test)
    assert conv["rhat"].shape == (7, 1) and conv["ess_bulk"].shape == (7, 1)
    json.dumps(d)  # plain numbers and lists: a result record can store them as they are


def test_arviz_hooks_return_the_stored_chains():
    x, y = small_data()
    with uncertified(), depth_saturated():
        posterior = pyrobdl.fit(small_mlp(), x, y, method="nuts", num_chains=2, max_tree_depth=3, **TINY)
    chains = posterior._chains(1)
    assert chains["layers.0.weight"].shape == (2, 8, 4, 2)
    stats = posterior._sample_stats(1)
    assert set(stats) == {"diverging", "step_size", "n_steps", "acceptance_rate", "lp", "tree_depth", "energy"}
    assert all(v.shape == (2, 8) for v in stats.values())
    np.testing.assert_array_equal(stats["n_steps"], posterior.trace.num_steps[:, 10:])
    np.testing.assert_array_equal(stats["energy"], posterior.trace.energy[:, 10:])
    idata = posterior.to_inference_data(x, y)
    assert idata.posterior.sizes["chain"] == 2 and idata.posterior.sizes["draw"] == 8
    assert idata.sample_stats["tree_depth"].shape == (2, 8)


def test_classification_contract():
    x, _ = small_data()
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    model = small_mlp(pyrobdl.likelihoods.Categorical(), out_features=3)
    with uncertified(), depth_saturated():
        posterior = pyrobdl.fit(model, x, y, method="nuts", num_chains=2, max_tree_depth=4, **TINY)
    pred = posterior.predict(x[:5], num_samples=10)
    assert pred.samples.shape == (10, 5, 3) and pred.aleatoric_variance is None
    torch.testing.assert_close(pred.mean.sum(-1), torch.ones(5))
    # function-space diagnostics on class probabilities
    assert posterior.function_space_convergence(x[:5])["rhat"].shape == (5, 3)


# -------------------------------------------------------------------------- errors up front
def test_improper_prior_raises_before_running(monkeypatch):
    import pyrobdl.inference.mcmc as mcmc

    monkeypatch.setattr(mcmc, "initialize_model", lambda *a, **k: pytest.fail("sampling started"))
    model = pyrobdl.BayesianMLP(2, (3,), 1, prior=pyrobdl.priors.LogUniform())
    x, y = small_data()
    for method in ("nuts", "hmc"):
        with pytest.raises(ValueError, match="improper"):
            pyrobdl.fit(model, x, y, method=method, progress=False)


@pytest.mark.parametrize(
    "method, options, match",
    [
        ("nuts", {"init_strategy": "uniform"}, r"init_strategy.*valid: \['median', 'sample', 'map', 'ensemble'\]"),
        ("nuts", {"potential": "jax"}, "potential"),
        ("nuts", {"potential": "direct", "jit_compile": True}, "jit_compile"),
        ("nuts", {"potential": "flat", "jit_compile": True}, "jit_compile"),
        ("nuts", {"num_chains": 0}, "num_chains"),
        ("nuts", {"num_warmup": -1}, "num_warmup"),
        ("nuts", {"target_accept_prob": 1.0}, "target_accept_prob"),
        ("nuts", {"max_tree_depth": 0}, "max_tree_depth"),
        ("nuts", {"trajectory_length": 1.0}, "does not take"),
        ("hmc", {"max_tree_depth": 5}, "does not take"),
        ("hmc", {"trajectory_length": -1.0}, "trajectory_length"),
        ("hmc", {"num_steps": 0}, "num_steps"),
        ("hmc", {"jitter": 1.0}, "jitter"),
        ("hmc", {"step_size": float("nan")}, "step_size"),
    ],
)
def test_bad_options_raise_before_running(monkeypatch, method, options, match):
    import pyrobdl.inference.mcmc as mcmc

    monkeypatch.setattr(mcmc, "initialize_model", lambda *a, **k: pytest.fail("sampling started"))
    x, y = small_data()
    with pytest.raises(ValueError, match=match):
        pyrobdl.fit(small_mlp(), x, y, method=method, progress=False, **options)


def test_auto_potential_is_flat_where_the_flat_log_joint_applies():
    class MyPrior(pyrobdl.priors.Gaussian):  # a user's own prior: only Pyro's trace knows it
        pass

    x, y = small_data()
    kw = dict(method="hmc", num_chains=1, num_steps=2, **TINY)
    cases = [(small_mlp(), {}, "flat"), (small_mlp(), {"jit_compile": True}, "trace"),
             (pyrobdl.BayesianMLP(2, (4,), 1, prior=MyPrior(1.0)), {}, "trace"),
             (small_mlp(), {"potential": "direct"}, "direct")]
    for model, extra, expected in cases:
        with uncertified():
            post = pyrobdl.fit(model, x, y, **kw, **extra)
        assert post.settings["potential"] == expected, (extra, expected)


def test_flat_potential_refuses_a_model_it_does_not_implement_before_running(monkeypatch):
    import pyrobdl.inference.mcmc as mcmc

    monkeypatch.setattr(mcmc, "initialize_model", lambda *a, **k: pytest.fail("sampling started"))
    x, y = small_data()
    class MyPrior(pyrobdl.priors.Gaussian):  # a user's own prior: the flat log joint cannot know it
        pass

    model = pyrobdl.BayesianMLP(2, (4,), 1, prior=MyPrior(1.0))
    with pytest.raises(TypeError, match="supports priors.Gaussian, not MyPrior"):
        pyrobdl.fit(model, x, y, method="hmc", potential="flat", progress=False)


def test_bool_options_must_be_bool():
    x, y = small_data()
    with pytest.raises(TypeError, match="jit_compile"):
        pyrobdl.fit(small_mlp(), x, y, method="nuts", jit_compile=1, progress=False)


# ------------------------------------------------------------------------ seeds and counting
def test_chains_reproducible_from_seed():
    x, y = small_data()
    kw = dict(method="nuts", max_tree_depth=3, num_warmup=4, num_samples=4, progress=False)
    with uncertified(), depth_saturated():
        runs = [pyrobdl.fit(small_mlp(), x, y, num_chains=3, seed=s, **kw) for s in (3, 3, 4)]
    a, b, c = (r.samples["layers.0.weight"] for r in runs)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)
    assert not torch.allclose(a[0], a[1])  # chains are seeded differently
    np.testing.assert_array_equal(runs[0].trace.num_steps, runs[1].trace.num_steps)
    # a chain's seed does not depend on how many chains there are
    assert chain_seeds(3, 2) == chain_seeds(3, 3)[:2]
    with uncertified(), depth_saturated():
        two = pyrobdl.fit(small_mlp(), x, y, num_chains=2, seed=3, **kw)
    assert torch.equal(two.samples["layers.0.weight"], a[:2])


def test_hmc_counts_every_leapfrog_step():
    x, y = small_data()
    with uncertified():
        posterior = pyrobdl.fit(small_mlp(), x, y, method="hmc", num_warmup=5, num_samples=10, num_chains=2,
                                adapt_step_size=False, step_size=0.05, num_steps=7, jitter=0.0, progress=False)
    assert posterior.cost.gradient_evaluations == 2 * 15 * 7
    assert (posterior.trace.num_steps == 7).all()
    # the one gradient at each chain's start, no step-size search
    assert posterior.diagnostics["other_gradient_evaluations"] == [1, 1]
    assert posterior.diagnostics["leapfrog_steps_sampling"] == [70, 70]
    assert posterior.diagnostics["num_steps_cap_hits_warmup"] == posterior.diagnostics["num_steps_cap_hits_sampling"] \
        == [0, 0]
    assert posterior.trace.tree_depth is None
    assert all(0 <= r <= 1 for r in posterior.diagnostics["acceptance_rate"])


def test_step_size_search_is_not_counted_as_leapfrog_steps():
    # With adaptation, Pyro re-runs its step-size search at the end of each warm-up window
    # (inside kernel.sample); those evaluations must not leak into the per-iteration counts.
    x, y = small_data()
    with uncertified():
        posterior = pyrobdl.fit(small_mlp(), x, y, method="hmc", num_warmup=30, num_samples=5, num_chains=1,
                                num_steps=3, jitter=0.0, progress=False)
    assert (posterior.trace.num_steps == 3).all()
    assert posterior.cost.gradient_evaluations == 35 * 3
    assert posterior.diagnostics["other_gradient_evaluations"][0] > 1 + 2  # the start + searches


def test_hmc_trajectory_length_sets_steps():
    x, y = small_data()
    with uncertified():
        posterior = pyrobdl.fit(small_mlp(), x, y, method="hmc", num_warmup=0, num_samples=5, num_chains=1,
                                adapt_step_size=False, step_size=0.1, trajectory_length=0.75, jitter=0.0,
                                progress=False)
    assert (posterior.trace.num_steps == 8).all()  # ceil(0.75 / 0.1), as NumPyro


def test_hmc_jitter_varies_the_trajectory():
    x, y = small_data()
    kw = dict(method="hmc", num_warmup=0, num_samples=40, num_chains=1, adapt_step_size=False, step_size=0.1,
              progress=False)
    with uncertified():
        fixed = pyrobdl.fit(small_mlp(), x, y, num_steps=4, jitter=0.5, **kw).trace.num_steps
    assert set(np.unique(fixed)) <= {2, 3, 4, 5, 6} and len(np.unique(fixed)) >= 3  # round(4 u), u in (0.5, 1.5)
    with uncertified():
        length = pyrobdl.fit(small_mlp(), x, y, trajectory_length=0.8, jitter=0.25, **kw).trace.num_steps
    assert set(np.unique(length)) <= {6, 7, 8, 9, 10} and len(np.unique(length)) >= 3  # ceil(8 u), u in (0.75, 1.25)


def test_nuts_trace_is_consistent():
    x, y = small_data()
    with uncertified(), depth_saturated():
        posterior = pyrobdl.fit(small_mlp(), x, y, method="nuts", num_chains=2, max_tree_depth=3, **TINY)
    tr, d = posterior.trace, posterior.diagnostics
    assert posterior.cost.gradient_evaluations == tr.num_steps.sum()
    assert d["leapfrog_steps_warmup"] == tr.num_steps[:, :10].sum(1).tolist()
    assert (tr.num_steps >= 1).all() and (tr.num_steps <= 2**3 - 1).all()
    np.testing.assert_array_equal(tr.tree_depth, [[int(n).bit_length() for n in row] for row in tr.num_steps])
    assert ((tr.accept_prob >= 0) & (tr.accept_prob <= 1 + 1e-6)).all()
    assert np.isfinite(tr.log_joint).all()
    assert min(d["other_gradient_evaluations"]) >= 1  # the start, plus step-size searches


def test_map_init_goes_through_the_registry():
    x, y = small_data()
    with uncertified(), depth_saturated():
        posterior = pyrobdl.fit(small_mlp(), x, y, method="nuts", num_chains=2, max_tree_depth=3,
                                init_strategy="map", map_num_steps=30, **TINY)
    d = posterior.diagnostics
    assert d["map_gradient_evaluations"] == 2 * 30  # one MAP fit per chain, one particle per step
    assert posterior.cost.gradient_evaluations == posterior.trace.num_steps.sum() + 60


def test_ensemble_init_starts_each_chain_at_its_member(monkeypatch):
    from pyrobdl.inference import mcmc

    given, real = [], mcmc._init_strategy

    def spy(*args, **kwargs):
        given.append(args[5] if len(args) > 5 else kwargs.get("member"))
        return real(*args, **kwargs)

    monkeypatch.setattr(mcmc, "_init_strategy", spy)
    x, y = small_data()
    with uncertified(), depth_saturated():
        posterior = pyrobdl.fit(small_mlp(), x, y, method="nuts", num_chains=2, max_tree_depth=3,
                                init_strategy="ensemble", map_num_steps=30, seed=0, **TINY)
    ens = pyrobdl.fit(small_mlp(), x, y, method="ensemble", num_members=2, num_steps=30, seed=0, progress=False)
    d = posterior.diagnostics
    assert d["map_gradient_evaluations"] == 2 * 30  # one batched ensemble of 2 members
    assert posterior.cost.gradient_evaluations == posterior.trace.num_steps.sum() + 60
    # chain c starts at member c of the (seeded, hence reproducible) ensemble
    assert len(given) == 2
    for c, member in enumerate(given):
        for name, value in ens.members.items():
            assert torch.equal(member[name], value[c])


@pytest.mark.parametrize("init", ["median", "sample"])
def test_init_strategies_run(init):
    x, y = small_data()
    with uncertified():
        posterior = pyrobdl.fit(small_mlp(), x, y, method="hmc", num_chains=2, num_steps=3, init_strategy=init, **TINY)
    assert posterior.num_draws == 8
    # "median" starts both chains from one point: the trace records them as one superchain
    assert posterior.trace.superchain_size == (2 if init == "median" else 1)


# ----------------------------------------------------------------- direct and flat potentials
@pytest.mark.parametrize("kind", ["direct", "flat"])
@pytest.mark.parametrize("likelihood", ["fixed", "learned", "categorical"])
def test_direct_and_flat_potentials_equal_pyros_traced_potential(kind, likelihood):
    x, y = small_data()
    if likelihood == "categorical":
        model, y = small_mlp(pyrobdl.likelihoods.Categorical(), out_features=3), (y > 0).long() + (y > 0.5).long()
    else:
        model = small_mlp(pyrobdl.likelihoods.GaussianLearnedPrecision(3.0, 2.0) if likelihood == "learned" else None)
    _, traced, transforms, _ = initialize_model(model, (x, y), init_strategy=init_to_sample)
    direct = _direct_potential(model, x, y, transforms) if kind == "direct" else _flat_potential(model, x, y)
    for seed in range(3):
        pyro.set_rng_seed(seed)
        z, _, _, _ = initialize_model(model, (x, y), init_strategy=init_to_sample)
        z = {k: v.requires_grad_() for k, v in z.items()}
        a, b = direct(z), traced(z)
        ga = torch.autograd.grad(a, list(z.values()))
        gb = torch.autograd.grad(b, list(z.values()))
        torch.testing.assert_close(a, b)
        for u, v in zip(ga, gb):
            torch.testing.assert_close(u, v)


@pytest.mark.parametrize("kind,method,likelihood", [("direct", "nuts", "fixed"), ("flat", "nuts", "fixed"),
                                                    ("flat", "nuts", "learned"), ("flat", "hmc", "learned")])
def test_direct_flat_and_traced_potentials_give_the_same_chain(kind, method, likelihood):
    # The direct potential does Pyro's float32 arithmetic in Pyro's order; the flat one sums in its
    # own order, and NUTS amplifies float32 rounding over iterations (1e-4 after 18 here), so
    # the flat chain is compared in float64, where the same chain agrees to ~1e-12.  The flat
    # potential runs Pyro's sampler on one site (the sites packed in Pyro's order): the same
    # momentum draws, mass matrix and tree, so the same chain, a positive site (the learned
    # precision, through exp) included.
    if kind == "flat":
        torch.set_default_dtype(torch.float64)
    try:
        x, y = small_data()
        steps = dict(max_tree_depth=4) if method == "nuts" else dict(num_steps=3)
        kw = dict(method=method, num_chains=1, **steps, **TINY)
        lik = (lambda: pyrobdl.likelihoods.GaussianLearnedPrecision(3.0, 2.0)) if likelihood == "learned" else lambda: None
        saturated = depth_saturated if method == "nuts" else contextlib.nullcontext
        with uncertified(), saturated():
            a = pyrobdl.fit(small_mlp(lik()), x, y, potential="trace", **kw)
        with uncertified(), saturated():
            b = pyrobdl.fit(small_mlp(lik()), x, y, potential=kind, **kw)
    finally:
        torch.set_default_dtype(torch.float32)
    tol = dict(atol=1e-5, rtol=1e-4) if kind == "direct" else dict(atol=1e-9, rtol=1e-9)
    assert set(a.samples) == set(b.samples) and len(a.samples) == (5 if likelihood == "learned" else 4)
    for k in a.samples:
        assert a.samples[k].dtype == (torch.float32 if kind == "direct" else torch.float64)
        assert a.samples[k].shape == b.samples[k].shape
        torch.testing.assert_close(a.samples[k], b.samples[k], **tol)
    # the chain moved (a stuck chain would agree trivially)
    assert max(float(v.std(1).max()) for v in b.samples.values()) > 0


def test_jit_compile_traces_once_and_follows_the_same_chain(monkeypatch):
    traces = []
    real_trace = torch.jit.trace
    monkeypatch.setattr(torch.jit, "trace", lambda *a, **k: traces.append(1) or real_trace(*a, **k))
    x, y = small_data()
    kw = dict(method="nuts", num_chains=2, max_tree_depth=4, **TINY)
    with uncertified(), depth_saturated():
        a = pyrobdl.fit(small_mlp(), x, y, jit_compile=False, **kw)
    with uncertified(), depth_saturated():
        b = pyrobdl.fit(small_mlp(), x, y, jit_compile=True, **kw)
    assert len(traces) == 1  # one compiled potential shared by both chains
    # The compiled potential rounds differently and NUTS amplifies rounding over iterations, so
    # the chains agree closely only at first: compare the first iterations of each chain.
    np.testing.assert_array_equal(a.trace.num_steps[:, :3], b.trace.num_steps[:, :3])
    np.testing.assert_allclose(a.trace.log_joint[:, :3], b.trace.log_joint[:, :3], rtol=1e-4)


# -------------------------------------------------------------------------- reference files
@pytest.fixture
def reference(tmp_path):
    x, y = small_data()
    model = small_mlp(pyrobdl.likelihoods.GaussianLearnedPrecision())
    x_eval = torch.randn(6, 2, generator=torch.Generator().manual_seed(5))
    with uncertified(), depth_saturated():
        ref = run_reference(model, x, y, x_eval, tmp_path / "ref.npz", thin=3, num_chains=2, max_tree_depth=3,
                            **TINY)
    return model, x_eval, ref


def test_reference_round_trip(reference):
    model, x_eval, ref = reference
    assert ref.function_draws.shape == (16, 6, 1) and ref.latents["precision"].shape == (16,)
    assert ref.draws["layers.0.weight"].shape == (2, 3, 4, 2)  # draws 0, 3, 6 of each chain
    loaded = load_reference(ref.path)  # no model: the likelihood is rebuilt from the sidecar
    assert type(loaded.likelihood) is type(model.likelihood)
    pred = loaded.prediction()
    assert pred.samples.shape == (16, 6, 1)
    torch.testing.assert_close(loaded.x_eval, x_eval)
    y = torch.zeros(6)
    torch.testing.assert_close(pred.log_likelihood(y), ref.prediction().log_likelihood(y))
    # the thinned weights pushed through the network again give the stored function draws
    thinned = ref.posterior(model).predict(x_eval, num_samples=6)
    torch.testing.assert_close(thinned.samples, pred.samples.reshape(2, 8, 6, 1)[:, ::3].reshape(6, 6, 1))
    # usable as the reference of the metrics module, which reads x_eval and prediction()
    with pytest.warns(UserWarning, match="agreement with an uncertified reference means nothing"):
        scores = pyrobdl.diagnostics.evaluate(ref.posterior(model), x_eval, torch.zeros(6), reference=loaded,
                                              num_samples=6)
    assert math.isfinite(scores["w2_to_reference"])
    assert scores["reference_certified"] == 0.0 and not loaded.certification.passed
    meta = loaded.metadata
    assert meta["method"] == "nuts" and meta["num_chains"] == 2 and meta["thin"] == 3
    assert meta["cost"]["gradient_evaluations"] > 0 and "function_space" in meta["diagnostics"]


def test_reference_files_are_checked(reference, tmp_path):
    model, x_eval, ref = reference
    x, y = small_data()
    with pytest.raises(FileExistsError, match="ref.npz"):
        run_reference(model, x, y, x_eval, ref.path, **TINY)
    with pytest.raises(ValueError, match="different model"):
        load_reference(ref.path, model=pyrobdl.BayesianMLP(2, (5,), 1))
    data = bytearray(ref.path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    ref.path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=re.escape(str(ref.path))):
        load_reference(ref.path)
    ref.path.with_suffix(".json").write_text("{not json")
    with pytest.raises(ValueError, match="ref.json"):
        load_reference(ref.path)
    with pytest.raises(FileNotFoundError, match="missing.npz"):
        load_reference(tmp_path / "missing.npz")
    with pytest.raises(ValueError, match=".npz"):
        run_reference(model, x, y, x_eval, tmp_path / "ref.pt", **TINY)
    assert not list(tmp_path.glob(".*.tmp"))  # no temporary files left behind


# ------------------------------------------------------------------ HMC's cap on leapfrog steps
def test_hmc_num_steps_never_exceeds_max_num_steps():
    """The kernel's step count, with no sampling: a collapsed step size and a jittered fixed count."""
    from pyrobdl.inference.mcmc import HMC_OPTIONS, _HMC

    def zero(z):
        return torch.zeros(())

    # the gradient budget of NUTS's default tree depth 10 (2**10 - 1 = 1023 leapfrog steps)
    assert HMC_OPTIONS["max_num_steps"] == 1024
    kernel = _HMC(potential_fn=zero, step_size=1e-6, trajectory_length=math.pi / 2)
    assert kernel._wanted_num_steps() == math.ceil((math.pi / 2) / 1e-6)  # 1,570,797 without the cap
    assert kernel.num_steps == 1024 and kernel._num_steps_capped()
    fixed = _HMC(potential_fn=zero, num_steps=10, fixed_num_steps=10, jitter=0.5, max_num_steps=12)
    for scale, steps, capped in [(0.5, 5, False), (1.2, 12, False), (1.26, 12, True), (1.49, 12, True)]:
        fixed._scale = scale  # what the jitter draws in sample(): round(10 * scale) steps before the cap
        assert (fixed.num_steps, fixed._num_steps_capped()) == (steps, capped), scale


def test_hmc_cap_bounds_a_collapsed_step_size():
    """The measured stall cannot recur: with step size 1e-6 HMC would ask ceil((pi/2) / 1e-6) =
    1,570,797 leapfrog steps per iteration (an outside check saw one iteration take ~190,000)."""
    x, y = small_data()
    with uncertified(), pytest.warns(UserWarning, match=r"max_num_steps=64 cut the leapfrog steps of 6 of 6 "
                                                        r"iterations") as record:
        posterior = pyrobdl.fit(small_mlp(), x, y, method="hmc", num_warmup=1, num_samples=2, num_chains=2,
                                step_size=1e-6, adapt_step_size=False, max_num_steps=64, potential="direct",
                                progress=False)
    [message] = [str(w.message) for w in record if "max_num_steps" in str(w.message)]
    assert "[1, 1] in warm-up, [2, 2] while sampling" in message and "warm-up" in message
    assert (posterior.trace.num_steps == 64).all()
    assert posterior.cost.gradient_evaluations == 2 * 3 * 64
    d = posterior.diagnostics
    assert d["num_steps_cap_hits_warmup"] == [1, 1] and d["num_steps_cap_hits_sampling"] == [2, 2]


def test_hmc_cap_hits_are_counted_per_phase():
    """Two runs with one seed draw the same jitter (leapfrog steps use no randomness): with
    max_num_steps=15 the cap never binds (round(10 u) <= 15 for u < 1.5), so that run's step counts
    are the uncapped ones, and the max_num_steps=12 run must cut exactly those above 12."""
    x, y = small_data()
    kw = dict(method="hmc", num_warmup=10, num_samples=30, num_chains=1, num_steps=10, jitter=0.5, step_size=0.05,
              adapt_step_size=False, adapt_mass_matrix=False, potential="direct", progress=False)
    with uncertified():  # and no cap warning: filterwarnings=error
        wanted = pyrobdl.fit(small_mlp(), x, y, max_num_steps=15, **kw)
    assert wanted.diagnostics["num_steps_cap_hits_warmup"] == wanted.diagnostics["num_steps_cap_hits_sampling"] == [0]
    with uncertified(), pytest.warns(UserWarning, match=r"max_num_steps=12 cut"):
        capped = pyrobdl.fit(small_mlp(), x, y, max_num_steps=12, **kw)
    uncapped = wanted.trace.num_steps[0]
    np.testing.assert_array_equal(capped.trace.num_steps[0], np.minimum(uncapped, 12))
    hits = uncapped > 12
    assert hits.any() and not hits.all()  # the comparison is not vacuous
    assert capped.diagnostics["num_steps_cap_hits_warmup"] == [int(hits[:10].sum())]
    assert capped.diagnostics["num_steps_cap_hits_sampling"] == [int(hits[10:].sum())]


@pytest.mark.parametrize(
    "options, match",
    [
        ({"max_num_steps": 0}, r"max_num_steps must be an integer >= 1"),
        ({"max_num_steps": 100.0}, r"max_num_steps must be an integer >= 1"),
        ({"max_num_steps": True}, r"max_num_steps must be an integer >= 1"),
        ({"num_steps": 20, "max_num_steps": 10}, r"num_steps=20 exceeds max_num_steps=10"),
    ],
)
def test_bad_max_num_steps_raises_before_running(monkeypatch, options, match):
    import pyrobdl.inference.mcmc as mcmc

    monkeypatch.setattr(mcmc, "initialize_model", lambda *a, **k: pytest.fail("sampling started"))
    x, y = small_data()
    with pytest.raises(ValueError, match=match):
        pyrobdl.fit(small_mlp(), x, y, method="hmc", progress=False, **options)
    with pytest.raises(ValueError, match="does not take"):  # NUTS bounds its steps by max_tree_depth
        pyrobdl.fit(small_mlp(), x, y, method="nuts", progress=False, max_num_steps=10)


def test_nuts_warns_when_the_tree_depth_saturates():
    x, y = small_data()
    with uncertified(), pytest.warns(UserWarning, match=r"of sampling iterations \(per chain\) hit "
                                                        r"max_tree_depth=2") as record:
        posterior = pyrobdl.fit(small_mlp(), x, y, method="nuts", num_chains=2, max_tree_depth=2, **TINY)
    fractions = posterior.diagnostics["max_tree_depth_fraction"]
    depth = posterior.trace.tree_depth[:, 10:]
    assert fractions == [float(f) for f in (depth >= 2).mean(1)] and max(fractions) > 0
    [message] = [str(w.message) for w in record if "max_tree_depth" in str(w.message)]
    assert message.startswith(f"nuts: {100 * fractions[0]:.3g}%, {100 * fractions[1]:.3g}% of sampling iterations")


# ------------------------------------------------------------------------- energy and E-BFMI
@pytest.mark.parametrize("method, extra", [("nuts", {}), ("hmc", {"num_steps": 4})])
def test_energy_is_the_hamiltonian_at_the_start_of_each_trajectory(blr, monkeypatch, method, extra):
    r"""energy[t] = U(z_{t-1}) + |r_t|^2 / 2: the potential of the state iteration t starts from plus
    the kinetic energy of the standard-normal momentum Pyro draws for it (named ``r_t={t}``; the
    mass matrix only scales it, so K = |r_unscaled|^2 / 2 whatever the adaptation did).  The
    momenta are caught as Pyro draws them, and U is evaluated again from the stored draws."""
    from pyro.infer.mcmc.hmc import HMC

    drawn, real = [], HMC._sample_r

    def spy(self, name):
        r, r_unscaled = real(self, name)
        drawn.append((name, 0.5 * sum(float(v.double().square().sum()) for v in r_unscaled.values())))
        return r, r_unscaled

    monkeypatch.setattr(HMC, "_sample_r", spy)
    w, n, c = 50, 10, 2
    model = blr_model()
    with uncertified():
        posterior = pyrobdl.fit(model, blr.x_train, blr.y_train, method=method, num_warmup=w, num_samples=n,
                                num_chains=c, progress=False, **extra)
    names = [name for name, _ in drawn]
    assert [m for m in names if m.startswith("r_t=")] == [f"r_t={t}" for t in range(w + n)] * c
    # the step-size search at the end of the mass-matrix window (iteration 43 of a 50-iteration
    # warm-up) draws momenta inside an iteration's sample() too, after the trajectory's: the
    # recorded energy must be that of the trajectory's draw, the first one
    last_chain = names[len(names) - names[::-1].index("r_t=0") - 1:]
    assert any(m.startswith("r_presample") for m in last_chain)
    kinetic = np.array([k for name, k in drawn if name.startswith("r_t=")]).reshape(c, w + n)
    tr = posterior.trace
    assert tr.energy.shape == tr.log_joint.shape == (c, w + n)
    # float32 arithmetic: a few ulps (1.2e-7 relative) of energies up to ~2500 (the prior-draw start)
    np.testing.assert_allclose(tr.energy[:, 1:], kinetic[:, 1:] - tr.log_joint[:, :-1], rtol=1e-6, atol=1e-4)
    # the sampling iterations t = w + 1 ... start from the stored draws d = 0 ...; U once more,
    # evaluated without Pyro's trace (BLR has only real sites, so no transforms): float32 sums over
    # 100 points computed in another order agree to ~1e-5 relative
    potential = _direct_potential(model, blr.x_train, blr.y_train, {})
    with torch.no_grad():
        u = np.array([[float(potential({k: v[i, d] for k, v in posterior.samples.items()})) for d in range(n - 1)]
                      for i in range(c)])
    np.testing.assert_allclose(tr.energy[:, w + 1:], kinetic[:, w + 1:] + u, rtol=1e-5, atol=1e-3)
    if method == "nuts":
        # no saturation on a 4-d Gaussian posterior, hence no warning (filterwarnings = error)
        assert posterior.diagnostics["max_tree_depth_fraction"] == [0.0, 0.0]


def test_energy_reaches_arviz_and_ebfmi_matches_az_bfmi(blr):
    import matplotlib.pyplot as plt

    from pyrobdl.diagnostics.arviz_adapter import az

    w, n = 30, 60
    with uncertified():
        posterior = pyrobdl.fit(blr_model(), blr.x_train, blr.y_train, method="hmc", num_warmup=w, num_samples=n,
                                num_chains=2, num_steps=3, potential="direct", progress=False)
    tr = posterior.trace
    assert np.isfinite(tr.energy).all()
    stats = posterior._sample_stats(1)
    np.testing.assert_array_equal(stats["energy"], tr.energy[:, w:])
    idata = posterior.to_inference_data(blr.x_train, blr.y_train)
    assert idata.sample_stats["energy"].shape == (2, n)
    ebfmi = posterior.diagnostics["ebfmi"]
    assert len(ebfmi) == 2
    np.testing.assert_allclose(ebfmi, az.bfmi(idata), rtol=1e-10)
    before = plt.get_fignums()
    with warnings.catch_warnings():
        # ArviZ 0.23's own call into matplotlib 3.11, deprecated there (arviz_adapter._arviz_plotting)
        warnings.filterwarnings("ignore", message="Passing a dict or None as alias_mapping",
                                category=DeprecationWarning)
        axes = az.plot_energy(idata)
    assert len(axes.get_lines()) + len(axes.collections) + len(axes.patches) > 0  # something was drawn
    plt.close(axes.get_figure())
    assert plt.get_fignums() == before
    # The kinetic energy of a fresh N(0, I_P) momentum is chi^2_P / 2: mean P/2 and variance P/2,
    # independently in every iteration.  K_t = energy_t - U(z_{t-1}) over all 2 * 89 iterations
    # with a predecessor, P = 4; Z standard errors (exact: the draws are independent).
    kinetic = (tr.energy[:, 1:] + tr.log_joint[:, :-1]).ravel()
    p = 4
    assert kinetic.min() >= -1e-4  # a sum of squares, up to float32 rounding of the energies
    assert abs(kinetic.mean() - p / 2) <= Z * math.sqrt(p / 2 / kinetic.size)


@pytest.mark.slow
def test_adapted_nuts_energy_on_blr(blr):
    """An adapted NUTS run on a 4-d Gaussian posterior: kinetic energy chi^2_4 / 2, healthy E-BFMI."""
    with uncertified():  # the settings of test_blr_exact_posterior: tail ESS ~270 < 400
        posterior = pyrobdl.fit(blr_model(), blr.x_train, blr.y_train, method="nuts", num_warmup=100,
                                num_samples=250, num_chains=2, potential="direct", progress=False)
    tr = posterior.trace
    kinetic = (tr.energy[:, 1:] + tr.log_joint[:, :-1]).ravel()
    p = 4
    # chi^2_P / 2 has mean and variance P/2; the variance of the sample variance of a Gamma(P/2, 1)
    # is (mu4 - sigma^4) / n with mu4 = 3 (P/2)^2 + 6 (P/2) for the Gamma(k=2): (12 + 12 - 4) / n
    assert abs(kinetic.mean() - p / 2) <= Z * math.sqrt(p / 2 / kinetic.size)
    assert abs(kinetic.var() - p / 2) <= Z * math.sqrt(20 / kinetic.size)
    # For a Gaussian target with independent successive states E-BFMI is ~2 (iid energies) and
    # measured 1.1-1.3 here; Stan and ArviZ flag < 0.3 as a sampler that explores energies slowly.
    assert min(posterior.diagnostics["ebfmi"]) > 0.3


def test_each_chain_progress_bar_names_its_chain_and_changes_no_draw(capfd):
    x = torch.linspace(-1, 1, 10).unsqueeze(-1)
    y = x[:, 0]
    opts = dict(num_warmup=6, num_samples=6, num_chains=2, max_tree_depth=3, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # tiny chains are not certified, and say so
        shown = pyrobdl.fit(pyrobdl.BayesianMLP(1, (3,), 1), x, y, "nuts", progress=True, **opts)
        err = capfd.readouterr().err
        quiet = pyrobdl.fit(pyrobdl.BayesianMLP(1, (3,), 1), x, y, "nuts", progress=False, **opts)
    assert "nuts chain 1/2" in err and "nuts chain 2/2" in err and "sample" in err
    assert "nuts chain" not in capfd.readouterr().err
    a, b = shown.sample(12), quiet.sample(12)
    assert all(torch.equal(a[k], b[k]) for k in a)
