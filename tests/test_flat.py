"""The flat batched log joint (pyrobdl.flat): equal to Pyro's potential, value and gradient, for
every supported prior, likelihood, activation and architecture; the hand-written gradient equal
to its autograd twin (minibatches, chunks); the layout; refusals; prior draws; dtypes; devices."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from conftest import DEVICES, leapfrog_inputs, leapfrog_steps, needs_cxx
from pyro.infer.autoguide.initialization import init_to_sample
from pyro.infer.mcmc.util import initialize_model

import pyrobdl
from pyrobdl.flat import FlatLayout, FlatLogJoint, auto_chunk_size
from pyrobdl.flat import kernel as flat_kernel_module
from pyrobdl.likelihoods import Categorical, GaussianLearnedPrecision
from pyrobdl.likelihoods import Gaussian as GaussianLik
from pyrobdl.priors import Gaussian as GaussianPrior

# Two float64 evaluations of one function written two ways (different summation orders, the
# sigmoid form of tanh in the fast path) agree to a few hundred ulps (2.2e-16 each): 1e-10 leaves
# a wide margin yet catches any wrong term (a missing constant or factor is O(1)).
TOL64 = 1e-10
# Monte Carlo tolerance of the prior-draw tests: Z standard errors, as in tests/test_mcmc.py.
Z = 4.0
NUM_DATA = 12


@pytest.fixture
def float64():
    """Default dtype float64 for the test (the model's prior distributions take the default dtype)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / max(|b|, 1), elementwise maximum."""
    return float(((a - b).abs() / b.abs().clamp_min(1.0)).max())


def grad_err(ga: torch.Tensor, gb: torch.Tensor) -> float:
    """max |ga - gb| / max |gb|."""
    return float((ga - gb).abs().max() / gb.abs().max())


# ------------------------------------------------------------------------------- the cases
PRIORS = {
    "scalar": lambda layers: GaussianPrior(0.7),
    # one scale per layer (the last scale large, so the outputs are not tiny), and a bias scale
    "per_layer": lambda layers: GaussianPrior([1.3, 0.6, 2.0][:layers], bias_scale=0.4),
    "fan_in": lambda layers: GaussianPrior("fan_in", gain=1.5),
}
LIKELIHOODS = {
    "gaussian-1": (lambda: GaussianLik(4.0), 1),
    "gaussian-2": (lambda: GaussianLik(4.0), 2),
    "learned-1": (lambda: GaussianLearnedPrecision(3.0, 2.0), 1),
    "learned-2": (lambda: GaussianLearnedPrecision(3.0, 2.0), 2),
    "categorical-3": (lambda: Categorical(), 3),
}
# the activation only matters with a hidden layer
ARCHITECTURES = [((), "relu"), ((5,), "relu"), ((5,), "tanh"), ((4, 3), "relu"), ((4, 3), "tanh")]


def make_model(prior: str, likelihood: str, hidden: tuple[int, ...], activation: str, in_features: int = 3):
    lik, out = LIKELIHOODS[likelihood]
    return pyrobdl.BayesianMLP(in_features, hidden, out, activation=activation,
                               prior=PRIORS[prior](len(hidden) + 1), likelihood=lik())


def make_data(model, n: int = NUM_DATA, seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, model.in_features, generator=g, dtype=dtype)
    if model.likelihood.task == "classification":
        y = torch.randint(model.out_features, (n,), generator=g)
    elif model.out_features == 1:
        y = torch.randn(n, generator=g, dtype=dtype)  # [N]: the likelihood makes it [N, 1]
    else:
        y = torch.randn(n, model.out_features, generator=g, dtype=dtype)
    return x, y


def pyro_value_and_grad(potential_fn, layout: FlatLayout, theta_row: torch.Tensor):
    """-U(z) and its autograd gradient, concatenated in layout order, for one flat row."""
    z = {k: v.detach().clone().requires_grad_(True) for k, v in layout.unpack(theta_row, constrained=False).items()}
    assert list(z) == [s.name for s in layout.sites]
    value = -potential_fn(z)
    grads = torch.autograd.grad(value, list(z.values()))
    return value.detach(), torch.cat([g.reshape(-1) for g in grads])


# ----------------------------------------------------------------- 1. equal to Pyro's potential
@pytest.mark.parametrize("hidden, activation", ARCHITECTURES, ids=lambda v: str(v))
@pytest.mark.parametrize("likelihood", list(LIKELIHOODS))
@pytest.mark.parametrize("prior", list(PRIORS))
def test_equals_pyros_potential(float64, flat_kernel, prior, likelihood, hidden, activation):
    model = make_model(prior, likelihood, hidden, activation)
    x, y = make_data(model)
    lj = FlatLogJoint(model, x, y)
    _, potential_fn, transforms, _ = initialize_model(model, (x, y), init_strategy=init_to_sample)
    assert list(transforms) == [s.name for s in lj.layout.sites]
    if isinstance(model.likelihood, GaussianLearnedPrecision):
        # Pyro's unconstrained coordinate of the precision is log(tau) as well (Gamma's support is
        # nonnegative; its bijection is exp then the identity affine map), with log|J| = u
        u = torch.tensor([-1.3, 0.0, 0.4, 2.5])
        t = transforms["precision"]  # constrained -> unconstrained
        torch.testing.assert_close(t.inv(u), u.exp(), rtol=1e-15, atol=0)
        torch.testing.assert_close(t(u.exp()), u, rtol=1e-15, atol=1e-15)
        torch.testing.assert_close(t.inv.log_abs_det_jacobian(u, u.exp()), u, rtol=1e-15, atol=1e-15)
    theta = lj.sample_prior(3, generator=torch.Generator().manual_seed(1))
    assert theta.dtype == torch.float64
    value, grad = lj.value_and_grad(theta)
    for row in range(theta.shape[0]):
        v_ref, g_ref = pyro_value_and_grad(potential_fn, lj.layout, theta[row])
        assert rel_err(value[row], v_ref) < TOL64, (value[row], v_ref)
        assert grad_err(grad[row], g_ref) < TOL64


@pytest.mark.parametrize("hidden, activation", ARCHITECTURES, ids=lambda v: str(v))
@pytest.mark.parametrize("likelihood", ["gaussian-2", "learned-1", "categorical-3"])
def test_without_biases_equals_pyros_potential(float64, flat_kernel, likelihood, hidden, activation):
    """``BayesianMLP(bias=False)`` (NumPyro's BNN example has no biases): no bias sites in the
    layout, and value and gradient are still Pyro's potential and its autograd gradient."""
    lik, out = LIKELIHOODS[likelihood]
    model = pyrobdl.BayesianMLP(3, hidden, out, activation=activation, prior=PRIORS["per_layer"](len(hidden) + 1),
                                likelihood=lik(), bias=False)
    x, y = make_data(model)
    lj = FlatLogJoint(model, x, y)
    _, potential_fn, transforms, _ = initialize_model(model, (x, y), init_strategy=init_to_sample)
    assert list(transforms) == [s.name for s in lj.layout.sites]
    assert not any(s.name.endswith(".bias") for s in lj.layout.sites)
    theta = lj.sample_prior(3, generator=torch.Generator().manual_seed(1))
    value, grad = lj.value_and_grad(theta)
    v_twin, g_twin = lj.log_prob_grad_autograd(theta)
    assert rel_err(value, v_twin) < TOL64
    for row in range(theta.shape[0]):
        v_ref, g_ref = pyro_value_and_grad(potential_fn, lj.layout, theta[row])
        assert rel_err(value[row], v_ref) < TOL64, (value[row], v_ref)
        assert grad_err(grad[row], g_ref) < TOL64
        assert grad_err(g_twin[row], g_ref) < TOL64


def test_minibatch_equals_pyros_subsampled_potential(float64, flat_kernel):
    """With indices ``idx`` the value is Pyro's potential under ``plate("data", subsample=idx)``."""
    model = make_model("per_layer", "learned-2", (4, 3), "tanh")
    x, y = make_data(model, n=10)
    idx = torch.tensor([7, 2, 2, 9])  # B = 4 of N = 10 (scale 2.5), a repeated index included
    lj = FlatLogJoint(model, x, y)
    _, potential_fn, _, _ = initialize_model(model, (x, y, idx), init_strategy=init_to_sample)
    theta = lj.sample_prior(2, generator=torch.Generator().manual_seed(3))
    value, grad = lj.value_and_grad(theta, idx)
    for row in range(2):
        v_ref, g_ref = pyro_value_and_grad(potential_fn, lj.layout, theta[row])
        assert rel_err(value[row], v_ref) < TOL64
        assert grad_err(grad[row], g_ref) < TOL64


def assert_same_calls(fast, ref, theta, idxs) -> None:
    """``fast(theta, idx)`` and ``ref(theta, idx)`` give the same log joint and, row by row, the
    same gradient to float64 rounding, for every ``idx`` (None: the full data)."""
    for idx in idxs:
        value, grad = fast(theta, idx)
        v_ref, g_ref = ref(theta, idx)
        assert rel_err(value, v_ref) < TOL64
        for row in range(theta.shape[0]):
            assert grad_err(grad[row], g_ref[row]) < TOL64


# ------------------------------------------------------------------ 2. the autograd twin
@pytest.mark.parametrize("hidden, activation", ARCHITECTURES, ids=lambda v: str(v))
@pytest.mark.parametrize("likelihood", ["gaussian-2", "learned-1", "categorical-3"])
def test_gradient_equals_autograd_twin(float64, flat_kernel, likelihood, hidden, activation):
    model = make_model("per_layer", likelihood, hidden, activation)
    x, y = make_data(model, n=10)
    lj = FlatLogJoint(model, x, y)
    theta = lj.sample_prior(5, generator=torch.Generator().manual_seed(2))
    full_value = lj.value_and_grad(theta)[0]
    # idx: B = 3 of N = 10, a non-integer scale 10/3; None: the full data
    assert_same_calls(lj.value_and_grad, lj.log_prob_grad_autograd, theta, (None, torch.tensor([4, 0, 8])))
    # one unbatched vector [P] gives the outputs without the leading dim
    v1, g1 = lj.value_and_grad(theta[2])
    assert v1.shape == () and g1.shape == (lj.size,)
    assert rel_err(v1, full_value[2]) < TOL64


@pytest.mark.parametrize("hidden, activation", ARCHITECTURES, ids=lambda v: str(v))
@pytest.mark.parametrize("likelihood", ["gaussian-2", "learned-1", "categorical-3"])
def test_forward_only_log_likelihood_equals_the_autograd_twins(float64, flat_kernel, likelihood, hidden, activation):
    """log_likelihood (the score-function path's forward pass) is the twin's scaled likelihood,
    log_joint(prior=False), for the full data, one minibatch and a minibatch per row."""
    model = make_model("per_layer", likelihood, hidden, activation)
    x, y = make_data(model, n=10)
    lj = FlatLogJoint(model, x, y)
    theta = lj.sample_prior(4, generator=torch.Generator().manual_seed(7))
    per_row = torch.stack([torch.randperm(10, generator=torch.Generator().manual_seed(r))[:3] for r in range(4)])
    for idx in (None, torch.tensor([4, 0, 8]), per_row):
        assert rel_err(lj.log_likelihood(theta, idx), lj.log_joint(theta, idx, prior=False)) < TOL64
    with pytest.raises(ValueError, match="idx must have shape"):
        lj.log_likelihood(theta, per_row[:2])


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("likelihood", ["gaussian-1", "learned-1"])
def test_relu_output_gradient_from_layer_zeros_product_equals_its_own_product(float64, likelihood, bias):
    """relu into one output unit (the UCI models): the output weight's gradient is taken from the
    product layer 0's gradient computes (relu(a) = a 1[a > 0]); it equals the direct product
    g^T relu(a0), for the full data, one minibatch and a minibatch per row, biases or none."""
    lik, out = LIKELIHOODS[likelihood]
    model = pyrobdl.BayesianMLP(3, (6,), out, activation="relu", likelihood=lik(), bias=bias)
    x, y = make_data(model, n=11)
    folded, direct = FlatLogJoint(model, x, y), FlatLogJoint(model, x, y)
    direct._fold_output_grad = False
    assert folded._fold_output_grad
    theta = folded.sample_prior(4, generator=torch.Generator().manual_seed(3))
    per_row = torch.stack([torch.randperm(11, generator=torch.Generator().manual_seed(r))[:5] for r in range(4)])
    assert_same_calls(folded.value_and_grad, direct.value_and_grad, theta, (None, torch.tensor([7, 1, 4]), per_row))
    assert_same_calls(folded.value_and_grad, folded.log_prob_grad_autograd, theta, (None, torch.tensor([7, 1, 4])))


@pytest.mark.parametrize("hidden", [(5,), (4, 3)], ids=str)
@pytest.mark.parametrize("likelihood", ["gaussian-1", "gaussian-2", "learned-1", "categorical-3"])
def test_tanh_through_sigmoid_equals_tanh(float64, likelihood, hidden):
    """The eager kernel's two forms of a tanh layer (tanh stored, or sigmoid(2a) with the affine map
    folded into the next layer: ``FlatLogJoint._sigmoid_tanh``, chosen per machine) give the autograd
    twin's log joint and gradient to float64 rounding, full data, one minibatch and a minibatch per row,
    the gradient without the value is the same gradient, and the forward-only log-likelihood the twin's."""
    model = make_model("per_layer", likelihood, hidden, "tanh")
    x, y = make_data(model, n=11)
    direct, folded = FlatLogJoint(model, x, y), FlatLogJoint(model, x, y)
    direct._sigmoid_tanh, folded._sigmoid_tanh = False, True
    direct.numpy_kernel = folded.numpy_kernel = False
    theta = folded.sample_prior(4, generator=torch.Generator().manual_seed(3))
    per_row = torch.stack([torch.randperm(11, generator=torch.Generator().manual_seed(r))[:5] for r in range(4)])
    for lj in (direct, folded):
        assert_same_calls(lj.value_and_grad, lj.log_prob_grad_autograd, theta, (None, torch.tensor([7, 1, 4]), per_row))
        _, grad = lj.value_and_grad(theta)
        assert torch.equal(lj.value_and_grad(theta, value=False)[1], grad)
        for idx in (None, per_row):
            assert rel_err(lj.log_likelihood(theta, idx), lj.log_joint(theta, idx, prior=False)) < TOL64


@pytest.mark.parametrize("vendor, mkl, cpu_fold", [("GenuineIntel", True, False), ("GenuineIntel", False, True),
                                                   ("AuthenticAMD", True, True), ("", True, True)])
def test_tanh_through_sigmoid_is_chosen_per_machine(monkeypatch, vendor, mkl, cpu_fold):
    """ATen's CPU tanh is MKL's VML: the eager kernel keeps it only on an Intel CPU with MKL (where it
    measured faster than ATen's sigmoid); elsewhere on the CPU the fold; on CUDA unchanged (tanh).
    The choice is made when the log joint is built, from the machine alone (no timing)."""
    monkeypatch.setattr(flat_kernel_module, "_cpu_vendor", lambda: vendor)
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: mkl)
    assert flat_kernel_module.tanh_through_sigmoid(torch.device("cpu")) is cpu_fold
    assert flat_kernel_module.tanh_through_sigmoid(torch.device("cuda")) is False
    model = make_model("scalar", "gaussian-1", (5,), "tanh")
    assert FlatLogJoint(model, *make_data(model))._sigmoid_tanh is cpu_fold


