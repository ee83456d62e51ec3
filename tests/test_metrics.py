"""Metrics against hand computations and closed forms; ``evaluate`` end to end on fixed draws.

Hand-computed values are worked out in the comments next to them.  Formulas: CRPS, Gneiting &
Raftery (2007, eq. 21) and its integral form; ECE, Guo et al. (2017, eq. 3); W2 of 1-D Gaussians,
sqrt((m1 - m2)^2 + (s1 - s2)^2) (e.g. Peyré & Cuturi 2019, remark 2.31).
"""

from __future__ import annotations

import math

import numpy as np
import pyro
import pytest
import torch
from scipy import integrate, stats

import pyrobdl
from pyrobdl.diagnostics import evaluate, metrics, vi_pareto_k
from pyrobdl.diagnostics.evaluate import classification_scores, reference_scores, regression_scores
from pyrobdl.guides.base import BNNGuide
from pyrobdl.posterior import Cost, Posterior, SVIPosterior

COST = Cost(wall_time_s=0.0, gradient_evaluations=0, epochs=0.0, peak_memory_bytes=0, device="cpu")


class FixedDraws(Posterior):
    """A posterior whose draws are given: ``_draw(S)`` cycles through them (exact predictive known)."""

    def __init__(self, model, draws):
        super().__init__(model, method="fixed", settings={}, cost=COST)
        self.draws = {k: torch.as_tensor(v, dtype=torch.get_default_dtype()) for k, v in draws.items()}

    def _draw(self, num_samples):
        total = next(iter(self.draws.values())).shape[0]
        idx = torch.arange(num_samples) % total
        return {k: v[idx] for k, v in self.draws.items()}


def linear_model(precision=4.0, out_features=1):
    return pyrobdl.BayesianMLP(1, (), out_features, likelihood=pyrobdl.likelihoods.Gaussian(precision))


def phi(z):
    """Standard normal CDF from math.erf (independent of scipy.special.ndtr used in the code)."""
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


# ----------------------------------------------------------------------------- regression


def test_log_predictive_density_by_hand():
    # point 0: mean(0.2, 0.4) = 0.3; point 1: mean(0.5, 0.1) = 0.3
    ll = np.log([[0.2, 0.5], [0.4, 0.1]])
    np.testing.assert_allclose(metrics.log_predictive_density(ll), np.log([0.3, 0.3]), rtol=1e-12)


def test_log_predictive_density_is_stable_for_tiny_likelihoods():
    ll = np.array([[-1000.0], [-1000.0 + math.log(3.0)]])  # exp underflows; mean = 2 e^-1000
    np.testing.assert_allclose(metrics.log_predictive_density(ll), [-1000.0 + math.log(2.0)], rtol=1e-12)


def test_rmse_by_hand():
    assert metrics.rmse([1.0, 2.0, 3.0], [1.0, 2.0, 5.0]) == pytest.approx(math.sqrt(4.0 / 3.0), rel=1e-12)
    with pytest.raises(ValueError, match="shapes must match"):
        metrics.rmse([1.0, 2.0], [1.0, 2.0, 3.0])


def test_gaussian_mixture_pit_by_hand():
    # y = 1 under 0.5 N(0, 1) + 0.5 N(2, 2^2): (Phi(1) + Phi(-0.5)) / 2
    u = metrics.gaussian_mixture_pit([1.0], [[0.0], [2.0]], [[1.0], [2.0]])
    assert u[0] == pytest.approx((phi(1.0) + phi(-0.5)) / 2, abs=1e-12)
    # scale broadcast from one value per draw
    u2 = metrics.gaussian_mixture_pit([1.0, 0.0], [[0.0, 0.0], [2.0, 0.0]], [[1.0], [2.0]])
    assert u2[1] == pytest.approx(0.5, abs=1e-12)


