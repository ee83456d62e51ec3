"""Black-box VI: the ScoreFunction guide, its exact surrogate gradient, and the "bbvi" method."""

from __future__ import annotations

import math

import pyro
import pytest
import torch
from pyro.ops.provenance import detach_provenance
from pyro.poutine.messenger import Messenger

import pyrobdl
from pyrobdl.datasets import bayesian_linear_regression
from pyrobdl.guides import MeanField, ScoreFunction
from pyrobdl.inference import DirectScoreFunctionELBO, ScoreFunctionELBO, get_method, make_elbo

PRECISION = 4.0
PRIOR_SCALE = 1.5
BETA = 0.8  # decaying-average baseline decay used in the exact tests
ZERO = torch.tensor(0.0, dtype=torch.float64)


def tiny_model() -> pyrobdl.BayesianMLP:
    """Bayesian linear regression with one input: sites layers.0.weight [1, 1], layers.0.bias [1]."""
    return pyrobdl.BayesianMLP(
        1, (), 1, prior=pyrobdl.priors.Gaussian(PRIOR_SCALE), likelihood=pyrobdl.likelihoods.Gaussian(PRECISION)
    )


def tiny_data() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.tensor([[-1.0], [0.5], [2.0], [0.0], [1.2]])
    y = torch.tensor([-1.5, 0.4, 2.2, 0.3, 1.0])
    return x, y


class _Record(Messenger):
    """Remember the value of every latent sample site (the guide's draw, replayed by the model)."""

    def __init__(self) -> None:
        super().__init__()
        self.values: dict[str, torch.Tensor] = {}

    def _pyro_post_sample(self, msg) -> None:  # type: ignore[no-untyped-def]
        if msg["name"].startswith("layers.") and msg["name"] not in self.values:
            self.values[msg["name"]] = detach_provenance(msg["value"]).detach().clone()


def _normal_logpdf(v: torch.Tensor, mu: torch.Tensor, sd: torch.Tensor) -> torch.Tensor:
    return -0.5 * math.log(2 * math.pi) - torch.log(sd) - (v - mu) ** 2 / (2 * sd**2)


def _hand_costs(values, params, x, y):
    r"""Per-particle downstream costs c_k = log p(v_k) - log q(v_k) + sum_n log p(y_n | v), by hand.

    ``values[k]`` has a leading particle dim P; returns {site: [P]} in float64.
    """
    w = values["layers.0.weight"].double().reshape(-1)  # [P]
    b = values["layers.0.bias"].double().reshape(-1)
    xd, yd = x.double().reshape(-1), y.double()
    f = w[:, None] * xd[None, :] + b[:, None]
    loglik = _normal_logpdf(yd[None, :], f, torch.tensor(PRECISION**-0.5, dtype=torch.float64)).sum(-1)
    costs = {}
    for name, v in (("layers.0.weight", w), ("layers.0.bias", b)):
        mu, sd = params[name]
        log_prior = _normal_logpdf(v, ZERO, torch.tensor(PRIOR_SCALE, dtype=torch.float64))
        costs[name] = log_prior - _normal_logpdf(v, mu, sd) + loglik
    return costs, loglik


def _hand_gradients(values, params, effective_costs, rho):
    r"""Gradient of the negative surrogate: -(1/P) sum_p grad log q(v_p) * effective_cost_p.

    d/dmu log N(v; mu, sd) = (v - mu) / sd^2 and d/drho = ((v - mu)^2 / sd^3 - 1 / sd) sigmoid(rho)
    with sd = softplus(rho).
    """
    grads = {}
    for name in ("layers.0.weight", "layers.0.bias"):
        v = values[name].double().reshape(-1)
        mu, sd = params[name]
        c = effective_costs[name]
        d_mu = (v - mu) / sd**2
        d_rho = ((v - mu) ** 2 / sd**3 - 1 / sd) * torch.sigmoid(rho[name])
        grads[name] = (-(d_mu * c).mean(), -(d_rho * c).mean())
    return grads


