"""pyrobdl's traceless DirectELBO equals Pyro's ELBOs; local reparameterization keeps the moments."""

from __future__ import annotations

import pyro
import pytest
import torch

import pyrobdl
from pyrobdl.inference.elbo import make_elbo
from pyrobdl.poutine import LocalReparameterizationMessenger, linear

LIKELIHOODS = {
    "gaussian": lambda: pyrobdl.likelihoods.Gaussian(4.0),
    "learned_precision": lambda: pyrobdl.likelihoods.GaussianLearnedPrecision(),
    "categorical": lambda: pyrobdl.likelihoods.Categorical(),
}


def setup(likelihood: str, local: bool):
    torch.manual_seed(0)
    out = 3 if likelihood == "categorical" else 1
    model = pyrobdl.BayesianMLP(4, (6,), out, activation="tanh", likelihood=LIKELIHOODS[likelihood]())
    guide = pyrobdl.guides.MeanField(model, init_scale=0.1, local_reparameterization=local)
    x = torch.randn(32, 4)
    y = torch.randint(0, 3, (32,)) if likelihood == "categorical" else torch.randn(32, 1)
    return model, guide, x, y


def loss_and_grad(model, guide, x, y, *, elbo, kl, particles, kl_weight=1.0):
    loss_fn = make_elbo(model, guide, elbo=elbo, kl=kl, num_particles=particles)
    loss_fn.kl_weight = kl_weight
    pyro.set_rng_seed(123)
    with pyro.get_param_store().scope():
        loss = loss_fn(x, y, torch.arange(8, 20))  # a minibatch: the likelihood scales by 32/12
        grads = torch.autograd.grad(loss, list(guide.parameters()))
    return loss.detach(), torch.cat([g.reshape(-1) for g in grads])


@pytest.mark.parametrize("likelihood", sorted(LIKELIHOODS))
@pytest.mark.parametrize("local", [False, True], ids=["weights", "local"])
@pytest.mark.parametrize("kl", ["monte_carlo", "analytic"])
@pytest.mark.parametrize("particles", [1, 3])
def test_direct_elbo_equals_pyro_elbo(likelihood, local, kl, particles):
    """Same seed, same draws: value and gradient equal Trace_ELBO / TraceMeanField_ELBO."""
    model, guide, x, y = setup(likelihood, local)
    direct = loss_and_grad(model, guide, x, y, elbo="distributions", kl=kl, particles=particles, kl_weight=0.3)
    pyro_ = loss_and_grad(model, guide, x, y, elbo="trace", kl=kl, particles=particles, kl_weight=0.3)
    # float32 sums of ~100 terms in different orders: relative 1e-5
    assert torch.allclose(direct[0], pyro_[0], rtol=1e-5, atol=1e-4)
    assert torch.allclose(direct[1], pyro_[1], rtol=1e-4, atol=1e-4)


def test_kl_weight_scales_only_the_kl():
    model, guide, x, y = setup("gaussian", False)
    full = loss_and_grad(model, guide, x, y, elbo="distributions", kl="analytic", particles=1)[0]
    none = loss_and_grad(model, guide, x, y, elbo="distributions", kl="analytic", particles=1, kl_weight=0.0)[0]
    q, p = guide.variational_distributions(), model.prior_distributions()
    kl = sum(torch.distributions.kl_divergence(q[n], p[n]) for n in q).detach()
    assert torch.allclose(full - none, kl, rtol=1e-5)


def test_direct_elbo_refuses_score_function_sites():
    model, guide, x, y = setup("gaussian", False)

    class NoRsample(pyrobdl.guides.MeanField):
        def variational_distributions(self):
            qs = super().variational_distributions()
            for q in qs.values():
                q.base_dist.has_rsample_(False)
            return qs

    with pytest.raises(ValueError, match="trace_graph"):
        make_elbo(model, NoRsample(model), elbo="direct")


# ("trace_graph", "analytic") is supported since issue 17 (tests/test_bbvi.py, analytic KL).
@pytest.mark.parametrize("bad", [{"elbo": "fast"}, {"kl": "exact"}, {"elbo": "trace_graph ", "kl": "analytic"}])
def test_make_elbo_rejects_unknown_options(bad):
    model, guide, _, _ = setup("gaussian", False)
    with pytest.raises(ValueError, match="valid|monte_carlo"):
        make_elbo(model, guide, **bad)


def test_local_reparameterization_moments_equal_weight_sampling():
    """Pre-activation mean/variance from the handler equal those of sampled weight matrices."""
    torch.manual_seed(1)
    x = torch.randn(5, 3)
    loc, scale = torch.randn(4, 3), torch.rand(4, 3) + 0.1
    bias = torch.randn(4)
    q = pyro.distributions.Normal(loc, scale).to_event(2)
    handler = LocalReparameterizationMessenger({"w"})
    num = 200_000
    w = q.sample((num,))
    with handler:
        handler.observe("w", w, q)
        mean, var = handler.preactivation_moments(x, w, bias)
        local_draws = linear(x, w, bias)  # intercepted: [num, 5, 4] pre-activations
    weight_draws = linear(x, w, bias)  # outside the handler: plain weight sampling
    # exact: E = x mu^T + b, Var = x^2 (sigma^2)^T
    assert torch.allclose(mean, x @ loc.T + bias, atol=1e-6)
    assert torch.allclose(var, (x**2) @ (scale**2).T, atol=1e-6)
    # both samplers match those moments within Monte Carlo error (5 standard errors)
    for draws in (weight_draws, local_draws):
        se_mean = (var / num).sqrt()
        assert ((draws.mean(0) - mean).abs() < 5 * se_mean).all()
        se_var = var * (2 / num) ** 0.5
        assert ((draws.var(0) - var).abs() < 5 * se_var).all()
    # but local draws are independent across data points while weight draws are not
    corr_w = torch.corrcoef(weight_draws[:, :2, 0].T)[0, 1]
    corr_l = torch.corrcoef(local_draws[:, :2, 0].T)[0, 1]
    assert corr_l.abs() < 0.02 and (corr_w - corr_l).abs() > 0.05


def test_local_reparameterization_is_scoped():
    """Outside its ``with`` block nothing is intercepted (no global patch)."""
    torch.manual_seed(0)
    model = pyrobdl.BayesianMLP(3, (4,), 1)
    guide = pyrobdl.guides.MeanField(model, local_reparameterization=True)
    x = torch.randn(6, 3)
    draws = guide.sample_params(2)
    assert torch.equal(model.network(draws, x), model.network(draws, x))  # deterministic: no handler
    with guide.training_context() as handler:
        assert isinstance(handler, LocalReparameterizationMessenger)
    assert isinstance(pyrobdl.guides.MeanField(model).training_context().__enter__(), type(None))


def test_direct_elbo_accepts_flat_regression_targets():
    """A [N] target for a one-output regression gives the same loss as [N, 1] (no broadcasting)."""
    model, guide, x, y = setup("gaussian", False)
    flat = loss_and_grad(model, guide, x, y.squeeze(-1), elbo="distributions", kl="analytic", particles=1)[0]
    column = loss_and_grad(model, guide, x, y, elbo="distributions", kl="analytic", particles=1)[0]
    assert torch.equal(flat, column)
