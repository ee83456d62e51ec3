"""Log-uniform prior and variational dropout: KL approximations, pruning, local reparameterization."""

from __future__ import annotations

import math

import numpy as np
import pyro
import pyro.infer
import pytest
import torch
from conftest import DEVICES
from torch.distributions import kl_divergence

import pyrobdl
from pyrobdl import likelihoods, priors
from pyrobdl.guides import VariationalDropout, pruned_posterior
from pyrobdl.guides.variational_dropout import (
    KINGMA_CONSTANTS,
    LOG_ALPHA_RANGE,
    Sparsity,
    VariationalDropoutNormal,
    kl_log_uniform,
)
from pyrobdl.inference import get_method, make_elbo, methods
from pyrobdl.inference.registry import require_proper_prior
from pyrobdl.posterior import predictive_from_draws


def vd_model(in_features: int = 3, hidden: tuple = (), out: int = 1, **prior_kw) -> pyrobdl.BayesianMLP:
    return pyrobdl.BayesianMLP(
        in_features, hidden, out, prior=priors.LogUniform(**prior_kw), likelihood=likelihoods.Gaussian(4.0)
    )


# ---------------------------------------------------------------------------------------------
# The exact KL, as reference.  For q = N(theta, alpha theta^2) and p(w) ~ 1/|w|,
#   -KL = 1/2 log(alpha) - E_{eps ~ N(1, alpha)} log|eps| + C.
# eps^2/alpha is noncentral chi-square with 1 dof and noncentrality 1/alpha, a Poisson(1/(2 alpha))
# mixture of central chi-square with 1 + 2j dof, whose log has mean log 2 + digamma(1/2 + j):
#   E log|eps| = 1/2 [log alpha + log 2 + sum_j Pois(j; 1/(2 alpha)) digamma(1/2 + j)].
# C is fixed by Molchanov's normalisation -KL -> 0 as alpha -> inf (the j = 0 term alone).
# ---------------------------------------------------------------------------------------------
def _digamma_half_plus(j_max: int) -> np.ndarray:
    """digamma(1/2 + j) for j = 0..j_max (recurrence digamma(x + 1) = digamma(x) + 1/x)."""
    steps = np.concatenate([[0.0], 1.0 / (0.5 + np.arange(j_max))])
    return -np.euler_gamma - 2.0 * math.log(2.0) + np.cumsum(steps)


def exact_neg_kl(log_alpha: float) -> float:
    lam = 0.5 * math.exp(-log_alpha)
    j_max = int(lam + 40.0 * math.sqrt(lam) + 60)
    j = np.arange(j_max + 1)
    log_pmf = -lam + j * math.log(lam) - np.array([math.lgamma(k + 1.0) for k in j])
    expected_digamma = float(np.sum(np.exp(log_pmf) * _digamma_half_plus(j_max)))
    return -0.5 * expected_digamma - 0.5 * np.euler_gamma - math.log(2.0)


GRID = np.linspace(-8.0, 8.0, 161)  # step 0.1 over the clipping range of the paper


@pytest.fixture(scope="module")
def exact_on_grid() -> np.ndarray:
    return np.array([exact_neg_kl(la) for la in GRID])


def test_exact_kl_series_matches_monte_carlo():
    # An independent check of the reference: plain Monte Carlo of the defining expectation.
    rng = np.random.default_rng(0)
    z = rng.standard_normal(1_000_000)
    for la in (-4.0, 0.0, 2.0, 6.0):
        s = math.exp(0.5 * la)
        terms = np.log(np.abs(1.0 + s * z))
        mc = 0.5 * la - terms.mean() - 0.5 * (np.euler_gamma + math.log(2.0))
        se = terms.std() / math.sqrt(z.size)
        assert abs(mc - exact_neg_kl(la)) < 5 * se  # 5 standard errors


def test_exact_kl_series_matches_quadrature():
    integrate = pytest.importorskip("scipy.integrate")
    for la in (-4.0, -1.0, 0.0, 3.0):
        s = math.exp(0.5 * la)
        f = lambda z: math.log(abs(1.0 + s * z)) * math.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)  # noqa: E731
        singular = -1.0 / s
        e_log = integrate.quad(f, -np.inf, singular, limit=200)[0] + integrate.quad(f, singular, np.inf, limit=200)[0]
        quad = 0.5 * la - e_log - 0.5 * (np.euler_gamma + math.log(2.0))
        assert abs(quad - exact_neg_kl(la)) < 1e-6  # both are near machine precision here


