"""The whole small SVI step in numpy (pyrobdl.inference.numpy_elbo.NumpyStep): what the flat ELBO's
general path computes, for the same draws from the same generator; which steps it serves; that it
follows the parameters and data it was made for.  The general path itself is held equal to Pyro's
ELBOs in tests/test_flat_elbo.py."""

from __future__ import annotations

import pytest
import torch
from test_flat import TOL64, float64, make_data, make_model  # noqa: F401
from test_flat_elbo import CASES

import pyrobdl
from pyrobdl.flat import FlatLogJoint
from pyrobdl.guides import MAP, MeanField
from pyrobdl.inference.flat_elbo import FlatELBO
from pyrobdl.inference.numpy_elbo import NumpyStep


def _fitted(model, guide, x, y, idx, **kw):
    """A flat ELBO after one (general) step, so that its numpy step is made; parameters moved off the init."""
    packed = guide.flat_family()[1]
    with torch.no_grad():
        packed["loc"].add_(0.2 * torch.randn(packed["loc"].shape, dtype=packed["loc"].dtype))
        if "scale" in packed:
            packed["scale"].add_(0.5 * torch.randn(packed["scale"].shape, dtype=packed["scale"].dtype))
    elbo = FlatELBO(model, guide, **kw)
    elbo.loss_and_grad(x, y, idx)
    return elbo


def _both_paths(elbo, x, y, idx, draw):
    """(loss, grad, generator state after) from the numpy step and from the general path, from one seed;
    ``draw()``: the general path's noise for the step, drawn as it draws it (None: no draws)."""
    step = elbo._numpy_step
    assert step.serves(elbo, x, y, idx)
    vector = elbo._vectors()[0]  # (parameters_to_optimize() would re-read the packing: a new step)
    ran = []
    run = step.run
    step.run = lambda *a: ran.append(1) or run(*a)
    torch.manual_seed(11)
    loss = elbo.loss_and_grad(x, y, idx)  # the numpy step: its own draws
    assert ran == [1]
    fast = (loss.clone(), vector.grad.clone(), torch.get_rng_state())
    torch.manual_seed(11)
    loss = elbo.loss_and_grad(x, y, idx, noise=draw())  # noise given: the general path
    return fast, (loss.clone(), vector.grad.clone(), torch.get_rng_state())


def _close(a, b):
    """Loss and gradient of the two paths equal to float64 rounding, the generator in the same state."""
    (loss_a, grad_a, state_a), (loss_b, grad_b, state_b) = a, b
    assert torch.equal(state_a, state_b)
    assert abs(float(loss_a - loss_b)) / max(1.0, abs(float(loss_b))) < TOL64
    assert float((grad_a - grad_b).abs().max() / grad_b.abs().max()) < TOL64


# mean field with weight draws and MAP: every case, a learned precision included; local reparameterization
# with a learned precision keeps the general path
LRT_CASES = [c for c in CASES if not c[1].startswith("learned")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("num_particles, minibatch, beta", [(1, False, 1.0), (3, True, 0.3), (1, True, 1.0)])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_mean_field_numpy_step_is_the_general_path(case, num_particles, minibatch, beta, dtype):
    """The same draws (the generator left in the same state) and the same floats, bit for bit: the
    numpy step runs the general path's own numpy function on the same arrays.  With a learned precision
    the general path is torch's (its numpy twin leaves it out): equal to float rounding, ~100 ulps of
    the dtype over the step's sums."""
    prior, lik, hidden, act = case
    dt = getattr(torch, dtype)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dt)
    try:
        torch.manual_seed(0)
        model = make_model(prior, lik, hidden, act)
        x, y = make_data(model, dtype=dt)
        y = model.likelihood.prepare_targets(y, model.out_features)
        idx = torch.tensor([0, 3, 4, 7, 11]) if minibatch else None
        elbo = _fitted(model, MeanField(model, init_scale=0.3), x, y, idx, num_particles=num_particles)
        elbo.kl_weight = beta
        size = elbo._vectors()[0].shape[0] // 2
        (loss_a, grad_a, state_a), (loss_b, grad_b, state_b) = _both_paths(
            elbo, x, y, idx, lambda: torch.randn(num_particles, size, dtype=dt))
    finally:
        torch.set_default_dtype(old)
    assert loss_a.dtype == loss_b.dtype == dt and loss_a.shape == loss_b.shape == ()
    assert torch.equal(state_a, state_b)
    if lik.startswith("learned"):
        tol = TOL64 if dt == torch.float64 else 100 * float(torch.finfo(dt).eps)
        assert abs(float(loss_a - loss_b)) / max(1.0, abs(float(loss_b))) < tol
        assert float((grad_a - grad_b).abs().max() / grad_b.abs().max()) < tol
    else:
        assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("beta", [1.0, 0.3])
