"""The dropout families on the flat SVI hot path (pyrobdl.inference.flat_dropout): value and
gradient equal to Pyro's ``Trace_ELBO`` / ``TraceMeanField_ELBO`` on the unchanged model and
guide for the same draws, in float64, for MC dropout (Bernoulli and Gaussian rows) and variational
dropout (sparse, Kingma, ARD; with and without local reparameterization), every likelihood, KL
treatment, particles and minibatches.  The draws are recovered from Pyro's run: the dropout
multipliers by replaying the torch RNG (the draw order of ``DropoutRows.rsample`` is its
contract), the Gaussian noise from the traced values, and the local reparameterization's
pre-activation noise from the values of the effectful ``linear`` and their moments.
"""

from __future__ import annotations

import contextlib

import pyro
import pyro.poutine as poutine
import pytest
import torch
from pyro.poutine.messenger import Messenger
from test_flat import LIKELIHOODS, PRIORS, TOL64, float64, make_data  # noqa: F401

import pyrobdl
from pyrobdl.guides import Dropout, VariationalDropout
from pyrobdl.guides._dropout_dists import DropoutRows
from pyrobdl.inference.elbo import DirectELBO, make_elbo
from pyrobdl.inference.flat_elbo import FlatELBO, flat_support
from pyrobdl.poutine import KLWeightMessenger

DROPOUT_CASES = [
    # (prior, likelihood, hidden, activation)
    ("scalar", "gaussian-1", (5,), "relu"),
    ("per_layer", "gaussian-2", (4, 3), "tanh"),
    ("fan_in", "learned-1", (5,), "tanh"),
    ("scalar", "learned-2", (4, 3), "relu"),
    ("per_layer", "categorical-3", (5,), "relu"),
    ("scalar", "gaussian-1", (), "relu"),
]
VD_CASES = [
    # (bias prior, likelihood, hidden, activation)
    ("flat", "gaussian-1", (5,), "relu"),
    ("log_uniform", "learned-1", (4, 3), "tanh"),
    ("flat", "categorical-3", (5,), "tanh"),
    ("log_uniform", "gaussian-2", (), "relu"),
    ("flat", "learned-2", (4, 3), "relu"),
]
VD_VARIANTS = {"sparse": {}, "kingma": {"sparse": False}, "ard": {"ard": True}}


class _PreactivationNoise(Messenger):
    """Records the standard-normal draw behind every locally reparameterized ``linear``."""

    def __init__(self, handler):
        super().__init__()
        self.handler, self.noise = handler, []

    def _pyro_post_pyrobdl_linear(self, msg):
        mean, var = self.handler.preactivation_moments(*msg["args"])
        self.noise.append(((msg["value"] - mean) / var.clamp_min(1e-30).sqrt()).detach())


def _site_noise(guide, tr, name, q):
    """The standard normals behind a Normal (or log-normal) site's traced value."""
    v = tr.nodes[name]["value"].detach()
    base = q
    while isinstance(base, (torch.distributions.Independent, torch.distributions.TransformedDistribution)):
        if isinstance(base, torch.distributions.TransformedDistribution):
            v = base.transforms[0].inv(v)
        base = base.base_dist
    return ((v - base.loc.detach()) / base.scale.detach()).reshape(-1)


