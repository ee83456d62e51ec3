"""The resolution of a reference (two independent runs' disagreement) and ``evaluate(resolution=)``:
near zero and shrinking with draws on exact BLR, large for runs in different modes, every bad
input refused before work."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import pyrobdl
from pyrobdl.datasets.synthetic import bayesian_linear_regression, blr_posterior
from pyrobdl.diagnostics import Resolution, evaluate, reference_resolution
from pyrobdl.inference import MCMCPosterior
from pyrobdl.posterior import Cost

COST = Cost(0.0, 0, 0.0, 0, "cpu")
PRECISION = 10.0


def blr_model(hidden=()) -> pyrobdl.BayesianMLP:
    return pyrobdl.BayesianMLP(3, hidden, 1, prior=pyrobdl.priors.Gaussian(1.0),
                               likelihood=pyrobdl.likelihoods.Gaussian(PRECISION))


@pytest.fixture(scope="module")
def blr():
    data = bayesian_linear_regression(100, 100, 3, prior_scale=1.0, precision=PRECISION, seed=3)
    exact = blr_posterior(data.x_train, data.y_train, weight_prior_scale=1.0, precision=PRECISION)
    return data, exact


def exact_run(exact, *, seed: int, chains: int = 4, draws: int = 1000, bias_shift: float = 0.0,
              scale: float = 1.0, model=None) -> MCMCPosterior:
    """Independent draws of the exact BLR posterior as an MCMC run (``scale`` < 1: a too-narrow
    approximation around the same mean; ``bias_shift``: every draw's bias moved, another mode)."""
    rng = np.random.default_rng(seed)
    mean, cov = exact.mean.numpy(), exact.covariance.numpy()
    z = rng.multivariate_normal(np.zeros_like(mean), cov, size=(chains, draws))
    theta = torch.as_tensor(mean + scale * z, dtype=torch.float32)
    samples = {"layers.0.weight": theta[..., :-1].reshape(chains, draws, 1, -1),
               "layers.0.bias": theta[..., -1:].reshape(chains, draws, 1) + bias_shift}
    return MCMCPosterior(model or blr_model(), samples, None, method="exact", settings={"seed": seed}, cost=COST)


def f_sd(exact, x: torch.Tensor) -> float:
    """Mean posterior sd of f(x) = w.x + b at the inputs (exact)."""
    xa = torch.cat([x.double(), torch.ones(x.shape[0], 1, dtype=torch.float64)], 1)
    return float(torch.sqrt(((xa @ exact.covariance) * xa).sum(1)).mean())


# ----------------------------------------------------------------------------- honesty


def test_resolution_of_exact_blr_is_near_zero_and_shrinks_with_more_draws(blr):
    data, exact = blr
    a, b = exact_run(exact, seed=0), exact_run(exact, seed=1)
    sd = f_sd(exact, data.x_test)
    small = reference_resolution(a, b, data.x_test, num_samples=100)
    large = reference_resolution(a, b, data.x_test, num_samples=1600)
    # two samples of S draws of one distribution: their W2 is Monte Carlo error, O(sd / sqrt(S))
    # (about 0.15 sd at S = 100, 0.04 sd at S = 1,600 for Gaussians), averaged over 100 inputs
    assert small.w2_function < 0.3 * sd
    assert large.w2_function < 0.08 * sd
    # 16x the draws: the error shrinks by about 4 (sqrt(16)); 2.5 leaves room for the log factor of
    # the empirical W2 and the draws' shared noise across the 100 inputs
    assert small.w2_function / large.w2_function > 2.5
    assert large.predictive_kl < 0.01
    assert large.num_samples == 1600 and large.num_points == 100 and large.task == "regression"
    assert math.isnan(large.agreement)


def test_runs_in_different_modes_have_a_large_resolution_and_resolve_nothing(blr):
    data, exact = blr
    sd = f_sd(exact, data.x_test)
    a = exact_run(exact, seed=0)
    b = exact_run(exact, seed=1, bias_shift=3.0 * sd)  # the second run sits in another mode
    res = reference_resolution(a, b, data.x_test, num_samples=400)
    assert res.w2_function == pytest.approx(3.0 * sd, rel=0.1)  # a pure shift: W2 is the shift
    # the exact posterior itself and a too-narrow approximation: neither is distinguishable from
    # the reference at this resolution, and their difference is not resolved
    exact_again = exact_run(exact, seed=2)
    narrow = exact_run(exact, seed=3, scale=0.5)
    s_exact = evaluate(exact_again, data.x_test, data.y_test, reference=a, resolution=res, num_samples=400)
    s_narrow = evaluate(narrow, data.x_test, data.y_test, reference=a, resolution=res, num_samples=400)
    assert s_exact["reference_resolved"] == 0.0 and s_narrow["reference_resolved"] == 0.0
    assert s_narrow["w2_function_to_reference_in_resolutions"] < 0.5
    assert not res.resolves(s_exact["w2_function_to_reference"], s_narrow["w2_function_to_reference"])


def test_evaluate_reads_a_distance_in_units_of_a_fine_resolution(blr):
    data, exact = blr
    a, b = exact_run(exact, seed=0), exact_run(exact, seed=1)
    res = reference_resolution(a, b, data.x_test, num_samples=400)
    sd = f_sd(exact, data.x_test)
    shifted = exact_run(exact, seed=2, bias_shift=sd)  # one posterior sd away
    exact_again = exact_run(exact, seed=3)
    s = evaluate(shifted, data.x_test, data.y_test, reference=a, resolution=res, num_samples=400)
    s0 = evaluate(exact_again, data.x_test, data.y_test, reference=a, resolution=res, num_samples=400)
    for key in ("w2_function_to_reference", "w2_to_reference", "kl_gaussian_to_reference"):
        assert s[f"{key}_resolution"] == res.metrics[key]
        assert s[f"{key}_in_resolutions"] == pytest.approx(s[key] / res.metrics[key], rel=1e-12)
    assert s["reference_resolved"] == 1.0 and s["w2_function_to_reference_in_resolutions"] > 3
    # another exact run is as far from the reference as the second reference run was (same Monte
    # Carlo error): about one resolution, well under the shifted one's
    assert 0.5 < s0["w2_function_to_reference_in_resolutions"] < 2.0
    assert res.resolves(s["w2_function_to_reference"], s0["w2_function_to_reference"])


def test_an_uncertified_reference_with_a_resolution_does_not_warn_meaningless(blr, recwarn):
    data, exact = blr
    a, b = exact_run(exact, seed=0), exact_run(exact, seed=1)
    a.certification = pyrobdl.diagnostics.Certification.missing("not converged")
    res = reference_resolution(a, b, data.x_test, num_samples=100)
    assert res.certified == (False, None)
    with pytest.warns(UserWarning, match="means nothing"):
        evaluate(exact_run(exact, seed=2), data.x_test, data.y_test, reference=a, num_samples=100)
    s = evaluate(exact_run(exact, seed=2), data.x_test, data.y_test, reference=a, resolution=res, num_samples=100)
    assert not [w for w in recwarn.list if "means nothing" in str(w.message)]
    assert s["reference_certified"] == 0.0 and "reference_resolved" in s


def test_resolution_record_round_trips(blr):
    data, exact = blr
    res = reference_resolution(exact_run(exact, seed=0), exact_run(exact, seed=1), data.x_test, num_samples=50,
                               y_mean=2.0, y_std=3.0)
    back = Resolution.from_dict(res.to_dict())
    assert back == res
    assert "function-space W2" in res.summary() and "2 x 50 draws at 100 points" in res.summary()
    # the distances are on the original scale: y_std = 3 triples the W2 of the unit scale
    unit = reference_resolution(exact_run(exact, seed=0), exact_run(exact, seed=1), data.x_test, num_samples=50)
    assert res.w2_function == pytest.approx(3.0 * unit.w2_function, rel=1e-5)
    with pytest.raises(ValueError, match="missing"):
        Resolution.from_dict({k: v for k, v in res.to_dict().items() if k != "metrics"})


def test_classification_resolution_reads_agreement_as_one_minus_a_distance():
    model = pyrobdl.BayesianMLP(2, (), 3, prior=pyrobdl.priors.Gaussian(1.0),
                                likelihood=pyrobdl.likelihoods.Categorical())
    x = torch.randn(40, 2, generator=torch.Generator().manual_seed(0))

    def run(seed, shift=0.0):
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(2, 5, 3, 2, generator=g) * 2.0 + torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]])
        b = torch.randn(2, 5, 3, generator=g) * 2.0 + torch.tensor([shift, 0.0, 0.0])
        return MCMCPosterior(model, {"layers.0.weight": w, "layers.0.bias": b}, None, method="t",
                             settings={"seed": seed}, cost=COST)

    # 10 broad draws per run: the runs disagree on some inputs, so the resolution is not 0
    res = reference_resolution(run(0), run(1), x, num_samples=10)
    assert res.task == "classification" and res.primary == "total_variation"
    assert 0.0 < res.total_variation < 0.3 and 0.5 < res.agreement < 1.0
    far = run(2, shift=40.0)  # class 0 everywhere
    y = torch.zeros(40, dtype=torch.long)
    s = evaluate(far, x, y, reference=run(0), resolution=res, num_samples=10)
    assert s["reference_resolved"] == 1.0
    assert s["agreement_in_resolutions"] == pytest.approx((1 - s["agreement"]) / (1 - res.agreement))


