"""Dropout-as-mixture guide (Gal & Ghahramani 2016): distributions, KLs, the L2 equivalence, registry."""

from __future__ import annotations

import math

import pyro
import pytest
import torch
from torch.distributions import kl_divergence

import pyrobdl
from pyrobdl.guides import Dropout
from pyrobdl.guides._dropout_dists import BernoulliDropoutRows, DropoutRows, GaussianDropoutRows
from pyrobdl.inference.elbo import make_elbo
from pyrobdl.posterior import SVIPosterior


@pytest.fixture
def float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def small_model(hidden=(6,), likelihood=None, prior_scale=1.0, bias_scale=None, in_features=3):
    return pyrobdl.BayesianMLP(
        in_features,
        hidden,
        1,
        activation="relu",
        prior=pyrobdl.priors.Gaussian(prior_scale, bias_scale=bias_scale),
        likelihood=likelihood or pyrobdl.likelihoods.Gaussian(4.0),
    )


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("p", [0.0, 1.0, -0.1, 1.5, float("nan")])
def test_drop_probability_outside_open_unit_interval_is_an_error(p):
    with pytest.raises(ValueError, match=r"p must be a drop probability in \(0, 1\)"):
        Dropout(small_model(), p=p)


def test_per_layer_p_must_match_the_layers():
    model = small_model(hidden=(4, 4))  # three linear layers
    assert Dropout(model, p=[0.1, 0.2, 0.3]).p == (0.1, 0.2, 0.3)
    with pytest.raises(ValueError, match="p has 2 entries but the network has 3 layers"):
        Dropout(model, p=[0.1, 0.2])
    with pytest.raises(ValueError, match=r"p\[1\] must be a drop probability"):
        Dropout(model, p=[0.1, 1.0, 0.2])


@pytest.mark.parametrize("sigma", [0.0, -1e-3, float("inf")])
def test_sigma_must_be_positive(sigma):
    with pytest.raises(ValueError, match="sigma must be a finite number > 0"):
        Dropout(small_model(), sigma=sigma)


def test_type_errors_and_unknown_kind():
    with pytest.raises(TypeError, match="p must be a number"):
        Dropout(small_model(), p="0.1")
    with pytest.raises(TypeError, match="sigma must be a number"):
        Dropout(small_model(), sigma=True)
    with pytest.raises(ValueError, match=r"unknown kind 'uniform'; valid: \['bernoulli', 'gaussian'\]"):
        Dropout(small_model(), kind="uniform")


def test_fit_rejects_bad_p_before_training():
    x, y = torch.randn(10, 3), torch.randn(10)
    with pytest.raises(ValueError, match="p must be a drop probability"):
        pyrobdl.fit(small_model(), x, y, method="dropout", p=1.2, progress=False)


# ---------------------------------------------------------------- the distributions


def test_sites_and_shapes_follow_the_model():
    model = small_model(hidden=(5,))
    guide = Dropout(model, p=0.2)
    qs = guide.variational_distributions()
    assert list(qs) == [s.name for s in model.sites]
    for s in model.sites:
        assert qs[s.name].event_shape == s.shape and qs[s.name].batch_shape == ()
    assert isinstance(qs["layers.0.weight"], BernoulliDropoutRows)
    draws = guide.sample_params(7)
    assert draws["layers.0.weight"].shape == (7, 5, 3) and draws["layers.1.bias"].shape == (7, 1)
    # only the means are learned for weights and biases
    assert sorted(n.removesuffix("_unconstrained") for n, _ in guide.named_parameters()) == sorted(
        f"{s.name.replace('.', '_')}_loc" for s in model.sites
    )