# Measured maximum absolute errors of -KL on GRID: Molchanov 0.00937 (at log alpha = -3.5),
# Kingma (on log alpha <= 0, with our c0) 0.0233.  Bounds are those rounded up.
MOLCHANOV_MAX_ERROR = 0.010
KINGMA_MAX_ERROR = 0.025


def test_molchanov_approximation_error(exact_on_grid):
    approx = -kl_log_uniform(torch.tensor(GRID, dtype=torch.float64), "molchanov").numpy()
    err = np.abs(approx - exact_on_grid)
    assert err.max() < MOLCHANOV_MAX_ERROR
    # The fit is not trivially good everywhere: the worst point is inside the range.
    assert err.max() > 1e-3


def test_kingma_approximation_error_and_constant(exact_on_grid):
    low = GRID <= 0.0
    la = torch.tensor(GRID[low], dtype=torch.float64)
    approx = -kl_log_uniform(la, "kingma").numpy()
    assert np.abs(approx - exact_on_grid[low]).max() < KINGMA_MAX_ERROR
    # c0 is the least-squares offset on this grid (its docstring): recompute it.
    c0 = KINGMA_CONSTANTS[0]
    residual = exact_on_grid[low] - (approx - c0)
    assert abs(residual.mean() - c0) < 1e-4


def test_ard_kl_is_the_optimum_over_the_prior_variance():
    theta, sigma = torch.tensor(0.7, dtype=torch.float64), torch.tensor(0.3, dtype=torch.float64)
    q = torch.distributions.Normal(theta, sigma)
    lam = torch.logspace(-2, 1, 20001, dtype=torch.float64)
    kls = kl_divergence(q, torch.distributions.Normal(torch.zeros_like(lam), lam))
    best = lam[kls.argmin()]
    assert float(best**2) == pytest.approx(float(theta**2 + sigma**2), rel=1e-3)  # grid step ~3.5e-4
    log_alpha = torch.log(sigma**2 / theta**2)
    assert float(kl_log_uniform(log_alpha, "ard")) == pytest.approx(float(kls.min()), abs=1e-7)


def test_unknown_approximation():
    with pytest.raises(ValueError, match="molchanov"):
        kl_log_uniform(torch.zeros(2), "exact")


# ---------------------------------------------------------------------------------------------
# The prior
# ---------------------------------------------------------------------------------------------
def test_log_uniform_prior_site_distributions():
    model = vd_model(3, (4,), 2)
    prior = model.prior
    assert prior.proper is False
    ps = model.prior_distributions()
    w = ps["layers.0.weight"]
    assert w.event_shape == (4, 3) and w.batch_shape == ()
    value = torch.randn(4, 3)
    assert torch.allclose(w.log_prob(value), -value.abs().log().sum())
    assert torch.isnan(w.mean).all() and torch.isinf(w.variance).all()
    b = ps["layers.0.bias"]
    assert b.event_shape == (4,) and float(b.log_prob(torch.randn(4))) == 0.0
    with pytest.raises(NotImplementedError, match="improper"):
        w.sample()
    with pytest.raises(NotImplementedError):
        b.sample()
    lu = vd_model(3, bias="log_uniform").prior_distributions()["layers.0.bias"]
    assert torch.allclose(lu.log_prob(torch.full((1,), 2.0)), torch.tensor(-math.log(2.0)))
    # expanded (vectorized particles / plates) keeps the class and the densities
    e = w.expand((5, 1))
    assert e.batch_shape == (5, 1) and e.log_prob(value).shape == (5, 1)