def test_cpu_vendor_is_read_from_the_machine():
    flat_kernel_module._cpu_vendor.cache_clear()
    vendor = flat_kernel_module._cpu_vendor()
    assert isinstance(vendor, str)
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            text = fh.read()
    except OSError:
        pytest.skip("no /proc/cpuinfo on this machine")
    if "vendor_id" in text:
        assert vendor and vendor in text


def log_prior_by_hand(model, lj: FlatLogJoint, theta: torch.Tensor) -> torch.Tensor:
    """Log prior of each row in unconstrained space, from torch.distributions and the sites' scales."""
    values = lj.layout.unpack(theta, constrained=False)
    total = theta.new_zeros(theta.shape[0])
    for site in model.sites:
        s = model.prior.layer_scale(site)
        log_p = torch.distributions.Normal(0.0, s).log_prob(values[site.name])
        total = total + log_p.reshape(theta.shape[0], -1).sum(-1)
    if isinstance(model.likelihood, GaussianLearnedPrecision):
        u = values["precision"]
        lik = model.likelihood
        # Gamma density of tau = exp(u) plus the log-Jacobian log(dtau/du) = u
        total = total + torch.distributions.Gamma(lik.concentration, lik.rate).log_prob(u.exp()) + u
    return total


@pytest.mark.parametrize("likelihood", ["gaussian-1", "learned-2", "categorical-3"])
def test_minibatch_scales_the_likelihood_by_n_over_b(float64, flat_kernel, likelihood):
    """N = 12, B = 4: the likelihood of the minibatch counts N/B = 3 times, exactly as the full
    log joint of a dataset made of the minibatch repeated three times."""
    model = make_model("scalar", likelihood, (5,), "tanh")
    x, y = make_data(model, n=12)
    idx = torch.tensor([3, 11, 0, 6])
    lj = FlatLogJoint(model, x, y)
    repeated = FlatLogJoint(model, x[idx].repeat(3, 1), y[idx].repeat(3, *([1] * (y.dim() - 1))))
    subset = FlatLogJoint(model, x[idx], y[idx])
    theta = lj.sample_prior(4, generator=torch.Generator().manual_seed(5))
    value, grad = lj.value_and_grad(theta, idx)
    v_rep, g_rep = repeated.value_and_grad(theta)
    assert rel_err(value, v_rep) < TOL64
    for row in range(4):
        assert grad_err(grad[row], g_rep[row]) < TOL64
    # by hand: prior + (N / B) * (log joint of the subset - prior)
    prior = log_prior_by_hand(model, lj, theta)
    by_hand = prior + 3.0 * (subset.value_and_grad(theta)[0] - prior)
    assert rel_err(value, by_hand) < TOL64
    # and the scale is not 1: the minibatch value differs from the subset's own log joint
    assert (value - subset.value_and_grad(theta)[0]).abs().min() > 1e-3