def _guide_params(guide):
    params, rho = {}, {}
    for name, key in (("layers.0.weight", "layers_0_weight"), ("layers.0.bias", "layers_0_bias")):
        mu = getattr(guide, f"{key}_loc").detach().double().reshape(())
        sd = getattr(guide, f"{key}_scale").detach().double().reshape(())
        params[name] = (mu, sd)
        rho[name] = getattr(guide, f"{key}_scale_unconstrained").detach().double().reshape(())
    return params, rho


def _autograd(guide, loss_fn, x, y):
    guide.zero_grad(set_to_none=True)
    record = _Record()
    with record:
        loss = loss_fn(x, y, None)
    loss.backward()
    grads = {}
    for name, key in (("layers.0.weight", "layers_0_weight"), ("layers.0.bias", "layers_0_bias")):
        grads[name] = (
            getattr(guide, f"{key}_loc_unconstrained").grad.double().reshape(()),
            getattr(guide, f"{key}_scale_unconstrained").grad.double().reshape(()),
        )
    values = {k: v.reshape(-1) for k, v in record.values.items()}  # one element per site: [P]
    return loss.detach().double(), grads, values


def _make_guide(baseline: str) -> tuple[pyrobdl.BayesianMLP, ScoreFunction]:
    model = tiny_model()
    guide = ScoreFunction(
        model, init_scale=0.3, baseline=baseline, baseline_beta=BETA,
        init_loc={"layers.0.weight": torch.tensor([[0.7]]), "layers.0.bias": torch.tensor([-0.2])},
    )
    return model, guide


# float32 model evaluations against a float64 hand computation; costs are O(10-100)
RTOL, ATOL = 2e-4, 1e-3


def _effective_costs(baseline, costs, loglik, values, params, previous_avg):
    """The cost each site's score is multiplied by, written out per baseline."""
    if baseline == "none":
        return costs
    if baseline == "leave_one_out":  # mean of the same site's cost over the other particles
        p = loglik.shape[0]
        return {k: c - (c.sum() - c) / (p - 1) for k, c in costs.items()}
    if baseline == "vargrad":  # the whole log-ratio, centred over particles, times P / (P - 1)
        p = loglik.shape[0]
        whole = loglik + sum(
            _normal_logpdf(values[k].double().reshape(-1), ZERO, torch.tensor(PRIOR_SCALE, dtype=torch.float64))
            - _normal_logpdf(values[k].double().reshape(-1), *params[k])
            for k in params
        )
        return {k: (whole - whole.mean()) * p / (p - 1) for k in costs}
    # decaying average; the zero-initialised neural correction adds nothing to it
    return {k: costs[k] - previous_avg[k] for k in costs}