@pytest.mark.parametrize("local_reparameterization", [False, True])
@pytest.mark.parametrize("bias", ["flat", "log_uniform"])
def test_pyro_predictive_works_with_the_improper_prior(bias, local_reparameterization):
    # Pyro 1.9's Predictive first runs the model under InitMessenger(init_to_sample) to learn
    # the sites' shapes (it reads only shapes from that run); the improper densities return a
    # placeholder there and nowhere else, so the guide's draws are what the model sees.
    model = pyrobdl.BayesianMLP(3, (5,), 1, prior=priors.LogUniform(bias=bias), likelihood=likelihoods.Gaussian(4.0))
    guide = VariationalDropout(model, local_reparameterization=local_reparameterization)
    torch.manual_seed(0)
    x = torch.randn(40, 3)
    sites = list(model.prior_distributions())
    pyro.set_rng_seed(1)
    out = pyro.infer.Predictive(model, guide=guide, num_samples=100, return_sites=[*sites, "obs", "_RETURN"])(x)
    assert out["obs"].shape == out["_RETURN"].shape == (100, 40, 1)
    for name in sites:
        w = out[name]
        assert w.shape[0] == 100 and torch.isfinite(w).all()
        assert not bool((w == 1).all())  # the guide's values, not the placeholder
        if bias == "flat" and name.endswith("bias"):
            assert bool((w == w[0]).all())  # flat-prior biases are point estimates in the guide
        else:
            assert float(w.std(0).min()) > 0
    # the returned function values are the model's output under the returned weights ...
    for i in (0, 57, 99):
        f = pyro.poutine.condition(model, data={n: out[n][i, 0] for n in sites})(x)
        assert torch.allclose(out["_RETURN"][i], f, atol=1e-5)
    # ... and obs is the Gaussian likelihood around them: 4,000 residuals with precision 4 have a
    # standard deviation of 0.5 with relative standard error 1/sqrt(2 * 4000) = 1.1%; 4.5 s.e.
    resid = out["obs"] - out["_RETURN"]
    assert float(resid.std()) == pytest.approx(0.5, rel=0.05)
    assert abs(float(resid.mean())) < 4.5 * 0.5 / math.sqrt(resid.numel())
    # parallel (vectorised) predictive works too
    par = pyro.infer.Predictive(model, guide=guide, num_samples=3, parallel=True, return_sites=["obs"])(x)
    assert par["obs"].shape == (3, 40, 1)


def test_improper_prior_still_has_no_draws_outside_initialisation():
    # A prior predictive has nothing to draw from: Predictive without a guide or posterior
    # samples still fails, with the improper-prior message, after its shape pass.
    model = vd_model()
    with pytest.raises(NotImplementedError, match="improper"):
        pyro.infer.Predictive(model, num_samples=2)(torch.randn(4, 3))
    with pytest.raises(NotImplementedError, match="improper"):
        pyro.poutine.trace(model).get_trace(torch.randn(4, 3))


def test_log_uniform_bias_option_validated():
    with pytest.raises(ValueError, match="flat"):
        priors.LogUniform(bias="gaussian")


def _improper_prior_methods() -> list[str]:
    names = [m for m in methods() if get_method(m).check_model is require_proper_prior]
    names += [m for m in ("map", "nuts", "hmc") if m in methods() and m not in names]
    return sorted(names)


@pytest.mark.parametrize("method", _improper_prior_methods())
def test_methods_needing_a_proper_prior_refuse_log_uniform(method):
    model = vd_model()
    x, y = torch.randn(10, 3), torch.randn(10)
    with pytest.raises(ValueError, match="improper") as info:
        pyrobdl.fit(model, x, y, method=method)
    assert "variational_dropout" in str(info.value)


def test_variational_dropout_needs_the_log_uniform_prior():
    model = pyrobdl.BayesianMLP(3, (), 1)
    with pytest.raises(ValueError, match="LogUniform"):
        VariationalDropout(model)
    with pytest.raises(ValueError, match="LogUniform"):
        pyrobdl.fit(model, torch.randn(10, 3), torch.randn(10), method="variational_dropout", num_steps=1)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"sparse": "yes"}, TypeError, "sparse"),
        ({"ard": 1}, TypeError, "ard"),
        ({"local_reparameterization": None}, TypeError, "local_reparameterization"),
        ({"sparse": False, "ard": True}, ValueError, "ard"),
        ({"init_log_sigma2": float("nan")}, ValueError, "init_log_sigma2"),
        ({"init_loc": "prior"}, ValueError, "init_loc"),
    ],
)
def test_guide_options_validated(kwargs, error, match):
    with pytest.raises(error, match=match):
        VariationalDropout(vd_model(), **kwargs)