def test_interval_coverage_by_hand():
    # level 0.9 covers |u - 0.5| <= 0.45: 0.5, 0.8, 0.3 are in; 0.04, 0.96 are out
    assert metrics.interval_coverage([0.5, 0.04, 0.96, 0.8, 0.3], 0.9) == pytest.approx(3 / 5)
    with pytest.raises(ValueError, match="level"):
        metrics.interval_coverage([0.5], 1.0)


def test_coverage_of_a_correct_gaussian_predictive_matches_the_level():
    rng = np.random.default_rng(0)
    y = rng.normal(size=20000)
    pit = metrics.gaussian_mixture_pit(y, np.zeros((1, y.size)), 1.0)
    for level in metrics.COVERAGE_LEVELS:
        # binomial sd at N = 20000 is <= 0.0036; 0.015 is > 4 sd
        assert metrics.interval_coverage(pit, level) == pytest.approx(level, abs=0.015)
    # and an over-confident one (scale 0.5) under-covers
    narrow = metrics.gaussian_mixture_pit(y, np.zeros((1, y.size)), 0.5)
    assert metrics.interval_coverage(narrow, 0.9) < 0.7


def test_pit_calibration_error_by_hand():
    # one value at 0.5: int_0^.5 p dp + int_.5^1 (1 - p) dp = 0.125 + 0.125
    assert metrics.pit_calibration_error([0.5]) == pytest.approx(0.25, abs=1e-12)
    # 0.25 and 0.75: 0.03125 + 2 * int_0^.25 t dt + 0.03125 = 0.125
    assert metrics.pit_calibration_error([0.25, 0.75]) == pytest.approx(0.125, abs=1e-12)
    # everything at 0 (the worst case): int_0^1 (1 - p) dp = 0.5
    assert metrics.pit_calibration_error([0.0, 0.0, 0.0]) == pytest.approx(0.5, abs=1e-12)


def test_pit_calibration_error_matches_numerical_integration():
    u = np.random.default_rng(1).beta(0.5, 0.5, size=37)
    grid = (np.arange(1_000_000) + 0.5) / 1_000_000  # midpoint rule: error O(N / grid) ~ 4e-5
    ecdf = np.searchsorted(np.sort(u), grid, side="right") / u.size
    assert metrics.pit_calibration_error(u) == pytest.approx(np.mean(np.abs(ecdf - grid)), abs=1e-4)


def test_crps_ensemble_by_hand():
    # one sample: CRPS is the absolute error
    np.testing.assert_allclose(metrics.crps_ensemble([[2.5]], [1.0]), [1.5])
    # samples {0, 1}, y = 0: E|X - y| = 0.5, E|X - X'| = 0.5 -> 0.5 - 0.25; integral form:
    # F = 0.5 on [0, 1) against the step at 0: (0.5 - 1)^2 * 1 = 0.25
    np.testing.assert_allclose(metrics.crps_ensemble([[0.0], [1.0]], [0.0]), [0.25])


def test_crps_ensemble_matches_the_integral_definition():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(7, 3))
    y = np.array([0.3, -2.0, 5.0])
    got = metrics.crps_ensemble(x, y)
    for n in range(3):
        # integral of (F_hat(t) - 1[t >= y])^2 over t: piecewise constant between sorted knots
        knots = np.sort(np.concatenate([x[:, n], [y[n]]]))
        mids = (knots[:-1] + knots[1:]) / 2
        f_hat = (x[:, n][None, :] <= mids[:, None]).mean(1)
        step = (mids >= y[n]).astype(float)
        assert got[n] == pytest.approx(np.sum((f_hat - step) ** 2 * np.diff(knots)), rel=1e-12)


def test_crps_gaussian_closed_form_against_quadrature_and_samples():
    mu, sigma, y = 0.7, 1.3, -0.4
    quad = integrate.quad(lambda t: (stats.norm.cdf(t, mu, sigma) - (t >= y)) ** 2, -30, 30, points=[y], limit=200)[0]
    assert metrics.crps_gaussian(mu, sigma, y) == pytest.approx(quad, rel=1e-6)
    samples = np.random.default_rng(3).normal(mu, sigma, size=(200_000, 1))
    # the empirical-distribution CRPS converges at O(S^-1/2): relative sd 0.3% at S = 2e5
    # (measured over 20 seeds), so 1.5% is 5 sd
    assert metrics.crps_ensemble(samples, [y])[0] == pytest.approx(quad, rel=0.015)