def test_map_numpy_step_is_the_general_path(float64, case, beta):
    """A point mass: the same gradient bit for bit (the same operations; with a learned precision to float64
    rounding, its Gamma prior in numpy); the loss's prior term is summed by numpy instead of torch, so it
    agrees to float64 rounding; no draws either way."""
    prior, lik, hidden, act = case
    torch.manual_seed(1)
    model = make_model(prior, lik, hidden, act)
    x, y = make_data(model)
    y = model.likelihood.prepare_targets(y, model.out_features)
    idx = torch.tensor([1, 2, 5, 6])
    elbo = _fitted(model, MAP(model), x, y, idx)
    elbo.kl_weight = beta
    fast, general = _both_paths(elbo, x, y, idx, lambda: None)
    _close(fast, general)
    if not lik.startswith("learned"):
        assert torch.equal(fast[1], general[1])


def _small():
    torch.manual_seed(0)
    model = pyrobdl.BayesianMLP(2, (4,), 1)
    x, y = torch.randn(20, 2), torch.randn(20)
    return model, x, y


@pytest.mark.parametrize("setting", ["monte_carlo_kl", "learned_precision", "numpy_kernel_off", "tensor_beta", "bool_beta", "large_batch",
                                     "per_row_minibatch", "other_data"])
def test_numpy_step_leaves_what_it_does_not_cover_to_the_general_path(monkeypatch, setting):
    model, x, y = _small()
    kw, guide_kw, idx = {}, {}, torch.tensor([0, 1, 2])
    if setting == "monte_carlo_kl":
        kw["analytic_kl"] = False
    elif setting == "learned_precision":  # with local reparameterization (weight draws: served)
        model = pyrobdl.BayesianMLP(2, (4,), 1, likelihood=pyrobdl.likelihoods.GaussianLearnedPrecision())
        guide_kw["local_reparameterization"] = True
    elbo = FlatELBO(model, MeanField(model, **guide_kw), **kw)
    elbo.loss_and_grad(x, y, idx)
    step = elbo._numpy_step
    assert isinstance(step, NumpyStep)
    if setting == "numpy_kernel_off":
        monkeypatch.setattr(FlatLogJoint, "numpy_kernel", False)
    elif setting == "tensor_beta":
        elbo.kl_weight = torch.tensor(0.5)
    elif setting == "bool_beta":
        elbo.kl_weight = True
    elif setting == "large_batch":
        monkeypatch.setattr("pyrobdl.flat.numpy_kernel.MAX_NUMPY_ELEMENTS", 3 * 4 - 1)
    elif setting == "per_row_minibatch":
        idx = idx[None]
    if setting == "other_data":
        assert not step.serves(elbo, x.clone(), y, idx)
    else:
        assert not step.serves(elbo, x, y, idx)
        # and the general path still serves the step
        assert torch.isfinite(elbo.loss_and_grad(x, y, idx if idx.dim() == 1 else None))


def test_numpy_step_is_remade_for_new_parameters_and_data():
    """Its numpy views belong to one packed vector and one log joint: after the parameters are re-read
    (a repacked guide) or other data arrive, the next general step makes a new one, which then serves."""
    model, x, y = _small()
    guide = MeanField(model)
    elbo = FlatELBO(model, guide)
    elbo.loss_and_grad(x, y)
    first = elbo._numpy_step
    assert first.serves(elbo, x, y, None)
    with torch.no_grad():
        guide.double()  # new storage: the packing is repaired on the next read
        guide.float()
    elbo.parameters_to_optimize()
    assert not first.current(elbo) and not first.serves(elbo, x, y, None)
    elbo.loss_and_grad(x, y)
    second = elbo._numpy_step
    assert second is not first and second.serves(elbo, x, y, None)
    x2, y2 = x + 1.0, y.clone()
    assert not second.serves(elbo, x2, y2, None)
    elbo.loss_and_grad(x2, y2)
    assert elbo._numpy_step.serves(elbo, x2, y2, None)
    # the step writes the gradient of the vector the optimizer steps, views and all
    (vector,) = elbo.parameters_to_optimize()
    elbo.loss_and_grad(x2, y2)
    assert vector.grad is not None and vector.grad.shape == vector.shape