# ---------------------------------------------------------------------------------------------
# The guide and its KL registration
# ---------------------------------------------------------------------------------------------
def test_guide_distributions_and_registered_kl():
    model = vd_model(3, (4,), 2)
    guide = VariationalDropout(model, init_log_sigma2=-6.0)
    qs, ps = guide.variational_distributions(), model.prior_distributions()
    assert set(qs) == set(ps)
    q = qs["layers.0.weight"]
    assert isinstance(q.base_dist, VariationalDropoutNormal)
    assert q.event_shape == (4, 3) and q.batch_shape == ()
    theta = guide.layers_0_weight_theta.detach()
    expected_la = (-6.0 - torch.log(theta**2 + 1e-8)).clamp(*LOG_ALPHA_RANGE)
    assert torch.allclose(guide.log_alpha()["layers.0.weight"], expected_la)
    assert torch.allclose(q.base_dist.scale, torch.full_like(theta, math.exp(-3.0)))
    kl = kl_divergence(q, ps["layers.0.weight"])
    assert torch.allclose(kl, kl_log_uniform(expected_la).sum())
    # biases are point estimates with a flat prior: zero KL (Pyro's KL(Delta, p) = -log p)
    assert isinstance(qs["layers.0.bias"], pyro.distributions.Delta)
    assert float(kl_divergence(qs["layers.0.bias"], ps["layers.0.bias"])) == 0.0
    # vectorized-particle layout: both sides expanded to [P, 1]
    assert kl_divergence(q.expand((3, 1)), ps["layers.0.weight"].expand((3, 1))).shape == (3, 1)


@pytest.mark.parametrize("sparse, ard, name", [(True, False, "molchanov"), (False, False, "kingma"), (True, True, "ard")])
def test_variant_selects_the_kl(sparse, ard, name):
    guide = VariationalDropout(vd_model(), sparse=sparse, ard=ard, init_log_sigma2=-2.0)
    q = guide.variational_distributions()["layers.0.weight"].base_dist
    assert q.approximation == name
    la = guide.log_alpha()["layers.0.weight"]
    if not sparse:
        # Kingma et al.: alpha <= 1, and the variance of q itself is capped at theta^2
        assert float(la.max()) <= 0.0
        assert torch.all(q.scale <= q.loc.abs() * (1 + 1e-6) + 1e-4)


def test_kingma_variance_cap():
    guide = VariationalDropout(vd_model(), sparse=False, init_log_sigma2=5.0)  # sigma^2 >> theta^2
    q = guide.variational_distributions()["layers.0.weight"].base_dist
    assert torch.allclose(q.scale**2, q.loc**2 + 1e-8, rtol=1e-5)
    assert torch.all(guide.log_alpha()["layers.0.weight"] == 0.0)


@pytest.mark.parametrize("local", [False, True])
@pytest.mark.parametrize("num_particles", [1, 2])
def test_direct_elbo_equals_trace_mean_field_elbo(local, num_particles):
    # Same seed, same draws: pyrobdl's traceless ELBO and Pyro's TraceMeanField_ELBO (which must
    # then pick up the registered KL) agree in value and gradient.
    model = vd_model(3, (5,), 1, bias="log_uniform")
    guide = VariationalDropout(model, init_log_sigma2=-4.0, local_reparameterization=local)
    x, y = torch.randn(20, 3), torch.randn(20, 1)  # y in the likelihood's shape, as fit passes it
    subsample = torch.arange(8)
    values, grads = [], []
    for loss_fn in (
        make_elbo(model, guide, elbo="direct", num_particles=num_particles),
        make_elbo(model, guide, elbo="trace", kl="analytic", num_particles=num_particles),
    ):
        pyro.set_rng_seed(3)
        with pyro.get_param_store().scope():
            loss = loss_fn(x, y, subsample)
            guide.zero_grad()
            loss.backward()
        values.append(float(loss.detach()))
        grads.append(guide.layers_0_weight_log_sigma2.grad.clone())
    assert values[0] == pytest.approx(values[1], rel=1e-5)
    assert torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-6)