# ----------------------------------------------------------------------------- distances


def test_wasserstein2_empirical_by_hand():
    # equal sizes: sorted differences 1 and 2 -> sqrt((1 + 4) / 2)
    assert metrics.wasserstein2_empirical([[1.0], [0.0]], [[3.0], [1.0]])[0] == pytest.approx(math.sqrt(2.5))
    # {0, 1} vs {0, 1, 2}: quantile functions differ by 1 on (1/3, 1/2] and (2/3, 1]: 1/6 + 1/3
    assert metrics.wasserstein2_empirical([[0.0], [1.0]], [[0.0], [1.0], [2.0]])[0] == pytest.approx(math.sqrt(0.5))
    # symmetric, and duplicated samples are the same distribution
    a = np.random.default_rng(4).normal(size=(5, 2))
    np.testing.assert_allclose(metrics.wasserstein2_empirical(a, np.concatenate([a, a])), 0.0, atol=1e-12)
    b = np.random.default_rng(5).normal(size=(3, 2))
    np.testing.assert_allclose(metrics.wasserstein2_empirical(a, b), metrics.wasserstein2_empirical(b, a))


@pytest.mark.parametrize("sizes", [(200_000, 200_000), (150_000, 200_000)])
def test_wasserstein2_of_gaussian_samples_matches_closed_form(sizes):
    rng = np.random.default_rng(6)
    (m1, s1), (m2, s2) = (1.0, 2.0), (-0.5, 0.5)
    a = rng.normal(m1, s1, size=(sizes[0], 1))
    b = rng.normal(m2, s2, size=(sizes[1], 1))
    exact = metrics.wasserstein2_gaussian(m1, s1, m2, s2)
    assert exact == pytest.approx(math.sqrt(1.5**2 + 1.5**2))
    # sampling sd of the sorted-sample estimator at these sizes: 0.0045 over 20 seeds (measured);
    # 0.02 is > 4 sd
    assert metrics.wasserstein2_empirical(a, b)[0] == pytest.approx(exact, abs=0.02)


def test_wasserstein2_of_gaussian_quantile_grids_matches_closed_form():
    # deterministic "samples" at the midpoints of S equal-probability cells
    s = 100_000
    q = stats.norm.ppf((np.arange(s) + 0.5) / s)[:, None]
    got = metrics.wasserstein2_empirical(1.0 + 2.0 * q, -0.5 + 0.5 * q)[0]
    # the grid truncates the tails: relative error ~1e-5 at S = 1e5
    assert got == pytest.approx(metrics.wasserstein2_gaussian(1.0, 2.0, -0.5, 0.5), rel=1e-4)


def test_gaussian_kl_against_torch():
    p, q = torch.distributions.Normal(0.3, 0.8), torch.distributions.Normal(-1.0, 2.0)
    expected = float(torch.distributions.kl_divergence(p, q))
    assert metrics.gaussian_kl(0.3, 0.64, -1.0, 4.0) == pytest.approx(expected, rel=1e-6)
    # by hand: KL(N(0,1) || N(1,4)) = 0.5 (log 4 + 2/4 - 1)
    assert metrics.gaussian_kl(0.0, 1.0, 1.0, 4.0) == pytest.approx(0.5 * (math.log(4) - 0.5))


# ----------------------------------------------------------------------------- classification

PROBS = np.array([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.3, 0.3, 0.4], [0.5, 0.4, 0.1]])
LABELS = np.array([0, 2, 2, 1])


