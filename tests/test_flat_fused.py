"""The fused kernel (pyrobdl.flat.fused): equal to Pyro's potential and to the float64 autograd twin
within float32 rounding, its leapfrog equal to the steps one by one, NaN kept, what it does not apply
to refused by name, its build cached and its failures named."""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch
from conftest import leapfrog_inputs, leapfrog_steps, needs_cxx
from pyro.infer.autoguide.initialization import init_to_sample
from pyro.infer.mcmc.util import initialize_model

import pyrobdl
from pyrobdl.flat import FlatLogJoint
from pyrobdl.flat import fused
from pyrobdl.likelihoods import Categorical, Gaussian, GaussianLearnedPrecision
from pyrobdl.priors import Gaussian as GaussianPrior

pytestmark = needs_cxx

EPS32 = float(torch.finfo(torch.float32).eps)


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    """One build per test session, in a folder of its own (not the user's cache)."""
    monkeypatch.setenv("PYROBDL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "fused-cache"))


def model_for(act="tanh", learned=True, bias=True, d=3, h=5, prior=None):
    lik = GaussianLearnedPrecision(3.0, 2.0) if learned else Gaussian(4.0)
    return pyrobdl.BayesianMLP(d, (h,), 1, activation=act, bias=bias,
                               prior=prior or GaussianPrior([1.3, 0.6], bias_scale=0.4), likelihood=lik)


def data(model, n, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, model.in_features, generator=g, dtype=dtype), torch.randn(n, generator=g, dtype=dtype)


def three_ways(model, n, k=6, seed=1):
    """The fused kernel, the float32 torch kernel and the float64 autograd twin at the same rows."""
    x, y = data(model, n)
    lj = FlatLogJoint(model, x, y)
    ref = FlatLogJoint(model, x.double(), y.double())
    eager = FlatLogJoint(model, x, y)
    assert lj.compile(k, kernel="fused") >= 0 and lj._fused is not None
    theta = lj.sample_prior(k, generator=torch.Generator().manual_seed(seed)) * 0.7
    return lj.value_and_grad(theta), eager.value_and_grad(theta), ref.log_prob_grad_autograd(theta.double()), theta


def assert_float32_close(got, torch32, want):
    """The fused kernel's error against float64 is of the shipped float32 kernel's size: at most 4x its
    error plus 16 float32 ulps of the largest term (both sum the same terms in float32, in other orders)."""
    (v, g), (v32, g32), (v64, g64) = got, torch32, want
    for a, b, ref in ((v, v32, v64), (g, g32, g64)):
        err, err32 = (a.double() - ref).abs().max(), (b.double() - ref).abs().max()
        assert err <= 4 * err32 + 16 * EPS32 * ref.abs().max(), (float(err), float(err32))


# -------------------------------------------------------------------- 1. the value and gradient
@pytest.mark.parametrize("act", ["tanh", "relu"])
@pytest.mark.parametrize("learned", [True, False], ids=["learned", "fixed"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("n, d, h", [(37, 3, 5), (32, 1, 1), (50, 11, 17), (16, 8, 3), (40, 20, 6)])
def test_equals_the_float64_autograd_twin(act, learned, bias, n, d, h):
    """Every shape the loops treat apart: N not a multiple of 16 (padding) and a multiple; D of 1, 3,
    8 (one block of eight inputs), 11 (a block and three more) and 20 (more than the 16 kept in
    registers); H odd (a unit left after the pairs) and even; biases or none; both likelihoods."""
    got, torch32, want, _ = three_ways(model_for(act, learned, bias, d, h), n)
    assert_float32_close(got, torch32, want)


def test_equals_pyros_potential():
    """Value and gradient against -U of Pyro's initialize_model on the unchanged model (float64, per row)."""
    model = model_for("tanh", learned=True, d=4, h=6)
    x, y = data(model, 23)
    lj = FlatLogJoint(model, x, y)
    lj.compile(3, kernel="fused")
    theta = lj.sample_prior(3, generator=torch.Generator().manual_seed(2)) * 0.7
    v, g = lj.value_and_grad(theta)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # the same model in float64 (its prior distributions take the default)
    try:
        model64 = model_for("tanh", learned=True, d=4, h=6)
        _, potential_fn, _, _ = initialize_model(model64, model_args=(x.double(), y.double()), init_strategy=init_to_sample)
    finally:
        torch.set_default_dtype(old)
    for row in range(3):
        z = {k: t.detach().double().clone().requires_grad_(True)
             for k, t in lj.layout.unpack(theta[row].double(), constrained=False).items()}
        value = -potential_fn(z)
        grads = torch.autograd.grad(value, list(z.values()))
        value, want = float(value.detach()), torch.cat([gr.reshape(-1) for gr in grads])
        # float32 against float64: a sum of N likelihood and P prior terms, each rounded: (N + P) ulps
        bound = (23 + lj.size) * EPS32
        assert abs(float(v[row]) - value) <= bound * (1 + abs(value))
        assert float((g[row].double() - want).abs().max()) <= bound * float(want.abs().max())


def test_benchmark_network_and_one_row():
    """The chees benchmark's 1 x 50 tanh network at N = 500, D = 8; one row as [P]."""
    model = pyrobdl.BayesianMLP(8, (50,), 1, activation="tanh", prior=GaussianPrior(1.0),
                                likelihood=GaussianLearnedPrecision(6.0, 6.0))
    got, torch32, want, theta = three_ways(model, 500, k=4)
    assert_float32_close(got, torch32, want)
    lj = FlatLogJoint(model, *data(model, 500))
    lj.compile(1, kernel="fused")
    v1, g1 = lj.value_and_grad(theta[2])
    assert v1.shape == () and g1.shape == (lj.size,)
    assert torch.equal(v1, got[0][2]) and torch.equal(g1, got[1][2])  # rows are independent: the same bits


def test_nan_and_inf_are_kept():
    """No -ffast-math: a NaN weight gives a NaN log joint, an infinite one a non-finite one (samplers
    read divergence from them), and the other rows are untouched."""
    for act in ("tanh", "relu"):
        model = model_for(act)
        lj = FlatLogJoint(model, *data(model, 20))
        lj.compile(3, kernel="fused")
        theta = lj.sample_prior(3, generator=torch.Generator().manual_seed(0))
        clean, _ = lj.value_and_grad(theta)
        theta[0, 2], theta[1, 1] = float("nan"), float("inf")
        v, g = lj.value_and_grad(theta)
        assert math.isnan(float(v[0])) and not math.isfinite(float(v[1]))
        assert torch.equal(v[2], clean[2])


def test_the_kernels_tanh_is_within_6_ulp_of_tanh():
    """Its rational tanh at every 257th positive normal float32 up to 12 and at the edges: within 6 ulp
    of the float64 tanh (every float32 checked by comparisons/benchmarks/tanh_rational.py: at most 5.23
    with FMA; the bound leaves room for a machine without FMA, where each Horner step rounds twice),
    at most 1 + 2^-22 in size (float32 rounding around 1 near the clamp at 9), odd to the bit, NaN for
    NaN, its value at +-9 for +-inf, +-0 for +-0."""
    first, last = (int(torch.tensor(v, dtype=torch.float32).view(torch.int32)) for v in (2.0**-126, 12.0))
    x = torch.arange(first, last, 257, dtype=torch.int32).view(torch.float32)
    x = torch.cat([x, torch.tensor([1e-3, 0.5, 1.0, 4.0, 8.4, 8.56065369, 9.0, 9.5, 30.0, 3e38])])
    got, exact = fused.tanh(x).double(), torch.tanh(x.double())
    nearest = exact.float().abs()
    ulp = (torch.nextafter(nearest, torch.tensor(math.inf)) - nearest).double()
    assert float(((got - exact).abs() / ulp).max()) <= 6.0
    assert float(got.abs().max()) <= 1 + 2.0**-22
    assert torch.equal(fused.tanh(-x), -fused.tanh(x))
    edge = fused.tanh(torch.tensor([float("nan"), math.inf, -math.inf, 0.0, -0.0]))
    at_clamp = float(fused.tanh(torch.tensor([9.0]))[0])
    assert math.isnan(float(edge[0])) and edge[1:3].tolist() == [at_clamp, -at_clamp]
    assert edge[3:].tolist() == [0.0, 0.0] and torch.signbit(edge[4]) and not torch.signbit(edge[3])
    with pytest.raises(ValueError, match="float32 on the CPU"):
        fused.tanh(x.double())


# -------------------------------------------------------------------------------- 2. the leapfrog
def test_leapfrog_block_equals_the_steps_one_by_one():
    """FlatLogJoint.leapfrog after compile(kernel="fused", leapfrog_block=3): every row's own step and
    final coefficient; equal to three steps of torch updates around the fused gradient within float32
    rounding of the updates (the C++ loop may fuse a multiply and an add), inputs unwritten."""
    model = model_for("tanh", learned=True, d=4, h=7)
    x, y = data(model, 41)
    lj = FlatLogJoint(model, x, y)
    lj.compile(5, leapfrog_block=3, kernel="fused")
    assert lj.leapfrog_block == 3
    theta, p, scaled, step, last = leapfrog_inputs(lj, 5, scale=0.5)
    inputs = [t.clone() for t in (theta, p, scaled, step, last)]
    out = lj.leapfrog(theta, p, scaled, step, last)
    for got, want in zip(out, leapfrog_steps(lj.value_and_grad, theta, p, scaled, step, last, 3)):
        assert float(((got - want).abs() / want.abs().clamp_min(1.0)).max()) < 1e-5
    assert all(torch.equal(a, b) for a, b in zip(inputs, (theta, p, scaled, step, last)))
    with pytest.raises(ValueError, match=r"step must be a float32 CPU tensor \[K, 1\]"):
        lj.leapfrog(theta, p, scaled, step.view(-1), last)


def test_chees_runs_on_the_fused_kernel():
    """chees with compile=True (and "auto" on the CPU) on a model the fused kernel applies to: the
    fused kernel runs every leapfrog step (blocks of LEAPFROG_BLOCK after the first n mod 4)."""
    model = model_for("tanh", learned=False, d=2, h=6)
    x, y = data(model, 30)
    for option in (True, "auto"):
        with pytest.warns(UserWarning, match="not certified"):  # chains this short are not a reference
            post = pyrobdl.fit(model, x, y, method="chees", num_chains=4, num_warmup=20, num_samples=10,
                               compile=option, progress=False)
        assert post.diagnostics["compile_s"] > 0
        assert post.diagnostics["kernel"] == "fused"


# ------------------------------------------------------------------ 3. where it does not apply
@pytest.mark.parametrize("case, reason", [
    (lambda: (pyrobdl.BayesianMLP(3, (4, 3), 1, prior=GaussianPrior(1.0), likelihood=Gaussian(1.0)), torch.float32),
     "one hidden layer"),
    (lambda: (pyrobdl.BayesianMLP(3, (), 1, prior=GaussianPrior(1.0), likelihood=Gaussian(1.0)), torch.float32),
     "one hidden layer"),
    (lambda: (pyrobdl.BayesianMLP(3, (4,), 2, prior=GaussianPrior(1.0), likelihood=Gaussian(1.0)), torch.float32),
     "one output"),
    (lambda: (pyrobdl.BayesianMLP(3, (4,), 3, prior=GaussianPrior(1.0), likelihood=Categorical()), torch.float32),
     "one output"),
    (lambda: (model_for(), torch.float64), "float32"),
], ids=["two-hidden", "linear", "two-outputs", "classifier", "float64"])
def test_what_it_does_not_apply_to_is_refused_by_name(case, reason):
    model, dtype = case()
    x, y = data(model, 10, dtype=dtype)
    if model.likelihood.task == "classification":
        y = torch.randint(3, (10,))
    elif model.out_features == 2:
        y = torch.randn(10, 2, dtype=dtype)
    lj = FlatLogJoint(model, x, y)
    assert reason in fused.unsupported(lj)
    with pytest.raises(ValueError, match=f"kernel='fused' does not apply to this log joint: .*{reason}"):
        lj.compile(4, kernel="fused")
    with pytest.raises(ValueError, match="the fused kernel does not apply"):
        fused.FusedKernel(lj)
    assert lj._fused is None


def test_prior_false_is_refused_and_a_bad_kernel_name_too():
    model = model_for()
    x, y = data(model, 10)
    assert "prior=False" in fused.unsupported(FlatLogJoint(model, x, y, prior=False))
    with pytest.raises(ValueError, match="kernel must be 'auto', 'fused' or 'inductor', got 'cuda'"):
        FlatLogJoint(model, x, y).compile(4, kernel="cuda")


def test_minibatches_and_the_likelihood_alone_stay_on_the_torch_kernel():
    """The fused kernel computes the full-data log joint; minibatch and prior=False calls give the
    torch kernel's own bits."""
    model = model_for()
    x, y = data(model, 30)
    lj, eager = FlatLogJoint(model, x, y), FlatLogJoint(model, x, y)
    lj.compile(4, kernel="fused")
    theta = lj.sample_prior(4, generator=torch.Generator().manual_seed(3))
    idx = torch.tensor([1, 4, 9, 20])
    for kwargs in ({"idx": idx}, {"prior": False}):
        a, b = lj.value_and_grad(theta, **kwargs), eager.value_and_grad(theta, **kwargs)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ------------------------------------------------------------------------ 4. the build and cache
def test_build_is_cached_per_machine(tmp_path, monkeypatch):
    """The first use builds the library into the cache folder (one file, named by a hash of the source,
    the compiler and the CPU); a later process loads it without building."""
    monkeypatch.setenv("PYROBDL_CACHE_DIR", str(tmp_path))
    fused._library.cache_clear()
    try:
        fused._library()
        built = list(tmp_path.glob("fused-*.so"))
        assert len(built) == 1 and not list(tmp_path.glob(".fused-*"))  # no temporary left
        stamp = built[0].stat().st_mtime_ns
        fused._library.cache_clear()
        fused._library()
        assert built[0].stat().st_mtime_ns == stamp and len(list(tmp_path.glob("fused-*.so"))) == 1
    finally:
        fused._library.cache_clear()


def test_no_compiler_is_named(monkeypatch):
    """Without a C++ compiler: FlatLogJoint.compile says so and how to run; chees's compile="auto"
    warns and runs eager."""
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setenv("PATH", "/nonexistent")
    fused._library.cache_clear()
    try:
        model = model_for()
        x, y = data(model, 12)
        lj = FlatLogJoint(model, x, y)
        with pytest.raises(RuntimeError, match=r"needs a C\+\+ compiler.*compile=False"):
            lj.compile(4, kernel="fused")
        assert lj._fused is None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            post = pyrobdl.fit(model, x, y, method="chees", num_chains=2, num_warmup=4, num_samples=4,
                               compile="auto", progress=False)
        assert any(w.category is RuntimeWarning and "could not compile the log joint" in str(w.message) for w in caught)
        assert post.diagnostics["compile_s"] == 0 and post.diagnostics["kernel"] == "eager"
    finally:
        fused._library.cache_clear()


def test_a_failed_build_is_named_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PYROBDL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(fused, "FLAGS", fused.FLAGS + ("-DPYROBDL_NO_SUCH_FLAG", "-fno-such-option"))
    fused._library.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="building the fused kernel with .* failed"):
            fused._library()
        assert not list(tmp_path.iterdir())
    finally:
        fused._library.cache_clear()


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("PYROBDL_CACHE_DIR", str(tmp_path / "a"))
    assert fused.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("PYROBDL_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert fused.cache_dir() == tmp_path / "x" / "pyrobdl"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert fused.cache_dir() == type(tmp_path)(os.path.expanduser("~")) / ".cache" / "pyrobdl"
