"""Bring your own network (issue 44): a trained ``torch.nn`` MLP in (``BayesianMLP.from_torch``,
``fit(..., init=...)``), a posterior out, and back to plain PyTorch (``Posterior.to_torch``).

Round trips are exact up to float rounding (the same weights through ``nn.Linear`` and through
pyrobdl's ``linear``).  Post-hoc Laplace is checked on Bayesian linear regression against the
closed-form posterior and against ``laplace`` after its own MAP fit, and on an MLP against
``laplace`` at the weights its own fit landed on.  A comparison with laplace-torch is not here:
``pip install --dry-run laplace-torch`` would replace this venv's torch 2.13.0+cpu by 2.14.1
(docs/bring_your_own_network.md).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pyrobdl
from pyrobdl.datasets import bayesian_linear_regression
from pyrobdl.flat import FlatLogJoint
from pyrobdl.inference.starts import spread_starts
from pyrobdl.torch_interop import init_sites, parse_module, to_sequential

PRECISION, PRIOR_SCALE = 10.0, 1.0
# float32 round trips: the same products summed in another order differ by a few ulps of the
# largest term; outputs here are O(1), float32 eps 1.2e-7
ROUND = 1e-5
# float64 closed forms (tests/test_laplace.py's bound: the computations agree to ~1e-15)
EXACT_TOL = 1e-6


def seq(*widths: int, act=torch.nn.ReLU, bias: bool = True, seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i in range(len(widths) - 1):
        layers.append(torch.nn.Linear(widths[i], widths[i + 1], bias=bias))
        if i < len(widths) - 2:
            layers.append(act())
    return torch.nn.Sequential(*layers)


def inputs(n: int, d: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def blr():
    return bayesian_linear_regression(100, 20, 3, prior_scale=PRIOR_SCALE, precision=PRECISION, seed=0)


def blr_model() -> pyrobdl.BayesianMLP:
    return pyrobdl.BayesianMLP(3, (), 1, prior=pyrobdl.priors.Gaussian(PRIOR_SCALE),
                               likelihood=pyrobdl.likelihoods.Gaussian(PRECISION))


@pytest.fixture
def float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


# ------------------------------------------------------------------------ 1. from_torch
@pytest.mark.parametrize("widths, act, bias", [
    ((3, 1), torch.nn.ReLU, True),
    ((4, 7, 2), torch.nn.ReLU, True),
    ((4, 7, 5, 1), torch.nn.Tanh, True),
    ((4, 6, 3), torch.nn.Tanh, False),
])
def test_round_trip_torch_pyrobdl_torch(widths, act, bias):
    net = seq(*widths, act=act, bias=bias)
    model = pyrobdl.BayesianMLP.from_torch(net)
    assert (model.in_features, model.hidden, model.out_features, model.bias) == (widths[0], widths[1:-1], widths[-1], bias)
    if len(widths) > 2:
        assert model.activation == {torch.nn.ReLU: "relu", torch.nn.Tanh: "tanh"}[act]
    values = init_sites(model, net)
    x = inputs(50, widths[0])
    with torch.no_grad():
        want = net(x)
        assert (model.network(values, x) - want).abs().max() < ROUND
        back = to_sequential(model, values)
        assert isinstance(back, torch.nn.Sequential)
        assert (back(x) - want).abs().max() < ROUND
    # the state dict gives the same sites as the module
    from_state = init_sites(model, net.state_dict())
    assert from_state.keys() == values.keys() and all(torch.equal(from_state[k], values[k]) for k in values)


def test_round_trip_through_a_fit_is_exact():
    """torch -> fit(init=net) -> to_torch: post-hoc Laplace is centred at the given weights, so
    its mean network is the user's network."""
    net = seq(2, 8, 1, act=torch.nn.Tanh)
    x = inputs(30, 2)
    y = torch.sin(x[:, 0])
    model = pyrobdl.BayesianMLP.from_torch(net, prior=pyrobdl.priors.Gaussian(1.0))
    post = pyrobdl.fit(model, x, y, "laplace", init=net, fit_map=False, progress=False)
    back = post.to_torch()
    with torch.no_grad():
        assert (back(x) - net(x)).abs().max() < ROUND
    assert post.cost.gradient_evaluations == 0 and len(post.history) == 0
    assert post.settings["fit_map"] is False