def test_analytic_and_monte_carlo_kl_agree_up_to_the_constant():
    # kl="monte_carlo" estimates E_q[log q + log|w|], the exact KL up to its constant, so for one
    # weight of known alpha the two differ by exactly that constant plus the approximation error.
    model = vd_model(1)
    guide = VariationalDropout(model, init_loc={"layers.0.weight": torch.tensor([[0.5]])}, init_log_sigma2=math.log(0.25))
    with torch.no_grad():
        q = guide.variational_distributions()["layers.0.weight"]
        p = model.prior_distributions()["layers.0.weight"]
        w = q.sample((400_000,))
        mc = (q.log_prob(w) - p.log_prob(w)).double()
        analytic = float(kl_divergence(q, p))
    # -KL_exact(alpha) = -(mc mean) + const with const = -1/2 log(2 pi e) - 1/2(gamma + log 2)
    const = 0.5 * math.log(2 * math.pi * math.e) + 0.5 * (np.euler_gamma + math.log(2.0))
    se = float(mc.std()) / math.sqrt(w.shape[0])
    assert float(mc.mean()) + const == pytest.approx(analytic, abs=MOLCHANOV_MAX_ERROR + 5 * se)


# ---------------------------------------------------------------------------------------------
# Local reparameterization
# ---------------------------------------------------------------------------------------------
def test_local_reparameterization_moments():
    model = pyrobdl.BayesianMLP(3, (), 2, prior=priors.LogUniform())
    theta = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.2, -0.3]])
    log_sigma2 = torch.tensor([[-2.0, -1.0, -3.0], [-0.5, -4.0, -1.5]])
    guide = VariationalDropout(model, init_loc={"layers.0.weight": theta, "layers.0.bias": torch.tensor([0.1, -0.2])})
    with torch.no_grad():
        guide.layers_0_weight_log_sigma2.copy_(log_sigma2)
    x = torch.tensor([[1.0, 2.0, -1.0], [1.0, 2.0, -1.0], [0.5, 0.0, 3.0]])  # rows 0 and 1 equal
    mean = x @ theta.T + torch.tensor([0.1, -0.2])
    var = (x * x) @ log_sigma2.exp().T
    num = 100_000

    def outputs(context: bool) -> torch.Tensor:
        qs = guide.variational_distributions()
        with torch.no_grad(), (guide.training_context() if context else torch.no_grad()) as handler:
            params = {n: q.rsample((num,)) for n, q in qs.items()}
            if context:
                handler.observe("layers.0.weight", params["layers.0.weight"], qs["layers.0.weight"])
            return model.network(params, x)

    for context in (True, False):
        f = outputs(context)
        # 5 standard errors; the sd of a sample variance is ~ var sqrt(2/num) for a Gaussian
        assert torch.all((f.mean(0) - mean).abs() < 5 * (var / num).sqrt())
        assert torch.all((f.var(0) - var).abs() < 5 * var * math.sqrt(2 / num))
    # Local reparameterization draws each data point independently; weight sampling does not.
    f_local, f_weights = outputs(True), outputs(False)
    corr = lambda f: float(torch.corrcoef(torch.stack([f[:, 0, 0], f[:, 1, 0]]))[0, 1])  # noqa: E731
    assert abs(corr(f_local)) < 5 / math.sqrt(num)
    assert corr(f_weights) == pytest.approx(1.0, abs=1e-6)


def test_training_context_off():
    guide = VariationalDropout(vd_model(), local_reparameterization=False)
    with guide.training_context() as handler:
        assert handler is None


# ---------------------------------------------------------------------------------------------
# Pruning
# ---------------------------------------------------------------------------------------------
def _pruning_guide():
    model = pyrobdl.BayesianMLP(4, (), 2, prior=priors.LogUniform())
    theta = torch.tensor([[1.0, 0.5, -2.0, 1.0], [0.5, 0.3, 1.0, -1.0]])
    # log alpha = log sigma^2 - log theta^2, clipped to [-8, 8]:
    #   [[-8, 2.39, -8, 4], [-8, -8, 8 (9 clipped), -8]]
    log_sigma2 = torch.tensor([[-20.0, 1.0, -20.0, 4.0], [-20.0, -20.0, 9.0, -20.0]])
    guide = VariationalDropout(
        model, init_loc={"layers.0.weight": theta, "layers.0.bias": torch.tensor([0.1, -0.1])}
    )
    with torch.no_grad():
        guide.layers_0_weight_log_sigma2.copy_(log_sigma2)
    return model, guide, theta