def test_accuracy_nll_brier_by_hand():
    # argmax (0, 1, 2, 0) vs labels (0, 2, 2, 1): 2 of 4
    assert metrics.accuracy(PROBS, LABELS) == pytest.approx(0.5)
    assert metrics.categorical_nll(PROBS, LABELS) == pytest.approx(-np.mean(np.log([0.7, 0.3, 0.4, 0.4])))
    # rows: 0.09+0.04+0.01, 0.01+0.36+0.49, 0.09+0.09+0.36, 0.25+0.36+0.01 -> 2.16 / 4
    assert metrics.brier_score(PROBS, LABELS) == pytest.approx(0.54)


def test_ece_and_reliability_table_by_hand():
    # confidences 0.7, 0.6, 0.4, 0.5; correct 1, 0, 1, 0.
    # 2 bins: (0, .5] holds 0.4, 0.5 (conf .45, acc .5); (.5, 1] holds 0.7, 0.6 (conf .65, acc .5)
    # ECE = 0.5 * 0.05 + 0.5 * 0.15 = 0.1
    table = metrics.reliability_table(PROBS, LABELS, num_bins=2)
    np.testing.assert_array_equal(table.count, [2, 2])
    np.testing.assert_allclose(table.confidence, [0.45, 0.65])
    np.testing.assert_allclose(table.accuracy, [0.5, 0.5])
    assert metrics.expected_calibration_error(PROBS, LABELS, num_bins=2) == pytest.approx(0.1)
    # 10 bins: an edge value (0.7) belongs to the bin it closes, (0.6, 0.7]
    table10 = metrics.reliability_table(PROBS, LABELS, num_bins=10)
    np.testing.assert_array_equal(np.nonzero(table10.count)[0], [3, 4, 5, 6])
    # one point per bin: ECE = mean |correct - conf| = (0.3 + 0.6 + 0.6 + 0.5) / 4
    assert table10.ece == pytest.approx(0.5)
    d = table10.to_dict()
    assert d["accuracy"][0] is None and d["count"][6] == 1


def test_entropy_split_by_hand():
    # two confident draws that disagree: predictive (0.5, 0.5), H = log 2, all of it epistemic
    draws = np.array([[[1.0, 0.0]], [[0.0, 1.0]]])
    assert metrics.predictive_entropy(draws.mean(0))[0] == pytest.approx(math.log(2))
    assert metrics.expected_entropy(draws)[0] == pytest.approx(0.0)
    assert metrics.mutual_information(draws)[0] == pytest.approx(math.log(2))
    # identical draws: no epistemic part
    same = np.array([[[0.3, 0.7]], [[0.3, 0.7]]])
    assert metrics.mutual_information(same)[0] == pytest.approx(0.0, abs=1e-15)
    assert metrics.expected_entropy(same)[0] == pytest.approx(-(0.3 * math.log(0.3) + 0.7 * math.log(0.7)))


def test_agreement_and_total_variation_by_hand():
    ref = np.array([[0.6, 0.3, 0.1], [0.1, 0.2, 0.7], [0.3, 0.3, 0.4], [0.2, 0.7, 0.1]])
    # argmax (0,1,2,0) vs (0,2,2,1): 2 of 4
    assert metrics.agreement(PROBS, ref) == pytest.approx(0.5)
    # TV per row: 0.5*(.1+.1+0)=.1, 0.5*(0+.4+.4)=.4, 0, 0.5*(.3+.3+0)=.3 -> 0.8 / 4
    assert metrics.total_variation(PROBS, ref) == pytest.approx(0.2)


def test_classification_metrics_reject_regression_inputs():
    with pytest.raises(ValueError, match=r"\[N, K\] with K >= 2"):
        metrics.accuracy(np.array([[0.3], [1.2]]), [0, 1])
    with pytest.raises(ValueError, match="class probabilities"):
        metrics.brier_score(np.array([[2.0, -1.0], [0.5, 0.5]]), [0, 1])
    with pytest.raises(TypeError, match="integer class labels"):
        metrics.accuracy(PROBS, [0.5, 1.0, 2.0, 0.0])
    with pytest.raises(ValueError, match="labels must have shape"):
        metrics.accuracy(PROBS, [0, 1])
    with pytest.raises(ValueError, match="labels must lie"):
        metrics.accuracy(PROBS, [0, 1, 3, 0])