def test_from_torch_walks_nested_modules_and_skips_identities():
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Dropout(0.1))
            self.head = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Identity(),
                                            torch.nn.Linear(4, 2))

        def forward(self, x):
            return self.head(self.body(x))

    net = Net().train()
    model = pyrobdl.BayesianMLP.from_torch(net, likelihood=pyrobdl.likelihoods.Categorical())
    assert (model.hidden, model.activation, model.out_features) == ((5, 4), "tanh", 2)
    assert net.training and net.body[2].training  # the output check ran in eval mode and restored it
    arch = parse_module(net)
    assert [name for name, _ in arch.linears] == ["body.0", "head.0", "head.3"]


@pytest.mark.parametrize("net, match", [
    (torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Sigmoid(), torch.nn.Linear(5, 1)), r"layer '1' \(Sigmoid"),
    (torch.nn.Sequential(torch.nn.Conv1d(1, 2, 3)), r"layer '0' \(Conv1d"),
    (torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.BatchNorm1d(5), torch.nn.ReLU(), torch.nn.Linear(5, 1)),
     r"layer '1' \(BatchNorm1d"),
    (torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(6, 1)),
     r"layer '2' .* takes 6 inputs but '0' gives 5"),
    (torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3), torch.nn.Tanh(),
                         torch.nn.Linear(3, 1)), r"layer '3' \(Tanh\(\)\) is a tanh activation"),
    (torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 1)), r"layer '1' .* no activation between"),
    (torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 1, bias=False)),
     r"layer '2' .* has no bias but layer '0' has one"),
    (torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3), torch.nn.LogSoftmax(-1)),
     r"layer '3' \(LogSoftmax.*applies the softmax itself"),
    (torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU()), r"ends with the activation '1'"),
    (torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(4, 1)), r"layer '0' .* before the first nn.Linear"),
    (torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.ReLU(), torch.nn.Linear(5, 1)),
     r"layer '2' .* follows the activation '1'"),
    (torch.nn.Sequential(), r"no nn.Linear layer"),
])
def test_from_torch_names_the_layer_it_cannot_map(net, match):
    with pytest.raises(ValueError, match=match):
        pyrobdl.BayesianMLP.from_torch(net)


def test_from_torch_checks_what_forward_computes():
    class Skip(torch.nn.Module):  # the right layers, but forward adds a skip connection
        def __init__(self) -> None:
            super().__init__()
            self.a, self.act, self.b = torch.nn.Linear(3, 3), torch.nn.ReLU(), torch.nn.Linear(3, 3)

        def forward(self, x):
            return self.b(self.act(self.a(x))) + x

    with pytest.raises(ValueError, match="forward\\(\\) does not compute its layers in order"):
        pyrobdl.BayesianMLP.from_torch(Skip())
    with pytest.raises(TypeError, match="expected a torch.nn.Module, got dict"):
        pyrobdl.BayesianMLP.from_torch({"0.weight": torch.zeros(1, 1)})


# ------------------------------------------------------------------------ 2. init=
def test_init_must_match_the_model():
    model = pyrobdl.BayesianMLP(4, (5,), 1, activation="relu")
    x, y = inputs(10, 4), torch.zeros(10)
    cases = [
        (seq(4, 6, 1), r"init's layer '0' .* has weight shape \[6, 4\] but the model's layers.0.weight is \[5, 4\]"),
        (seq(4, 5, 1, act=torch.nn.Tanh), "init uses the tanh activation but the model 'relu'"),
        (seq(4, 5, 1, bias=False), "init's layers have no biases but the model was built with bias=True"),
        (seq(4, 5, 3, 1), "init has 3 linear layers but the model has 2"),
        ({**seq(4, 5, 1).state_dict(), "1.running_mean": torch.zeros(5)},
         r"cannot map init state dict entry '1.running_mean'"),
        ({"0.weight": torch.zeros(5, 4), "0.bias": torch.zeros(5), "2.weight": torch.zeros(2, 5),
          "2.bias": torch.zeros(2)}, r"init state dict entry '2.weight' has shape \[2, 5\]"),
        ({"0.weight": torch.full((5, 4), float("nan")), "0.bias": torch.zeros(5), "2.weight": torch.zeros(1, 5),
          "2.bias": torch.zeros(1)}, "init's layer '0' has a non-finite weight"),
    ]
    for init, match in cases:
        with pytest.raises(ValueError, match=match):
            pyrobdl.fit(model, x, y, "map", init=init, num_steps=1, progress=False)
    with pytest.raises(TypeError, match="init must be a torch.nn.Module or its state_dict"):
        pyrobdl.fit(model, x, y, "map", init=np.zeros(3), num_steps=1, progress=False)


