"""The flat SVI hot path (pyrobdl.inference.flat_elbo): value and gradient equal to Pyro's
``Trace_ELBO`` / ``TraceMeanField_ELBO`` on the unchanged model and guide for the same draws (the
noise recovered from Pyro's guide trace), in float64; packed guide parameters; the loop's use of it.
"""

from __future__ import annotations

import copy

import pyro
import pyro.poutine as poutine
import pytest
import torch
from conftest import DEVICES
from test_flat import LIKELIHOODS, PRIORS, TOL64, float64, make_data, make_model  # noqa: F401

import pyrobdl
from pyrobdl.guides import MAP, Dropout, MeanField, ScoreFunction
from pyrobdl.inference.elbo import DirectELBO, make_elbo
from pyrobdl.inference.flat_elbo import FlatELBO, flat_support
from pyrobdl.poutine import KLWeightMessenger

CASES = [
    # (prior, likelihood, hidden, activation)
    ("scalar", "gaussian-1", (5,), "relu"),
    ("per_layer", "gaussian-2", (4, 3), "tanh"),
    ("fan_in", "learned-1", (5,), "tanh"),
    ("scalar", "learned-2", (4, 3), "relu"),
    ("per_layer", "categorical-3", (5,), "relu"),
    ("scalar", "gaussian-1", (), "relu"),
]


def pyro_loss_and_grads(model, guide, x, y, idx, *, analytic: bool, beta: float, num_particles: int):
    """Pyro's differentiable loss averaged over particles, each particle one traced guide run;
    returns the loss, the gradient of every guide parameter in the guide's packed order, and the
    standard-normal noise of each particle recovered from the traces ([S, P])."""
    elbo = (pyro.infer.TraceMeanField_ELBO if analytic else pyro.infer.Trace_ELBO)(max_plate_nesting=1)
    fam, packed = guide.flat_family()
    names = [s.key for s in guide.site_specs]
    args = (x, y) if idx is None else (x, y, idx)
    total, noise = 0.0, []
    with pyro.get_param_store().scope():
        for _ in range(num_particles):
            tr = poutine.trace(guide).get_trace(*args)
            if fam == "normal":
                parts = []
                for s in guide.site_specs:
                    v = tr.nodes[s.name]["value"].detach()
                    u = v.log() if not s.is_real else v
                    mu = getattr(guide, f"{s.key}_loc_unconstrained").detach()
                    sigma = torch.nn.functional.softplus(getattr(guide, f"{s.key}_scale_unconstrained").detach())
                    parts.append(((u - mu) / sigma).reshape(-1))
                noise.append(torch.cat(parts))
            h = KLWeightMessenger(beta)
            total = total + elbo.differentiable_loss(h(model), h(poutine.replay(guide, trace=tr)), *args)
        loss = total / num_particles
        for p in guide.parameters():
            p.grad = None
        loss.backward()
    groups = ["loc", "scale"] if fam == "normal" else ["loc"]
    grads = [
        torch.cat([getattr(guide, f"{n}_{g}_unconstrained").grad.reshape(-1) for n in names]) for g in groups
    ]
    return loss.detach(), grads, (torch.stack(noise) if noise else None)


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("kl", ["analytic", "monte_carlo"])
@pytest.mark.parametrize("num_particles", [1, 3])
@pytest.mark.parametrize("minibatch", [False, True])
def test_mean_field_equals_pyro(float64, flat_kernel, case, kl, num_particles, minibatch):
    prior, lik, hidden, act = case
    pyro.set_rng_seed(0)
    model = make_model(prior, lik, hidden, act)
    x, y = make_data(model)
    y = model.likelihood.prepare_targets(y, model.out_features)
    guide = MeanField(model, init_scale=0.3)
    packed = guide.flat_family()[1]
    with torch.no_grad():  # unequal scales and locations away from the init
        packed["loc"].add_(0.2 * torch.randn(packed["loc"].shape))
        packed["scale"].add_(0.5 * torch.randn(packed["scale"].shape))
    idx = torch.tensor([0, 3, 4, 7, 11]) if minibatch else None
    beta = 0.3 if minibatch else 1.0
    analytic = kl == "analytic"
    ref_loss, ref_grads, noise = pyro_loss_and_grads(
        model, guide, x, y, idx, analytic=analytic, beta=beta, num_particles=num_particles
    )
    fast = FlatELBO(model, guide, num_particles=num_particles, analytic_kl=analytic)
    fast.kl_weight = beta
    loss = fast.loss_and_grad(x, y, idx, noise=noise)
    assert abs(float(loss - ref_loss)) / max(1.0, abs(float(ref_loss))) < TOL64
    (vector,) = fast.parameters_to_optimize()
    half = vector.shape[0] // 2
    assert rel(vector.grad[:half], ref_grads[0]) < TOL64
    assert rel(vector.grad[half:], ref_grads[1]) < TOL64


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("kl", ["analytic", "monte_carlo"])
@pytest.mark.parametrize("num_particles, minibatch", [(1, False), (3, True)])
def test_mean_field_local_reparameterization_equals_pyro(float64, flat_kernel, case, kl, num_particles, minibatch):
    """With local reparameterization the flat path samples every layer's pre-activations, as
    :class:`~pyrobdl.poutine.LocalReparameterizationMessenger` does under Pyro's ELBOs; the noise
    of both (the weights' draws, which still enter a Monte Carlo KL, and the pre-activations')
    is recovered from Pyro's run."""
    from test_flat_dropout import check_equal

    prior, lik, hidden, act = case
    pyro.set_rng_seed(2)
    model = make_model(prior, lik, hidden, act)
    x, y = make_data(model)
    x[0] = 0.0  # a zero input row: the pre-activation variance hits the messenger's floor
    y = model.likelihood.prepare_targets(y, model.out_features)
    guide = MeanField(model, init_scale=0.3, local_reparameterization=True)
    packed = guide.flat_family()[1]
    with torch.no_grad():
        packed["loc"].add_(0.2 * torch.randn(packed["loc"].shape))
        packed["scale"].add_(0.5 * torch.randn(packed["scale"].shape))
    idx = torch.tensor([0, 3, 4, 7, 11]) if minibatch else None
    check_equal(model, guide, x, y, idx, analytic=kl == "analytic", beta=0.3 if minibatch else 1.0,
                num_particles=num_particles)