# ----------------------------------------------------------------------------- evaluate


def fixed_linear(shift=0.0):
    """A linear model y = w x + b with four given (w, b) draws and noise sd 0.5."""
    model = linear_model(precision=4.0)
    w = torch.tensor([0.8, 1.0, 1.2, 0.9]).reshape(4, 1, 1)
    b = torch.tensor([0.1, -0.1, 0.0, 0.2]).reshape(4, 1) + shift
    return FixedDraws(model, {"layers.0.weight": w, "layers.0.bias": b})


def test_evaluate_regression_matches_direct_computation():
    post = fixed_linear()
    x = torch.linspace(-1, 1, 9)[:, None]
    y = 1.1 * x[:, 0] + 0.3 * torch.sin(5 * x[:, 0])
    y_mean, y_std = 3.0, 2.0
    scores = evaluate(post, x, y, num_samples=4, y_mean=y_mean, y_std=y_std)
    w = post.draws["layers.0.weight"][:, 0, 0].double().numpy()
    b = post.draws["layers.0.bias"][:, 0].double().numpy()
    f = (w[:, None] * x[:, 0].double().numpy()[None] + b[:, None]) * y_std + y_mean  # original scale
    sd = 0.5 * y_std
    y_o = y.double().numpy() * y_std + y_mean
    dens = stats.norm.pdf(y_o[None], f, sd).mean(0)
    assert scores["test_ll"] == pytest.approx(np.mean(np.log(dens)), rel=1e-6)
    assert scores["rmse"] == pytest.approx(np.sqrt(np.mean((f.mean(0) - y_o) ** 2)), rel=1e-6)
    pit = np.array([np.mean([phi((y_o[n] - f[s, n]) / sd) for s in range(4)]) for n in range(9)])
    assert scores["coverage_90"] == pytest.approx(np.mean(np.abs(pit - 0.5) <= 0.45))
    assert scores["pit_calibration_error"] == pytest.approx(metrics.pit_calibration_error(pit), abs=1e-7)
    assert scores["epistemic_variance"] == pytest.approx(np.mean(f.var(0)), rel=1e-5)
    assert scores["aleatoric_variance"] == pytest.approx(sd**2, rel=1e-6)
    assert all(isinstance(v, float) for v in scores.values())


def test_evaluate_crps_against_the_mixture_closed_form():
    post = fixed_linear()
    x = torch.linspace(-1, 1, 5)[:, None]
    y = torch.tensor([0.0, -0.5, 0.3, 1.5, 0.9])
    w = post.draws["layers.0.weight"][:, 0, 0].double().numpy()
    b = post.draws["layers.0.bias"][:, 0].double().numpy()
    mu = w[:, None] * x[:, 0].double().numpy()[None] + b[:, None]  # [4, N]
    sd = 0.5

    def a(m, v):  # E|Z| for Z ~ N(m, v) (Grimit et al. 2006)
        s = np.sqrt(v)
        return 2 * s * stats.norm.pdf(m / s) + m * (2 * stats.norm.cdf(m / s) - 1)

    exact = np.mean(a(y.double().numpy()[None] - mu, sd**2).mean(0)
                    - 0.5 * a(mu[:, None] - mu[None], 2 * sd**2).mean((0, 1)))
    got = evaluate(post, x, y, num_samples=8000)["crps"]
    # 8000 predictive draws: relative sd of the estimate 0.6% over 20 seeds (measured); 3% is 5 sd
    assert got == pytest.approx(exact, rel=0.03)


def test_evaluate_scale_invariants():
    post = fixed_linear()
    x = torch.linspace(-1, 1, 9)[:, None]
    y = x[:, 0] * 0.9
    base = evaluate(post, x, y, num_samples=4)
    scaled = evaluate(post, x, y, num_samples=4, y_mean=-7.0, y_std=3.0)
    assert scaled["rmse"] == pytest.approx(3.0 * base["rmse"], rel=1e-6)
    assert scaled["test_ll"] == pytest.approx(base["test_ll"] - math.log(3.0), rel=1e-6)
    assert scaled["crps"] == pytest.approx(3.0 * base["crps"], rel=1e-6)
    assert scaled["coverage_50"] == base["coverage_50"]