def test_init_is_refused_by_name_where_it_means_nothing_and_its_options_need_it():
    model = blr_model()
    x, y = inputs(10, 3), torch.zeros(10)
    net = seq(3, 1)
    with pytest.raises(ValueError, match=r"method 'nuts' takes no init= .* \['bbvi', 'chees', .*'laplace', 'map'"):
        pyrobdl.fit(model, x, y, "nuts", init=net, progress=False)
    with pytest.raises(ValueError, match=r"option\(s\) \['fit_map'\] of method 'laplace' apply only beside init="):
        pyrobdl.fit(model, x, y, "laplace", fit_map=False, progress=False)
    with pytest.raises(ValueError, match=r"do not pass \['init_loc'\] beside it"):
        pyrobdl.fit(model, x, y, "mean_field", init=net, init_loc="prior", progress=False)
    with pytest.raises(ValueError, match=r"do not pass \['init_strategy'\] beside it"):
        pyrobdl.fit(model, x, y, "chees", init=net, init_strategy="map", progress=False)
    for method, spread in (("chees", None), ("chees", -0.1), ("ensemble", float("nan"))):
        with pytest.raises(ValueError, match="init_spread must be a finite number >= 0"):
            pyrobdl.fit(model, x, y, method, init=net, init_spread=spread, progress=False)
    with pytest.raises(TypeError, match="fit_map must be True or False"):
        pyrobdl.fit(model, x, y, "laplace", init=net, fit_map="no", progress=False)


@pytest.mark.parametrize("method", ["map", "mean_field", "bbvi", "dropout", "gaussian_dropout", "variational_dropout"])
def test_svi_guides_start_at_the_given_weights(method):
    """One Adam step of size 1e-9 from init: the guide's locations are the user's weights up to the step."""
    net = seq(3, 6, 1, act=torch.nn.Tanh)
    x, y = inputs(40, 3), torch.zeros(40)
    prior = pyrobdl.priors.LogUniform() if method == "variational_dropout" else None
    model = pyrobdl.BayesianMLP.from_torch(net, prior=prior)
    post = pyrobdl.fit(model, x, y, method, init=net, num_steps=1, lr=1e-9, progress=False)
    dists = post.guide.variational_distributions()
    for name, value in init_sites(model, net).items():
        q = dists[name]
        # Bernoulli dropout rows: the mean is (1 - p) times the location
        loc = q.loc if method == "dropout" and name.endswith("weight") else q.mean
        assert (loc - value).abs().max() < 1e-6, name


def test_ensemble_member_zero_is_the_given_network_and_the_others_spread():
    # not seed 0: fit(seed=0)'s fresh nn.Linear-style draws would repeat the net's own initialisation
    net = seq(3, 6, 1, seed=5)
    x, y = inputs(40, 3), torch.zeros(40)
    model = pyrobdl.BayesianMLP.from_torch(net)
    target = FlatLogJoint(model, x, y).layout.pack(init_sites(model, net))
    fresh = pyrobdl.fit(model, x, y, "ensemble", init=net, num_members=3, num_steps=1, lr=1e-9, progress=False)
    assert (fresh.theta[0] - target).abs().max() < 1e-6
    # the others are nn.Linear-style draws: O(1/sqrt(fan_in)) away in every coordinate
    assert ((fresh.theta[1:] - target).abs().mean(1) > 0.1).all()
    spread = pyrobdl.fit(model, x, y, "ensemble", init=net, num_members=3, num_steps=1, lr=1e-9, init_spread=0.05,
                         progress=False)
    assert (spread.theta[0] - target).abs().max() < 1e-6
    assert ((spread.theta[1:] - target).abs().max(1).values < 0.05 * 6).all()  # 6 sd: every one of 2 x 31