def pyro_reference(model, guide, x, y, idx, *, analytic, beta, num_particles):
    """Pyro's differentiable loss averaged over particles (each one traced guide run), the
    gradient of each packed vector (per-site gradients in pack order), and the draws of each
    particle in FlatELBO's format."""
    elbo = (pyro.infer.TraceMeanField_ELBO if analytic else pyro.infer.Trace_ELBO)(max_plate_nesting=1)
    args = (x, y) if idx is None else (x, y, idx)
    layout = pyrobdl.flat.FlatLayout(model)
    total, draws = 0.0, []
    with pyro.get_param_store().scope():
        for _ in range(num_particles):
            state = torch.get_rng_state()
            with guide.training_context() as lrt:
                recorder = _PreactivationNoise(lrt) if lrt is not None else None
                tr = poutine.trace(guide).get_trace(*args)
                h = KLWeightMessenger(beta)
                with recorder if recorder is not None else contextlib.nullcontext():
                    total = total + elbo.differentiable_loss(h(model), h(poutine.replay(guide, trace=tr)), *args)
            qs = guide.variational_distributions()
            eps = torch.zeros(layout.size, dtype=x.dtype)
            draw = {}
            if isinstance(guide, Dropout):  # replay the RNG: multipliers, then noise, site by site
                torch.set_rng_state(state)
                mult = []
                with torch.no_grad():
                    for s in layout.sites:
                        q = qs[s.name]
                        if isinstance(q, DropoutRows):
                            xi, e = q.sample_multipliers(), torch.randn(q.event_shape)
                            assert torch.equal(q.rsample_from(xi, e), tr.nodes[s.name]["value"])
                            mult.append(xi)
                            eps[s.start : s.stop] = e.reshape(-1)
                        else:
                            q.rsample()
                            eps[s.start : s.stop] = _site_noise(guide, tr, s.name, q)
                draw["multipliers"] = torch.cat(mult).unsqueeze(0)
            else:
                for s in layout.sites:
                    if s.name not in getattr(guide, "point_sites", ()):
                        eps[s.start : s.stop] = _site_noise(guide, tr, s.name, qs[s.name])
                if recorder is not None:
                    draw["preactivations"] = [n.unsqueeze(0) for n in recorder.noise]
            draw["eps"] = eps.unsqueeze(0)
            draws.append(draw)
        loss = total / num_particles
        for p in guide.parameters():
            p.grad = None
        loss.backward()
    owners = [guide] + ([guide.fallback] if getattr(guide, "fallback", None) is not None else [])
    grads = [torch.cat([o._parameters[n + "_unconstrained"].grad.reshape(-1) for n in o._packs["params"]]) for o in owners]
    noise = {k: torch.cat([d[k] for d in draws]) for k in draws[0] if k != "preactivations"}
    if "preactivations" in draws[0]:
        noise["preactivations"] = [torch.cat(layer) for layer in zip(*[d["preactivations"] for d in draws])]
    return loss.detach(), grads, noise


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def check_equal(model, guide, x, y, idx, *, analytic, beta, num_particles):
    ref_loss, ref_grads, noise = pyro_reference(
        model, guide, x, y, idx, analytic=analytic, beta=beta, num_particles=num_particles
    )
    fast = FlatELBO(model, guide, num_particles=num_particles, analytic_kl=analytic)
    fast.kl_weight = beta
    loss = fast.loss_and_grad(x, y, idx, noise=noise)
    assert abs(float(loss - ref_loss)) / max(1.0, abs(float(ref_loss))) < TOL64
    vectors = fast.parameters_to_optimize()
    assert len(vectors) == len(ref_grads)
    for v, g in zip(vectors, ref_grads):
        assert rel(v.grad, g) < TOL64