@pytest.mark.parametrize("num_particles", [1, 2, 3])
@pytest.mark.parametrize("baseline", ["none", "decaying_average", "neural", "leave_one_out", "vargrad"])
def test_surrogate_gradient_matches_hand_formula(num_particles, baseline):
    """Two consecutive steps, so the decaying average of the first draw is the second's baseline."""
    x, y = tiny_data()
    model, guide = _make_guide(baseline)
    if baseline in ("leave_one_out", "vargrad") and num_particles == 1:
        with pytest.raises(ValueError, match="at least 2 particles"):
            make_elbo(model, guide, elbo="trace_graph", kl="monte_carlo", num_particles=num_particles)
        return
    loss_fn = make_elbo(model, guide, elbo="trace_graph", kl="monte_carlo", num_particles=num_particles)
    params, rho = _guide_params(guide)
    previous_avg = {k: torch.zeros(num_particles, dtype=torch.float64) for k in params}
    with pyro.get_param_store().scope():
        for step in range(2):
            loss, grads, values = _autograd(guide, loss_fn, x, y)
            assert all(v.shape[0] == num_particles for v in values.values())
            costs, loglik = _hand_costs(values, params, x, y)
            # the loss's value is the negative ELBO estimate (not the surrogate's value)
            log_q = sum(_normal_logpdf(values[k].double().reshape(-1), *params[k]) for k in params)
            log_p = loglik + sum(
                _normal_logpdf(values[k].double().reshape(-1), ZERO, torch.tensor(PRIOR_SCALE, dtype=torch.float64))
                for k in params
            )
            torch.testing.assert_close(loss, -(log_p - log_q).mean(), rtol=RTOL, atol=ATOL)
            effective = _effective_costs(baseline, costs, loglik, values, params, previous_avg)
            expected = _hand_gradients(values, params, effective, rho)
            for name in params:
                torch.testing.assert_close(grads[name][0], expected[name][0], rtol=RTOL, atol=ATOL)
                torch.testing.assert_close(grads[name][1], expected[name][1], rtol=RTOL, atol=ATOL)
            if baseline == "neural":
                # Pyro's baseline loss sum_p (c_p - b_p)^2 / P; b = avg + N * mean_n g, so the
                # output bias of g gets -2 N / P * sum_p (c_p - b_p).
                for name, key in (("layers.0.weight", "layers_0_weight"), ("layers.0.bias", "layers_0_bias")):
                    got = guide.baseline_nets[key].net[-1].bias.grad.double().reshape(())
                    want = -2 * x.shape[0] * effective[name].sum() / num_particles
                    torch.testing.assert_close(got, want, rtol=RTOL, atol=1e-2)
            previous_avg = {k: BETA * previous_avg[k] + (1 - BETA) * costs[k] for k in costs}


def test_sites_are_not_reparameterized_even_after_expand():
    model = pyrobdl.BayesianMLP(2, (3,), 1, likelihood=pyrobdl.likelihoods.GaussianLearnedPrecision())
    guide = ScoreFunction(model)
    qs = guide.variational_distributions()
    assert set(qs) == set(model.prior_distributions())
    for name, q in qs.items():
        assert not q.has_rsample, name
        assert not q.expand((4, 1)).has_rsample, name  # what Pyro's particle plate does
        assert q.event_shape == model.prior_distributions()[name].event_shape
    draws = guide.sample_params(5)
    assert draws["precision"].min() > 0
    with pytest.raises(ValueError, match="trace_graph"):
        make_elbo(model, guide, elbo="direct")


def test_same_family_and_distributions_as_mean_field():
    model = pyrobdl.BayesianMLP(2, (3,), 1)
    pyro.set_rng_seed(3)
    mf = MeanField(model, init_scale=0.05)
    pyro.set_rng_seed(3)
    sf = ScoreFunction(model, init_scale=0.05, baseline="neural")
    mf_state = mf.state_dict()
    sf_state = {k: v for k, v in sf.state_dict().items() if not k.startswith("baseline_nets.")}
    assert mf_state.keys() == sf_state.keys()
    for k in mf_state:
        assert torch.equal(mf_state[k], sf_state[k]), k
    for name, q in sf.variational_distributions().items():
        v = q.sample((2,))
        torch.testing.assert_close(q.log_prob(v), mf.variational_distributions()[name].log_prob(v))
    # the baseline networks are trained by the loop's one optimizer over guide.parameters()
    names = {n for n, _ in sf.named_parameters()}
    assert any(n.startswith("baseline_nets.") for n in names)