@pytest.mark.parametrize("through_sigmoid", [False, True])
@pytest.mark.parametrize("case", [c for c in CASES if c[3] == "tanh"], ids=lambda c: "-".join(map(str, c)))
def test_both_tanh_forms_of_the_torch_paths_equal_pyro(float64, monkeypatch, case, through_sigmoid):
    """Whichever form the machine's tanh takes on the torch paths (ATen's, or 2 sigmoid(2a) - 1 where
    ATen's is MKL's slow path: ``pyrobdl.flat.kernel.tanh_through_sigmoid``), the locally reparameterized
    likelihood (mean field's and variational dropout's) and the weight-draw path equal Pyro's ELBO."""
    from pyrobdl.flat import FlatLogJoint
    from pyrobdl.flat import kernel as flat_kernel_module

    monkeypatch.setattr(flat_kernel_module, "tanh_through_sigmoid", lambda device: through_sigmoid)
    monkeypatch.setattr(FlatLogJoint, "numpy_kernel", False)
    test_mean_field_local_reparameterization_equals_pyro(None, "torch", case, "analytic", 3, True)
    test_mean_field_equals_pyro(None, "torch", case, "monte_carlo", 1, False)
    assert FlatLogJoint(make_model(*case), *make_data(make_model(*case)))._sigmoid_tanh is through_sigmoid


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("beta", [1.0, 0.3])
def test_map_equals_pyro(float64, flat_kernel, case, beta):
    prior, lik, hidden, act = case
    pyro.set_rng_seed(1)
    model = make_model(prior, lik, hidden, act)
    x, y = make_data(model)
    y = model.likelihood.prepare_targets(y, model.out_features)
    guide = MAP(model)
    idx = torch.tensor([1, 2, 5, 6])
    ref_loss, ref_grads, _ = pyro_loss_and_grads(model, guide, x, y, idx, analytic=False, beta=beta, num_particles=1)
    fast = FlatELBO(model, guide)
    fast.kl_weight = beta
    loss = fast.loss_and_grad(x, y, idx)
    assert abs(float(loss - ref_loss)) / max(1.0, abs(float(ref_loss))) < TOL64
    (theta,) = fast.parameters_to_optimize()
    assert rel(theta.grad, ref_grads[0]) < TOL64