# ----------------------------------------------------------------------------- bad input


def test_bad_pairs_are_refused_before_any_work(blr):
    data, exact = blr
    a = exact_run(exact, seed=0)
    with pytest.raises(ValueError, match="ref_b is missing"):
        reference_resolution(a, None, data.x_test)
    with pytest.raises(ValueError, match="same run"):
        reference_resolution(a, a, data.x_test)
    with pytest.raises(ValueError, match="same seed"):
        reference_resolution(a, exact_run(exact, seed=0), data.x_test)
    other = exact_run(exact, seed=5)
    other.settings = {}  # no recorded seed: caught by its draws instead
    twin = MCMCPosterior(a.model, a.samples, None, method="exact", settings={}, cost=COST)
    with pytest.raises(ValueError, match="identical draws"):
        reference_resolution(twin, MCMCPosterior(a.model, a.samples, None, method="e", settings={}, cost=COST),
                             data.x_test)
    wide = pyrobdl.BayesianMLP(3, (4,), 1, prior=pyrobdl.priors.Gaussian(1.0),
                               likelihood=pyrobdl.likelihoods.Gaussian(PRECISION))
    wide_run = MCMCPosterior(wide, {s.name: torch.zeros(1, 4, *s.shape) for s in wide.sites}, None,
                             method="e", settings={"seed": 9}, cost=COST)
    with pytest.raises(ValueError, match="different models"):
        reference_resolution(a, wide_run, data.x_test)
    with pytest.raises(ValueError, match="x_test"):
        reference_resolution(a, other, torch.randn(5, 2))
    with pytest.raises(TypeError, match="Posterior"):
        reference_resolution("a.npz", "b.npz", data.x_test)
    with pytest.raises(ValueError, match="num_samples"):
        reference_resolution(a, other, data.x_test, num_samples=1)