@pytest.mark.parametrize("prior", [True, False])
def test_members_numpy_step_is_the_general_step(prior):
    """The ensemble's and Laplace's full-batch member step at few activations (the numpy twin called
    directly) gives the general step's gradient and members' objectives bit for bit."""
    from pyrobdl.inference.ensemble import _member_step, _numpy_member_step

    model, x, y = _small()
    lj = FlatLogJoint(model, x, y)
    param = torch.nn.Parameter(0.3 * torch.randn(4, lj.size))
    loss_a, value_a = _numpy_member_step(lj, param, prior)(None)
    grad_a = param.grad.clone()
    loss_b, value_b = _member_step(lj, param, prior)(None)
    assert torch.equal(grad_a, param.grad) and torch.equal(value_a, value_b)
    assert value_a.shape == (4,) and loss_a.shape == () and torch.allclose(loss_a, loss_b, rtol=1e-6)


def test_train_members_takes_the_numpy_step_only_at_full_batch(monkeypatch):
    from pyrobdl.inference import ensemble
    from pyrobdl.inference.svi import LoopSettings

    model, x, y = _small()
    lj = FlatLogJoint(model, x, y)
    made = []
    real = ensemble._numpy_member_step
    monkeypatch.setattr(ensemble, "_numpy_member_step", lambda *a: made.append(1) or real(*a))
    theta = 0.3 * torch.randn(3, lj.size)
    full = ensemble.train_members(lj, theta, LoopSettings(num_steps=5, lr=1e-2))
    assert made == [1] and full.history.shape == (5, 3) and torch.isfinite(full.theta).all()
    ensemble.train_members(lj, theta, LoopSettings(num_steps=5, lr=1e-2, batch_size=8))
    assert made == [1]


