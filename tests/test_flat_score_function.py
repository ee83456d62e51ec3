"""BBVI's flat path (issue 41): FlatScoreFunctionELBO equals DirectScoreFunctionELBO on the same draws."""

from __future__ import annotations

from unittest import mock

import pyro
import pytest
import torch

import pyrobdl
from pyrobdl.guides import ScoreFunction
from pyrobdl.inference import DirectScoreFunctionELBO, make_elbo, numpy_elbo
from pyrobdl.inference.flat_score_function import FlatScoreFunctionELBO, flat_score_function_support

# float64 throughout: the two paths sum the same numbers in different orders (per-site sums by a
# matrix product), so they agree to ~1e-13 on costs of O(10-100)
TOL = dict(rtol=1e-10, atol=1e-10)
LIKELIHOODS = {
    "gaussian": lambda: pyrobdl.likelihoods.Gaussian(4.0),
    "learned_precision": lambda: pyrobdl.likelihoods.GaussianLearnedPrecision(),
    "categorical": lambda: pyrobdl.likelihoods.Categorical(),
}


@pytest.fixture(autouse=True)
def _float64():
    """The model's prior distributions are built in the default dtype (float32 even after
    ``model.double()``), so the reference path would mix in float32 constants (~1e-8 relative)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def _problem(likelihood: str, activation: str = "tanh", hidden: tuple = (3, 4), baseline: str = "leave_one_out"):
    out = 3 if likelihood == "categorical" else 1
    model = pyrobdl.BayesianMLP(2, hidden, out, activation=activation, likelihood=LIKELIHOODS[likelihood](),
                                prior=pyrobdl.priors.Gaussian(0.7)).double()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(12, 2, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (12,), generator=gen) if out == 3 else torch.randn(12, generator=gen, dtype=torch.float64)
    pyro.set_rng_seed(0)
    guide = ScoreFunction(model, init_scale=0.2, baseline=baseline).double()
    return model, guide, x, y


def _steps(loss_fn, guide, x, y, subsample, steps=3, seed=5):
    """Value and per-site gradients (through ``backward``) of consecutive steps from one seed."""
    out = []
    pyro.set_rng_seed(seed)
    for _ in range(steps):
        guide.zero_grad(set_to_none=True)
        loss = loss_fn(x, y, subsample)
        loss.backward()
        out.append((loss.detach(), torch.cat([p.grad.reshape(-1) for p in guide.parameters()])))
    return out


def _assert_same(a, b):
    for (loss_a, grad_a), (loss_b, grad_b) in zip(a, b):
        torch.testing.assert_close(loss_b, loss_a, **TOL)
        torch.testing.assert_close(grad_b, grad_a, **TOL)


@pytest.mark.parametrize("likelihood", list(LIKELIHOODS))
@pytest.mark.parametrize("analytic_kl", [False, True])
@pytest.mark.parametrize("baseline", ["none", "decaying_average", "leave_one_out", "vargrad"])
def test_value_and_gradient_equal_the_direct_path(baseline, analytic_kl, likelihood, flat_kernel, monkeypatch):
    """Three consecutive steps (the decaying average carries over), minibatch and full batch,
    KL weight 1 and 0.6, tanh and relu, two hidden layers, float64; on the torch kernel and on the
    numpy twin (which serves every case but the learned precision's)."""
    served = []
    real = numpy_elbo.score_loss_and_grad
    monkeypatch.setattr(numpy_elbo, "score_loss_and_grad", lambda *a: served.append(1) or real(*a))
    for activation in ("tanh", "relu"):
        for subsample in (torch.tensor([0, 3, 4, 7, 9, 11]), None):
            for beta in (1.0, 0.6):
                results = []
                for cls in (DirectScoreFunctionELBO, FlatScoreFunctionELBO):
                    model, guide, x, y = _problem(likelihood, activation, baseline=baseline)
                    loss_fn = cls(model, guide, num_particles=3, analytic_kl=analytic_kl)
                    loss_fn.kl_weight = beta
                    results.append(_steps(loss_fn, guide, x, y, subsample))
                _assert_same(*results)
    assert bool(served) == (flat_kernel == "numpy" and likelihood != "learned_precision")


@pytest.mark.parametrize("hidden, num_particles", [((), 2), ((5,), 1), ((4, 3, 2), 4)])
def test_depth_and_particles(hidden, num_particles, flat_kernel):
    """No hidden layer, one, three; a single particle (baseline "none")."""
    baseline = "none" if num_particles == 1 else "vargrad"
    results = []
    for cls in (DirectScoreFunctionELBO, FlatScoreFunctionELBO):
        model, guide, x, y = _problem("gaussian", "relu", hidden, baseline)
        results.append(_steps(cls(model, guide, num_particles=num_particles), guide, x, y, None))
    _assert_same(*results)


def test_loss_and_grad_is_the_backward_gradient_and_draws_are_the_guides():
    """The loop's entry point sets the packed vector's .grad to what backward gives the per-site
    parameters; and the particles are exactly the guide distributions' samples for the seed."""
    model, guide, x, y = _problem("learned_precision")
    loss_fn = FlatScoreFunctionELBO(model, guide, num_particles=3)
    (loss, grad), = _steps(loss_fn, guide, x, y, None, steps=1)
    vector = loss_fn.parameters_to_optimize()[0]
    pyro.set_rng_seed(5)
    assert torch.equal(loss_fn.loss_and_grad(x, y, None), loss)
    # backward's per-site gradients, in the packed order [locs..., scales...]
    packed = torch.cat([guide._parameters[n + "_unconstrained"].grad.reshape(-1) for n in guide._packs["params"]])
    assert torch.equal(vector.grad, packed)
    assert torch.equal(packed.sort().values, grad.sort().values)
    # the draws: one [P, *shape] sample per site, as Normal.sample takes them
    pyro.set_rng_seed(5)
    eps = loss_fn.draw(vector)
    pyro.set_rng_seed(5)
    qs = guide.variational_distributions()
    with torch.no_grad():
        samples = {name: q.sample((3,)) for name, q in qs.items()}
        d = vector.shape[0] // 2
        theta = eps * torch.nn.functional.softplus(vector[d:]) + vector[:d]
    for sl in loss_fn._lj.layout.sites:
        got = theta[:, sl.start : sl.stop]
        want = samples[sl.name].reshape(3, -1)
        if sl.transform == "exp":
            want = want.log()
            torch.testing.assert_close(got, want, rtol=1e-15, atol=1e-15)
        else:
            assert torch.equal(got, want), sl.name


def test_make_elbo_takes_the_flat_path_and_falls_back():
    model, guide, _, _ = _problem("gaussian")
    assert flat_score_function_support(model, guide) is None
    assert type(make_elbo(model, guide, elbo="direct_score_function", kl="monte_carlo", num_particles=2)) is FlatScoreFunctionELBO

    class OtherGaussian(pyrobdl.priors.Gaussian):
        pass

    other = pyrobdl.BayesianMLP(2, (3,), 1, prior=OtherGaussian(0.7))
    sf = ScoreFunction(other, baseline="vargrad")
    assert "priors.Gaussian" in flat_score_function_support(other, sf)
    assert type(make_elbo(other, sf, elbo="direct_score_function", num_particles=2)) is DirectScoreFunctionELBO
    with pytest.raises(ValueError, match="flat score-function ELBO cannot run.*priors.Gaussian"):
        FlatScoreFunctionELBO(other, sf, num_particles=2)

    class Changed(ScoreFunction):  # a subclass that changes the family keeps the distributions path
        def variational_distributions(self):
            return super().variational_distributions()

    assert "is not a ScoreFunction guide" in flat_score_function_support(model, Changed(model))
    neural = ScoreFunction(model, baseline="neural")
    assert "neural" in flat_score_function_support(model, neural)
    with pytest.raises(ValueError, match="trace_graph"):  # DirectScoreFunctionELBO's refusal, unchanged
        make_elbo(model, neural, elbo="direct_score_function", num_particles=2)
    with pytest.raises(ValueError, match="num_particles >= 2"):
        FlatScoreFunctionELBO(model, ScoreFunction(model, baseline="vargrad"), num_particles=1)


@pytest.mark.parametrize("options", [{}, {"baseline": "decaying_average", "kl": "analytic", "batch_size": 8, "kl_warmup": 3}])
def test_fit_equals_the_old_path(options, flat_kernel):
    """pyrobdl.fit(method="bbvi") on the flat path and on DirectScoreFunctionELBO: same draws, so
    the same trajectory up to float32 rounding (six Adam steps)."""
    x, y = torch.randn(24, 2), torch.randn(24)
    model = pyrobdl.BayesianMLP(2, (5,), 1, activation="tanh")
    common = dict(num_steps=6, num_particles=4, seed=3, progress=False, lr=1e-2, **options)
    flat = pyrobdl.fit(model, x, y, "bbvi", **common)
    with mock.patch("pyrobdl.inference.flat_score_function.flat_score_function_support", lambda m, g: "off"):
        assert type(make_elbo(model, ScoreFunction(model), elbo="direct_score_function", num_particles=4)) \
            is DirectScoreFunctionELBO
        old = pyrobdl.fit(model, x, y, "bbvi", **common)
    torch.testing.assert_close(flat.history, old.history, rtol=1e-5, atol=1e-4)
    a, b = flat.guide.state_dict(), old.guide.state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    # the fit did move the guide (the comparison is not between two starting points)
    start = pyrobdl.fit(model, x, y, "bbvi", **{**common, "num_steps": 1, "lr": 1e-30}).guide.state_dict()
    assert (a["layers_0_weight_loc_unconstrained"] - start["layers_0_weight_loc_unconstrained"]).abs().max() > 1e-3