@pytest.mark.parametrize("chunk_size", [1, 3, "auto"])
def test_chunks_equal_one_call(float64, chunk_size):
    model = make_model("per_layer", "learned-2", (4, 3), "tanh")
    x, y = make_data(model)
    whole = FlatLogJoint(model, x, y)
    chunked = FlatLogJoint(model, x, y, chunk_size=chunk_size)
    theta = whole.sample_prior(7, generator=torch.Generator().manual_seed(4))  # 7 rows: 3 does not divide it
    value, grad = whole.value_and_grad(theta)
    # each row goes through the same operations whatever the batch it is in; only the blocking
    # of the batched matrix products may differ, so equal to float64 rounding
    assert_same_calls(chunked.value_and_grad, whole.value_and_grad, theta, (None, torch.tensor([1, 5, 9])))
    if chunk_size == "auto":
        # CPU: rows x N x widest layer near 16 MiB, a power of two (N = 12, width 4, float64: 32768)
        assert chunked.chunk_size == auto_chunk_size(NUM_DATA, 4, 8) == 32768  # float64
    else:
        assert chunked.chunk_size == chunk_size
    assert value.shape == (7,) and grad.shape == (7, whole.size)


@pytest.mark.parametrize("likelihood", ["gaussian-1", "gaussian-2", "learned-2", "categorical-3"])
@pytest.mark.parametrize("chunk_size", [None, 3])
def test_gradient_without_the_value_is_the_same_gradient(likelihood, chunk_size):
    # value=False (chees's inner leapfrog steps): the torch kernel skips the fixed-precision Gaussian's
    # value sums and returns None for it; the gradient's bits are unchanged, and the other likelihoods
    # (whose value is part of the gradient's computation) still return the value
    model = make_model("per_layer", likelihood, (4, 3), "tanh")
    x, y = make_data(model)
    lj = FlatLogJoint(model, x, y, chunk_size=chunk_size)
    lj.numpy_kernel = False  # the torch kernel: the one that skips
    theta = lj.sample_prior(7, generator=torch.Generator().manual_seed(4))
    for idx in (None, torch.tensor([1, 5, 9])):
        for prior in (True, False):
            value, grad = lj.value_and_grad(theta, idx, prior=prior)
            skipped, same = lj.value_and_grad(theta, idx, prior=prior, value=False)
            assert torch.equal(same, grad)
            if likelihood.startswith("gaussian"):
                assert skipped is None
            else:
                assert torch.equal(skipped, value)
    v1, g1 = lj.value_and_grad(theta[0], value=False)
    assert torch.equal(g1, lj.value_and_grad(theta[0])[1]) and (v1 is None) == likelihood.startswith("gaussian")