def test_dropping_input_unit_j_equals_zeroing_input_j():
    """A dropped unit zeroes a *column* of the stored [out, in] weight, i.e. the input x[:, j]."""
    model = small_model(hidden=(5,), in_features=4)
    guide = Dropout(model, p=0.3)
    q = guide.variational_distributions()
    params = {s.name: getattr(guide, f"{s.name.replace('.', '_')}_loc").detach() for s in model.sites}
    x = torch.randn(9, 4)
    w0 = q["layers.0.weight"]
    for j in range(4):
        mask = torch.ones(4)
        mask[j] = 0.0
        dropped = dict(params, **{"layers.0.weight": w0.rsample_from(mask, torch.zeros(5, 4))})
        x_zeroed = x.clone()
        x_zeroed[:, j] = 0.0
        assert torch.equal(model.network(dropped, x), model.network(params, x_zeroed))


def test_sampled_columns_are_kept_or_dropped_as_a_whole_at_rate_p():
    loc = torch.randn(20, 30) + 3.0  # entries far from 0 in units of sigma
    q = BernoulliDropoutRows(loc, p=0.25, sigma=1e-3)
    w = q.sample((400,))
    near_m = ((w - loc).abs() < 6e-3).all(-2)  # [400, 30], whole column within 6 sigma of M
    near_0 = (w.abs() < 6e-3).all(-2)
    assert bool((near_m ^ near_0).all())
    rate = near_0.double().mean().item()
    # 12000 Bernoulli(0.25) draws: s.e. 0.004; 4 s.e.
    assert abs(rate - 0.25) < 0.016


def test_bernoulli_log_prob_is_the_exact_mixture_density(float64):
    torch.manual_seed(1)
    loc = torch.randn(3, 4) * 0.2  # small means: the components overlap, so the mixture matters
    q = BernoulliDropoutRows(loc, p=0.3, sigma=0.15)
    value = q.sample((5,))
    components = torch.distributions.Independent(
        torch.distributions.Normal(torch.stack([loc.T, torch.zeros_like(loc.T)], -2), 0.15), 1
    )  # batch [in, 2], event [out]
    mixture = torch.distributions.MixtureSameFamily(
        torch.distributions.Categorical(torch.tensor([0.7, 0.3]).expand(4, 2)), components
    )
    expected = mixture.log_prob(value.transpose(-1, -2)).sum(-1)
    assert torch.allclose(q.log_prob(value), expected, rtol=1e-12)


def test_gaussian_log_prob_is_the_exact_rank_one_gaussian(float64):
    torch.manual_seed(2)
    loc = torch.randn(3, 4)
    q = GaussianDropoutRows(loc, p=0.2, sigma=1e-3)
    value = q.sample((6,))
    alpha = 0.2 / 0.8
    cov = 1e-6 * torch.eye(3) + alpha * loc.T.unsqueeze(-1) * loc.T.unsqueeze(-2)  # [in, out, out]
    mvn = torch.distributions.MultivariateNormal(loc.T, cov)
    expected = mvn.log_prob(value.transpose(-1, -2)).sum(-1)
    # sigma/|m| = 1e-3 makes cov ill-conditioned (1e6); Cholesky loses ~6 digits of 16
    assert torch.allclose(q.log_prob(value), expected, rtol=1e-8)


@pytest.mark.parametrize("cls", [BernoulliDropoutRows, GaussianDropoutRows])
def test_mean_and_variance_match_draws(cls):
    loc = torch.randn(4, 5)
    q = cls(loc, p=0.2, sigma=0.05)
    w = q.sample((40000,))
    # 40000 draws: mean s.e. <= sqrt(0.2*0.8*max m^2)/200; 5 s.e. in a loose absolute bound
    assert torch.allclose(w.mean(0), q.mean, atol=0.02)
    assert torch.allclose(w.var(0), q.variance, rtol=0.1, atol=1e-3)


# ---------------------------------------------------------------- KLs


def test_bernoulli_closed_form_kl_matches_monte_carlo_for_separated_components(float64):
    """Gal's large-K form (constant included) is the mixture's KL when components do not overlap."""
    torch.manual_seed(3)
    model = small_model(hidden=(50,), prior_scale=0.7, in_features=8)
    prior = model.prior_distributions()["layers.0.weight"]
    loc = torch.randn(50, 8) * 0.3
    q = BernoulliDropoutRows(loc, p=0.1, sigma=1e-2)
    closed = kl_divergence(q, prior)
    w = q.sample((20000,))
    terms = q.log_prob(w) - prior.log_prob(w)
    se = terms.std() / math.sqrt(len(terms))
    assert abs(closed - terms.mean()) < 4 * se  # overlap ~ exp(-|m|^2/8 sigma^2) ~ 0 here