@pytest.mark.parametrize("init", [{}, {"init_scale": 0.05, "init_loc": "prior"}])
def test_bbvi_and_mean_field_fits_start_from_the_same_parameters(init):
    """A 1-step fit at a negligible learning rate returns the initial parameters."""
    model = pyrobdl.BayesianMLP(3, (4,), 1)
    x, y = torch.randn(12, 3), torch.randn(12)
    # lr 1e-30: Adam moves each parameter by ~lr, far below float32 resolution of O(1e-2) values
    common = dict(num_steps=1, lr=1e-30, average_last=0.0, seed=7, progress=False, **init)
    mf = pyrobdl.fit(model, x, y, "mean_field", **common).guide.state_dict()
    sf = pyrobdl.fit(model, x, y, "bbvi", **common).guide.state_dict()
    assert mf.keys() <= sf.keys()
    for k in mf:
        assert torch.equal(mf[k], sf[k]), k
    other = pyrobdl.fit(model, x, y, "bbvi", **{**common, "seed": 8}).guide.state_dict()
    assert not torch.equal(other["layers_0_weight_loc_unconstrained"], sf["layers_0_weight_loc_unconstrained"])


def test_registry_entry_and_loop_defaults():
    method = get_method("bbvi")
    # issue 38: the default estimator is the trace-free fast path (equal to trace_graph below)
    assert method.options["elbo"] == "direct_score_function" and method.options["kl"] == "monte_carlo"
    assert method.options["num_particles"] > 1
    # issue 17: the default baseline became leave-one-out (docs/methods/bbvi.md, measured)
    assert method.options["baseline"] == "leave_one_out"
    with pytest.raises(ValueError, match="decaying_average"):
        pyrobdl.fit(tiny_model(), *tiny_data(), "bbvi", baseline="mean", progress=False)
    with pytest.raises(ValueError, match="local_reparameterization"):
        pyrobdl.fit(tiny_model(), *tiny_data(), "bbvi", local_reparameterization=True, progress=False)


@pytest.mark.parametrize(
    "bad", [{"baseline": "ema"}, {"baseline_beta": 1.0}, {"baseline_beta": 0}, {"baseline_hidden": 0}]
)
def test_bad_guide_options(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        ScoreFunction(tiny_model(), **bad)


@pytest.mark.parametrize("baseline, elbo", [
    *[(b, e) for b in ("none", "decaying_average", "leave_one_out", "vargrad")
      for e in ("direct_score_function", "trace_graph")],
    ("neural", "trace_graph"),  # the neural baseline needs Pyro's trace
])
def test_fit_smoke_minibatch_and_predict(baseline, elbo):
    x, y = torch.randn(30, 2), torch.randn(30)
    model = pyrobdl.BayesianMLP(2, (5,), 1)
    post = pyrobdl.fit(
        model, x, y, "bbvi", num_steps=15, num_particles=4, batch_size=10, baseline=baseline, elbo=elbo,
        progress=False,
    )
    # the decaying averages lived in the loop's private param-store scope (DESIGN.md trap)
    assert not any(k.startswith("__baseline") for k in pyro.get_param_store().keys())
    assert post.history.shape == (15,) and all(math.isfinite(v) for v in post.history)
    assert post.cost.gradient_evaluations == 15 * 4
    pred = post.predict(x[:3], num_samples=7, seed=0)
    assert pred.samples.shape == (7, 3, 1)
    # plain Pyro: SVI with pyro.optim works with the guide as is (particle baselines need
    # pyrobdl's ELBO and vectorized particles)
    guide = ScoreFunction(model, baseline=baseline)
    if baseline in ("leave_one_out", "vargrad"):
        elbo = ScoreFunctionELBO(num_particles=4, max_plate_nesting=1)
    else:
        elbo = pyro.infer.TraceGraph_ELBO()
    svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), elbo)
    assert math.isfinite(svi.step(x, y))
    samples = pyro.infer.Predictive(model, guide=guide, num_samples=3)(x[:2])
    assert samples["obs"].shape[:2] == (3, 2)


def test_classification_fit():
    x, y = torch.randn(20, 2), torch.randint(0, 3, (20,))
    model = pyrobdl.BayesianMLP(2, (4,), 3, likelihood=pyrobdl.likelihoods.Categorical())
    for options in ({"baseline": "neural", "elbo": "trace_graph"}, {}):  # Pyro's path, and the default fast one
        post = pyrobdl.fit(model, x, y, "bbvi", num_steps=5, progress=False, **options)
        assert all(math.isfinite(v) for v in post.history)