@needs_cxx
@pytest.mark.parametrize("case", [("per_layer", "learned-2", (4, 3), "tanh"), ("scalar", "categorical-3", (5,), "relu")],
                         ids=["tanh-learned", "relu-categorical"])
def test_compiled_equals_eager(float64, case):
    """FlatLogJoint.compile: the compiled kernel (every chunk shape compiled up front) gives the
    eager value and gradient to float64 rounding; calls it does not cover (minibatches) stay eager."""
    model = make_model(*case)
    x, y = make_data(model)
    eager = FlatLogJoint(model, x, y, chunk_size=3)
    compiled = FlatLogJoint(model, x, y, chunk_size=3)
    seconds = compiled.compile(7)  # chunks of 3, 3 and 1
    assert seconds > 0 and compiled._compiled is not None
    theta = eager.sample_prior(7, generator=torch.Generator().manual_seed(5))
    assert_same_calls(compiled.value_and_grad, eager.value_and_grad, theta, (None, torch.tensor([1, 5, 9])))


@needs_cxx
def test_compiled_leapfrog_block_equals_the_steps_one_by_one(float64):
    """FlatLogJoint.leapfrog (compile(..., leapfrog_block=3)): three leapfrog steps of every row in one
    compiled call, each row with its own step and final coefficient, chunked, equal to the same steps
    through the eager kernel to float64 rounding; its inputs are not written; compiled graphs: the
    kernel and the block.  A block of 1 or a non-integer is refused; leapfrog before compile says so."""
    import torch._dynamo.utils as dynamo_utils

    model = make_model("per_layer", "learned-2", (4, 3), "tanh")
    x, y = make_data(model)
    eager = FlatLogJoint(model, x, y, chunk_size=3)
    compiled = FlatLogJoint(model, x, y, chunk_size=3)
    with pytest.raises(RuntimeError, match=r"needs compile\(batch_size, leapfrog_block=m\) first"):
        compiled.leapfrog(*[torch.zeros(7, compiled.size)] * 3, *[torch.zeros(7, 1)] * 2)
    for bad in (1, -2, 2.0, True):
        with pytest.raises(ValueError, match="leapfrog_block must be 0 \\(none\\) or an integer >= 2"):
            compiled.compile(7, leapfrog_block=bad)
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    compiled.compile(7, leapfrog_block=3)  # chunks of 3, 3 and 1
    assert compiled.leapfrog_block == 3 and eager.leapfrog_block == 0
    theta, p, scaled, step, last = leapfrog_inputs(eager, 7)
    inputs = [t.clone() for t in (theta, p, scaled, step, last)]
    t_ref, p_ref, v_ref, g_ref = leapfrog_steps(eager.value_and_grad, theta, p, scaled, step, last, 3)
    out = compiled.leapfrog(theta, p, scaled, step, last)
    for got, want in zip(out, (t_ref, p_ref, v_ref, g_ref)):
        assert rel_err(got, want) < TOL64
    assert all(torch.equal(a, b) for a, b in zip(inputs, (theta, p, scaled, step, last)))
    # ``last`` the same tensor as ``step`` (a block that is not a trajectory's last): no second graph
    out = compiled.leapfrog(theta, p, scaled, step, step)
    assert rel_err(out[1], p_ref + (step - last) * g_ref) < TOL64
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 2 * 2  # kernel and block at 3 rows and at 1