@pytest.mark.parametrize("approximation", ["molchanov", "kingma", "ard"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_numpy_kl_and_slope_are_kl_log_uniform_and_its_derivative(approximation, dtype, monkeypatch):
    """The variational-dropout twin's KL written out in numpy: kl_log_uniform's value (to a few ulps of
    its dtype) and its autograd derivative; a replaced kl_log_uniform gives the value instead."""
    import numpy as np

    import pyrobdl.guides.variational_dropout as vd
    from pyrobdl.inference.numpy_elbo import _kl_and_slope

    dt = getattr(torch, dtype)
    hi = 0.0 if approximation == "kingma" else 8.0
    la = torch.linspace(-8.0, hi, 1001, dtype=dt).requires_grad_(True)
    ref = vd.kl_log_uniform(la, approximation)
    (slope_ref,) = torch.autograd.grad(ref.sum(), la)
    arr = la.detach().numpy()
    kl, slope = _kl_and_slope(arr, approximation, arr.dtype.type)
    assert kl.dtype == slope.dtype == arr.dtype
    ulp = float(torch.finfo(dt).eps)
    assert np.max(np.abs(kl - ref.detach().numpy()) / np.maximum(np.abs(ref.detach().numpy()), 1.0)) < 8 * ulp
    assert np.max(np.abs(slope - slope_ref.numpy()) / np.maximum(np.abs(slope_ref.numpy()), 1.0)) < 8 * ulp
    monkeypatch.setattr(vd, "kl_log_uniform", lambda t, approximation: torch.full_like(t, 10.0))
    kl, slope2 = _kl_and_slope(arr, approximation, arr.dtype.type)
    assert np.all(kl == 10.0) and np.array_equal(slope, slope2)


VD_VARIANTS = [  # (guide options, KL): the Monte Carlo KL needs the weights sampled
    (dict(), "analytic"), (dict(sparse=False), "analytic"), (dict(ard=True), "analytic"),
    (dict(local_reparameterization=False), "analytic"), (dict(local_reparameterization=False), "monte_carlo"),
]


@pytest.mark.parametrize("variant, kl", VD_VARIANTS,
                         ids=["molchanov-lrt", "kingma", "ard", "weights-sampled", "weights-sampled-mc-kl"])
@pytest.mark.parametrize("num_particles, minibatch, beta", [(1, False, 1.0), (3, True, 0.3)])
def test_variational_dropout_numpy_step_is_the_general_path(variant, kl, num_particles, minibatch, beta):
    """The same draws (vd_noise, the generator left in the same state) and the same floats, bit for bit."""
    from pyrobdl.guides import VariationalDropout
    from pyrobdl.inference.flat_vd import vd_noise

    torch.manual_seed(0)
    model = pyrobdl.BayesianMLP(3, (5, 4), 1, activation="tanh", prior=pyrobdl.priors.LogUniform())
    x, y = make_data(model, dtype=torch.float32)
    y = model.likelihood.prepare_targets(y, model.out_features)
    idx = torch.tensor([0, 3, 4, 7, 11]) if minibatch else None
    guide = VariationalDropout(model, init_log_sigma2=-3.0, **variant)
    elbo = FlatELBO(model, guide, num_particles=num_particles, analytic_kl=kl == "analytic")
    with torch.no_grad():
        elbo._params["loc"].add_(0.3 * torch.randn(elbo._params["loc"].shape))
        elbo._params["spread"].add_(0.5 * torch.randn(elbo._params["spread"].shape))
    elbo.loss_and_grad(x, y, idx)
    elbo.kl_weight = beta
    batch = x.shape[0] if idx is None else idx.shape[0]
    fast, general = _both_paths(elbo, x, y, idx, lambda: vd_noise(guide, elbo._plan, num_particles, batch, elbo._lj))
    assert all(torch.equal(a, b) for a, b in zip(fast, general))


@pytest.mark.parametrize("baseline", ["none", "decaying_average", "leave_one_out", "vargrad"])
@pytest.mark.parametrize("analytic_kl, minibatch, beta", [(False, False, 1.0), (True, True, 0.3)])
def test_score_function_small_step_is_the_general_path(baseline, analytic_kl, minibatch, beta, monkeypatch):
    """BBVI's small CPU step goes straight to the numpy twin: the same draws and floats, bit for bit, as
    the general path on two estimators of the same guide (a decaying average's state included)."""
    import copy

    from pyrobdl.guides import ScoreFunction
    from pyrobdl.inference.flat_score_function import FlatScoreFunctionELBO

    torch.manual_seed(0)
    model = pyrobdl.BayesianMLP(3, (5,), 1, activation="tanh")
    x, y = make_data(model, dtype=torch.float32)
    y = model.likelihood.prepare_targets(y, model.out_features)
    idx = torch.tensor([0, 3, 4, 7, 11]) if minibatch else None
    guide = ScoreFunction(model, baseline=baseline, init_scale=0.3)
    ests = [FlatScoreFunctionELBO(model, g, num_particles=4, analytic_kl=analytic_kl)
            for g in (guide, copy.deepcopy(guide))]
    general = []
    real = FlatScoreFunctionELBO._loss_and_grads
    monkeypatch.setattr(FlatScoreFunctionELBO, "_loss_and_grads", lambda self, *a: general.append(self) or real(self, *a))
    out = []
    for k, est in enumerate(ests):
        est.kl_weight = beta
        (vector,) = est.parameters_to_optimize()
        torch.manual_seed(5)
        rows = []
        for _ in range(3):  # the first step builds the log joint; the later ones take the small step (k = 0)
            noise = None if k == 0 else est.draw(vector)
            loss = est.loss_and_grad(x, y, idx, noise=noise)
            rows.append((loss.clone(), vector.grad.clone()))
        out.append((rows, torch.get_rng_state()))
    assert general.count(ests[0]) == 1 and general.count(ests[1]) == 3  # the small step took the later two
    (rows_a, state_a), (rows_b, state_b) = out
    for (la, ga), (lb, gb) in zip(rows_a, rows_b):
        assert torch.equal(la, lb) and torch.equal(ga, gb)
    assert torch.equal(state_a, state_b)


@pytest.mark.parametrize("kind", ["bernoulli", "gaussian"])
@pytest.mark.parametrize("num_particles, minibatch, beta", [(1, False, 1.0), (3, True, 0.3)])
@pytest.mark.parametrize("hidden", [(5,), (4, 3)])
def test_dropout_numpy_step_is_the_general_path(float64, kind, num_particles, minibatch, beta, hidden):
    """MC dropout with the closed-form KL: the same draws (dropout_noise, the generator left in the same
    state); the same floats up to float64 rounding (the Gaussian rows' column norms are summed by
    numpy's add.at instead of torch's index_add_)."""
    from pyrobdl.guides import Dropout
    from pyrobdl.inference.flat_dropout import dropout_noise

    torch.manual_seed(0)
    model = pyrobdl.BayesianMLP(3, hidden, 1, activation="tanh")
    x, y = make_data(model)
    y = model.likelihood.prepare_targets(y, model.out_features)
    idx = torch.tensor([0, 3, 4, 7, 11]) if minibatch else None
    guide = Dropout(model, p=[0.1, 0.3, 0.2][: len(hidden) + 1], sigma=0.05, kind=kind)
    elbo = _fitted(model, guide, x, y, idx, num_particles=num_particles)
    elbo.kl_weight = beta
    fast, general = _both_paths(elbo, x, y, idx, lambda: dropout_noise(guide, elbo._plan, num_particles, elbo._lj))
    _close(fast, general)
    if kind == "bernoulli":  # no column norms: the same operations
        assert all(torch.equal(a, b) for a, b in zip(fast, general))


def test_dropout_with_a_monte_carlo_kl_keeps_the_general_path():
    from pyrobdl.guides import Dropout

    model, x, y = _small()
    elbo = FlatELBO(model, Dropout(model), analytic_kl=False)
    elbo.loss_and_grad(x, y)
    assert not elbo._numpy_step.ok and not elbo._numpy_step.serves(elbo, x, y, None)


@pytest.mark.parametrize("change", ["num_particles", "analytic_kl"])
def test_numpy_step_follows_the_elbos_settings(change):
    """Particles and the KL treatment are read when the step is made: changing either on the ELBO makes
    the next step a general one, which makes a new numpy step (or none) for the new settings."""
    model, x, y = _small()
    elbo = FlatELBO(model, MeanField(model))
    elbo.loss_and_grad(x, y)
    step = elbo._numpy_step
    assert step.serves(elbo, x, y, None)
    setattr(elbo, change, 3 if change == "num_particles" else False)
    assert not step.serves(elbo, x, y, None)
    elbo.loss_and_grad(x, y)
    assert elbo._numpy_step is not step
    assert elbo._numpy_step.serves(elbo, x, y, None) == (change == "num_particles")
    assert elbo._numpy_step.rows == elbo.num_particles


@pytest.mark.parametrize("case", LRT_CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("num_particles, minibatch, beta", [(1, False, 1.0), (3, True, 0.3)])
def test_mean_field_local_reparameterization_numpy_step_is_the_general_path(float64, case, num_particles, minibatch,
                                                                           beta):
    """Local reparameterization: the same draws (normal_lrt_noise, the generator left in the same state); the
    likelihood the same numpy function, the KL and chain rule in numpy instead of torch (float64 rounding)."""
    from pyrobdl.inference.flat_vd import normal_lrt_noise

    prior, lik, hidden, act = case
    torch.manual_seed(0)
    model = make_model(prior, lik, hidden, act)
    x, y = make_data(model)
    x[0] = 0.0  # a zero input row: the pre-activation variance hits the floor
    y = model.likelihood.prepare_targets(y, model.out_features)
    idx = torch.tensor([0, 3, 4, 7, 11]) if minibatch else None
    elbo = _fitted(model, MeanField(model, init_scale=0.3, local_reparameterization=True), x, y, idx,
                   num_particles=num_particles)
    elbo.kl_weight = beta
    batch = x.shape[0] if idx is None else idx.shape[0]
    _close(*_both_paths(elbo, x, y, idx, lambda: normal_lrt_noise(elbo._plan, num_particles, batch, elbo._lj)))
