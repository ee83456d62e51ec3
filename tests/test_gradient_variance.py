"""The gradient-variance diagnostic: closed forms, unbiasedness across estimators, the contract."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from conftest import DEVICES

import pyrobdl
from pyrobdl.datasets import bayesian_linear_regression
from pyrobdl.diagnostics import gradient_variance
from pyrobdl.diagnostics.gradient_variance import DEFAULT_ESTIMATORS, GradientVarianceTable
from pyrobdl.guides import MeanField, ScoreFunction
from pyrobdl.inference import LoopSettings, get_method
from pyrobdl.posterior import Posterior

PRECISION = 10.0
GROUPS = ("layers_0_weight_loc", "layers_0_weight_scale", "layers_0_bias_loc", "layers_0_bias_scale")


@pytest.fixture(scope="module")
def blr():
    return bayesian_linear_regression(40, 10, 2, prior_scale=1.0, precision=PRECISION, seed=1)


def blr_model() -> pyrobdl.BayesianMLP:
    return pyrobdl.BayesianMLP(
        2, (), 1, prior=pyrobdl.priors.Gaussian(1.0), likelihood=pyrobdl.likelihoods.Gaussian(PRECISION)
    )


def off_optimum_guide(blr, offset_in_sd=(2.0, -2.0, 1.5), scale=0.1) -> MeanField:
    """A guide a few posterior sds from the optimum, where every gradient is clearly non-zero."""
    exact = blr.posterior
    loc = (exact.mean + torch.tensor(offset_in_sd, dtype=torch.float64) * exact.mean_field_sd).float()
    return MeanField(
        blr_model(), init_scale=scale, init_loc={"layers.0.weight": loc[:2].reshape(1, 2), "layers.0.bias": loc[2:]}
    )


def test_table_structure_and_report(blr):
    guide = MeanField(blr_model())
    table = gradient_variance(blr_model(), blr.x_train, blr.y_train, guide, num_draws=12, baseline_warmup=3)
    assert isinstance(table, GradientVarianceTable)
    assert table.estimators == DEFAULT_ESTIMATORS
    assert table.groups == GROUPS
    assert len(table.rows) == len(DEFAULT_ESTIMATORS) * len(GROUPS)
    for r in table.rows:
        assert r.num_elements == {"weight": 2, "bias": 1}[r.group.split("_")[2]]
        assert r.mean.shape == r.standard_error.shape == (r.num_elements,)
        assert r.variance >= 0 and r.seconds_per_draw > 0
        assert math.isclose(r.mean_abs_gradient, float(np.abs(r.mean).mean()), rel_tol=1e-12)
        # variance = mean over elements of s_j^2 = T * se_j^2
        assert math.isclose(r.variance, float((table.num_draws * r.standard_error**2).mean()), rel_tol=1e-9)
        assert math.isclose(r.snr, r.mean_abs_gradient / math.sqrt(r.variance), rel_tol=1e-12)
    ratio = table.variance_ratio("score_function", "reparameterization")
    assert set(ratio) == set(GROUPS)
    assert ratio["layers_0_weight_loc"] == table.row("score_function", "layers_0_weight_loc").variance / table.row(
        "reparameterization", "layers_0_weight_loc"
    ).variance
    md = table.to_markdown()
    assert md.splitlines()[0].startswith("| estimator | group |") and "variance / reparameterization" in md
    assert sum(line.startswith("|") for line in md.splitlines()) == 2 + len(table.rows)
    assert table.snr_noise_floor == math.sqrt(2 / (math.pi * 12))
    json.dumps(table.to_records())
    with pytest.raises(dataclasses.FrozenInstanceError):
        table.num_draws = 3  # type: ignore[misc]
    with pytest.raises(KeyError):
        table.row("score_function", "nope")


# Relative standard error of a sample variance from T Gaussian draws is sqrt(2 / (T - 1)):
# 4.5% for T = 1000; 5 of them is the tolerance.  The mean is checked to 5 standard errors.
CLOSED_FORM_DRAWS = 1000


def test_reparameterization_matches_its_closed_form(blr):
    r"""BLR, reparameterized, MC KL: d(-L)/d mu = Lambda (mu + sigma * eps - m) exactly.

    (log q(mu + sigma eps; mu, sigma) does not depend on mu.)  So the mean is Lambda (mu - m) and
    the per-element variance is sum_j Lambda_ij^2 sigma_j^2.
    """
    guide = off_optimum_guide(blr)
    table = gradient_variance(
        blr_model(), blr.x_train, blr.y_train, guide, estimators=("reparameterization",), num_draws=CLOSED_FORM_DRAWS
    )
    exact = blr.posterior
    lam = exact.precision_matrix
    mu = torch.cat([guide.layers_0_weight_loc.reshape(-1), guide.layers_0_bias_loc]).detach().double()
    sigma = torch.cat([guide.layers_0_weight_scale.reshape(-1), guide.layers_0_bias_scale]).detach().double()
    mean = lam @ (mu - exact.mean)
    var = (lam**2) @ sigma**2
    for group, idx in (("layers_0_weight_loc", slice(0, 2)), ("layers_0_bias_loc", slice(2, 3))):
        row = table.row("reparameterization", group)
        z = (row.mean - mean[idx].numpy()) / row.standard_error
        assert np.abs(z).max() < 5, (group, z)
        rel = row.variance / float(var[idx].mean()) - 1
        assert abs(rel) < 5 * math.sqrt(2 / (CLOSED_FORM_DRAWS - 1)), (group, rel)


def test_parameters_and_caller_rng_are_untouched(blr):
    model = blr_model()
    guide = ScoreFunction(model, baseline="neural")
    before = {k: v.clone() for k, v in guide.state_dict().items()}
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    table = gradient_variance(
        model, blr.x_train, blr.y_train, guide,
        estimators=("score_function+neural_baseline", "native", "reparameterization"), num_draws=4, baseline_warmup=3,
    )
    assert torch.equal(torch.get_rng_state(), rng)
    for k, v in guide.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert table.estimators == ("score_function+neural_baseline", "native", "reparameterization")
    # every estimator starts from the given parameters and seed: same seed, same numbers
    again = gradient_variance(
        model, blr.x_train, blr.y_train, guide, estimators=("native",), num_draws=4, baseline_warmup=3
    )
    for group in GROUPS:
        np.testing.assert_array_equal(again.row("native", group).mean, table.row("native", group).mean)


def test_minibatch_noise_is_measured(blr):
    guide = off_optimum_guide(blr)
    kw = dict(estimators=("reparameterization",), num_draws=200)
    full = gradient_variance(blr_model(), blr.x_train, blr.y_train, guide, **kw)
    mini = gradient_variance(blr_model(), blr.x_train, blr.y_train, guide, batch_size=5, **kw)
    assert mini.batch_size == 5 and full.batch_size is None
    # N/B = 8 times rescaled minibatch likelihood terms: far noisier than the full batch
    assert mini.row("reparameterization", "layers_0_bias_loc").variance > 3 * full.row(
        "reparameterization", "layers_0_bias_loc"
    ).variance


def _svi_methods() -> list[str]:
    loop = {f.name for f in dataclasses.fields(LoopSettings)}
    return [m for m in pyrobdl.methods() if loop <= set(get_method(m).options)]


@pytest.mark.parametrize("method", _svi_methods())
def test_native_estimator_for_every_registered_svi_method(method):
    x, y = torch.randn(16, 2), torch.randn(16)
    errors = []
    # the first prior the method accepts (methods refuse a model they cannot fit before any work)
    for prior in (pyrobdl.priors.Gaussian(1.0), pyrobdl.priors.LogUniform()):
        model = pyrobdl.BayesianMLP(2, (3,), 1, prior=prior)
        try:
            posterior = pyrobdl.fit(model, x, y, method, num_steps=2, progress=False)
            break
        except ValueError as e:
            errors.append(str(e))
    else:
        pytest.fail(f"{method} accepted no test model: {errors}")
    # 2 particles: bbvi's default leave-one-out baseline compares the particles of a draw
    table = gradient_variance(model, x, y, posterior, estimators=("native",), num_draws=3, baseline_warmup=2,
                              num_particles=2)
    assert table.rows and all(r.estimator == "native" for r in table.rows)
    assert all(math.isfinite(r.variance) and r.variance >= 0 for r in table.rows)
    names = {n.removesuffix("_unconstrained") for n, p in posterior.guide.named_parameters() if p.requires_grad}
    assert set(table.groups) <= names


def test_builtin_estimators_need_a_mean_field_guide():
    x, y = torch.randn(16, 2), torch.randn(16)
    model = pyrobdl.BayesianMLP(2, (3,), 1)
    posterior = pyrobdl.fit(model, x, y, "map", num_steps=2, progress=False)
    with pytest.raises(ValueError, match="native"):
        gradient_variance(model, x, y, posterior, estimators=("score_function",), num_draws=3)
    other = MeanField(pyrobdl.BayesianMLP(2, (4,), 1))
    with pytest.raises(ValueError, match="shapes"):
        gradient_variance(model, x, y, other, estimators=("reparameterization",), num_draws=3)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"estimators": ("reparametrization",)}, ValueError, "valid"),
        ({"estimators": ("native", "native")}, ValueError, "duplicates"),
        ({"num_draws": 1}, ValueError, "num_draws"),
        ({"num_particles": 0}, ValueError, "num_particles"),
        ({"estimators": ("reparameterization", "score_function+leave_one_out")}, ValueError, "num_particles >= 2"),
        ({"batch_size": 0}, ValueError, "batch_size"),
        ({"baseline_warmup": -1}, ValueError, "baseline_warmup"),
        ({"kl": "exact"}, ValueError, "kl"),
        ({"seed": 1.5}, TypeError, "seed"),
        ({"guide_params": {"loc": 0}}, TypeError, "guide_params"),
    ],
)
def test_bad_arguments_fail_before_work(kwargs, error, match):
    model = pyrobdl.BayesianMLP(2, (), 1)
    args = {"guide_params": MeanField(model), **kwargs}
    with pytest.raises(error, match=match):
        gradient_variance(model, torch.randn(5, 2), torch.randn(5), **args)


def test_native_particle_baseline_needs_particles_before_work():
    model = pyrobdl.BayesianMLP(2, (), 1)
    with pytest.raises(ValueError, match="native.*num_particles >= 2"):
        gradient_variance(model, torch.randn(5, 2), torch.randn(5), ScoreFunction(model, baseline="vargrad"),
                          estimators=("native",))


def test_posterior_without_a_guide_is_refused():
    model = pyrobdl.BayesianMLP(2, (), 1)
    cost = pyrobdl.Cost(0.0, 0, 0.0, 0, "cpu")
    with pytest.raises(TypeError, match="no guide"):
        gradient_variance(model, torch.randn(5, 2), torch.randn(5), Posterior(model, "nuts", {}, cost))


# Unbiasedness: all estimators target the same gradient.  Each per-element mean gradient must
# agree with the reparameterization one within 4 combined standard errors (a two-sided
# 6e-5 event per element for Gaussian errors; 12 elements x 5 estimators here).  Power: the
# score-function standard errors must be small against the gradient itself, so a wrong sign or
# a missing term (e.g. dropping the entropy part) would be caught.
UNBIASED_DRAWS = 400
UNBIASED_PARTICLES = 32  # one draw averages 32 particles: 12,800 single-sample gradients


@pytest.mark.slow
def test_all_estimators_agree_in_expectation(blr):
    guide = off_optimum_guide(blr)
    estimators = ("reparameterization", "local_reparameterization", "score_function", "score_function+baseline",
                  "score_function+leave_one_out", "score_function+vargrad")
    table = gradient_variance(
        blr_model(), blr.x_train, blr.y_train, guide, estimators=estimators,
        num_draws=UNBIASED_DRAWS, num_particles=UNBIASED_PARTICLES, baseline_warmup=100,
    )
    for group in GROUPS:
        ref = table.row("reparameterization", group)
        for name in estimators[1:]:
            row = table.row(name, group)
            z = (row.mean - ref.mean) / np.sqrt(row.standard_error**2 + ref.standard_error**2)
            assert np.abs(z).max() < 4, (name, group, z)
            if name.startswith("score_function") and group.endswith("_loc"):
                assert np.all(np.abs(ref.mean) > 4 * row.standard_error), (name, group, ref.mean, row.standard_error)
    # and the measured ordering the issue asks about: score function is the noisier estimator
    for group in GROUPS:
        assert table.row("score_function", group).variance > table.row("reparameterization", group).variance


@pytest.mark.parametrize("device", DEVICES)
def test_bbvi_fit_and_diagnostic_on_device(device):
    x, y = torch.randn(24, 2), torch.randn(24)
    model = pyrobdl.BayesianMLP(2, (3,), 1)
    posterior = pyrobdl.fit(
        model, x, y, "bbvi", num_steps=3, num_particles=4, baseline="neural", elbo="trace_graph", device=device,
        progress=False,
    )
    assert all(p.device.type == device for p in posterior.guide.parameters())
    table = gradient_variance(
        model, x, y, posterior, estimators=("reparameterization", "score_function+neural_baseline", "native"),
        num_draws=3, baseline_warmup=2,
    )
    assert all(math.isfinite(r.variance) for r in table.rows)


def test_report_table_puts_estimators_side_by_side_with_ratios():
    from pyrobdl.report.tables import gradient_variance_tables

    rows = [{"estimator": e, "group": g, "num_elements": 3, "variance": v}
            for e, g, v in [("reparameterization", "w_loc", 0.5), ("score_function+leave_one_out", "w_loc", 50.0),
                            ("reparameterization", "w_scale", 2.0), ("score_function+leave_one_out", "w_scale", 1.0)]]
    record = {"status": "ok", "method": "mean_field", "split": 0, "seed": 0, "gradient_variance": rows}
    (table,) = gradient_variance_tables([record])
    assert table.columns == ("group", "d", "reparameterization", "score_function+leave_one_out")
    assert table.rows[0] == ("w_loc", "3", "0.5", "50 (×100)")
    assert table.rows[1] == ("w_scale", "3", "2", "1 (×0.5)")