def test_flat_and_distribution_paths_agree_in_expectation(float64):
    """Same estimator, independent draws: the flat and DirectELBO losses agree within Monte
    Carlo error (4 standard errors of the difference of two means over 400 draws each)."""
    pyro.set_rng_seed(2)
    model = make_model("scalar", "learned-1", (5,), "tanh")
    x, y = make_data(model)
    y = model.likelihood.prepare_targets(y, model.out_features)
    guide = MeanField(model, init_scale=0.2)
    fast, slow = FlatELBO(model, guide), DirectELBO(model, guide)
    a = torch.stack([fast(x, y).detach() for _ in range(400)])
    with torch.no_grad():
        b = torch.stack([slow(x, y) for _ in range(400)])
    se = (a.var() / 400 + b.var() / 400).sqrt()
    assert abs(float(a.mean() - b.mean())) < 4 * float(se)


# ------------------------------------------------------------------------------ packing
def test_packed_parameters_are_views_of_one_vector():
    model = pyrobdl.BayesianMLP(3, (4,), 2, likelihood=pyrobdl.likelihoods.GaussianLearnedPrecision())
    guide = MeanField(model)
    layout = pyrobdl.flat.FlatLayout(model)
    vector = guide.packed("params")
    assert vector.shape == (2 * layout.size,)
    loc = guide.flat_family()[1]["loc"]
    assert loc.data_ptr() == vector.data_ptr() and loc.shape == (layout.size,)
    with torch.no_grad():
        loc.copy_(torch.arange(layout.size, dtype=loc.dtype))
    for s in layout.sites:  # the per-site parameters see the write, in the flat layout's order
        p = getattr(guide, s.name.replace(".", "_") + "_loc_unconstrained")
        assert torch.equal(p.reshape(-1), torch.arange(s.start, s.stop, dtype=loc.dtype))
    # Pyro's view: an ordinary guide with one sample site per latent site
    tr = poutine.trace(guide).get_trace()
    assert [n for n, m in tr.nodes.items() if m["type"] == "sample"] == [s.name for s in layout.sites]


@pytest.mark.parametrize("break_it", ["deepcopy", "double", "load_state_dict"])
def test_packing_survives_copies_and_conversions(break_it):
    model = pyrobdl.BayesianMLP(2, (3,), 1)
    guide = MeanField(model)
    before = {k: v.clone() for k, v in guide.state_dict().items()}
    if break_it == "deepcopy":
        guide = copy.deepcopy(guide)
    elif break_it == "double":
        guide = guide.double()
    else:
        guide.load_state_dict({k: v + 1.0 for k, v in before.items()})
        before = {k: v + 1.0 for k, v in before.items()}
    loc = guide.flat_family()[1]["loc"]
    with torch.no_grad():
        loc.mul_(2.0)
    state = guide.state_dict()
    for k, v in before.items():
        expected = 2.0 * v if "_loc_" in k else v
        assert torch.allclose(state[k].to(v.dtype), expected), k