def test_compile_failure_names_the_fix(monkeypatch):
    model = make_model("scalar", "gaussian-1", (5,), "relu")
    x, y = make_data(model)
    lj = FlatLogJoint(model, x, y)

    def broken(fn, **kwargs):
        def run(*a):
            raise OSError("no C++ compiler")
        return run

    monkeypatch.setattr(torch, "compile", broken)
    with pytest.raises(RuntimeError, match=r"torch.compile of the flat log joint failed.*no C\+\+ compiler.*compile=False"):
        lj.compile(4)
    assert lj._compiled is None  # still usable, eagerly
    lj.value_and_grad(lj.sample_prior(2))


def test_compile_survives_inductors_tf32_advice_under_warnings_as_errors(monkeypatch):
    """On an H200, Inductor warns (UserWarning) that TF32 matmuls are available but not enabled;
    under pytest's ``filterwarnings = error`` that warning became an InductorError and compile
    failed.  A compiler that emits it must compile; any other warning still reaches the caller's
    filter (here: an error)."""
    model = make_model("scalar", "gaussian-1", (5,), "relu")
    x, y = make_data(model)

    def advising(message):
        def fake_compile(fn, **kwargs):
            def run(*a):
                warnings.warn(message, UserWarning)
                return fn(*a)
            return run
        return fake_compile

    tf32 = ("TensorFloat32 tensor cores for float32 matrix multiplication available but not enabled. "
            "Consider setting `torch.set_float32_matmul_precision('high')` for better performance.")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        monkeypatch.setattr(torch, "compile", advising(tf32))
        lj = FlatLogJoint(model, x, y)
        assert lj.compile(4) > 0 and lj._compiled is not None
        monkeypatch.setattr(torch, "compile", advising("something else"))
        with pytest.raises(RuntimeError, match="torch.compile of the flat log joint failed.*something else"):
            FlatLogJoint(model, x, y).compile(4)