def test_spread_starts_have_the_stated_spread():
    """init + spread * N(0, 1) in every unconstrained coordinate: the sample sd of 64 x P offsets
    is within 4 standard errors (sd / sqrt(2n)) of the spread; keep_first leaves row 0 at init."""
    net = seq(3, 6, 1)
    model = pyrobdl.BayesianMLP.from_torch(net, likelihood=pyrobdl.likelihoods.GaussianLearnedPrecision())
    lj = FlatLogJoint(model, inputs(10, 3), torch.zeros(10))
    values = init_sites(model, net)
    rows = spread_starts(model, lj, values, 64, 0.3, keep_first=True, generator=torch.Generator().manual_seed(0))
    base = lj.layout.pack({**values, "precision": model.prior_distributions()["precision"].mean})
    assert torch.equal(rows[0], base)
    offsets = (rows[1:] - base).double()
    n = offsets.numel()
    assert abs(float(offsets.std()) - 0.3) < 4 * 0.3 / np.sqrt(2 * n)
    assert abs(float(offsets.mean())) < 4 * 0.3 / np.sqrt(n)


# ------------------------------------------------------------------------ 3. to_torch
def test_to_torch_equals_the_posterior_network_at_its_weights():
    net = seq(3, 6, 2, act=torch.nn.Tanh)
    x, y = inputs(40, 3), torch.randint(0, 2, (40,), generator=torch.Generator().manual_seed(0))
    model = pyrobdl.BayesianMLP.from_torch(net, likelihood=pyrobdl.likelihoods.Categorical())
    post = pyrobdl.fit(model, x, y, "mean_field", init=net, num_steps=20, progress=False)
    xt = inputs(25, 3, seed=7)
    with torch.no_grad():
        mean_net = post.to_torch("mean")
        locs = {k: q.mean for k, q in post.guide.variational_distributions().items()}
        assert (mean_net(xt) - model.network(locs, xt)).abs().max() < ROUND
        draw_net = post.to_torch("draw", seed=3)
        draw = {k: v[0] for k, v in post.sample(1, seed=3).items()}
        assert (draw_net(xt) - model.network(draw, xt)).abs().max() < ROUND
        assert (draw_net(xt) - mean_net(xt)).abs().max() > 1e-3  # a draw, not the mean
    assert [type(m) for m in draw_net] == [torch.nn.Linear, torch.nn.Tanh, torch.nn.Linear]
    with pytest.raises(ValueError, match=r"unknown kind 'median'; valid: \['mean', 'draw'\]"):
        post.to_torch("median")
    with pytest.raises(ValueError, match="seed only applies to to_torch\\(kind='draw'\\)"):
        post.to_torch("mean", seed=0)


def test_to_torch_mean_is_refused_for_ensembles():
    net = seq(3, 4, 1)
    x, y = inputs(20, 3), torch.zeros(20)
    post = pyrobdl.fit(pyrobdl.BayesianMLP.from_torch(net), x, y, "ensemble", num_members=2, num_steps=2,
                       progress=False)
    with pytest.raises(ValueError, match="the average of their weights is not a network of the posterior"):
        post.to_torch()
    with torch.no_grad():
        member0 = to_sequential(post.model, {k: v[0] for k, v in post.members.items()})
        assert (post.to_torch("draw")(x) - member0(x)).abs().max() == 0


# ------------------------------------------------------------------------ 4. post-hoc Laplace
def test_post_hoc_laplace_is_the_exact_blr_posterior(float64, blr):
    """A torch Linear at the exact posterior mean: post-hoc Laplace there is the exact posterior
    (the log joint is quadratic), and equals laplace after its own MAP fit + one Newton step."""
    exact = blr.posterior
    net = torch.nn.Linear(3, 1)
    with torch.no_grad():
        net.weight.copy_(exact.mean[:3].view(1, 3))
        net.bias.copy_(exact.mean[3:])
    x, y = blr.x_train.double(), blr.y_train.double()
    post = pyrobdl.fit(blr_model(), x, y, "laplace", init=net, fit_map=False, progress=False)
    assert (post.mean - exact.mean).abs().max() < EXACT_TOL
    assert (post.covariance() - exact.covariance).abs().max() < EXACT_TOL
    assert post.diagnostics["log_joint_gradient_norm"] < 1e-8  # the exact mean is the mode
    own = pyrobdl.fit(blr_model(), x, y, "laplace", num_steps=300, newton_steps=1, progress=False)
    assert (own.mean - post.mean).abs().max() < EXACT_TOL
    assert (own.covariance() - post.covariance()).abs().max() < EXACT_TOL
    assert abs(own.diagnostics["log_marginal_likelihood"] - post.diagnostics["log_marginal_likelihood"]) < EXACT_TOL