def test_evaluate_reference_metrics_closed_form():
    post, shifted = fixed_linear(), fixed_linear(shift=0.25)
    x = torch.linspace(-1, 1, 6)[:, None]
    y = x[:, 0]
    same = evaluate(post, x, y, reference=post, num_samples=4)
    assert same["w2_function_to_reference"] == pytest.approx(0.0, abs=1e-6)
    assert same["kl_gaussian_to_reference"] == pytest.approx(0.0, abs=1e-6)
    moved = evaluate(post, x, y, reference=shifted, num_samples=4, y_std=2.0)
    # every function draw moves by 0.25 * y_std = 0.5: sorted samples differ by exactly 0.5
    assert moved["w2_function_to_reference"] == pytest.approx(0.5, rel=1e-5)
    # same variance v, means 0.5 apart: KL = 0.5^2 / (2 v)
    pred = post.predict(x, 4)
    v = (pred.variance[:, 0].double().numpy()) * 4.0
    assert moved["kl_gaussian_to_reference"] == pytest.approx(np.mean(0.25 / (2 * v)), rel=1e-5)
    # a Prediction computed at the same points is accepted, and gives the same numbers
    again = evaluate(post, x, y, reference=shifted.predict(x, 4, seed=0), num_samples=4, y_std=2.0)
    assert again["w2_function_to_reference"] == pytest.approx(moved["w2_function_to_reference"])

    class Stored:  # the shape of pyrobdl.inference.reference.Reference: inputs + a prediction
        x_eval = x

        def prediction(self):
            return shifted.predict(x, 4, seed=0)

    stored = evaluate(post, x, y, reference=Stored(), num_samples=4, y_std=2.0)
    assert stored["w2_function_to_reference"] == pytest.approx(moved["w2_function_to_reference"])
    Stored.x_eval = x + 0.5
    with pytest.raises(ValueError, match="different test points"):
        evaluate(post, x, y, reference=Stored(), num_samples=4)


def classifier_posterior():
    model = pyrobdl.BayesianMLP(2, (), 3, likelihood=pyrobdl.likelihoods.Categorical())
    w = torch.tensor([[[2.0, 0.0], [0.0, 2.0], [-1.0, -1.0]], [[1.5, 0.5], [0.0, 1.0], [-1.0, 0.0]]])
    return FixedDraws(model, {"layers.0.weight": w, "layers.0.bias": torch.zeros(2, 3)})


def test_evaluate_classification_matches_direct_computation():
    post = classifier_posterior()
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0], [0.5, 0.5]])
    y = torch.tensor([0, 1, 2, 1])
    scores = evaluate(post, x, y, num_samples=2)
    logits = torch.einsum("ski,ni->snk", post.draws["layers.0.weight"].double(), x.double())
    draw_probs = torch.softmax(logits, -1).numpy()
    probs = draw_probs.mean(0)
    assert scores["accuracy"] == pytest.approx(metrics.accuracy(probs, y.numpy()))
    assert scores["nll"] == pytest.approx(metrics.categorical_nll(probs, y.numpy()), rel=1e-6)
    assert scores["test_ll"] == pytest.approx(-scores["nll"])
    assert scores["brier"] == pytest.approx(metrics.brier_score(probs, y.numpy()), rel=1e-6)
    assert scores["ece"] == pytest.approx(metrics.expected_calibration_error(probs, y.numpy()), rel=1e-6)
    assert scores["mutual_information"] == pytest.approx(metrics.mutual_information(draw_probs).mean(), rel=1e-6)
    ref = evaluate(post, x, y, reference=post, num_samples=2)
    assert ref["agreement"] == 1.0 and ref["total_variation"] == pytest.approx(0.0, abs=1e-12)