def test_every_compiled_shape_is_compiled_past_dynamos_recompile_limit(monkeypatch):
    """Dynamo compiles a code object at most 8 times (``recompile_limit``) and then runs it
    eagerly: with one lambda for every log joint, a process that compiled 9 or more shapes ran the
    later ones uncompiled while reporting them compiled.  Every shape must reach the compiler, and
    log joints of one shape must share one compilation.  (Dynamo with a counting backend, no
    Inductor, so this takes a second.)"""
    compiled_graphs = []

    def counting(gm, example_inputs):
        compiled_graphs.append(gm)
        return gm.forward

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, backend=counting, **kw))
    torch._dynamo.reset()
    model = make_model("scalar", "learned-1", (5,), "relu")
    shapes = [10 + i for i in range(12)]  # > torch._dynamo.config.recompile_limit (8)
    assert len(shapes) > getattr(torch._dynamo.config, "recompile_limit", 8)
    for n in shapes + shapes[:2]:  # the last two repeat a shape: nothing new to compile
        x, y = make_data(model, n=n, dtype=torch.float32)
        lj = FlatLogJoint(model, x, y)
        lj.compile(4, kernel="inductor")  # "auto" would take the fused kernel for this model (test_flat_fused.py)
        theta = lj.sample_prior(4, generator=torch.Generator().manual_seed(n))
        value, grad = lj.value_and_grad(theta)
        v_ref, g_ref = FlatLogJoint(model, x, y).value_and_grad(theta)
        torch.testing.assert_close(value, v_ref)
        torch.testing.assert_close(grad, g_ref)
    assert len(compiled_graphs) == len(shapes)


def test_auto_chunk_size_is_the_documented_power_of_two():
    # activations [N, rows, width] near 16 MiB, the power of two nearest in log scale
    assert auto_chunk_size(500, 50) == 128  # 2**24 / (500 * 50 * 4) = 167.8 -> log2 7.39 -> 2**7
    assert auto_chunk_size(1439, 50) == 64  # wine's training split: 58.3 -> 2**6 (18.4 MB)
    assert auto_chunk_size(7373, 50) == 16  # kin8nm's: 11.4 -> log2 3.51 -> 2**4 (23.6 MB)
    assert auto_chunk_size(500, 50, 8) == 64  # float64: half the rows
    assert auto_chunk_size(10**6, 100) == 1  # never below one row
    # never a block above glibc's 32 MB heap ceiling, for any N and width (float32 and float64)
    for n in (1, 80, 277, 500, 927, 1439, 4000, 7373, 8611, 40000):
        for width in (1, 10, 50, 100, 1000):
            for itemsize in (4, 8):
                rows = auto_chunk_size(n, width, itemsize)
                assert rows == 1 or rows * n * width * itemsize <= 2**0.5 * 2**24


# ----------------------------------------------------------------------------- 3. the layout
def test_layout_order_sizes_and_round_trip(float64):
    model = pyrobdl.BayesianMLP(3, (4, 2), 2, activation="tanh", likelihood=GaussianLearnedPrecision())
    layout = FlatLayout(model)
    expected = [("layers.0.weight", (4, 3)), ("layers.0.bias", (4,)), ("layers.1.weight", (2, 4)),
                ("layers.1.bias", (2,)), ("layers.2.weight", (2, 2)), ("layers.2.bias", (2,)), ("precision", ())]
    assert [(s.name, s.shape) for s in layout.sites] == expected
    sizes = [12, 4, 8, 2, 4, 2, 1]
    assert [s.size for s in layout.sites] == sizes and layout.size == sum(sizes) == 33
    starts = [0, 12, 16, 24, 26, 30, 32]
    assert [s.start for s in layout.sites] == starts  # contiguous, in order
    assert [s.transform for s in layout.sites] == ["identity"] * 6 + ["exp"]
    assert layout["precision"] is layout.sites[-1]
    theta = torch.randn(2, 5, layout.size, generator=torch.Generator().manual_seed(0))
    values = layout.unpack(theta)
    for (name, shape), s in zip(expected, layout.sites):
        assert values[name].shape == (2, 5, *shape)
        flat = theta[..., s.start : s.stop]
        if s.transform == "identity":
            assert torch.equal(values[name].reshape(2, 5, -1), flat)  # row-major
    assert torch.equal(values["precision"], theta[..., 32].exp())  # the positive site is exp-mapped
    assert torch.equal(layout.unpack(theta, constrained=False)["precision"], theta[..., 32])
    assert torch.equal(values["layers.0.weight"][1, 3, 2], theta[1, 3, 6:9])  # row 2 of [4, 3]: entries 6..8
    back = layout.pack(values)
    assert back.shape == theta.shape
    assert torch.equal(back[..., :32], theta[..., :32])
    torch.testing.assert_close(back, theta, rtol=0, atol=1e-15)  # log(exp(u)): rounding only
    # no batch dims
    single = layout.pack(layout.unpack(theta[0, 0]))
    torch.testing.assert_close(single, theta[0, 0], rtol=0, atol=1e-15)
    with pytest.raises(KeyError, match="precision"):
        layout.pack({k: v for k, v in values.items() if k != "precision"})