# BBVI on Bayesian linear regression: 3000 steps, 128 particles, decaying-average baseline,
# linearly decayed rate, default init (some mean > 10 optimal sd from the optimum, sds 0.01 vs
# ~0.047).  Measured for fit seeds 0, 1, 2 (docs/methods/bbvi.md): means within 0.008 / 0.006 /
# 0.03 optimal sd, sds at 0.81-0.97 / 0.55-0.91 / 0.67-0.80 of the optimal mean-field sd.  The
# sds are still growing: at small sigma the score-function gradient of the scales has a
# signal-to-noise ratio of a few percent, so they move slowly from 0.01 (started at the optimum,
# 16 particles stay there to 1-3%).  Tolerances: means 0.25 sd (the mean-field test's, 8x the
# worst seen); sds within [0.4, 1.25] of the optimum, versus 0.21 at the start.
BLR_MEAN_TOL_IN_SD = 0.25
BLR_SD_RATIO = (0.4, 1.25)


@pytest.mark.slow
def test_bbvi_moves_to_the_mean_field_optimum_of_blr():
    data = bayesian_linear_regression(50, 10, 2, prior_scale=1.0, precision=10.0, seed=0)
    model = pyrobdl.BayesianMLP(
        2, (), 1, prior=pyrobdl.priors.Gaussian(1.0), likelihood=pyrobdl.likelihoods.Gaussian(10.0)
    )
    exact = data.posterior
    post = pyrobdl.fit(
        model, data.x_train, data.y_train, "bbvi", num_steps=3000, lr=1e-2, lr_schedule="linear",
        num_particles=128, seed=0, progress=False,
    )
    pyro.set_rng_seed(0)
    start = MeanField(model)  # the fit's initial guide (test_bbvi_and_mean_field_fits_start_...)
    g = post.guide
    means = torch.cat([g.layers_0_weight_loc.reshape(-1), g.layers_0_bias_loc.reshape(-1)]).detach().double()
    sds = torch.cat([g.layers_0_weight_scale.reshape(-1), g.layers_0_bias_scale.reshape(-1)]).detach().double()
    start_means = torch.cat([start.layers_0_weight_loc.reshape(-1), start.layers_0_bias_loc.reshape(-1)])
    start_err = ((start_means.detach().double() - exact.mean) / exact.mean_field_sd).abs().max()
    assert start_err > 10
    mean_err = ((means - exact.mean) / exact.mean_field_sd).abs()
    assert mean_err.max() < BLR_MEAN_TOL_IN_SD, f"means off by {mean_err.tolist()} sd"
    ratio = sds / exact.mean_field_sd
    assert BLR_SD_RATIO[0] < ratio.min() and ratio.max() < BLR_SD_RATIO[1], ratio.tolist()
    assert (0.01 / exact.mean_field_sd).max() < BLR_SD_RATIO[0]  # the start is outside the band