def test_sparsity_and_compression():
    model, guide, theta = _pruning_guide()
    la = guide.log_alpha()["layers.0.weight"]
    expected_removed = int((la >= 3.0).sum())
    assert expected_removed == 2
    sp = guide.sparsity(3.0)
    assert isinstance(sp, Sparsity)
    assert sp.total == {"layers.0.weight": 8} and sp.kept == {"layers.0.weight": 6}
    assert sp.removed["layers.0.weight"] == pytest.approx(0.25)
    assert sp.removed_total == pytest.approx(0.25) and sp.compression_ratio == pytest.approx(8 / 6)
    assert guide.sparsity(1.0).kept == {"layers.0.weight": 5}
    assert guide.sparsity(100.0).compression_ratio == 1.0
    assert guide.sparsity(-100.0).compression_ratio == math.inf
    with pytest.raises(ValueError, match="threshold"):
        guide.sparsity(float("nan"))
    with pytest.raises(ValueError, match="threshold"):
        guide.prune("3")


def test_prune_masks_draws_and_predictions():
    model, guide, theta = _pruning_guide()
    pruned = guide.prune(3.0)
    keep = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    # the original is untouched, the copy drops exactly the high-alpha weights
    assert guide.sparsity(3.0).kept == {"layers.0.weight": 6}
    assert torch.equal(pruned.layers_0_weight_mask.bool(), keep)
    draws = pruned.sample_params(50)
    assert torch.all(draws["layers.0.weight"][:, ~keep] == 0.0)
    assert torch.all(draws["layers.0.weight"][:, keep] != 0.0)
    assert pruned.log_alpha()["layers.0.weight"][~keep].eq(LOG_ALPHA_RANGE[1]).all()
    assert pruned.sparsity(3.0).compression_ratio == pytest.approx(8 / 6)
    assert torch.equal(pruned.point_params()["layers.0.weight"][0], theta * keep)
    # a stricter threshold on the pruned copy can only remove more
    assert pruned.sparsity(1.0).kept == {"layers.0.weight": 5}

    # Predictions through the shared predictive.  Kept weights have sigma ~ 5e-5 except
    # w[0, 1], whose input is set to 0, so the pruned posterior is deterministic up to ~1e-4;
    # the pruned w[0, 3] (sigma = e^2) sees an input of 3, so the unpruned one is not.
    x = torch.randn(7, 4)
    x[:, 1] = 0.0
    x[:, 3] = 3.0
    post = pyrobdl.posterior.SVIPosterior(
        model, guide, method="variational_dropout", settings={}, cost=None, history=None
    )
    pruned_post = pruned_posterior(post, 3.0)
    assert pruned_post.settings["prune_threshold"] == 3.0
    masked = predictive_from_draws(model, pruned.point_params(), x).mean
    full = predictive_from_draws(model, guide.point_params(), x).mean
    assert torch.allclose(full[:, 0] - masked[:, 0], torch.full((7,), 3.0), atol=1e-5)
    assert torch.allclose(pruned_post.predict(x, 20, seed=0).mean, masked, atol=1e-3)
    assert not torch.allclose(post.predict(x, 20, seed=0).mean, masked, atol=0.5)
    with pytest.raises(TypeError, match="VariationalDropout"):
        pruned_posterior(object())


def test_log_uniform_biases_are_sparsified_too():
    guide = VariationalDropout(vd_model(3, (4,), 1, bias="log_uniform"))
    assert set(guide.log_alpha()) == {"layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias"}
    assert set(guide.sparsity().total) == set(guide.log_alpha())


# ---------------------------------------------------------------------------------------------
# Fitting
# ---------------------------------------------------------------------------------------------
def _sparse_regression(num: int = 100, dims: int = 10, precision: float = 4.0):
    """y = x w + noise with only the first three weights non-zero.

    The noise is projected off the column space of x, so the least-squares estimate of every
    irrelevant weight is exactly 0.  (With raw noise an irrelevant weight whose estimate lies
    ~1 posterior sd from 0 keeps a local optimum with finite alpha, as ARD does, and whether it
    is pruned depends on the optimiser's path rather than on the method.)
    """
    g = torch.Generator().manual_seed(0)
    x = torch.randn(num, dims, generator=g, dtype=torch.float64)
    w = torch.zeros(dims, dtype=torch.float64)
    w[:3] = torch.tensor([2.0, -1.5, 1.0], dtype=torch.float64)
    e = torch.randn(num, generator=g, dtype=torch.float64)
    e = e - x @ torch.linalg.lstsq(x, e).solution
    e = e / e.std() / math.sqrt(precision)
    return x.float(), (x @ w + e).float(), w.float()