def test_gaussian_kl_is_the_exact_gaussian_kl(float64):
    torch.manual_seed(4)
    loc = torch.randn(3, 4)
    q = GaussianDropoutRows(loc, p=0.4, sigma=0.1)
    prior = pyrobdl.priors.Gaussian(2.0).site_distribution(pyrobdl.priors.Site("w", 0, "weight", (3, 4), 4, 1))
    alpha = 0.4 / 0.6
    cov = 0.01 * torch.eye(3) + alpha * loc.T.unsqueeze(-1) * loc.T.unsqueeze(-2)
    exact = kl_divergence(
        torch.distributions.MultivariateNormal(loc.T, cov),
        torch.distributions.MultivariateNormal(torch.zeros(4, 3), 4.0 * torch.eye(3)),
    ).sum()
    assert torch.allclose(kl_divergence(q, prior), exact, rtol=1e-10)


@pytest.mark.parametrize("kind", ["bernoulli", "gaussian"])
def test_kl_is_registered_against_the_models_prior_types_and_batches(kind):
    model = small_model()
    guide = Dropout(model, p=0.1, kind=kind)
    q, p = guide.variational_distributions()["layers.0.weight"], model.prior_distributions()["layers.0.weight"]
    kl = kl_divergence(q, p)
    assert kl.shape == () and torch.isfinite(kl)
    # the layout of vectorized particles (batch [P, 1]) that Pyro's plates produce
    expanded = kl_divergence(q.expand((3, 1)), p.expand((3, 1)))
    assert expanded.shape == (3, 1) and torch.allclose(expanded, kl.expand(3, 1))


def test_non_gaussian_prior_falls_back_to_monte_carlo():
    q = BernoulliDropoutRows(torch.randn(2, 3), p=0.1, sigma=0.1)
    laplace = pyro.distributions.Laplace(torch.zeros(2, 3), 1.0).to_event(2)
    with pytest.raises(NotImplementedError):
        kl_divergence(q, laplace)


# ---------------------------------------------------------------- the dropout / weight-decay equivalence


def _replay_draws(guide, seed):
    """Redraw the guide's masks and noise exactly as one ELBO evaluation with ``seed`` does."""
    pyro.set_rng_seed(seed)
    draws = {}
    for name, q in guide.variational_distributions().items():
        if isinstance(q, DropoutRows):
            mask = q.sample_multipliers()
            noise = torch.randn(q.event_shape)
            draws[name] = (mask, noise)
        else:
            draws[name] = ((q.rsample() - q.mean) / guide.sigma).detach()
    return draws


def _dropout_loss(guide, draws, x, y, lengthscale, bias_lengthscale, tau, num_data):
    r"""Standard dropout loss (1/2B)·Σ(y - ŷ)² + Σ λ_ℓ‖M_ℓ‖² + Σ λ_b‖b‖² in plain torch.

    Units are dropped on each layer's *input* (h ⊙ z), not through the guide's weight layout.
    The σ-noise of the guide is added as the fixed perturbation σ·h·Eᵀ, so the forward pass is
    the one the ELBO sees.
    """
    h = x
    num_layers = len(guide.p)
    decay = 0.0
    for i in range(num_layers):
        m = getattr(guide, f"layers_{i}_weight_loc")
        b = getattr(guide, f"layers_{i}_bias_loc")
        mask, noise = draws[f"layers.{i}.weight"]
        h_next = (h * mask) @ m.T + guide.sigma * h @ noise.T + b + guide.sigma * draws[f"layers.{i}.bias"]
        h = torch.relu(h_next) if i < num_layers - 1 else h_next
        lam = lengthscale**2 * (1 - guide.p[i]) / (2 * num_data * tau)
        lam_b = bias_lengthscale**2 / (2 * num_data * tau)
        decay = decay + lam * (m**2).sum() + lam_b * (b**2).sum()
    return ((y - h) ** 2).sum() / (2 * x.shape[0]) + decay