# ------------------------------------------------------------------------------------ MC dropout
@pytest.mark.parametrize("case", DROPOUT_CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("kind, kl", [("bernoulli", "analytic"), ("bernoulli", "monte_carlo"), ("gaussian", "analytic")])
@pytest.mark.parametrize("num_particles, minibatch", [(1, False), (3, True)])
def test_dropout_equals_pyro(float64, flat_kernel, case, kind, kl, num_particles, minibatch):
    prior, lik, hidden, act = case
    pyro.set_rng_seed(0)
    out = LIKELIHOODS[lik][1]
    model = pyrobdl.BayesianMLP(3, hidden, out, activation=act, prior=PRIORS[prior](len(hidden) + 1),
                                likelihood=LIKELIHOODS[lik][0]())
    x, y = make_data(model)
    y = model.likelihood.prepare_targets(y, model.out_features)
    # sigma comparable to the means, so both mixture components carry weight in the MC KL
    guide = Dropout(model, p=[0.2, 0.4, 0.3][: len(hidden) + 1], sigma=0.3, kind=kind)
    packed = guide.flat_family()[1]
    with torch.no_grad():
        packed["loc"].add_(0.3 * torch.randn(packed["loc"].shape))
        if packed["fallback"] is not None:
            packed["fallback"].add_(0.3 * torch.randn(2))
    idx = torch.tensor([0, 3, 4, 7, 11]) if minibatch else None
    check_equal(model, guide, x, y, idx, analytic=kl == "analytic", beta=0.3 if minibatch else 1.0,
                num_particles=num_particles)


def test_gaussian_dropout_with_monte_carlo_kl_falls_back():
    model = pyrobdl.BayesianMLP(2, (3,), 1)
    guide = Dropout(model, kind="gaussian")
    assert "Monte Carlo" in flat_support(model, guide, analytic_kl=False)
    assert isinstance(make_elbo(model, guide, kl="monte_carlo"), DirectELBO)
    assert isinstance(make_elbo(model, guide, kl="analytic"), FlatELBO)
    assert isinstance(make_elbo(model, Dropout(model), kl="monte_carlo"), FlatELBO)


# --------------------------------------------------------------------------- variational dropout
def vd_setup(case, variant, local, seed):
    bias, lik, hidden, act = case
    pyro.set_rng_seed(seed)
    out = LIKELIHOODS[lik][1]
    model = pyrobdl.BayesianMLP(3, hidden, out, activation=act, prior=pyrobdl.priors.LogUniform(bias=bias),
                                likelihood=LIKELIHOODS[lik][0]())
    guide = VariationalDropout(model, local_reparameterization=local, **VD_VARIANTS[variant])
    fam = guide.flat_family()[1]
    ps = len(fam["spread"]) - (1 if "learned" in lik else 0)
    with torch.no_grad():
        fam["loc"].add_(0.2 * torch.randn(fam["loc"].shape))
    # log sigma^2 around log theta^2 (log alpha in about [-3, 3]: Kingma's cap binds for some),
    # and two weights far past the upper clip (the KL is flat there)
    with torch.no_grad():
        plan_sparse = torch.cat([torch.arange(s.start, s.stop) for s in pyrobdl.flat.FlatLayout(model).sites
                                 if s.name in guide.sparse_sites])
        assert plan_sparse.numel() == ps
        t = fam["loc"][plan_sparse]
        fam["spread"][:ps] = torch.log(t * t) + 1.5 * torch.randn(ps)
        fam["spread"][:2] += 12.0
        if ps < len(fam["spread"]):
            fam["spread"][ps:] = 0.3 * torch.randn(1) - 1.0
    return model, guide


@pytest.mark.parametrize("case", VD_CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("variant", list(VD_VARIANTS))
@pytest.mark.parametrize("local", [True, False], ids=["local", "weights"])
@pytest.mark.parametrize("kl", ["analytic", "monte_carlo"])
@pytest.mark.parametrize("num_particles, minibatch", [(1, False), (3, True)])
def test_variational_dropout_equals_pyro(float64, flat_kernel, case, variant, local, kl, num_particles, minibatch):
    model, guide = vd_setup(case, variant, local, seed=1)
    x, y = make_data(model)
    x[0] = 0.0  # a zero input row: the pre-activation variance hits the messenger's floor
    y = model.likelihood.prepare_targets(y, model.out_features)
    idx = torch.tensor([1, 2, 5, 6, 9]) if minibatch else None
    check_equal(model, guide, x, y, idx, analytic=kl == "analytic", beta=0.3 if minibatch else 1.0,
                num_particles=num_particles)


def test_variational_dropout_flat_support():
    model = pyrobdl.BayesianMLP(2, (3,), 1, prior=pyrobdl.priors.LogUniform())
    guide = VariationalDropout(model)
    assert flat_support(model, guide) is None
    assert isinstance(make_elbo(model, guide), FlatELBO)
    with torch.no_grad():
        guide.layers_0_weight_log_sigma2[0, 0] = 5.0  # log alpha far above the threshold
    pruned = guide.prune(3.0)
    assert "VariationalDropout" in flat_support(model, pruned)
    assert isinstance(make_elbo(model, pruned), DirectELBO)


# ------------------------------------------------------------------ packing and the loop's use
def _dropout_guide():
    model = pyrobdl.BayesianMLP(3, (4,), 1, likelihood=pyrobdl.likelihoods.GaussianLearnedPrecision())
    return model, Dropout(model, p=0.2, sigma=0.1)


def _vd_guide():
    model = pyrobdl.BayesianMLP(3, (4,), 1, prior=pyrobdl.priors.LogUniform(bias="log_uniform"),
                                likelihood=pyrobdl.likelihoods.GaussianLearnedPrecision())
    return model, VariationalDropout(model, init_log_sigma2=-4.0)


@pytest.mark.parametrize("make", [_dropout_guide, _vd_guide], ids=["dropout", "variational_dropout"])
@pytest.mark.parametrize("break_it", ["none", "deepcopy", "double", "load_state_dict"])
def test_packed_views_survive_copies_and_conversions(make, break_it):
    import copy

    model, guide = make()
    if break_it == "deepcopy":
        guide = copy.deepcopy(guide)
    elif break_it == "double":
        guide = guide.double()
    elif break_it == "load_state_dict":
        guide.load_state_dict({k: v + 1.0 for k, v in guide.state_dict().items()})
    before = {k: v.clone() for k, v in guide.state_dict().items()}
    vector = guide.flat_family()[1]["vector"]
    with torch.no_grad():
        vector.add_(0.5)
    # every packed per-site parameter saw the write; nothing else changed
    packed = {n + "_unconstrained" for n in guide._packs["params"]}
    for k, v in guide.state_dict().items():
        expected = before[k] + 0.5 if k in packed else before[k]
        assert torch.equal(v, expected), k


@pytest.mark.parametrize("make", [_dropout_guide, _vd_guide], ids=["dropout", "variational_dropout"])
def test_forward_is_differentiable_like_the_other_losses(float64, make):
    """``loss.backward()`` gives every per-site parameter (a Dropout's fallback too) the gradient
    loss_and_grad puts on the packed vectors."""
    model, guide = make()
    x, y = make_data(model)
    fast = make_elbo(model, guide)
    assert isinstance(fast, FlatELBO)
    pyro.set_rng_seed(5)
    loss = fast(x, y)
    loss.backward()
    pyro.set_rng_seed(5)
    value = fast.loss_and_grad(x, y)
    assert float(loss.detach()) == float(value)
    owners = fast._vector_owners()
    assert len(owners) == (2 if isinstance(guide, Dropout) else 1)
    for owner, vector in zip(owners, fast.parameters_to_optimize()):
        per_site = torch.cat([owner._parameters[n + "_unconstrained"].grad.reshape(-1) for n in owner._packs["params"]])
        assert torch.equal(per_site, vector.grad)


@pytest.mark.parametrize("method, prior", [("dropout", None), ("gaussian_dropout", None),
                                           ("variational_dropout", "log_uniform")])
def test_fit_through_the_flat_path_matches_the_distribution_path(method, prior):
    """Same objective, same seed, same draws: a short fit through the flat path and through
    DirectELBO ends at the same parameters (float32 rounding over 50 Adam steps)."""
    torch.manual_seed(0)
    x = torch.randn(64, 3)
    y = x[:, 0] - 0.5 * x[:, 1] + 0.1 * torch.randn(64)
    kw = {"prior": pyrobdl.priors.LogUniform()} if prior else {}
    model = pyrobdl.BayesianMLP(3, (8,), 1, **kw)
    states = []
    for elbo in ["direct", "distributions"]:
        post = pyrobdl.fit(model, x, y, method, num_steps=50, batch_size=16, lr=1e-2, elbo=elbo, progress=False, seed=3)
        states.append(post.guide.state_dict())
    for k, v in states[0].items():
        assert torch.allclose(v, states[1][k], rtol=1e-4, atol=1e-5), k


def test_score_function_guide_is_packed_but_stays_off_the_flat_path():
    """ScoreFunction inherits MeanField's packing (its per-site parameters are views of one
    vector); its gradient estimator is not reparameterised, so it has no flat ELBO."""
    from pyrobdl.guides import ScoreFunction

    model = pyrobdl.BayesianMLP(2, (3,), 1)
    guide = ScoreFunction(model)
    vector = guide.packed("params")
    with torch.no_grad():
        vector.fill_(0.25)
    for n in guide._packs["params"]:
        assert torch.all(guide._parameters[n + "_unconstrained"] == 0.25)
    assert guide.flat_family() is None and "ScoreFunction" in flat_support(model, guide)


@pytest.mark.parametrize("log_uniform, make", [
    (False, lambda m: Dropout(m, p=0.2, sigma=0.1)),
    (True, lambda m: VariationalDropout(m, init_log_sigma2=-3.0)),
    (True, lambda m: VariationalDropout(m, init_log_sigma2=-3.0, local_reparameterization=False)),
], ids=["dropout", "variational_dropout", "variational_dropout-weights"])
def test_flat_path_without_biases_equals_the_distribution_path(float64, flat_kernel, log_uniform, make):
    """A model built with bias=False (no bias sites): same seed, same draws, so the flat and the
    distribution paths give the same loss and gradients up to float64 rounding."""
    prior = pyrobdl.priors.LogUniform() if log_uniform else pyrobdl.priors.Gaussian(1.0)
    model = pyrobdl.BayesianMLP(3, (4,), 1, prior=prior, bias=False)
    guide = make(model)
    x, y = make_data(model)
    results = []
    for elbo in ["direct", "distributions"]:
        loss_fn = make_elbo(model, guide, elbo=elbo)
        assert isinstance(loss_fn, FlatELBO) == (elbo == "direct")
        guide.zero_grad()
        pyro.set_rng_seed(0)
        loss = loss_fn(x, y.unsqueeze(-1))
        loss.backward()
        results.append((loss.detach(), torch.cat([p.grad.reshape(-1) for p in guide.parameters()])))
    assert abs(float(results[0][0] - results[1][0])) < TOL64 * abs(float(results[1][0]))
    assert rel(results[0][1], results[1][1]) < TOL64