def test_flat_support_names_the_reason():
    gaussian = pyrobdl.BayesianMLP(2, (3,), 1)
    assert flat_support(gaussian, MeanField(gaussian)) is None
    assert flat_support(gaussian, MAP(gaussian)) is None
    assert "ScoreFunction" in flat_support(gaussian, ScoreFunction(gaussian))
    assert flat_support(gaussian, MeanField(gaussian, local_reparameterization=True)) is None
    assert flat_support(gaussian, Dropout(gaussian, p=0.1)) is None  # packed since issue 12
    assert "Monte Carlo" in flat_support(gaussian, Dropout(gaussian, kind="gaussian"), analytic_kl=False)
    vd_model = pyrobdl.BayesianMLP(2, (3,), 1, prior=pyrobdl.priors.LogUniform())
    assert "improper" in flat_support(vd_model, MeanField(vd_model))
    with pytest.raises(ValueError, match="flat ELBO cannot run"):
        FlatELBO(vd_model, MeanField(vd_model))


def test_make_elbo_picks_the_flat_path_when_it_can():
    model = pyrobdl.BayesianMLP(2, (3,), 1)
    assert isinstance(make_elbo(model, MeanField(model)), FlatELBO)
    assert isinstance(make_elbo(model, MeanField(model), elbo="distributions"), DirectELBO)
    assert isinstance(make_elbo(model, MeanField(model, local_reparameterization=True)), FlatELBO)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["mean_field", "map"])
def test_fit_through_the_flat_path_matches_the_distribution_path(method, device):
    """Both paths optimise the same objective: on Bayesian linear regression (known noise) the
    trained means agree with the exact posterior mean (MAP: the exact mode) and with each other."""
    torch.manual_seed(0)
    x = torch.randn(100, 2)
    y = x @ torch.tensor([1.5, -0.7]) + 0.2 + 0.5 * torch.randn(100)
    model = pyrobdl.BayesianMLP(2, (), 1, prior=pyrobdl.priors.Gaussian(1.0), likelihood=pyrobdl.likelihoods.Gaussian(4.0))
    x1 = torch.cat([x, torch.ones(100, 1)], 1).double()
    prec = 4.0 * x1.T @ x1 + torch.eye(3)
    exact = torch.linalg.solve(prec, 4.0 * x1.T @ y.double())
    fits = {}
    for elbo in ["direct", "distributions"]:
        post = pyrobdl.fit(model, x, y, method, num_steps=3000, lr=2e-2, elbo=elbo, progress=False, device=device)
        g = post.guide
        fits[elbo] = torch.cat([g.layers_0_weight_loc_unconstrained.reshape(-1), g.layers_0_bias_loc_unconstrained]).detach().cpu().double()
    # posterior sd is ~0.05: Adam noise and Polyak averaging leave the means within 0.01
    for elbo, m in fits.items():
        assert torch.allclose(m, exact, atol=0.01), (elbo, m, exact)


@pytest.mark.parametrize("kernel", ["fused", "five operations"])
def test_packed_adam_equals_torch_adam(float64, kernel):
    from pyrobdl.inference.svi import PackedAdam

    g = torch.Generator().manual_seed(0)
    a = torch.randn(37, generator=g)
    b = a.clone()
    ours, theirs = PackedAdam([a], lr=0.05), torch.optim.Adam([b], lr=0.05)
    if kernel == "fused":
        assert ours._step is not None  # torch >= 2.4 has the CPU kernel (pyproject's range allows older)
    else:
        ours._step = None
    for step in range(200):
        grad = torch.randn(37, generator=g) * (1 + step % 7) + a.detach()
        a.grad, b.grad = grad.clone(), grad.clone()
        lr = 0.05 * (1 - step / 400)  # a changing learning rate, as the loop's schedules do
        ours.param_groups[0]["lr"] = theirs.param_groups[0]["lr"] = lr
        ours.step()
        theirs.step()
    assert float((a - b).abs().max() / b.abs().max()) < TOL64