@pytest.mark.parametrize("device", DEVICES)
def test_irrelevant_inputs_are_pruned(device):
    x, y, w = _sparse_regression()
    model = pyrobdl.BayesianMLP(10, (), 1, prior=priors.LogUniform(), likelihood=likelihoods.Gaussian(4.0))
    post = pyrobdl.fit(
        model, x, y, method="variational_dropout", num_steps=200, lr=3e-2, kl_warmup=50, seed=0,
        device=device, progress=False,
    )
    la = post.guide.log_alpha()["layers.0.weight"][0].cpu()
    # Measured (seeds 0-4): log alpha = -8 (the clip) on every relevant input, >= 4.2 on the others.
    assert torch.all(la[:3] < 3.0) and torch.all(la[3:] >= 3.0)
    sp = post.guide.sparsity(3.0)
    assert sp.kept == {"layers.0.weight": 3} and sp.compression_ratio == pytest.approx(10 / 3)
    theta = post.guide.point_params()["layers.0.weight"][0, 0].cpu()
    # The posterior sd of a relevant weight is ~1/sqrt(N tau var x) = 0.05, but 200 steps do not
    # converge: the largest |theta - w| measured over seeds 0-4 was 0.19.
    assert torch.allclose(theta[:3], w[:3], atol=0.25)
    pruned = pruned_posterior(post)
    pred = pruned.predict(x[:5], num_samples=10, seed=0)
    assert pred.mean.shape == (5, 1) and torch.isfinite(pred.mean).all()


def test_fit_with_learned_noise_and_plain_pyro_svi():
    x, y, _ = _sparse_regression(40, 4)
    model = pyrobdl.BayesianMLP(
        4, (8,), 1, prior=priors.LogUniform(), likelihood=likelihoods.GaussianLearnedPrecision()
    )
    guide = VariationalDropout(model)
    assert set(guide.variational_distributions()) == {*(s.name for s in model.sites), "precision"}
    svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), pyro.infer.TraceMeanField_ELBO())
    losses = []
    for _ in range(30):
        with guide.training_context():
            losses.append(svi.step(x, y))
    assert all(math.isfinite(v) for v in losses)
    point = guide.point_params()
    assert point["precision"].shape[0] == 1 and float(point["precision"].min()) > 0
    post = pyrobdl.fit(model, x, y, method="variational_dropout", num_steps=20, progress=False, elbo="trace")
    assert np.isfinite(post.history).all()


def test_registry_entry():
    meth = get_method("variational_dropout")
    assert meth.options["sparse"] is True and meth.options["ard"] is False
    assert meth.options["local_reparameterization"] is True and meth.options["init_log_sigma2"] == -10.0
    assert meth.check_model is None


@pytest.mark.parametrize("elbo", ["direct", "trace"])
def test_elbos_dispatch_to_the_registered_kl(elbo, monkeypatch):
    # Replace the KL formula by a constant per weight: the loss must move by exactly that much,
    # so both pyrobdl's DirectELBO and Pyro's TraceMeanField_ELBO go through register_kl.
    import pyrobdl.guides.variational_dropout as vd

    model = vd_model(3, (4,), 1)
    guide = VariationalDropout(model, local_reparameterization=False)
    x, y = torch.randn(5, 3), torch.randn(5, 1)
    loss_fn = make_elbo(model, guide, elbo=elbo, kl="analytic")
    with pyro.get_param_store().scope():
        pyro.set_rng_seed(1)
        before = float(loss_fn(x, y).detach())
        monkeypatch.setattr(vd, "kl_log_uniform", lambda la, approximation: torch.full_like(la, 10.0))
        pyro.set_rng_seed(1)
        after = float(loss_fn(x, y).detach())
    exact = sum(10.0 * la.numel() - float(kl_log_uniform(la).sum()) for la in guide.log_alpha().values())
    assert after - before == pytest.approx(exact, rel=1e-4)