@pytest.mark.parametrize("elbo", ["direct", "trace"])
@pytest.mark.parametrize("minibatch", [False, True])
def test_elbo_gradient_equals_dropout_loss_with_weight_decay(float64, elbo, minibatch):
    """Requirement 5: ∇(−ELBO/(Nτ)) = ∇[(1/2B)Σ‖y − ŷ‖² + λ‖M‖² + λ_b‖b‖²] for the same masks.

    λ = l²(1−p)/(2Nτ) per layer, λ_b = l_b²/(2Nτ) for the (never dropped) biases.
    """
    torch.manual_seed(5)
    tau, l, l_b, n = 3.0, 0.8, 0.5, 40
    model = small_model(
        hidden=(7, 6), prior_scale=1 / l, bias_scale=1 / l_b, likelihood=pyrobdl.likelihoods.Gaussian(tau)
    )
    guide = Dropout(model, p=[0.1, 0.3, 0.2], sigma=1e-2)
    x, y = torch.randn(n, 3), torch.randn(n, 1)
    subsample = torch.arange(5, 21) if minibatch else None
    loss_fn = make_elbo(model, guide, elbo=elbo, kl="analytic")  # "trace" -> TraceMeanField_ELBO
    params = list(guide.parameters())

    pyro.set_rng_seed(11)
    with pyro.get_param_store().scope():
        neg_elbo = loss_fn(x, y, subsample) / (n * tau)
    elbo_grads = torch.autograd.grad(neg_elbo, params)

    draws = _replay_draws(guide, 11)
    xb, yb = (x[subsample], y[subsample]) if minibatch else (x, y)
    reference = _dropout_loss(guide, draws, xb, yb, l, l_b, tau, n)
    ref_grads = torch.autograd.grad(reference, params)
    for g, r in zip(elbo_grads, ref_grads):
        assert torch.allclose(g, r, rtol=1e-10, atol=1e-12)  # float64: exact up to rounding
    # the objectives differ by a constant only (Gaussian normaliser and the KL's constant)
    offset = float((neg_elbo - reference).detach())
    with torch.no_grad():
        for prm in params:
            prm.mul_(1.7).add_(0.1)
    pyro.set_rng_seed(11)
    with pyro.get_param_store().scope():
        shifted = loss_fn(x, y, subsample) / (n * tau) - _dropout_loss(guide, draws, xb, yb, l, l_b, tau, n)
    shifted = float(shifted.detach())
    assert shifted == pytest.approx(offset, rel=1e-10)


@pytest.mark.parametrize("kind", ["bernoulli", "gaussian"])
@pytest.mark.parametrize("kl", ["monte_carlo", "analytic"])
@pytest.mark.parametrize("particles", [1, 3])
def test_direct_elbo_equals_pyro_elbo(kind, kl, particles):
    """The guide is a plain Pyro guide: Trace_ELBO/TraceMeanField_ELBO see the same draws as DirectELBO."""
    model = small_model(likelihood=pyrobdl.likelihoods.GaussianLearnedPrecision())
    guide = Dropout(model, p=0.2, sigma=0.05, kind=kind)
    x, y = torch.randn(16, 3), torch.randn(16)
    results = []
    for elbo in ("direct", "trace"):
        loss_fn = make_elbo(model, guide, elbo=elbo, kl=kl, num_particles=particles)
        pyro.set_rng_seed(7)
        with pyro.get_param_store().scope():
            loss = loss_fn(x, y.unsqueeze(-1), None)
            grads = torch.autograd.grad(loss, list(guide.parameters()))
        results.append((loss.detach(), torch.cat([g.reshape(-1) for g in grads])))
    # float32 sums of ~100 terms in different orders
    assert torch.allclose(results[0][0], results[1][0], rtol=1e-5, atol=1e-3)
    assert torch.allclose(results[0][1], results[1][1], rtol=1e-4, atol=1e-3)