@pytest.mark.parametrize(
    "baseline, num_particles", [("none", 1), ("none", 3), ("leave_one_out", 3), ("vargrad", 2), ("vargrad", 3)]
)
def test_surrogate_gradient_with_analytic_kl(baseline, num_particles):
    """kl="analytic": closed-form KL, differentiated pathwise; the scores see only the log-likelihood."""
    x, y = tiny_data()
    model, guide = _make_guide(baseline)
    loss_fn = make_elbo(model, guide, elbo="trace_graph", kl="analytic", num_particles=num_particles)
    params, rho = _guide_params(guide)
    with pyro.get_param_store().scope():
        loss, grads, values = _autograd(guide, loss_fn, x, y)
    _, loglik = _hand_costs(values, params, x, y)
    s0 = torch.tensor(PRIOR_SCALE, dtype=torch.float64)
    kl = {k: torch.log(s0 / sd) + (sd**2 + mu**2) / (2 * s0**2) - 0.5 for k, (mu, sd) in params.items()}
    torch.testing.assert_close(loss, -(loglik.mean() - sum(kl.values())), rtol=RTOL, atol=ATOL)
    p = num_particles
    if baseline == "none":
        effective = {k: loglik for k in params}
    else:  # with the KL terms out of every cost, both baselines centre the log-likelihood
        effective = {k: (loglik - loglik.mean()) * p / (p - 1) for k in params}
    expected = _hand_gradients(values, params, effective, rho)
    for name, (mu, sd) in params.items():
        d_mu = mu / s0**2  # dKL/dmu
        d_rho = (-1 / sd + sd / s0**2) * torch.sigmoid(rho[name])  # dKL/dsigma * dsigma/drho
        torch.testing.assert_close(grads[name][0], expected[name][0] + d_mu, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(grads[name][1], expected[name][1] + d_rho, rtol=RTOL, atol=ATOL)


def _exact_elbo_gradient(guide, x, y):
    r"""Gradient of the negative ELBO of ``tiny_model`` in closed form (float64).

    For f = w x + b with q = N(mu_w, s_w^2) N(mu_b, s_b^2):
    E_q[(y - f)^2] = (y - mu_w x - mu_b)^2 + s_w^2 x^2 + s_b^2, E_q[w^2] = mu^2 + s^2, and the
    entropy of N(mu, s^2) is log s + const; differentiated by autograd in (loc, rho).
    """
    leaves = {}
    for key in ("layers_0_weight", "layers_0_bias"):
        leaves[f"{key}_loc"] = getattr(guide, f"{key}_loc").detach().double().reshape(()).requires_grad_()
        leaves[f"{key}_rho"] = getattr(guide, f"{key}_scale_unconstrained").detach().double().reshape(()).requires_grad_()
    mw, mb = leaves["layers_0_weight_loc"], leaves["layers_0_bias_loc"]
    sw = torch.nn.functional.softplus(leaves["layers_0_weight_rho"])
    sb = torch.nn.functional.softplus(leaves["layers_0_bias_rho"])
    xd, yd = x.double().reshape(-1), y.double()
    sq = (yd - mw * xd - mb) ** 2 + sw**2 * xd**2 + sb**2
    loglik = (0.5 * math.log(PRECISION / (2 * math.pi)) - 0.5 * PRECISION * sq).sum()
    prior = sum(-0.5 * math.log(2 * math.pi * PRIOR_SCALE**2) - (m**2 + s**2) / (2 * PRIOR_SCALE**2)
                for m, s in ((mw, sw), (mb, sb)))
    entropy = torch.log(sw) + torch.log(sb) + math.log(2 * math.pi * math.e)
    (-(loglik + prior + entropy)).backward()
    return torch.stack([leaves[k].grad for k in ("layers_0_weight_loc", "layers_0_weight_rho",
                                                  "layers_0_bias_loc", "layers_0_bias_rho")])


def _gradient_draws(baseline, num_particles, num_draws, seed=0, kl="monte_carlo", elbo="trace_graph"):
    x, y = tiny_data()
    model, guide = _make_guide(baseline)
    loss_fn = make_elbo(model, guide, elbo=elbo, kl=kl, num_particles=num_particles)
    pyro.set_rng_seed(seed)
    draws = []
    with pyro.get_param_store().scope():
        for _ in range(num_draws):
            guide.zero_grad(set_to_none=True)
            loss_fn(x, y, None).backward()
            draws.append(torch.stack([
                getattr(guide, f"{key}_{part}_unconstrained").grad.double().reshape(())
                for key in ("layers_0_weight", "layers_0_bias") for part in ("loc", "scale")
            ]))
    return torch.stack(draws), _exact_elbo_gradient(guide, x, y)


# Draws of 16 vectorized particles.  Each component's mean must be within 4.5 Monte Carlo
# standard errors of the closed-form gradient (false-alarm rate ~7e-6 per component).
UNBIASED_SE = 4.5
NUM_PARTICLES = 16


@pytest.mark.parametrize(
    "baseline, kl, elbo",
    [("none", "monte_carlo", "trace_graph"), ("leave_one_out", "monte_carlo", "trace_graph"),
     ("vargrad", "monte_carlo", "trace_graph"), ("leave_one_out", "analytic", "trace_graph"),
     ("leave_one_out", "monte_carlo", "direct_score_function"), ("vargrad", "analytic", "direct_score_function")],
)
def test_expected_gradient_is_the_closed_form_elbo_gradient(baseline, kl, elbo):
    num_draws = 100
    draws, exact = _gradient_draws(baseline, NUM_PARTICLES, num_draws, kl=kl, elbo=elbo)
    mean, se = draws.mean(0), draws.std(0) / math.sqrt(num_draws)
    z = (mean - exact) / se
    assert z.abs().max() < UNBIASED_SE, f"mean {mean.tolist()} exact {exact.tolist()} z {z.tolist()}"


# Measured with 400 draws x 16 particles, seed 0 (python tests/.. via _gradient_draws): per
# component (weight loc, weight rho, bias loc, bias rho) variance none 102 / 19.6 / 83.3 / 14,
# leave-one-out 29.5 / 8.9 / 20.3 / 4.69, VarGrad 28.6 / 8.45 / 18.3 / 4.36: ratios 0.22-0.45.
# The variance of a 400-draw variance estimate is ~10-15% relative here, so "every ratio below
# 0.7" claims only what the measurement supports with margin.  s.e./|gradient| was at most
# 0.15 with a particle baseline: below 0.25, an error of the size of the gradient is >= 4 s.e.
VARIANCE_RATIO_CLAIM = 0.7
POWER = 0.25


@pytest.mark.slow
def test_particle_baselines_unbiased_and_reduce_variance():
    num_draws = 400
    none, exact = _gradient_draws("none", NUM_PARTICLES, num_draws)
    for baseline in ("leave_one_out", "vargrad"):
        draws, _ = _gradient_draws(baseline, NUM_PARTICLES, num_draws, seed=1)
        mean, se = draws.mean(0), draws.std(0) / math.sqrt(num_draws)
        z = (mean - exact) / se
        assert z.abs().max() < UNBIASED_SE, (baseline, z.tolist())
        assert (se < POWER * exact.abs()).all(), (baseline, (se / exact.abs()).tolist())
        ratio = draws.var(0) / none.var(0)
        assert (ratio < VARIANCE_RATIO_CLAIM).all(), (baseline, ratio.tolist())


@pytest.mark.parametrize("baseline", ["leave_one_out", "vargrad"])
def test_plain_pyro_svi_with_the_particle_baselines(baseline):
    """ELBO-level baseline on a guide without one == the guide's per-site option, same draws."""
    x, y = tiny_data()
    grads = []
    for guide_baseline, elbo_baseline in ((baseline, None), ("none", baseline)):
        model, guide = _make_guide(guide_baseline)
        elbo = ScoreFunctionELBO(num_particles=5, max_plate_nesting=1, baseline=elbo_baseline)
        pyro.set_rng_seed(4)
        with pyro.get_param_store().scope():
            loss = elbo.loss_and_grads(model, guide, x, y)
        assert math.isfinite(loss)
        grads.append([p.grad.clone() for p in guide.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
    # Pyro's own TraceGraph_ELBO refuses the option instead of silently dropping the baseline
    model, guide = _make_guide(baseline)
    with pytest.raises(ValueError, match="Unrecognized baseline options"):
        pyro.infer.TraceGraph_ELBO(num_particles=2, vectorize_particles=True, max_plate_nesting=1).loss_and_grads(
            model, guide, x, y
        )
    # a short SVI run with pyro.optim moves towards the data
    model, guide = _make_guide(baseline)
    svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 5e-2}),
                         ScoreFunctionELBO(num_particles=8, max_plate_nesting=1))
    losses = [svi.step(x, y) for _ in range(60)]
    assert sum(losses[-10:]) < sum(losses[:10])