def test_evaluate_bad_input_is_rejected_before_work():
    post = fixed_linear()
    x = torch.linspace(-1, 1, 6)[:, None]
    y = x[:, 0]
    with pytest.raises(ValueError, match="x_test has 2 features"):
        evaluate(post, torch.zeros(6, 2), y)
    with pytest.raises(ValueError, match="y_test must have one row per test input"):
        evaluate(post, x, y[:5])
    with pytest.raises(ValueError, match="y_std must be > 0"):
        evaluate(post, x, y, y_std=0.0)
    with pytest.raises(ValueError, match="reference prediction has 5 test points"):
        evaluate(post, x, y, reference=post.predict(x[:5], 4))
    with pytest.raises(ValueError, match="different test points"):
        evaluate(post, x, y, reference=(x + 1.0, post.predict(x + 1.0, 4)))
    with pytest.raises(ValueError, match="classification"):
        evaluate(post, x, y, reference=classifier_posterior())
    with pytest.raises(TypeError, match="Posterior"):
        evaluate("not a posterior", x, y)
    clf = classifier_posterior()
    xc, yc = torch.zeros(3, 2), torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="classification model"):
        evaluate(clf, xc, yc, y_std=2.0)
    with pytest.raises(ValueError, match="labels outside"):
        evaluate(clf, xc, torch.tensor([0, 1, 5]))


def test_task_specific_scores_reject_the_wrong_task():
    x = torch.linspace(-1, 1, 4)[:, None]
    reg = fixed_linear().predict(x, 4)
    with pytest.raises(ValueError, match="needs a classification prediction"):
        classification_scores(reg, [0, 1, 0, 1])
    clf = classifier_posterior().predict(torch.zeros(4, 2), 2)
    with pytest.raises(ValueError, match="needs a regression prediction"):
        regression_scores(clf, torch.zeros(4))
    with pytest.raises(ValueError, match="regression"):
        reference_scores(reg, clf)


# ----------------------------------------------------------------------------- PSIS k-hat of VI


class ScaledExact(BNNGuide):
    """q = N(exact posterior mean, (c * exact marginal sd)^2) per site, independent."""

    def __init__(self, model, exact, c):
        super().__init__(model)
        self.loc = {"layers.0.weight": exact.weight_mean.reshape(1, -1).float(),
                    "layers.0.bias": exact.bias_mean.reshape(1).float()}
        self.scale = {"layers.0.weight": c * exact.weight_sd.reshape(1, -1).float(),
                      "layers.0.bias": c * exact.bias_sd.reshape(1).float()}

    def variational_distributions(self):
        return {k: pyro.distributions.Normal(self.loc[k], self.scale[k]).to_event(self.loc[k].dim()) for k in self.loc}


@pytest.mark.parametrize("c, low, high", [(3.0, -np.inf, 0.5), (0.4, 0.7, np.inf)])
def test_vi_pareto_k_separates_wide_and_narrow_approximations(c, low, high):
    """Yao et al. 2018: ratios p/q are bounded when q is wider than p in every direction
    (k-hat <= 0.5 expected), and heavy-tailed when q is much narrower (k-hat > 0.7).
    Measured over seeds 0-4: k-hat in [-0.39, -0.16] for c = 3 and [0.80, 1.09] for c = 0.4."""
    data = pyrobdl.datasets.bayesian_linear_regression(num_train=30, in_features=2, seed=0)
    model = pyrobdl.BayesianMLP(2, (), 1, prior=pyrobdl.priors.Gaussian(data.prior_scale),
                                likelihood=pyrobdl.likelihoods.Gaussian(data.precision))
    guide = ScaledExact(model, data.posterior, c)
    post = SVIPosterior(model, guide, method="test", settings={}, cost=COST)
    k = vi_pareto_k(post, data.x_train, data.y_train, num_samples=4000, seed=0)
    assert low < k < high


def test_vi_pareto_k_is_none_without_a_density():
    assert vi_pareto_k(fixed_linear(), torch.zeros(3, 1), torch.zeros(3)) is None