def test_layout_without_likelihood_latents():
    model = pyrobdl.BayesianMLP(2, (), 3, likelihood=Categorical())
    layout = FlatLayout(model)
    assert [s.name for s in layout.sites] == ["layers.0.weight", "layers.0.bias"]
    assert layout.size == 9 and all(s.transform == "identity" for s in layout.sites)


# -------------------------------------------------------------------------- 4. refusals
@pytest.fixture
def no_layout(monkeypatch):
    """Fail the test if FlatLogJoint gets as far as building its layout (the first real work)."""
    import pyrobdl.flat.logjoint as flat  # where FlatLogJoint looks FlatLayout up

    monkeypatch.setattr(flat, "FlatLayout", lambda *a, **k: pytest.fail("work started before the refusal"))


def test_improper_prior_is_refused(no_layout):
    model = pyrobdl.BayesianMLP(2, (3,), 1, prior=pyrobdl.priors.LogUniform())
    x, y = torch.randn(5, 2), torch.randn(5)
    with pytest.raises(ValueError, match="improper"):
        FlatLogJoint(model, x, y)


class ScaledPrior(GaussianPrior):
    """A Gaussian prior subclass the fast path does not know (it might change the density)."""


class StudentTLikelihood(GaussianLik):
    """A Gaussian-likelihood subclass the fast path does not know."""


@pytest.mark.parametrize("prior, likelihood, name", [
    (ScaledPrior(1.0), GaussianLik(), "ScaledPrior"),
    (GaussianPrior(1.0), StudentTLikelihood(), "StudentTLikelihood"),
])
def test_unsupported_subclasses_are_refused_by_name(no_layout, prior, likelihood, name):
    model = pyrobdl.BayesianMLP(2, (3,), 1, prior=prior, likelihood=likelihood)
    with pytest.raises(TypeError, match=name):
        FlatLogJoint(model, torch.randn(5, 2), torch.randn(5))


@pytest.mark.parametrize("chunk_size", [0, -1, True, "x", 2.0])
def test_bad_chunk_size_is_refused(no_layout, chunk_size):
    model = pyrobdl.BayesianMLP(2, (3,), 1)
    with pytest.raises(ValueError, match="chunk_size"):
        FlatLogJoint(model, torch.randn(5, 2), torch.randn(5), chunk_size=chunk_size)


def test_bad_theta_shape_is_refused():
    model = pyrobdl.BayesianMLP(2, (3,), 1)
    lj = FlatLogJoint(model, torch.randn(5, 2), torch.randn(5))
    with pytest.raises(ValueError, match=r"theta must have shape \[K, 13\]"):
        lj.value_and_grad(torch.zeros(4, 12))
    with pytest.raises(ValueError, match=r"theta must have shape"):
        lj.value_and_grad(torch.zeros(2, 4, 13))


# ------------------------------------------------------------------------ 5. prior draws
def test_sample_prior_is_reproducible_from_a_generator():
    model = make_model("per_layer", "learned-1", (4,), "tanh")
    x, y = make_data(model, dtype=torch.float32)
    lj = FlatLogJoint(model, x, y)
    a = lj.sample_prior(6, generator=torch.Generator().manual_seed(11))
    b = lj.sample_prior(6, generator=torch.Generator().manual_seed(11))
    c = lj.sample_prior(6, generator=torch.Generator().manual_seed(12))
    assert a.shape == (6, lj.size) and a.dtype == torch.float32 and torch.isfinite(a).all()
    assert torch.equal(a, b)
    assert (a != c).all()  # continuous draws: no coordinate coincides
    # without a generator, torch's global RNG (seeded by conftest) is used
    torch.manual_seed(5)
    d = lj.sample_prior(6)
    torch.manual_seed(5)
    assert torch.equal(d, lj.sample_prior(6))


def test_sample_prior_moments():
    """4000 draws: each site's entries are N(0, s^2) with the prior's per-site scale, and
    exp(precision) is Gamma(a, b); means and variances within Z standard errors."""
    a, b = 3.0, 2.0
    model = pyrobdl.BayesianMLP(3, (4,), 1, activation="tanh", prior=GaussianPrior([1.3, 0.2], bias_scale=0.5),
                                likelihood=GaussianLearnedPrecision(a, b))
    x, y = make_data(model, dtype=torch.float64)
    lj = FlatLogJoint(model, x, y)
    n = 4000
    theta = lj.sample_prior(n, generator=torch.Generator().manual_seed(0))
    values = lj.layout.unpack(theta)
    scales = {"layers.0.weight": 1.3, "layers.0.bias": 0.5, "layers.1.weight": 0.2, "layers.1.bias": 0.5}
    for name, s in scales.items():
        v = values[name].reshape(n, -1)
        m = v.numel()  # i.i.d. N(0, s^2) entries
        assert abs(float(v.mean())) <= Z * s / math.sqrt(m), name
        # the sample variance of m normal draws has sd s^2 sqrt(2 / (m - 1))
        assert abs(float(v.var()) - s * s) <= Z * s * s * math.sqrt(2.0 / (m - 1)), name
        # every entry is drawn independently: entries of one draw are uncorrelated
        if v.shape[1] > 1:
            r = float(torch.corrcoef(v[:, :2].t())[0, 1])
            assert abs(r) <= Z / math.sqrt(n), name
    tau = values["precision"]
    assert tau.shape == (n,) and (tau > 0).all()
    mean, var = a / b, a / b**2
    assert abs(float(tau.mean()) - mean) <= Z * math.sqrt(var / n)
    # Var of the sample variance: (mu4 - sigma^4) / n, with the Gamma's mu4 = 3 (a^2 + 2 a) / b^4
    mu4 = 3 * (a * a + 2 * a) / b**4
    assert abs(float(tau.var()) - var) <= Z * math.sqrt((mu4 - var * var) / n)