@pytest.mark.parametrize(
    "kwargs, match",
    [({"baseline": "loo"}, "unknown baseline"), ({"baseline": "vargrad", "num_particles": 1}, "num_particles >= 2"),
     ({"baseline": "leave_one_out", "num_particles": 4, "vectorize_particles": False}, "vectorize_particles=True")],
)
def test_score_function_elbo_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ScoreFunctionELBO(**kwargs)


def test_particle_baseline_with_one_particle_fails_before_training():
    with pytest.raises(ValueError, match="num_particles=1"):
        pyrobdl.fit(tiny_model(), *tiny_data(), "bbvi", baseline="leave_one_out", num_particles=1, progress=False)


@pytest.mark.parametrize("kl", ["monte_carlo", "analytic"])
@pytest.mark.parametrize("baseline", ["none", "decaying_average", "leave_one_out", "vargrad"])
def test_direct_fast_path_equals_pyro_trace_graph(baseline, kl):
    """elbo="direct_score_function": value and gradient equal ScoreFunctionELBO's on the same draws.

    A 1x3 network (every weight reaches the output through the hidden layer), 3 particles, a
    minibatch, two consecutive steps (the decaying average carries over).  The default runs the
    flat path (issue 41); DirectScoreFunctionELBO, its fallback, is checked too
    (tests/test_flat_score_function.py: the two agree to 1e-10 in float64).
    """
    x, y = torch.randn(12, 2), torch.randn(12)
    model = pyrobdl.BayesianMLP(2, (3,), 1, likelihood=pyrobdl.likelihoods.Gaussian(PRECISION))
    pyro.set_rng_seed(0)
    guide = ScoreFunction(model, init_scale=0.2, baseline=baseline)
    subsample = torch.tensor([0, 3, 4, 7, 9, 11])
    results = []
    for elbo in ("trace_graph", "direct_score_function", DirectScoreFunctionELBO):
        if isinstance(elbo, str):
            loss_fn = make_elbo(model, guide, elbo=elbo, kl=kl, num_particles=3)
        else:
            loss_fn = elbo(model, guide, num_particles=3, analytic_kl=kl == "analytic")
        out = []
        pyro.set_rng_seed(5)
        with pyro.get_param_store().scope():
            for _ in range(2):
                guide.zero_grad(set_to_none=True)
                loss = loss_fn(x, y, subsample)
                loss.backward()
                out.append((loss.detach(), [p.grad.clone() for p in guide.parameters()]))
        results.append(out)
    for other in results[1:]:
        for (loss_a, grads_a), (loss_b, grads_b) in zip(results[0], other):
            torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-4)
            for a, b in zip(grads_a, grads_b):
                torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-3)


def test_direct_fast_path_refuses_the_neural_baseline():
    model = tiny_model()
    with pytest.raises(ValueError, match="trace_graph"):
        make_elbo(model, ScoreFunction(model, baseline="neural"), elbo="direct_score_function", num_particles=2)
    # the default elbo does not take the neural baseline: fit says which elbo does, before any step
    with pytest.raises(ValueError, match="trace_graph"):
        pyrobdl.fit(model, *tiny_data(), "bbvi", baseline="neural", progress=False)
    post = pyrobdl.fit(model, *tiny_data(), "bbvi", baseline="neural", elbo="trace_graph", num_steps=3,
                       progress=False)
    assert post.settings["elbo"] == "trace_graph"