def test_packed_adam_fused_equals_five_operations_when_a_tensor_has_no_gradient(float64):
    """Steps where a tensor has no gradient take the five-operation path; the bias corrections
    count every step either way, so the two kernels stay equal step by step."""
    from pyrobdl.inference.svi import PackedAdam

    g = torch.Generator().manual_seed(1)
    start = [torch.randn(5, generator=g), torch.randn(3, 2, generator=g)]
    fused_params, plain_params = [t.clone() for t in start], [t.clone() for t in start]
    fused, plain = PackedAdam(fused_params, lr=0.05), PackedAdam(plain_params, lr=0.05)
    plain._step = None
    for step in range(30):
        grads = [torch.randn(t.shape, generator=g) for t in start]
        for params in (fused_params, plain_params):
            for p, grad in zip(params, grads):
                p.grad = None if (step % 4 == 1 and p.dim() == 2) else grad.clone()
        fused.step()
        plain.step()
        for f, q in zip(fused_params, plain_params):
            assert float((f - q).abs().max()) < TOL64
    assert fused.t == plain.t == 30 and float(fused._step) == 30
    assert all(float((f - s).abs().max()) > 0.1 for f, s in zip(fused_params, start))


def test_forward_is_differentiable_like_the_other_losses(float64):
    """``loss_fn(x, y).backward()`` (what generic code does with make_elbo's losses) gives the
    per-site parameters the same gradient loss_and_grad puts on the packed vector."""
    pyro.set_rng_seed(4)
    model = make_model("scalar", "learned-1", (5,), "relu")
    x, y = make_data(model)
    guide = MeanField(model, init_scale=0.2)
    fast = FlatELBO(model, guide)
    pyro.set_rng_seed(5)
    loss = fast(x, y)
    loss.backward()
    pyro.set_rng_seed(5)
    value = fast.loss_and_grad(x, y)
    assert float(loss.detach()) == float(value)
    (vector,) = fast.parameters_to_optimize()
    per_site = torch.cat([p.grad.reshape(-1) for p in [guide._parameters[n + "_unconstrained"] for n in guide._packs["params"]]])
    assert torch.equal(per_site, vector.grad)


# ------------------------------------------------------------------------------- threads
def test_threads_option_is_used_recorded_and_restored():
    from pyrobdl.inference.registry import resolve_threads

    model = pyrobdl.BayesianMLP(2, (3,), 1)
    x, y = torch.randn(20, 2), torch.randn(20)
    before = torch.get_num_threads()
    post = pyrobdl.fit(model, x, y, num_steps=3, progress=False)  # default "auto": small -> 1
    assert post.settings["threads"] == 1
    assert torch.get_num_threads() == before
    post = pyrobdl.fit(model, x, y, num_steps=3, progress=False, threads=2)
    assert post.settings["threads"] == 2 and torch.get_num_threads() == before
    big = pyrobdl.BayesianMLP(784, (400, 400), 10, likelihood=pyrobdl.likelihoods.Categorical())
    # large work: torch's setting capped by the cores the load average leaves idle, at least one
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("os.cpu_count", lambda: 8)
        mp.setattr(torch, "get_num_threads", lambda: 4)
        mp.setattr("os.getloadavg", lambda: (2.2, 0.0, 0.0))  # 8 - 3 = 5 idle: torch's 4
        assert resolve_threads("auto", big, 128) == 4
        mp.setattr("os.getloadavg", lambda: (5.5, 0.0, 0.0))  # 8 - 6 = 2 idle
        assert resolve_threads("auto", big, 128) == 2
        mp.setattr("os.getloadavg", lambda: (11.0, 0.0, 0.0))  # none idle: still one
        assert resolve_threads("auto", big, 128) == 1
    assert resolve_threads("auto", model, 10**6) == 1  # 9e6 multiply-adds: still small
    assert resolve_threads(None, model, 10) is None
    for bad in (0, -1, 1.5, True, "many"):
        with pytest.raises(ValueError, match="threads must be"):
            pyrobdl.fit(model, x, y, num_steps=3, progress=False, threads=bad)