# --------------------------------------------------------------------------------- 6. float32
@pytest.mark.parametrize("likelihood", ["gaussian-2", "learned-1", "categorical-3"])
def test_float32_matches_float64(likelihood, flat_kernel):
    """float32 evaluates the same function: relative errors below 1e-5.  Reason: float32 rounds at
    6e-8 (half of eps 1.2e-7); the value sums ~100 terms (prior over 33-45 weights, N * out
    likelihood terms) and each term passes a handful of rounded ops, so the worst-case linear
    accumulation is ~100 x 6e-8 ~ 6e-6 of the largest magnitude involved (measured: at most 1.6e-7
    for the value, 4.7e-7 for the gradient)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model64 = make_model("per_layer", likelihood, (4, 3), "tanh")
        x, y = make_data(model64)
        lj64 = FlatLogJoint(model64, x, y)
        theta = lj64.sample_prior(8, generator=torch.Generator().manual_seed(9))
    finally:
        torch.set_default_dtype(old)
    assert old == torch.float32
    model32 = make_model("per_layer", likelihood, (4, 3), "tanh")
    lj32 = FlatLogJoint(model32, x.float(), y if y.dtype == torch.long else y.float())
    v64, g64 = lj64.value_and_grad(theta)
    v32, g32 = lj32.value_and_grad(theta.float())
    assert v32.dtype == g32.dtype == torch.float32
    assert rel_err(v32.double(), v64) < 1e-5
    for row in range(8):
        assert grad_err(g32[row].double(), g64[row]) < 1e-5


# ------------------------------------------------------------------------------------ 7. CUDA
@pytest.mark.cuda
@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA device")
@pytest.mark.parametrize("likelihood", ["gaussian-2", "learned-1", "categorical-3"])
@pytest.mark.parametrize("activation", ["relu", "tanh"])
def test_cuda_equals_cpu(float64, likelihood, activation):
    model = make_model("per_layer", likelihood, (4, 3), activation)
    x, y = make_data(model)
    cpu = FlatLogJoint(model, x, y)
    theta = cpu.sample_prior(16, generator=torch.Generator().manual_seed(6))
    gpu_model = make_model("per_layer", likelihood, (4, 3), activation).to("cuda")
    gpu = FlatLogJoint(gpu_model, x.cuda(), y.cuda())
    assert gpu.device.type == "cuda" and gpu.chunk_size is None
    assert FlatLogJoint(gpu_model, x.cuda(), y.cuda(), chunk_size="auto").chunk_size is None  # CUDA: all at once
    for idx in (None, torch.tensor([2, 7, 7, 11])):
        v, g = cpu.value_and_grad(theta, idx)
        vg, gg = gpu.value_and_grad(theta.cuda(), None if idx is None else idx.cuda())
        assert vg.device.type == gg.device.type == "cuda"
        assert rel_err(vg.cpu(), v) < TOL64
        for row in range(16):
            assert grad_err(gg[row].cpu(), g[row]) < TOL64
    draws = gpu.sample_prior(4, generator=torch.Generator(device="cuda").manual_seed(0))
    assert draws.device.type == "cuda" and draws.dtype == torch.float64 and torch.isfinite(draws).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_const_gives_the_bits_of_the_python_number(dtype):
    # FlatLogJoint.const: a number as a cached 0-d tensor (torch copies a Python number at every
    # tensor-scalar op); an op with it must give exactly what the op with the number gives
    x = torch.randn(10, 2, dtype=dtype)
    lj = FlatLogJoint(pyrobdl.BayesianMLP(2, (3,), 1), x, torch.randn(10, dtype=dtype))
    t = torch.randn(257, dtype=dtype) * 100
    for v in (0.1, 1.0 / 3.0, 2.5, 100.0, -7.25e-3, 1e30, 1e-30):
        c = lj.const(v)
        assert isinstance(c, torch.Tensor) and c.dtype == dtype and c.dim() == 0 and lj.const(v) is c
        for op in (torch.mul, torch.add, torch.sub, torch.div, torch.rsub, torch.ge):
            assert torch.equal(op(t, v), op(t, c)), (op, v)
    # zeros (one key for +0.0 and -0.0) and NaN are never cached: the number itself comes back
    assert lj.const(0.0) == 0.0 and not isinstance(lj.const(-0.0), torch.Tensor)
    assert math.isnan(lj.const(float("nan")))
    assert all(isinstance(k, float) and k != 0.0 and k == k for k in lj._consts)


def test_const_is_the_number_in_half_precision():
    x = torch.randn(10, 2).to(torch.bfloat16)
    lj = FlatLogJoint(pyrobdl.BayesianMLP(2, (3,), 1), x, torch.randn(10).to(torch.bfloat16))
    assert lj.const(2.5) == 2.5 and not isinstance(lj.const(2.5), torch.Tensor)