def test_plain_pyro_svi_and_predictive_work():
    model = small_model()
    guide = Dropout(model, p=0.1)
    x = torch.randn(20, 3)
    y = x[:, :1].sum(-1) + 0.1 * torch.randn(20)
    svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), pyro.infer.Trace_ELBO())
    losses = [svi.step(x, y) for _ in range(5)]
    assert all(math.isfinite(v) for v in losses)
    predictive = pyro.infer.Predictive(model, guide=guide, num_samples=4, parallel=True, return_sites=["obs"])
    assert predictive(x)["obs"].shape == (4, 20, 1)


# ---------------------------------------------------------------- registry and predictive


@pytest.mark.parametrize("method", ["dropout", "gaussian_dropout"])
def test_registry_methods_fit_and_predict_through_the_shared_contract(method):
    model = small_model(likelihood=pyrobdl.likelihoods.Gaussian(25.0))
    torch.manual_seed(0)
    x = torch.randn(64, 3)
    y = x[:, 0] - 0.5 * x[:, 1]
    post = pyrobdl.fit(model, x, y, method=method, p=0.1, num_steps=300, lr=1e-2, seed=0, progress=False)
    assert isinstance(post, SVIPosterior) and post.method == method
    assert post.guide.kind == ("gaussian" if method == "gaussian_dropout" else "bernoulli")
    assert post.history[-30:].mean() > post.history[:30].mean()  # the ELBO improved
    pred = post.predict(x, num_samples=100, seed=1)
    # MC dropout moments: the mean of the passes, and their variance plus 1/tau
    assert torch.allclose(pred.mean, pred.samples.mean(0))
    assert torch.allclose(pred.variance, pred.samples.var(0, unbiased=False) + 1 / 25.0)
    assert float(((pred.mean.squeeze(-1) - y) ** 2).mean()) < 0.1 * float(y.var())


def test_learned_precision_uses_the_mean_field_fallback():
    model = small_model(likelihood=pyrobdl.likelihoods.GaussianLearnedPrecision())
    guide = Dropout(model, p=0.1)
    q = guide.variational_distributions()["precision"]
    assert isinstance(guide.fallback, pyrobdl.guides.MeanField)
    assert bool((q.sample((50,)) > 0).all())
    assert guide.weight_averaged_params()["precision"] > 0
    x, y = torch.randn(32, 3), torch.randn(32)
    post = pyrobdl.fit(model, x, y, method="dropout", num_steps=20, seed=0, progress=False)
    pred = post.predict(x, num_samples=10, seed=0)
    assert torch.isfinite(pred.aleatoric_variance).all()


@pytest.mark.parametrize("kind, scale", [("bernoulli", 0.75), ("gaussian", 1.0)])
def test_weight_averaging_scales_the_weights(kind, scale):
    model = small_model(hidden=())  # a linear model: E[f] equals the weight-averaged output exactly
    guide = Dropout(model, p=0.25, kind=kind)
    params = guide.weight_averaged_params()
    assert torch.equal(params["layers.0.weight"], scale * guide.layers_0_weight_loc.detach())
    assert torch.equal(params["layers.0.bias"], guide.layers_0_bias_loc.detach())
    x = torch.randn(10, 3)
    wa = guide.weight_averaged_prediction(model, x)
    assert wa.samples.shape == (1, 10, 1) and bool((wa.epistemic_variance == 0).all())
    assert torch.allclose(wa.variance, torch.full((10, 1), 1 / 4.0))
    draws = guide.sample_params(20000)
    mc = model.network(draws, x).mean(0)
    # 20000 passes, |w| <= 1/sqrt(3) and |x| ~ 1: MC error s.e. < 2e-3; 5 s.e.
    assert torch.allclose(mc, wa.mean, atol=1e-2)