@pytest.mark.parametrize("hessian", ["full", "kron", "diag", "last_layer"])
def test_post_hoc_laplace_equals_laplace_at_its_own_map(hessian):
    """On an MLP: laplace's own MAP fit, exported to torch and given back as init with
    fit_map=False, gives the same Gaussian (same mean, covariance and tuned prior precision)."""
    x = inputs(60, 2)
    y = torch.sin(2 * x[:, 0]) + 0.1 * inputs(60, 1, seed=5)[:, 0]
    model = pyrobdl.BayesianMLP(2, (8,), 1, activation="tanh", likelihood=pyrobdl.likelihoods.Gaussian(PRECISION))
    own = pyrobdl.fit(model, x, y, "laplace", hessian=hessian, prior_precision="marglik", num_steps=300, progress=False)
    trained = own.to_torch()
    post = pyrobdl.fit(model, x, y, "laplace", init=trained, fit_map=False, hessian=hessian, prior_precision="marglik",
                       progress=False)
    assert torch.equal(post.mean, own.mean)
    assert torch.equal(post.covariance(), own.covariance())
    assert post.prior_precision_multiplier == own.prior_precision_multiplier


# ------------------------------------------------------------------------ chees starts
def test_chees_started_at_a_trained_network_reaches_the_exact_blr_posterior(blr):
    """Chains started at a torch Linear (least squares, not the posterior mean) with spread 0.1:
    the posterior mean within 4 Monte Carlo standard errors (as tests/test_chees.py) and
    certified."""
    x, y = blr.x_train, blr.y_train
    design = torch.cat([x, torch.ones(x.shape[0], 1)], 1).double()
    ls = torch.linalg.lstsq(design, y.double().unsqueeze(-1)).solution[:, 0]
    net = torch.nn.Linear(3, 1)
    with torch.no_grad():
        net.weight.copy_(ls[:3].view(1, 3))
        net.bias.copy_(ls[3:])
    post = pyrobdl.fit(blr_model(), x, y, "chees", init=net, num_chains=32, num_warmup=300, num_samples=200,
                       seed=0, progress=False)
    assert post.settings["init_spread"] == 0.1
    assert post.certification.passed, post.certification.failures
    s = post.samples
    draws = torch.cat([s["layers.0.weight"].reshape(32, 200, -1), s["layers.0.bias"].reshape(32, 200, -1)],
                      -1).double().numpy()
    from pyrobdl.diagnostics import convergence

    conv = convergence(draws)
    sd = np.sqrt(np.diag(blr.posterior.covariance.numpy()))
    err = np.abs(draws.mean((0, 1)) - blr.posterior.mean.numpy())
    assert (err <= 4 * sd / np.sqrt(conv["ess_bulk"])).all(), (err / sd, conv["ess_bulk"])


@pytest.mark.parametrize("method, options", [("mean_field", dict(num_steps=5)), ("laplace", dict(fit_map=False))])
def test_a_fit_from_init_saves_and_loads(tmp_path, method, options):
    """The settings hold the init's tensors, which JSON cannot: they are saved as stand-ins and the
    loaded posterior has the same mean network."""
    net = seq(3, 5, 1)
    x, y = inputs(30, 3), torch.zeros(30)
    post = pyrobdl.fit(pyrobdl.BayesianMLP.from_torch(net), x, y, method, init=net, progress=False, **options)
    loaded = pyrobdl.load_posterior(post.save(tmp_path / method))
    with torch.no_grad():
        assert torch.equal(loaded.to_torch()(x), post.to_torch()(x))