def test_evaluate_refuses_a_resolution_from_elsewhere(blr):
    data, exact = blr
    a, b = exact_run(exact, seed=0), exact_run(exact, seed=1)
    res = reference_resolution(a, b, data.x_test, num_samples=100)
    method = exact_run(exact, seed=2)
    with pytest.raises(ValueError, match="give the reference"):
        evaluate(method, data.x_test, data.y_test, resolution=res, num_samples=100)
    with pytest.raises(ValueError, match="other inputs"):
        evaluate(method, data.x_test[:50], data.y_test[:50], reference=a, resolution=res, num_samples=100)
    with pytest.raises(ValueError, match="equal draws"):
        evaluate(method, data.x_test, data.y_test, reference=a, resolution=res, num_samples=200)
    with pytest.raises(ValueError, match="y_std"):
        evaluate(method, data.x_test, data.y_test, reference=a, resolution=res, num_samples=100, y_std=2.0)
    with pytest.raises(TypeError, match="Resolution"):
        evaluate(method, data.x_test, data.y_test, reference=a, resolution=0.1, num_samples=100)


@pytest.mark.slow
def test_two_chees_runs_on_blr_agree_within_their_monte_carlo_error(blr):
    """Two real many-chain HMC runs (other seeds) of BLR: their resolution is as small as two exact
    samples' of the same size, and each is as close to the exact posterior."""
    data, exact = blr
    model = blr_model()
    runs = [pyrobdl.fit(model, data.x_train, data.y_train, method="chees", num_chains=64, num_warmup=250,
                        num_samples=250, seed=s, progress=False) for s in (0, 1)]
    res = reference_resolution(*runs, data.x_test, num_samples=1600)
    floor = reference_resolution(exact_run(exact, seed=0), exact_run(exact, seed=1), data.x_test, num_samples=1600)
    # MCMC draws are autocorrelated (ESS < draws), so allow the floor's error at a quarter of the draws
    assert res.w2_function < 2.5 * floor.w2_function
    s = evaluate(exact_run(exact, seed=4), data.x_test, data.y_test, reference=runs[0], resolution=res,
                 num_samples=1600)
    assert s["w2_function_to_reference_in_resolutions"] < 2.0
