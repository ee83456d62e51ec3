"""Method "chees" (many-chain HMC with ChEES adaptation, pyrobdl.inference.chees): exact posteriors
of Bayesian linear regression, agreement with Pyro's NUTS, seeds, the posterior contract and its
gradient accounting, certification, the steps cap, option checks, and the adaptation's parts."""

from __future__ import annotations

import dataclasses

import math
import re
import warnings

import numpy as np
import pytest
import torch
from conftest import DEVICES, needs_cxx

import pyrobdl
import pyrobdl.inference.chees as chees
from pyrobdl.datasets import bayesian_linear_regression
from pyrobdl.diagnostics import CertificationCriteria, certify
from pyrobdl.diagnostics import convergence
from pyrobdl.flat import FlatLogJoint
from pyrobdl.inference import MCMCPosterior, SamplerTrace
from pyrobdl.inference.chees import WindowVariance, chees_gradient, halton, warmup_windows

PRECISION = 10.0
PRIOR_SCALE = 1.0
# Monte Carlo tolerance, as tests/test_mcmc.py: an estimate may be Z standard errors (sd / sqrt(ESS),
# ArviZ's bulk ESS of the very quantity averaged) from the exact value; Z = 4 is a 6e-5 two-sided
# chance per check, ~1e-3 over the ~15 checks of one test.
Z = 4.0
# ... meaningful only with a small standard error: ESS >= 100 bounds it by 0.4 posterior sd.
MIN_ESS = 100.0
# The convergence requirement.
GOOD_RHAT = 1.05
# Short runs for the bookkeeping tests (shapes, counts, seeds): statistics are not checked there.
TINY = dict(num_chains=4, num_warmup=10, num_samples=8, progress=False)
# The optimum of the ChEES criterion for a Gaussian target in the coordinates the mass matrix
# whitens, with the trajectory length jittered by h ~ U(0, 1) (Halton): ChEES(T) is proportional
# to E_h[sin^2(h T)] = 1/2 - sin(2T) / (4T), maximal where tan(2T) = 2T, T = 4.493 / 2 = 2.25.
JITTERED_GAUSSIAN_OPTIMUM = 2.25
# The adapted T must come within a factor 2 of it (E_h[sin^2(h T)] is 54% of its maximum at
# T/2, 78% at 2T): the moving average lags and the noisy ascent wanders near the flat maximum
# (measured on the BLR of test_blr_exact_posterior: 1.82, 1.63, 2.26 for seeds 0-2).
T_FACTOR = 2.0


def uncertified():
    """Short runs fail the reference certification (function-space R-hat and ESS, divergences,
    E-BFMI: tests/test_certification.py) and ``fit`` says so; pytest 9 re-raises an unmatched
    warning inside ``pytest.warns``, so this goes outermost when other warnings are expected."""
    return pytest.warns(UserWarning, match=r"the chees posterior is not certified as a reference: ")


@pytest.fixture(scope="module")
def blr():
    return bayesian_linear_regression(100, 20, 3, prior_scale=PRIOR_SCALE, precision=PRECISION, seed=0)


def blr_model(likelihood=None) -> pyrobdl.BayesianMLP:
    return pyrobdl.BayesianMLP(3, (), 1, prior=pyrobdl.priors.Gaussian(PRIOR_SCALE),
                               likelihood=likelihood or pyrobdl.likelihoods.Gaussian(PRECISION))


def small_mlp(likelihood=None) -> pyrobdl.BayesianMLP:
    return pyrobdl.BayesianMLP(2, (4,), 1, activation="tanh",
                               likelihood=likelihood or pyrobdl.likelihoods.GaussianLearnedPrecision())


def small_data(n: int = 20, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=g)
    return x, torch.sin(x[:, 0]) + 0.1 * torch.randn(n, generator=g)


def blr_draws(posterior: MCMCPosterior) -> np.ndarray:
    """Draws of (w_1, w_2, w_3, b), the exact posterior's coordinate order, ``[C, D, 4]``."""
    s = posterior.samples
    c, d = posterior.num_chains, posterior.num_draws
    return torch.cat([s["layers.0.weight"].reshape(c, d, -1), s["layers.0.bias"].reshape(c, d, -1)],
                     -1).double().cpu().numpy()


def assert_moments(draws: np.ndarray, mean: np.ndarray, cov: np.ndarray) -> None:
    """Posterior mean and covariance within Z Monte Carlo standard errors, and R-hat < 1.05."""
    conv = convergence(draws)
    assert conv["rhat"].max() < GOOD_RHAT, conv["rhat"]
    assert conv["ess_bulk"].min() >= MIN_ESS, conv["ess_bulk"]
    sd = np.sqrt(np.diag(cov))
    err = np.abs(draws.mean((0, 1)) - mean)
    assert (err <= Z * sd / np.sqrt(conv["ess_bulk"])).all(), (err / sd, conv["ess_bulk"])
    # Sigma_ij = E[(t_i - mu_i)(t_j - mu_j)] with the exact mu: the average of the products
    # estimates it, with standard error sd(product) / sqrt(ESS of the product)
    i, j = np.triu_indices(len(mean))
    prods = (draws - mean)[..., i] * (draws - mean)[..., j]
    conv_p = convergence(prods)
    assert conv_p["ess_bulk"].min() >= MIN_ESS, conv_p["ess_bulk"]
    mcse = prods.std((0, 1)) / np.sqrt(conv_p["ess_bulk"])
    err_p = np.abs(prods.mean((0, 1)) - cov[i, j])
    assert (err_p <= Z * mcse).all(), (err_p / mcse, cov[i, j])


def kinetic_energies(trace: SamplerTrace) -> np.ndarray:
    """K_t = energy_t + log_joint_{t-1}: the kinetic energy of the momentum drawn for iteration t."""
    return trace.energy[:, 1:] + trace.log_joint[:, :-1]


# ------------------------------------------------------------------ 1. exact posteriors (BLR)
# 32 chains x (300 warm-up + 300 draws), ~1.5 CPU s here, with each way of estimating the mass
# matrix.  With 200 draws the certification (REFERENCE_CRITERIA) failed about one run in ten by a
# hair, function-space R-hat 1.0100-1.0104 at 1 of 50 points: seeds 0-9 x the three mass matrices,
# 26 of 30 certified with the kernel of 2026-11-29 (whose rounding moved seed 0 among the failures),
# 28 of 30 with the one before.  With 300 draws 29 of 30, the one failure an outlier chain flagged
# at alpha = 0.01 (the rate those tests are designed to have); with 400 also 29 of 30 (the same
# kind).  The mean was within 2.6 Monte Carlo standard errors of the exact one in all 30 runs at
# 200 draws.  Command: python comparisons/benchmarks/blr_certification_rate.py --num-samples 200 300 400
@pytest.mark.parametrize("mass_matrix", ["cross-chain", "within-chain", "per-chain"])
def test_blr_exact_posterior(blr, mass_matrix):
    posterior = pyrobdl.fit(blr_model(), blr.x_train, blr.y_train, method="chees", num_chains=32, num_warmup=300,
                            num_samples=300, seed=0, progress=False,
                            mass_matrix=mass_matrix)  # certified: no warning (filterwarnings=error)
    assert posterior.settings["mass_matrix"] == mass_matrix
    assert posterior.certification.passed, posterior.certification.failures
    assert_moments(blr_draws(posterior), blr.posterior.mean.numpy(), blr.posterior.covariance.numpy())
    d = posterior.diagnostics
    assert d["function_space"]["rhat_max"] < GOOD_RHAT and sum(d["divergences"]) == 0
    # the adapted trajectory length approaches the optimum of ChEES for a (whitened) Gaussian
    assert JITTERED_GAUSSIAN_OPTIMUM / T_FACTOR < d["trajectory_length"] < JITTERED_GAUSSIAN_OPTIMUM * T_FACTOR
    # a 4-d Gaussian posterior: every momentum's kinetic energy is chi^2_4 / 2 (mean and variance
    # 2) whatever the mass matrix, independently in each of the 32 x 599 iterations
    kinetic = kinetic_energies(posterior.trace).ravel()
    # a sum of squares, up to float32 rounding of energies up to 1.8e4 at the prior-draw start (ulp 2e-3)
    assert kinetic.min() >= -1e-2
    assert abs(kinetic.mean() - 2.0) <= Z * math.sqrt(2.0 / kinetic.size)


def exact_precision_posterior(x: torch.Tensor, y: torch.Tensor, a: float, b: float) -> tuple[float, float]:
    r"""Mean and sd of p(tau | y) for BLR with N(0, s^2) weights and bias, Gamma(a, b) on tau
    (copied from tests/test_mcmc.py): y | tau ~ N(0, K + I / tau) with K = s^2 Phi Phi^T, by
    quadrature on a fine tau grid."""
    phi = np.concatenate([x.double().numpy(), np.ones((x.shape[0], 1))], 1)
    lam, u = np.linalg.eigh(PRIOR_SCALE**2 * phi @ phi.T)
    r2 = (u.T @ y.double().numpy()) ** 2
    tau = np.linspace(0.5, 40.0, 20000)
    var = lam[None, :] + 1.0 / tau[:, None]
    log_post = (a - 1) * np.log(tau) - b * tau - 0.5 * np.log(var).sum(1) - 0.5 * (r2 / var).sum(1)
    w = np.exp(log_post - log_post.max())
    w /= w.sum()
    mean = float((w * tau).sum())
    return mean, float(np.sqrt((w * (tau - mean) ** 2).sum()))


@pytest.fixture(scope="module")
def learned_precision_fit(blr):
    """The BLR data with a Gamma(2, 0.2) precision (prior mean 10, sd 7: weak next to 100 points);
    32 chains x (300 + 200), ~3 s here.  Certified at these settings since Adam's state is reset
    at every mass-matrix window (before that fix T froze at 1.05 and function-space R-hat was 1.02
    for seeds 0-3); fit would warn otherwise, an error under filterwarnings = error."""
    a, b = 2.0, 0.2
    model = blr_model(pyrobdl.likelihoods.GaussianLearnedPrecision(a, b))
    posterior = pyrobdl.fit(model, blr.x_train, blr.y_train, method="chees", num_chains=32, num_warmup=300,
                            num_samples=200, seed=0, progress=False)
    return posterior, exact_precision_posterior(blr.x_train, blr.y_train, a, b)


def test_learned_precision_posterior(learned_precision_fit):
    posterior, (exact_mean, exact_sd) = learned_precision_fit
    tau = posterior.samples["precision"].double().numpy()
    assert tau.shape == (32, 200) and (tau > 0).all()
    conv = convergence(tau)
    assert conv["rhat"] < GOOD_RHAT and conv["ess_bulk"] >= MIN_ESS
    assert abs(tau.mean() - exact_mean) <= Z * tau.std() / math.sqrt(conv["ess_bulk"])
    # sd of an sd estimate ~ 1 / sqrt(2 ESS) <= 0.07 relative for ESS >= 100: 0.25 is > 3.5 of them
    assert abs(tau.std() / exact_sd - 1) < 0.25
    # the reference itself: the data were drawn with precision 10, 2.1 posterior sd from the
    # exact mean 7.73 (a quadrature error would put it far off)
    assert abs(exact_mean - PRECISION) < 3 * exact_sd
    assert set(posterior.diagnostics["latents"]) == {"precision"}


# Regression test: the first ChEES gradients, taken while the chains fall from their prior draws
# (~7e4, later ones O(1)), used to fill Adam's second moment, which forgets only as 0.95^t, and T
# stayed at exp(lr) = 1.051 through warm-up.  Adam's state is now reset at each mass-matrix window.
def test_trajectory_length_adapts_with_a_learned_precision(learned_precision_fit):
    posterior, _ = learned_precision_fit
    t = posterior.diagnostics["trajectory_length"]
    assert JITTERED_GAUSSIAN_OPTIMUM / T_FACTOR < t < JITTERED_GAUSSIAN_OPTIMUM * T_FACTOR, t


# ------------------------------------------------------------------ 2. agreement with NUTS
@pytest.mark.slow
def test_agrees_with_nuts_on_a_small_learned_noise_mlp():
    """Posterior predictive mean of f at 5 inputs and the precision's posterior mean: chees and
    Pyro's NUTS agree within Z standard errors of their difference, sqrt(se_chees^2 + se_nuts^2).
    ~3 min here, nearly all NUTS: ~50 leapfrog steps per iteration at ~3 ms per Pyro step."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, 2, generator=g)
    y = torch.sin(2 * x[:, 0]) + 0.2 * torch.randn(30, generator=g)
    x_test = torch.tensor([[0.0, 0.0], [1.0, -0.5], [-1.0, 0.5], [0.5, 1.5], [-2.0, -1.0]])
    with warnings.catch_warnings():
        # whether this NUTS run reaches the certificate's ESS of 400 is not what is tested here;
        # its own R-hat and ESS are checked below
        warnings.filterwarnings("ignore", message="the nuts posterior is not certified", category=UserWarning)
        nuts = pyrobdl.fit(small_mlp(), x, y, method="nuts", num_chains=2, num_warmup=150, num_samples=350,
                           potential="direct", seed=0, progress=False)
    # certified (measured), hence no warning (filterwarnings = error)
    ch = pyrobdl.fit(small_mlp(), x, y, method="chees", num_chains=64, num_warmup=400, num_samples=200, seed=0,
                     progress=False)
    assert ch.certification.passed

    def estimate(posterior: MCMCPosterior) -> tuple[np.ndarray, np.ndarray]:
        f = posterior.function_draws(x_test)[..., 0].double().numpy()  # [C, D, 5]
        tau = posterior.samples["precision"].double().numpy()[..., None]
        q = np.concatenate([f, tau], -1)
        conv = convergence(q)
        assert conv["rhat"].max() < GOOD_RHAT and conv["ess_bulk"].min() >= MIN_ESS, conv
        return q.mean((0, 1)), q.std((0, 1)) / np.sqrt(conv["ess_bulk"])

    (m1, se1), (m2, se2) = estimate(nuts), estimate(ch)
    z = np.abs(m1 - m2) / np.sqrt(se1**2 + se2**2)
    assert (z <= Z).all(), (m1, m2, z)


# ----------------------------------------------------------------------------------- 3. seeds
def test_reproducible_from_the_seed():
    x, y = small_data()
    kw = dict(method="chees", num_chains=4, num_warmup=12, num_samples=6, progress=False)
    with uncertified():
        a = pyrobdl.fit(small_mlp(), x, y, seed=3, **kw)
    with uncertified():
        b = pyrobdl.fit(small_mlp(), x, y, seed=3, **kw)
    with uncertified():
        c = pyrobdl.fit(small_mlp(), x, y, seed=4, **kw)
    for name in a.samples:
        assert torch.equal(a.samples[name], b.samples[name]), name
        assert not torch.allclose(a.samples[name], c.samples[name]), name
    np.testing.assert_array_equal(a.trace.num_steps, b.trace.num_steps)
    np.testing.assert_array_equal(a.trace.energy, b.trace.energy)
    assert not torch.allclose(a.samples["layers.0.weight"][0], a.samples["layers.0.weight"][1])  # chains differ


def test_chunk_size_changes_only_rounding():
    """chunk_size=2 evaluates the same rows as one call of 4, but the batched matrix products are
    blocked differently, so values and gradients differ in the last float32 bit (7.6e-6 of ~140,
    measured).  Without adaptation the chains then agree to rounding amplified by the dynamics
    (measured: 1e-6 after 15 iterations).  With adaptation they agree at first, but dual averaging
    turns the differences of the acceptance probabilities into step sizes (relative energy
    differences grow from 1e-7 to 6e-6 by iteration 11, measured), and once ceil(h T / step) rounds
    the other way (iteration 26 of a measured 30-iteration warm-up) the trajectories part: a run is
    reproducible from its seed for a given chunk_size, not across chunk sizes, so only a fixed
    step size is compared here."""
    x, y = small_data()
    kw = dict(method="chees", num_chains=4, num_warmup=0, num_samples=15, step_size=0.1, seed=3, progress=False)
    with uncertified():
        whole = pyrobdl.fit(small_mlp(), x, y, chunk_size=None, **kw)
    with uncertified():
        chunked = pyrobdl.fit(small_mlp(), x, y, chunk_size=2, **kw)
    np.testing.assert_array_equal(whole.trace.num_steps, chunked.trace.num_steps)
    for name in whole.samples:
        torch.testing.assert_close(chunked.samples[name], whole.samples[name], rtol=0, atol=1e-5)
    np.testing.assert_allclose(chunked.trace.energy, whole.trace.energy, rtol=1e-5)
    # "auto" on 20 points x width 4 is a chunk of 4096 rows > 4 chains: the very same single call
    with uncertified():
        auto = pyrobdl.fit(small_mlp(), x, y, chunk_size="auto", **kw)
    for name in whole.samples:
        assert torch.equal(auto.samples[name], whole.samples[name])


@needs_cxx
@pytest.mark.parametrize("kernel", ["fused", "inductor"])
def test_compile_changes_only_rounding(monkeypatch, kernel):
    """compile=True runs the same sampler on the compiled log joint: with a fixed step size the
    draws agree with the eager run to float32 rounding amplified by the dynamics, as for chunk
    sizes (above), whether a trajectory runs in compiled blocks of steps (15 draws, steps of 1 to
    ~10, so blocks and single steps both); the compile time is reported and counted.  Both kernels:
    the fused one (this one-hidden-layer model's) and Inductor's (the fused one ruled out here).
    Inductor's kernel is compiled once: the leapfrog loop calls it in inference mode, a chain's
    start outside it, and torch.compile guards on both the grad mode and theta's dispatch keys
    (each mismatch was a second compilation)."""
    import torch._dynamo.utils as dynamo_utils

    from pyrobdl.flat import fused

    if kernel == "inductor":
        monkeypatch.setattr(fused, "unsupported", lambda lj: "ruled out by the test")
    x, y = small_data()
    kw = dict(method="chees", num_chains=4, num_warmup=0, num_samples=15, step_size=0.1, seed=3, progress=False)
    with uncertified():
        eager = pyrobdl.fit(small_mlp(), x, y, compile=False, **kw)
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    with uncertified():
        compiled = pyrobdl.fit(small_mlp(), x, y, compile=True, **kw)
    assert compiled.diagnostics["kernel"] == kernel and eager.diagnostics["kernel"] == "eager"
    # on the CPU Inductor compiles the kernel and a block of leapfrog steps (FlatLogJoint.leapfrog), each once
    graphs = 2 if kernel == "inductor" else 0
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs and chees.kernel.LEAPFROG_BLOCK > 1
    assert eager.diagnostics["compile_s"] == 0.0
    assert 0 < compiled.diagnostics["compile_s"] <= compiled.cost.wall_time_s
    np.testing.assert_array_equal(eager.trace.num_steps, compiled.trace.num_steps)
    for name in eager.samples:
        torch.testing.assert_close(compiled.samples[name], eager.samples[name], rtol=0, atol=1e-5)
    with pytest.raises(TypeError, match="compile must be True, False or 'auto', got 'yes'"):
        pyrobdl.fit(small_mlp(), x, y, compile="yes", **kw)


@needs_cxx
def test_compile_auto_on_cpu_is_the_fused_kernel_or_eager():
    """The default compile='auto' on the CPU: the fused kernel where it applies (this one-hidden-layer
    model: the eager draws to float32 rounding, with a fixed step size as above), else the eager run,
    draw for draw (two hidden layers); never Inductor (CUDA only)."""
    x, y = small_data()
    kw = dict(method="chees", num_chains=4, num_warmup=0, num_samples=10, step_size=0.1, seed=3, progress=False)
    with uncertified():
        auto = pyrobdl.fit(small_mlp(), x, y, **kw)
    with uncertified():
        eager = pyrobdl.fit(small_mlp(), x, y, compile=False, **kw)
    assert auto.settings["compile"] == "auto" and auto.diagnostics["compile_s"] > 0
    assert auto.diagnostics["kernel"] == "fused"
    np.testing.assert_array_equal(eager.trace.num_steps, auto.trace.num_steps)
    for name in eager.samples:
        torch.testing.assert_close(auto.samples[name], eager.samples[name], rtol=0, atol=1e-5)
    deep = lambda: pyrobdl.BayesianMLP(2, (4, 3), 1, activation="tanh",  # noqa: E731
                                       likelihood=pyrobdl.likelihoods.GaussianLearnedPrecision())
    with uncertified():
        auto = pyrobdl.fit(deep(), x, y, **kw)
    with uncertified():
        eager = pyrobdl.fit(deep(), x, y, compile=False, **kw)
    assert auto.diagnostics["compile_s"] == 0.0 and auto.diagnostics["kernel"] == "eager"
    for name in eager.samples:
        assert torch.equal(auto.samples[name], eager.samples[name])


class _StubLogJoint:
    """What ``_compile`` sees of a FlatLogJoint: its device and ``compile``."""

    def __init__(self, device: str, fails: bool) -> None:
        self.device, self.fails, self.calls = torch.device(device), fails, 0

    def compile(self, k: int, leapfrog_block: int = 0, kernel: str = "auto") -> float:
        self.calls += 1
        if self.fails:
            raise RuntimeError("torch.compile of the flat log joint failed on this machine (stub)")
        return 1.5


def test_compile_auto_falls_back_to_eager_when_the_compiler_fails(monkeypatch):
    from pyrobdl.flat import fused
    from pyrobdl.inference.chees import _compile

    assert _compile(_StubLogJoint("cuda", fails=False), 8, "auto") == 1.5
    monkeypatch.setattr(fused, "unsupported", lambda lj: "not this model")
    cpu = _StubLogJoint("cpu", fails=False)
    assert _compile(cpu, 8, "auto") == 0.0 and cpu.calls == 0  # on the CPU only the fused kernel is tried
    monkeypatch.setattr(fused, "unsupported", lambda lj: None)
    assert _compile(cpu, 8, "auto") == 1.5 and cpu.calls == 1
    for device in ("cuda", "cpu"):
        with pytest.warns(RuntimeWarning, match=f"compile='auto' could not compile the log joint on {device}.*running eager"):
            assert _compile(_StubLogJoint(device, fails=True), 8, "auto") == 0.0
    with pytest.raises(RuntimeError, match="stub"):  # asked for explicitly: a failure stops the run
        _compile(_StubLogJoint("cpu", fails=True), 8, True)
    assert _compile(_StubLogJoint("cpu", fails=True), 8, False) == 0.0


# ---------------------------------------------------------------------------- 4. the contract
def test_contract_and_gradient_accounting(monkeypatch):
    """Shapes of the result, and every gradient counted: the rows of every value_and_grad call and
    of every leapfrog block times its steps (spied; the default compile="auto" runs this model on the
    fused kernel, in blocks) sum to cost.gradient_evaluations = K (the start) + K x leapfrog steps +
    the step-size searches' K per trial step."""
    rows = {"all": 0, "search": 0}
    in_search, searches = [], []
    real_vg, real_search = FlatLogJoint.value_and_grad, chees._Sampler.find_step_size
    real_leapfrog = FlatLogJoint.leapfrog

    def counting_vg(self, theta, idx=None, **kw):
        n = theta.shape[0] if theta.dim() == 2 else 1
        rows["all"] += n
        rows["search"] += n if in_search else 0
        return real_vg(self, theta, idx, **kw)

    def counting_leapfrog(self, theta, *a):
        n = theta.shape[0] * self.leapfrog_block
        rows["all"] += n
        rows["search"] += n if in_search else 0
        return real_leapfrog(self, theta, *a)

    def counting_search(self, *a, **k):
        searches.append(1)
        in_search.append(1)
        try:
            return real_search(self, *a, **k)
        finally:
            in_search.pop()

    monkeypatch.setattr(FlatLogJoint, "value_and_grad", counting_vg)
    monkeypatch.setattr(FlatLogJoint, "leapfrog", counting_leapfrog)
    monkeypatch.setattr(chees._Sampler, "find_step_size", counting_search)
    k, w, n = 4, 30, 10  # 30 warm-up iterations: one mass-matrix window (ends at 27), so two searches
    x, y = small_data()
    with uncertified():
        posterior = pyrobdl.fit(small_mlp(), x, y, method="chees", num_chains=k, num_warmup=w, num_samples=n,
                                seed=1, progress=False)
    assert isinstance(posterior, MCMCPosterior) and posterior.method == "chees"
    assert posterior.num_chains == k and posterior.num_draws == n
    shapes = {"layers.0.weight": (4, 2), "layers.0.bias": (4,), "layers.1.weight": (1, 4), "layers.1.bias": (1,),
              "precision": ()}
    assert {name: tuple(v.shape) for name, v in posterior.samples.items()} == {s: (k, n, *t) for s, t in shapes.items()}
    assert (posterior.samples["precision"] > 0).all()
    tr = posterior.trace
    assert isinstance(tr, SamplerTrace) and tr.num_warmup == w and tr.tree_depth is None
    for field in ("energy", "diverging", "num_steps", "step_size", "accept_prob", "log_joint"):
        assert getattr(tr, field).shape == (k, w + n), field
    assert np.isfinite(tr.energy).all() and tr.diverging.dtype == bool
    assert ((tr.accept_prob >= 0) & (tr.accept_prob <= 1)).all()
    # lock-step chains share the step size and the number of leapfrog steps of each iteration
    assert (tr.num_steps == tr.num_steps[0]).all() and (tr.step_size == tr.step_size[0]).all()
    # the steps of iteration t: ceil(h_t T_t / step_t) with the Halton jitter h_t = halton(t + 1)
    lengths = posterior.adaptation["trajectory_length"]
    wanted = [max(1, min(1024, math.ceil(halton(t + 1) * lengths[t] / tr.step_size[0, t]))) for t in range(w + n)]
    np.testing.assert_array_equal(tr.num_steps[0], wanted)
    # gradient accounting, exactly
    d, cost = posterior.diagnostics, posterior.cost
    steps = int(tr.num_steps[0].sum())
    assert d["leapfrog_steps_warmup"] + d["leapfrog_steps_sampling"] == steps
    assert len(searches) == 2 and warmup_windows(w) == [27]
    assert d["step_size_search_chain_gradients"] == rows["search"] and rows["search"] >= 2 * 2 * k  # >= 2 trials each
    assert d["map_chain_gradients"] == 0
    assert cost.gradient_evaluations == d["chain_gradients"] == rows["all"] == k * (1 + steps) + rows["search"]
    assert isinstance(cost.cpu_time_s, float) and cost.cpu_time_s > 0 and cost.wall_time_s > 0
    assert cost.device == "cpu"
    # the stored log joint is that of the stored draw
    lj = FlatLogJoint(posterior.model, x, y)
    theta = lj.layout.pack({name: v[:, -1] for name, v in posterior.samples.items()})
    np.testing.assert_allclose(lj.value_and_grad(theta)[0].numpy(), tr.log_joint[:, -1], rtol=1e-5)
    # energy = U(start) + |z|^2 / 2 with z ~ N(0, I_P), P = 17 (the mass matrix only rescales p)
    kinetic = kinetic_energies(tr)
    assert kinetic.min() >= -1e-3
    assert abs(kinetic.mean() - 17 / 2) <= Z * math.sqrt(17 / 2 / kinetic.size)
    # predictions, function draws, ArviZ
    x_test = torch.randn(7, 2)
    pred = posterior.predict(x_test, num_samples=12)
    assert pred.samples.shape == (12, 7, 1) and pred.mean.shape == (7, 1) and torch.isfinite(pred.variance).all()
    assert posterior.function_draws(x_test).shape == (k, n, 7, 1)
    # an array is taken as a tensor would be; a wrong shape is named before any work
    torch.testing.assert_close(posterior.function_draws(x_test.numpy()), posterior.function_draws(x_test))
    with pytest.raises(ValueError, match="x has 3 features but the model has in_features=2"):
        posterior.function_draws(torch.randn(7, 3))
    idata = posterior.to_inference_data(x, y)
    assert idata.posterior.sizes["chain"] == k and idata.posterior.sizes["draw"] == n
    np.testing.assert_array_equal(idata.sample_stats["energy"].values, tr.energy[:, w:])
    assert len(d["ebfmi"]) == len(d["divergences"]) == len(d["accept_prob"]) == k


# ------------------------------------------------------------------------- 5. certification
def test_short_run_is_not_certified():
    x, y = small_data()
    with uncertified() as record:
        posterior = pyrobdl.fit(small_mlp(), x, y, method="chees", num_chains=4, num_warmup=5, num_samples=10,
                                progress=False)
    cert = posterior.certification
    assert not cert.passed and cert.failures
    assert any("R-hat" in f or "ESS" in f for f in cert.failures), cert.failures
    assert cert.num_chains == 4 and cert.num_draws == 10 and cert.num_points == 20
    assert posterior.diagnostics["certification"]["passed"] is False
    [message] = [str(r.message) for r in record]
    assert all(f in message for f in cert.failures)


# ------------------------------------------------------------------ sampling until certified
def test_sampling_until_certified_equals_a_run_of_that_length(blr):
    """max_num_samples: the chains are certified (at certify_inputs) after num_samples draws and
    after every extend_by more, until they pass; the result is the run started with that many
    draws, to the bit (nothing is redrawn, every chain goes on where it stood)."""
    kw = dict(method="chees", num_chains=32, num_warmup=300, seed=0, progress=False, certify_inputs=blr.x_test)
    post = pyrobdl.fit(blr_model(), blr.x_train, blr.y_train, num_samples=20, max_num_samples=400, extend_by=40,
                       **kw)  # certified in the end: no warning (filterwarnings=error)
    ext = post.diagnostics["extensions"]
    n = ext[-1]["num_samples"]
    assert len(ext) >= 2 and n < 400  # measured: not certified at 20, 60, 100 draws; certified at 140
    assert [e["num_samples"] for e in ext] == list(range(20, n + 1, 40))
    assert [e["certified"] for e in ext] == [False] * (len(ext) - 1) + [True]
    assert all(e["failures"] for e in ext[:-1]) and ext[-1]["failures"] == []
    cert = post.certification
    assert cert.passed and cert.num_draws == n and cert.num_points == blr.x_test.shape[0]
    assert post.diagnostics["num_samples"] == n and post.trace.accept_prob.shape == (32, 300 + n)
    direct = pyrobdl.fit(blr_model(), blr.x_train, blr.y_train, num_samples=n, **kw)
    assert "extensions" not in direct.diagnostics
    for name in post.samples:
        assert torch.equal(post.samples[name], direct.samples[name]), name
    for field in ("accept_prob", "energy", "log_joint", "diverging", "num_steps", "step_size"):
        np.testing.assert_array_equal(getattr(post.trace, field), getattr(direct.trace, field), err_msg=field)
    assert post.cost.gradient_evaluations == direct.cost.gradient_evaluations
    assert direct.certification.to_dict() == cert.to_dict()


def test_certify_rhat_both_samples_until_split_and_nested_rhat_pass(blr):
    """certify_rhat="both": the chains (started in superchains) are extended until split R-hat
    passes too, not only nested R-hat (certify_rhat="nested"; "auto" checks both since
    REFERENCE_CRITERIA)."""
    kw = dict(method="chees", num_chains=32, superchain_size=4, num_warmup=300, seed=0, progress=False,
              certify_inputs=blr.x_test, num_samples=10, max_num_samples=400, extend_by=10)
    nested = pyrobdl.fit(blr_model(), blr.x_train, blr.y_train, certify_rhat="nested", **kw)
    both = pyrobdl.fit(blr_model(), blr.x_train, blr.y_train, certify_rhat="both", **kw)
    assert nested.certification.rhat_method == "nested" and both.certification.rhat_method == "both"
    n_nested = nested.diagnostics["extensions"][-1]["num_samples"]
    ext = both.diagnostics["extensions"]
    assert n_nested < ext[-1]["num_samples"] < 400  # measured: 20 and 110 draws per chain
    # certified by nested R-hat while split R-hat still failed; "both" went on until it passed
    assert nested.certification.rhat_nested_max <= 1.01 < nested.certification.rhat_split_max
    assert both.certification.passed and max(both.certification.rhat_split_max,
                                             both.certification.rhat_nested_max) <= 1.01
    last_failed = ext[-2]
    assert not last_failed["certified"] and last_failed["rhat_split_max"] > 1.01
    assert [f.split(" ")[1] for f in last_failed["failures"] if "R-hat" in f] == ["split"]  # not nested
    again = certify(both, blr.x_test, CertificationCriteria(rhat="both"))
    assert dataclasses.replace(again, inputs=both.certification.inputs).to_dict() == both.certification.to_dict()
    assert both.certification.inputs["source"] == "certify_inputs"
    with pytest.raises(ValueError, match=r"unknown certify_rhat 'bulk'; valid: \['auto', 'split', 'nested', 'both'\]"):
        pyrobdl.fit(blr_model(), blr.x_train, blr.y_train, certify_rhat="bulk", **kw)
    with pytest.raises(ValueError, match=r"certify_rhat='both' needs chains started in superchains"):
        pyrobdl.fit(blr_model(), blr.x_train, blr.y_train, certify_rhat="both", **{**kw, "superchain_size": 1})


@pytest.mark.parametrize("device", DEVICES)
def test_sampling_until_certified_stops_at_max_num_samples(device):
    x, y = small_data()
    held_back = torch.randn(9, 2, generator=torch.Generator().manual_seed(3))
    kw = dict(method="chees", num_chains=4, num_warmup=5, seed=1, device=device, progress=False,
              certify_inputs=held_back)
    with uncertified():
        post = pyrobdl.fit(small_mlp(), x, y, num_samples=4, max_num_samples=11, extend_by=4, **kw)
    ext = post.diagnostics["extensions"]
    assert [e["num_samples"] for e in ext] == [4, 8, 11] and not any(e["certified"] for e in ext)
    assert ext[-1]["failures"] == list(post.certification.failures)
    assert post.certification.num_points == 9 and post.cost.device.startswith(device)
    assert post.samples["layers.0.weight"].shape[:2] == (4, 11) and post.trace.energy.shape == (4, 16)
    with uncertified():
        direct = pyrobdl.fit(small_mlp(), x, y, num_samples=11, **kw)
    for name in post.samples:  # on the device too: the same draws as the run started with 11
        assert torch.equal(post.samples[name], direct.samples[name]), name


def test_certify_inputs_are_what_the_chains_are_certified_at(tmp_path):
    """certify_inputs (e.g. held-back test inputs) replace the first diagnostic_points training
    inputs; the settings record their number and SHA-256, so a saved posterior stays JSON."""
    x, y = small_data()
    held_back = torch.randn(7, 2, generator=torch.Generator().manual_seed(1))
    with uncertified():
        post = pyrobdl.fit(small_mlp(), x, y, method="chees", certify_inputs=held_back, **TINY)
    assert post.certification.num_points == 7
    again = certify(post, held_back, post.certification.criteria)
    assert dataclasses.replace(again, inputs=post.certification.inputs).to_dict() == post.certification.to_dict()
    assert post.certification.inputs == {"source": "certify_inputs", "points": 7,
                                         "sha256": post.settings["certify_inputs"]["sha256"]}
    assert post.diagnostics["function_space"] == post.convergence_summary(held_back)["function_space"]
    digest = post.settings["certify_inputs"]
    assert digest["points"] == 7 and len(digest["sha256"]) == 64
    with uncertified():
        other = pyrobdl.fit(small_mlp(), x, y, method="chees", certify_inputs=held_back + 1, **TINY)
    assert other.settings["certify_inputs"]["sha256"] != digest["sha256"]
    loaded = pyrobdl.load_posterior(post.save(tmp_path / "p"))
    assert loaded.settings["certify_inputs"] == digest


# -------------------------------------------------------------------------- 6. the steps cap
def test_num_steps_never_exceed_the_cap():
    """With no warm-up the initial trajectory length is used as it is: T = 50 at step 0.01 wants
    ceil(h 5000) >= 157 steps (h >= 1/32 over 20 iterations) and every iteration is cut to 2."""
    x, y = small_data()
    with pytest.warns(UserWarning) as caught:  # every warning of the fit, checked one by one below
        posterior = pyrobdl.fit(small_mlp(), x, y, method="chees", num_chains=2, num_warmup=0, num_samples=20,
                                step_size=0.01, max_num_steps=2, init_trajectory_length=50.0, progress=False)
    texts = [str(w.message) for w in caught]
    assert any(t.startswith("the chees posterior is not certified as a reference: ") for t in texts), texts
    assert any(re.search(r"max_num_steps=2 leapfrog steps in 20 of 20 sampling", t) for t in texts), texts
    # the trajectory length itself (50) needs 5000 steps of 0.01: cut to 2 x 0.01, and said so
    assert any(re.search(r"adapted trajectory length 50 needs more than max_num_steps=2 .* cut to 0\.02", t)
               for t in texts), texts
    assert (posterior.trace.num_steps == 2).all()
    d = posterior.diagnostics
    assert d["trajectory_length_capped"] is True and d["trajectory_length_wanted"] == pytest.approx(50.0)
    assert d["num_steps_cap_hits_sampling"] == 20 and d["num_steps_cap_hits_warmup"] == 0
    assert posterior.cost.gradient_evaluations == 2 * (1 + 20 * 2)  # no step-size search: given


def test_cap_during_warm_up_bounds_the_trajectory():
    """With warm-up, only iteration 0 can want more than the cap: every later T is clamped to
    max_num_steps x step, so no sampling iteration hits the cap; the clamp itself is reported
    (diagnostics and a warning) because the chains then move less than the adaptation asked."""
    x, y = small_data()
    with uncertified(), pytest.warns(UserWarning, match=r"adapted trajectory length .* needs more than max_num_steps=3"):
        posterior = pyrobdl.fit(small_mlp(), x, y, method="chees", num_chains=2, num_warmup=25, num_samples=10,
                                max_num_steps=3, init_trajectory_length=50.0, progress=False)
    assert posterior.diagnostics["trajectory_length_capped"] is True
    tr = posterior.trace
    assert tr.num_steps.max() <= 3 and tr.num_steps[0, 0] == 3
    d = posterior.diagnostics
    assert d["num_steps_cap_hits_warmup"] == 1 and d["num_steps_cap_hits_sampling"] == 0
    lengths = posterior.adaptation["trajectory_length"]
    assert (lengths[1:] <= 3 * tr.step_size[0, 1:] * (1 + 1e-12)).all()


def _adam_run(mode, log_t=0.0, step=0.01, cap=100, length=1.0, ceiling=math.inf):
    """What :func:`chees.run._update_trajectory` reads of a run."""
    from types import SimpleNamespace

    from pyrobdl.inference.chees.adaptation import _TrajectoryAdam

    traj = _TrajectoryAdam(log_t=log_t, lr=0.05)
    traj.log_t_avg = log_t
    return SimpleNamespace(options={"trajectory_adaptation": mode}, traj=traj, step=step, cap=cap,
                           trajectory_length=length, ceiling=ceiling)


def test_trajectory_adaptation_bounds_log_t():
    """A ChEES gradient that always says "longer": Adam's log T climbs by one clipped update (0.05,
    Adam's lr, as the sign is all that is left) per iteration when free, past log(cap x step) =
    log 1; projected it stops there; anchored it restarts every iteration from the consumed T, so
    it is never more than one update above it."""
    free, projected, anchored = (_adam_run(m) for m in ("free", "projected", "anchored"))
    for _ in range(200):
        for run in (free, projected, anchored):
            chees.run._update_trajectory(run, 1.0)
    assert free.traj.log_t == pytest.approx(200 * 0.05, rel=1e-6)
    assert projected.traj.log_t == pytest.approx(math.log(100 * 0.01))
    assert anchored.traj.log_t == pytest.approx(math.log(1.0) + 0.05, rel=1e-6)  # length 1.0 stays consumed
    # below: projected onto log(step)
    low = _adam_run("projected", log_t=math.log(0.01))
    for _ in range(50):
        chees.run._update_trajectory(low, -1.0)
    assert low.traj.log_t == pytest.approx(math.log(0.01))
    # a quarter-period ceiling below the steps' cap: projected onto it instead
    ceiled = _adam_run("ceiling", ceiling=0.3)
    for _ in range(200):
        chees.run._update_trajectory(ceiled, 1.0)
    assert ceiled.traj.log_t == pytest.approx(math.log(0.3))


def test_quarter_period_is_that_of_the_slowest_whitened_direction():
    """States drawn from a Gaussian whose whitened covariance has a known top eigenvalue: two unit
    variances with correlation 0.9 (eigenvalues 1.9 and 0.1) beside independent ones of variance 4
    (whitened: 1).  The window's estimate of (pi / 2) sqrt(1.9) is within its Monte Carlo error
    (20,000 states: the top sample eigenvalue's sd is about 1.9 * sqrt(2 / 20,000) = 0.019)."""
    from pyrobdl.inference.chees.adaptation import WindowVariance, quarter_period

    g = torch.Generator().manual_seed(0)
    cov = torch.diag(torch.tensor([1.0, 1.0, 4.0, 4.0, 4.0], dtype=torch.float64))
    cov[0, 1] = cov[1, 0] = 0.9
    chol = torch.linalg.cholesky(cov)
    w = WindowVariance("cross-chain", outer=True)
    for _ in range(500):  # 500 iterations of 40 chains, about a mean of 3
        w.add(3.0 + torch.randn(40, 5, generator=g, dtype=torch.float64) @ chol.T)
    var = w.variance()
    assert torch.allclose(var, torch.diagonal(cov), rtol=0.05)
    lam = (quarter_period(w, var) / (0.5 * math.pi)) ** 2
    assert lam == pytest.approx(1.9, abs=4 * 0.019)
    # whitened by the identity instead, the slowest direction is a variance-4 one
    assert (quarter_period(w, torch.ones(5, dtype=torch.float64)) / (0.5 * math.pi)) ** 2 == pytest.approx(4.0, abs=0.2)
    # a within-chain window sums each chain about its own first state: the same covariance, pooled
    within = WindowVariance("within-chain", outer=True)
    g = torch.Generator().manual_seed(0)
    for _ in range(500):
        within.add(3.0 + torch.randn(40, 5, generator=g, dtype=torch.float64) @ chol.T)
    assert quarter_period(within, var) == pytest.approx(quarter_period(w, var), rel=1e-9)
    with pytest.raises(RuntimeError, match="outer=True"):
        quarter_period(WindowVariance("cross-chain"), var)


def test_eigen_trajectory_is_the_last_windows_quarter_period():
    """``trajectory_adaptation="eigen"``: from the first mass-matrix window's end the consumed T is
    the last window's quarter period, constant between window ends and through sampling;
    ``"ceiling"``'s T never exceeds it; the default records none."""
    x, y = small_data()
    kw = dict(method="chees", num_chains=8, num_warmup=60, num_samples=10, progress=False, seed=1,
              init_trajectory_length=0.2, step_size_adaptation="continuous")
    with uncertified():
        eig = pyrobdl.fit(small_mlp(), x, y, trajectory_adaptation="eigen", **kw)
    with uncertified():
        ceil = pyrobdl.fit(small_mlp(), x, y, trajectory_adaptation="ceiling", **kw)
    with uncertified():
        free = pyrobdl.fit(small_mlp(), x, y, **kw)
    ends = chees.adaptation.warmup_windows(60)
    t_eig = eig.adaptation["trajectory_length"]
    for a, b in zip(ends, [*ends[1:], 70]):
        assert (t_eig[a:b] == t_eig[a]).all(), (a, b)
    q = eig.diagnostics["trajectory_quarter_period"]
    assert t_eig[-1] == pytest.approx(q, rel=1e-12) and q > 0.2  # not Adam's T from 0.2
    qc, t_ceil = ceil.diagnostics["trajectory_quarter_period"], ceil.adaptation["trajectory_length"]
    assert qc is not None and t_ceil[-1] <= qc * (1 + 1e-12)
    assert free.diagnostics["trajectory_quarter_period"] is None
    wide = pyrobdl.BayesianMLP(2, (2100,), 1, activation="tanh")  # 8,401 parameters
    with pytest.raises(ValueError, match=r"P = 8401 > 4096 parameters"):
        pyrobdl.fit(wide, x, y, trajectory_adaptation="eigen", **{**kw, "num_warmup": 2, "num_samples": 2})


def test_warmup_trajectory_scale_shortens_only_the_warmup():
    """``warmup_trajectory_scale=0.5``: every warm-up iteration takes ceil(0.5 h T / step) leapfrog
    steps (h its Halton jitter), every sampling iteration ceil(h T / step)."""
    x, y = small_data()
    with uncertified():
        post = pyrobdl.fit(small_mlp(), x, y, method="chees", num_chains=4, num_warmup=30, num_samples=10,
                           warmup_trajectory_scale=0.5, progress=False, seed=2)
    a = post.adaptation
    for it in range(40):
        scale = 0.5 if it < 30 else 1.0
        wanted = math.ceil(chees.adaptation.halton(it + 1) * scale * a["trajectory_length"][it] / a["step_size"][it])
        assert a["num_steps"][it] == max(1, min(1024, wanted)), it


def test_continuous_step_size_adaptation_searches_once():
    """``step_size_adaptation="continuous"``: one dual averaging over the whole warm-up, no step-size
    search at the window ends (only the first one, counted), the final step the moving average of its
    log iterates; ``"windowed"`` searches again at every window end."""
    x, y = small_data()
    kw = dict(method="chees", num_chains=4, num_warmup=40, num_samples=10, progress=False, seed=3)
    with uncertified():
        cont = pyrobdl.fit(small_mlp(), x, y, step_size_adaptation="continuous", **kw)
    with uncertified():
        win = pyrobdl.fit(small_mlp(), x, y, **kw)
    first = cont.diagnostics["step_size_search_chain_gradients"]
    assert first > 0 and win.diagnostics["step_size_search_chain_gradients"] > first
    # replayed from the recorded acceptance: every warm-up step is the one dual averaging's iterate,
    # the sampling step the t ** -0.5 moving average of its log iterates
    steps, tr = cont.adaptation["step_size"], cont.trace
    da = chees.adaptation._DualAveraging.start(float(steps[0]))
    for t in range(40):
        ap = torch.as_tensor(tr.accept_prob[:, t], dtype=torch.float32)[~torch.as_tensor(tr.diverging[:, t])]
        da.update(chees.kernel._harmonic_mean(ap) if len(ap) else 0.0, 0.651)
        if t < 39:
            assert steps[t + 1] == pytest.approx(math.exp(da.log_step), rel=1e-9)
    assert (steps[40:] == steps[40]).all()
    assert steps[40] == pytest.approx(math.exp(da.log_step_ma), rel=1e-9)
    # not Stan's average: the two averages of one run can lie close (4.5e-4 apart in log seen), so the
    # test is that the step matches the moving average to the replay's 1e-9 and Stan's not even to 1e-6
    assert steps[40] != pytest.approx(math.exp(da.log_step_bar), rel=1e-6)


def test_later_options_at_their_default_leave_a_checkpoints_identity_unchanged():
    """A checkpoint written before ``step_size_adaptation`` / ``trajectory_adaptation`` existed (its
    identity without them) still matches a run at their defaults; another value is another run."""
    from pyrobdl.inference.checkpoint import run_identity

    x, y = small_data()
    opts = {**chees.CHEES_OPTIONS, "seed": 0}
    old = {k: v for k, v in opts.items() if k not in ("step_size_adaptation", "trajectory_adaptation")}

    def identity(o):
        return run_identity(small_mlp(), x, y, o, exclude=chees._NOT_IDENTITY + chees.run._defaulted(o))

    assert identity(opts) == identity(old)
    assert identity({**opts, "step_size_adaptation": "continuous"}) != identity(old)
    assert identity({**opts, "trajectory_adaptation": "anchored"}) != identity(old)


# --------------------------------------------------------------------- 7. options, up front
@pytest.mark.parametrize(
    "options, error, match",
    [
        ({"num_chains": 1}, ValueError, r"num_chains must be an integer >= 2"),
        ({"num_chains": 4.0}, ValueError, r"num_chains must be an integer >= 2"),
        ({"num_warmup": -1}, ValueError, r"num_warmup must be an integer >= 0"),
        ({"num_samples": 0}, ValueError, r"num_samples must be an integer >= 1"),
        ({"target_accept_prob": 1.0}, ValueError, r"target_accept_prob must be in \(0, 1\)"),
        ({"target_accept_prob": 0}, ValueError, r"target_accept_prob"),
        ({"jitter": "x"}, ValueError, r"unknown jitter 'x'; valid: \['halton', 'uniform', 'none'\]"),
        ({"mass_matrix": "dense"}, ValueError,
         r"unknown mass_matrix 'dense'; valid: \['cross-chain', 'within-chain', 'per-chain'\]"),
        ({"init_strategy": "x"}, ValueError, r"unknown init_strategy 'x'; valid: \['prior', 'map', 'ensemble'\]"),
        ({"step_size_adaptation": "stan"}, ValueError,
         r"unknown step_size_adaptation 'stan'; valid: \['windowed', 'continuous'\]"),
        ({"trajectory_adaptation": "clipped"}, ValueError,
         r"unknown trajectory_adaptation 'clipped'; valid: \['free', 'projected', 'anchored', 'ceiling', 'eigen'\]"),
        ({"trajectory_adaptation": "eigen", "mass_matrix": "per-chain"}, ValueError,
         r"trajectory_adaptation='eigen' needs one metric for every chain"),
        ({"trajectory_adaptation": "ceiling", "num_chains": 8, "temperatures": [1.0, 0.5]}, ValueError,
         r"trajectory_adaptation='ceiling' needs one metric for every chain"),
        ({"warmup_trajectory_scale": 0.0}, ValueError, r"warmup_trajectory_scale must be in \(0, 1\], got 0.0"),
        ({"warmup_trajectory_scale": 1.5}, ValueError, r"warmup_trajectory_scale must be in \(0, 1\]"),
        ({"chunk_size": 0}, ValueError, r"chunk_size must be an integer >= 1"),
        ({"chunk_size": "x"}, ValueError, r"chunk_size"),
        ({"step_size": -1}, ValueError, r"step_size must be a finite number > 0 or None"),
        ({"step_size": float("inf")}, ValueError, r"step_size"),
        ({"max_num_steps": 0}, ValueError, r"max_num_steps must be an integer >= 1"),
        ({"init_trajectory_length": 0.0}, ValueError, r"init_trajectory_length"),
        ({"divergence_threshold": float("nan")}, ValueError, r"divergence_threshold"),
        ({"adapt_mass_matrix": 1}, TypeError, r"adapt_mass_matrix must be True or False"),
        ({"max_tree_depth": 5}, ValueError, r"method 'chees' does not take option\(s\) \['max_tree_depth'\]"),
        ({"superchain_size": 0}, ValueError, r"superchain_size must be an integer >= 1"),
        ({"superchain_size": 3}, ValueError, r"superchain_size=3 must divide num_chains=64 into at least 2 superchains"),
        ({"num_chains": 8, "superchain_size": 8}, ValueError, r"superchain_size=8 must divide num_chains=8"),
        ({"max_num_samples": 100}, ValueError, r"max_num_samples=100 must be >= num_samples=200"),
        ({"max_num_samples": 300.0}, ValueError, r"max_num_samples must be an integer >= 1"),
        ({"extend_by": 0}, ValueError, r"extend_by must be an integer >= 1"),
        ({"certify_inputs": torch.zeros(5, 3)}, ValueError,
         r"certify_inputs has 3 features but the model has in_features=2"),
        ({"certify_inputs": torch.full((5, 2), float("nan"))}, ValueError, r"certify_inputs"),
    ],
)
def test_bad_options_raise_before_running(monkeypatch, options, error, match):
    monkeypatch.setattr(chees.run, "FlatLogJoint", lambda *a, **k: pytest.fail("sampling started"))
    x, y = small_data()
    with pytest.raises(error, match=match):
        pyrobdl.fit(small_mlp(), x, y, method="chees", progress=False, **options)


def test_unsupported_models_raise_before_running(monkeypatch):
    monkeypatch.setattr(chees.run, "FlatLogJoint", lambda *a, **k: pytest.fail("sampling started"))
    x, y = small_data()
    with pytest.raises(ValueError, match="improper"):
        pyrobdl.fit(pyrobdl.BayesianMLP(2, (3,), 1, prior=pyrobdl.priors.LogUniform()), x, y, method="chees",
                    progress=False)

    class WiderPrior(pyrobdl.priors.Gaussian):
        """A prior the flat log joint does not implement."""

    with pytest.raises(TypeError, match="WiderPrior"):
        pyrobdl.fit(pyrobdl.BayesianMLP(2, (3,), 1, prior=WiderPrior(1.0)), x, y, method="chees", progress=False)


# ----------------------------------------------------------------------- 8. building blocks
def test_halton():
    # base 2 (van der Corput): the binary digits of i mirrored after the point
    assert [halton(i) for i in range(1, 9)] == [1 / 2, 1 / 4, 3 / 4, 1 / 8, 5 / 8, 3 / 8, 7 / 8, 1 / 16]
    assert [halton(i, base=3) for i in range(1, 5)] == pytest.approx([1 / 3, 2 / 3, 1 / 9, 4 / 9])
    assert halton(0) == 0.0
    values = [halton(i) for i in range(1, 1024)]
    assert len(set(values)) == 1023 and 0 < min(values) and max(values) < 1
    # low discrepancy: the first 2^k - 1 points put one point in each of the 2^k - 1 inner cells
    assert sorted(values) == [i / 1024 for i in range(1, 1024)]


@pytest.mark.parametrize("num_warmup, ends", [
    # Stan's windowed adaptation: a 75-iteration initial buffer, slow windows of 25, 50, 100, ...
    # the last absorbing the remainder, a 50-iteration terminal buffer (Stan reference manual,
    # "HMC algorithm parameters", Automatic parameter tuning): for 1000 the windows end at
    # 100, 150, 250, 450 and 950 (window 850-950 would leave room for no doubling, so absorbs)
    (1000, [100, 150, 250, 450, 950]),
    (300, [100, 150, 250]),  # the 100-wide third window ends exactly at the terminal buffer
    (200, [100, 150]),
    (150, [100]),
    # under 150: 15% / 75% / 10% buffers (int() rounding): 15 + one window to 90 + 10
    (100, [90]),
    (20, [18]),  # 3 + window to 18 + 2
    (19, []), (0, []),  # Stan adapts nothing below 20
])
def test_warmup_windows(num_warmup, ends):
    assert warmup_windows(num_warmup) == ends


def harmonic_trajectories(k: int, dim: int, t: float, seed: int, scale: torch.Tensor | None = None):
    """Stationary starts theta0 ~ N(0, S^2), momenta p ~ N(0, S^-2) (mass M = S^-2, the adapted one),
    and the exact end points of the Hamiltonian flow of U = |theta / S|^2 / 2 after time t:
    theta(t) = theta0 cos t + S^2 p sin t, p(t) = p cos t - theta0 / S^2 sin t (a harmonic
    oscillator of period 2 pi in the whitened coordinates theta / S)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(k, dim, generator=g, dtype=torch.float64)
    v = torch.randn(k, dim, generator=g, dtype=torch.float64)
    s = torch.ones(dim, dtype=torch.float64) if scale is None else scale
    theta0, p = u * s, v / s
    theta1 = theta0 * math.cos(t) + s * s * p * math.sin(t)
    p1 = p * math.cos(t) - theta0 / (s * s) * math.sin(t)
    return theta0, theta1, p1, s * s


@pytest.mark.parametrize("t", [0.3, 0.6, 1.0, 2.0, 2.6])
def test_chees_gradient_on_a_gaussian(t):
    r"""For a standard Gaussian in D dims and exact dynamics, ChEES(T) = 1/4 E[(|theta'|^2 - |theta|^2)^2]
    = D sin^2 T (each coordinate contributes sin^4 T E[(p^2 - theta^2)^2] + sin^2 2T E[theta^2 p^2]
    = 4 sin^2 T, over 4): maximal at a quarter period pi/2.  Its derivative D sin 2T times
    d T / d log T = T, normalised by (E|theta - mean|^2)^2 = D^2, gives T sin(2T) / D: positive below
    pi/2, negative between pi/2 and pi.  4096 chains; the tolerance is Z standard errors of the
    weighted mean of the per-chain terms."""
    k, dim = 4096, 4
    theta0, theta1, p1, inv_mass = harmonic_trajectories(k, dim, t, seed=int(10 * t))
    weights = torch.ones(k, dtype=torch.float64)
    g = chees_gradient(theta0, theta1, p1, inv_mass, weights, jitter=1.0, trajectory_length=t)
    # the per-chain terms the function averages, for their standard error
    c1, c0 = theta1 - theta1.mean(0), theta0 - theta0.mean(0)
    sq0 = (c0 * c0).sum(-1)
    per_chain = t * ((c1 * c1).sum(-1) - sq0) * (c1 * p1).sum(-1) / float(sq0.mean()) ** 2
    se = float(per_chain.std()) / math.sqrt(k)
    assert g == pytest.approx(float(per_chain.mean()), rel=1e-9)
    expected = t * math.sin(2 * t) / dim
    assert abs(g - expected) <= Z * se, (g, expected, se)
    assert (g > Z * se) if t < math.pi / 2 else (g < -Z * se)  # the sign, significantly
    # the jitter h scales the length: h T enters as a factor
    half = chees_gradient(theta0, theta1, p1, inv_mass, weights, jitter=0.5, trajectory_length=t)
    assert half == pytest.approx(g / 2)


def test_chees_gradient_whitens_with_the_mass_matrix():
    """A Gaussian with sds S sampled with the matched inverse mass S^2 is the standard Gaussian
    in theta / S: built from the same normal draws, the gradient is the same."""
    scale = torch.tensor([0.01, 0.3, 2.0, 50.0], dtype=torch.float64)
    unit = harmonic_trajectories(512, 4, 0.8, seed=0)
    scaled = harmonic_trajectories(512, 4, 0.8, seed=0, scale=scale)
    w = torch.rand(512, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    g_unit = chees_gradient(*unit, w, 1.0, 0.8)
    g_scaled = chees_gradient(*scaled, w, 1.0, 0.8)
    assert g_unit != 0 and g_scaled == pytest.approx(g_unit, rel=1e-10)
    # invariant to the overall scale of the posterior (the normalisation) too
    big = tuple(v * f for v, f in zip(unit, (1e3, 1e3, 1e-3, 1e6)))
    assert chees_gradient(*big, w, 1.0, 0.8) == pytest.approx(g_unit, rel=1e-10)


def test_chees_gradient_weights():
    theta0, theta1, p1, inv_mass = harmonic_trajectories(64, 3, 0.5, seed=2)
    ones = torch.ones(64, dtype=torch.float64)
    assert chees_gradient(theta0, theta1, p1, inv_mass, torch.zeros(64, dtype=torch.float64), 1.0, 0.5) == 0.0
    # chains with weight 0 (rejected, divergent) or a non-finite end point do not count: a
    # non-finite chain gives the same result as a zero weight, and weights are normalised
    bad = theta1.clone()
    bad[5] = float("nan")
    half = ones.clone()
    half[5] = 0.0
    a = chees_gradient(theta0, bad, p1, inv_mass, ones, 1.0, 0.5)
    b = chees_gradient(theta0, theta1, p1, inv_mass, half, 1.0, 0.5)
    assert math.isfinite(a) and a == pytest.approx(b, rel=1e-12)
    assert chees_gradient(theta0, theta1, p1, inv_mass, 3 * half, 1.0, 0.5) == pytest.approx(b, rel=1e-12)


def test_chees_gradient_with_one_metric_per_chain():
    """Per-chain inverse masses ``[K, P]`` that are all the same row give the ``[P]`` result; with
    different rows the criterion is taken in the coordinates the chains' mean metric whitens,
    with each chain's own velocity M_k^-1 p_k: built here by hand."""
    theta0, theta1, p1, inv_mass = harmonic_trajectories(256, 3, 0.7, seed=3)
    w = torch.rand(256, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    g = chees_gradient(theta0, theta1, p1, inv_mass, w, 1.0, 0.7)
    rows = inv_mass.expand(256, 3).clone()
    assert chees_gradient(theta0, theta1, p1, rows, w, 1.0, 0.7) == pytest.approx(g, rel=1e-12)
    rows = torch.rand(256, 3, generator=torch.Generator().manual_seed(5), dtype=torch.float64) + 0.5
    root = rows.mean(0).sqrt()
    z0, z1, vel = theta0 / root, theta1 / root, p1 * rows / root
    c0, c1 = z0 - z0.mean(0), z1 - (w[:, None] * z1).sum(0) / w.sum()
    sq0 = (c0 * c0).sum(-1)
    per_chain = 0.7 * ((c1 * c1).sum(-1) - sq0) * (c1 * vel).sum(-1)
    expected = float((w * per_chain).sum() / w.sum()) / float(sq0.mean()) ** 2
    assert chees_gradient(theta0, theta1, p1, rows, w, 1.0, 0.7) == pytest.approx(expected, rel=1e-12)


# ------------------------------------------------------------------ mass-matrix estimates
def window_states(k: int = 6, n: int = 40, dim: int = 3, seed: int = 0) -> torch.Tensor:
    """States ``[n, K, P]`` of a window: chain k sits at its own offset (a mode), spread 10 across
    chains, and moves with sd 0.1 (parameter 0), 1 (1) or 3 (2) about it."""
    g = torch.Generator().manual_seed(seed)
    offsets = 10.0 * torch.randn(k, dim, generator=g, dtype=torch.float64)
    sd = torch.tensor([0.1, 1.0, 3.0], dtype=torch.float64)[:dim]
    return offsets + sd * torch.randn(n, k, dim, generator=g, dtype=torch.float64)


def regularised(var: np.ndarray, n: int) -> np.ndarray:
    """Stan's regularisation of a variance estimated from n states."""
    return n / (n + 5.0) * var + 1e-3 * 5.0 / (n + 5.0)


@pytest.mark.parametrize("kind", ["cross-chain", "within-chain", "per-chain"])
def test_window_variance_matches_numpy(kind):
    states = window_states()
    n, k, _ = states.shape
    est = WindowVariance(kind)
    for t in states:
        est.add(t)
    x = states.numpy()
    expected = {
        "cross-chain": regularised(x.reshape(n * k, -1).var(0, ddof=1), n * k),
        "within-chain": regularised(x.var(0, ddof=1).mean(0), n * k),
        "per-chain": regularised(x.var(0, ddof=1), n),
    }[kind]
    got = est.variance().numpy()
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-12)


def test_within_chain_estimates_ignore_the_spread_between_chains():
    """Chains in different modes: the cross-chain variance is dominated by the spread of the modes
    (sd 10), the within-chain estimates see only how each chain moves (sd 0.1, 1, 3), within
    Monte Carlo error (the chi-square spread of a variance from K (n - 1) = 3,900 degrees of
    freedom: relative sd sqrt(2 / 3900) = 0.023; Z of them)."""
    states = window_states(k=100, n=40)
    est = {kind: WindowVariance(kind) for kind in ("cross-chain", "within-chain", "per-chain")}
    for t in states:
        for e in est.values():
            e.add(t)
    true = torch.tensor([0.01, 1.0, 9.0], dtype=torch.float64)
    within = est["within-chain"].variance()
    dof = states.shape[1] * (states.shape[0] - 1)
    assert ((within / true - 1).abs() <= Z * math.sqrt(2 / dof)).all(), within
    # the spread of the offsets (variance ~100) dominates the cross-chain estimate
    assert (est["cross-chain"].variance() > 50).all(), est["cross-chain"].variance()
    # per chain: K unbiased estimates whose mean, before regularisation, is the pooled one
    per, (n, k) = est["per-chain"].variance(), states.shape[:2]
    assert per.shape == (k, 3)
    unreg_per = (per - 1e-3 * 5 / (n + 5)) * (n + 5) / n
    unreg_within = (within - 1e-3 * 5 / (n * k + 5)) * (n * k + 5) / (n * k)
    torch.testing.assert_close(unreg_per.mean(0), unreg_within, rtol=1e-10, atol=0)


def test_window_variance_does_not_cancel_far_from_zero():
    """Sums are taken about the window's first state, so a variance of 1e-6 beside a mean of 1e4 is
    exact to float64 rounding (raw sums of squares would lose it: 1e8 against 1e-6)."""
    states = 1e4 + 1e-3 * window_states(k=4, n=30)
    for kind in ("cross-chain", "within-chain", "per-chain"):
        est = WindowVariance(kind)
        for t in states:
            est.add(t)
        ref = WindowVariance(kind)
        for t in states - 1e4:
            ref.add(t)
        np.testing.assert_allclose(est.variance().numpy(), ref.variance().numpy(), rtol=1e-6)


def test_window_variance_refuses_fewer_than_two_states():
    est = WindowVariance("per-chain")
    est.add(torch.zeros(3, 2))
    with pytest.raises(RuntimeError, match="at least 2 iterations, got 1"):
        est.variance()
    with pytest.raises(ValueError, match="unknown mass_matrix 'dense'"):
        WindowVariance("dense")


def test_leapfrog_with_one_metric_per_chain_is_each_chain_alone():
    """K chains with inverse masses ``[K, P]`` in one batched leapfrog land where each chain lands
    when integrated alone with its own ``[P]`` metric (the batch only stacks them)."""
    x, y = small_data()
    lj = FlatLogJoint(small_mlp(), x.double(), y.double(), chunk_size=None)
    g = torch.Generator().manual_seed(0)
    theta = 0.3 * torch.randn(5, lj.size, generator=g, dtype=torch.float64)
    p = torch.randn(5, lj.size, generator=g, dtype=torch.float64)
    inv_mass = torch.rand(5, lj.size, generator=g, dtype=torch.float64) + 0.1
    batch = chees._Sampler(lj, theta, g, 1000.0)
    batch.inv_mass = inv_mass
    out = batch.leapfrog(theta, p, batch.grad, 0.01, 7)
    for k in range(5):
        alone = chees._Sampler(lj, theta[k:k + 1], g, 1000.0)
        alone.inv_mass = inv_mass[k]
        one = alone.leapfrog(theta[k:k + 1], p[k:k + 1], alone.grad, 0.01, 7)
        for a, b in zip(out, one):
            torch.testing.assert_close(a[k:k + 1], b, rtol=1e-12, atol=1e-12)
    # each chain's kinetic energy uses its own metric
    torch.testing.assert_close(batch.kinetic(p), 0.5 * (p * p * inv_mass).sum(-1), rtol=1e-14, atol=0)


def test_leapfrog_with_one_step_size_per_chain_is_each_chain_alone():
    """A ``[K, 1]`` step (replica exchange: each rung its own) moves every chain as a leapfrog with
    its own scalar step would, alone."""
    x, y = small_data()
    lj = FlatLogJoint(small_mlp(), x.double(), y.double(), chunk_size=None)
    g = torch.Generator().manual_seed(1)
    theta = 0.3 * torch.randn(4, lj.size, generator=g, dtype=torch.float64)
    p = torch.randn(4, lj.size, generator=g, dtype=torch.float64)
    steps = torch.tensor([[0.01], [0.02], [0.005], [0.03]], dtype=torch.float64)
    batch = chees._Sampler(lj, theta, g, 1000.0)
    out = batch.leapfrog(theta, p, batch.grad, steps, 6)
    for k in range(4):
        alone = chees._Sampler(lj, theta[k:k + 1], g, 1000.0)
        one = alone.leapfrog(theta[k:k + 1], p[k:k + 1], alone.grad, float(steps[k, 0]), 6)
        for a, b in zip(out, one):
            torch.testing.assert_close(a[k:k + 1], b, rtol=1e-12, atol=1e-12)


def test_map_init_runs_and_counts_its_gradients(monkeypatch):
    starts, maps = [], []
    real_init, real_map = chees._Sampler.__init__, chees._map_init

    def spy_init(self, lj, theta, *a, **k):
        starts.append((lj, theta.clone()))
        real_init(self, lj, theta, *a, **k)

    def spy_map(lj, theta, *a, **k):
        out = real_map(lj, theta, *a, **k)
        maps.append((theta.clone(), out.clone()))
        return out

    monkeypatch.setattr(chees._Sampler, "__init__", spy_init)
    monkeypatch.setattr(chees.starts, "_map_init", spy_map)
    x, y = small_data()
    with uncertified():
        posterior = pyrobdl.fit(small_mlp(), x, y, method="chees", init_strategy="map", map_num_steps=40, seed=2,
                                **TINY)
    d = posterior.diagnostics
    assert d["map_chain_gradients"] == 4 * 40
    steps = int(posterior.trace.num_steps[0].sum())
    assert posterior.cost.gradient_evaluations == 4 * (1 + steps) + d["step_size_search_chain_gradients"] + 4 * 40
    # the chains start where the MAP fit ended, which is up the log joint from every prior draw
    [(lj, start)] = starts
    [(before, after)] = maps
    assert torch.equal(start, after)
    assert (lj.value_and_grad(after)[0] > lj.value_and_grad(before)[0]).all()
    with uncertified():
        pyrobdl.fit(small_mlp(), x, y, method="chees", seed=2, **TINY)
    assert len(maps) == 1 and torch.equal(starts[1][1], before)  # "prior": the same draws, no MAP


def test_map_start_runs_the_one_optimisation_loop_and_names_a_divergence(monkeypatch):
    """The MAP start is the ensemble's trainer (the SVI loop): a fit whose log joint becomes
    non-finite stops with an error naming the strategy and ``map_lr``, not a silent repair."""
    calls = []
    from pyrobdl.inference import ensemble

    real = ensemble.train_members

    def spy(lj, theta, settings, **k):
        calls.append(settings)
        return real(lj, theta, settings, **k)

    monkeypatch.setattr(ensemble, "train_members", spy)
    x, y = small_data()
    with uncertified():
        pyrobdl.fit(small_mlp(), x, y, method="chees", init_strategy="map", map_num_steps=30, map_lr=0.02, seed=1,
                    **TINY)
    assert [(c.num_steps, c.lr) for c in calls] == [(30, 0.02)]
    model = pyrobdl.BayesianMLP(x.shape[1], (8,), 1, likelihood=pyrobdl.likelihoods.GaussianLearnedPrecision(1.0, 0.01))
    with pytest.raises(FloatingPointError, match=r"init_strategy='map'.*became nan at step 1.*lower map_lr"):
        pyrobdl.fit(model, x, y, method="chees", init_strategy="map", map_num_steps=50, map_lr=1e12, seed=0, **TINY)


# ------------------------------------------------------------------------------ superchains
def test_superchains_share_their_start_and_are_certified_with_nested_rhat(tmp_path):
    """superchain_size=M: chains c*M .. (c+1)*M - 1 start from one prior draw (steps of 1e-9 keep
    every chain where it started), the fit certifies with nested R-hat over those superchains, the
    trace and a saved copy remember them, and a later ``certify`` uses the same criteria."""
    x, y = small_data()
    with uncertified() as record:
        post = pyrobdl.fit(small_mlp(), x, y, method="chees", num_chains=6, superchain_size=3, num_warmup=0,
                           num_samples=12, step_size=1e-9, init_trajectory_length=1e-9, max_num_steps=1,
                           seed=0, progress=False)
    w = post.samples["layers.0.weight"]  # [6, 12, 4, 2]
    for first in (0, 3):
        for c in (first + 1, first + 2):
            torch.testing.assert_close(w[c], w[first], rtol=0, atol=1e-6)
    assert (w[3] - w[0]).abs().max() > 0.1  # the two superchains start from different prior draws
    assert post.trace.superchain_size == 3
    cert = post.certification
    # "auto" over superchains: REFERENCE_CRITERIA, split and nested R-hat
    assert cert.rhat_method == "both" and cert.criteria.superchain_size == 3
    assert any(f.startswith("function-space nested R-hat") for f in cert.failures), cert.failures
    assert "nested R-hat" in str(record[0].message)
    loaded = pyrobdl.load_posterior(post.save(tmp_path / "p"))
    assert loaded.trace.superchain_size == 3
    again = loaded.certify(x[:20])
    assert again.rhat_method == "both" and again.rhat_max == cert.rhat_max


def test_superchains_fit_one_map_start_per_superchain(monkeypatch):
    maps = []
    real_map = chees._map_init
    monkeypatch.setattr(chees.starts, "_map_init", lambda lj, theta, *a, **k: maps.append(theta.shape) or real_map(lj, theta, *a, **k))
    x, y = small_data()
    with uncertified():
        post = pyrobdl.fit(small_mlp(), x, y, method="chees", init_strategy="map", map_num_steps=40,
                           superchain_size=2, seed=2, **TINY)
    assert maps[0][0] == 2 and post.diagnostics["map_chain_gradients"] == 2 * 40
    steps = int(post.trace.num_steps[0].sum())
    assert post.cost.gradient_evaluations == 4 * (1 + steps) + post.diagnostics["step_size_search_chain_gradients"] + 2 * 40


def test_independent_starts_are_recorded_and_certified_with_split_rhat():
    x, y = small_data()
    with uncertified():
        post = pyrobdl.fit(small_mlp(), x, y, method="chees", seed=5, **TINY)
    assert post.trace.superchain_size == 1 and post.certification.rhat_method == "split"
    w = post.samples["layers.0.weight"]
    assert not torch.allclose(w[0], w[1])  # (and every chain from its own prior draw)


# -------------------------------------------------------------------- replica exchange (tempering)
LADDER = [1.0, 0.5, 0.25, 0.125]


@pytest.mark.parametrize("kind", ["cross-chain", "within-chain", "per-chain"])
def test_grouped_window_variance_is_each_groups_own_estimate(kind):
    """With groups, every row carries the estimate of its own group of consecutive chains alone."""
    states = window_states(k=6, n=40)
    est = WindowVariance(kind, groups=3)
    for t in states:
        est.add(t)
    got = est.variance().numpy()
    assert got.shape == (6, 3)
    for g in range(3):
        alone = WindowVariance(kind)
        for t in states[:, 2 * g : 2 * g + 2]:
            alone.add(t)
        np.testing.assert_allclose(got[2 * g : 2 * g + 2], np.broadcast_to(alone.variance().numpy(), (2, 3)),
                                   rtol=1e-10)
    with pytest.raises(ValueError, match="groups must be an integer >= 1, got 0"):
        WindowVariance(kind, groups=0)


def test_tempered_log_joint_is_prior_plus_beta_times_likelihood():
    """Value and gradient to float64 rounding, every row at its own temperature; beta = 1 is the log joint."""
    torch.manual_seed(0)
    x, y = torch.randn(30, 3, dtype=torch.float64), torch.randn(30, dtype=torch.float64)
    model = pyrobdl.BayesianMLP(3, (4,), 1, activation="tanh", prior=pyrobdl.priors.Gaussian(1.0),
                                likelihood=pyrobdl.likelihoods.GaussianLearnedPrecision(2.0, 2.0)).double()
    lj = FlatLogJoint(model, x, y)
    theta = 0.5 * lj.sample_prior(6, generator=torch.Generator().manual_seed(1))
    beta = torch.tensor([1.0, 1.0, 0.3, 0.3, 0.01, 0.01], dtype=torch.float64)
    value, grad = chees._Tempered(lj, beta).value_and_grad(theta)
    lik, g_lik = lj.value_and_grad(theta, prior=False)
    prior, g_prior = lj.log_prior(theta)
    torch.testing.assert_close(value, prior + beta * lik, rtol=1e-10, atol=1e-9)
    torch.testing.assert_close(grad, g_prior + beta.unsqueeze(-1) * g_lik, rtol=1e-10, atol=1e-9)
    full, g_full = lj.value_and_grad(theta)
    torch.testing.assert_close(value[:2], full[:2], rtol=1e-12, atol=1e-9)
    torch.testing.assert_close(grad[:2], g_full[:2], rtol=1e-12, atol=1e-9)
    torch.testing.assert_close(chees._Tempered(lj, beta).log_likelihood(theta, value), lik, rtol=1e-8, atol=1e-8)


def test_swap_exchanges_neighbours_with_the_metropolis_probability():
    """Rungs are blocks of rows; the even-odd scheme pairs (0, 1), (2, 3) on even and (1, 2) on
    odd iterations; each column's exchange has probability min(1, exp((b_r - b_r+1)(l_r+1 - l_r)))
    and an accepted one swaps the two states, whose log joints and gradients are recomputed."""
    blr = bayesian_linear_regression(40, 10, 3, prior_scale=PRIOR_SCALE, precision=PRECISION, seed=1)
    lj = FlatLogJoint(blr_model().double(), blr.x_train.double(), blr.y_train.double())
    betas = torch.tensor(LADDER, dtype=torch.float64).repeat_interleave(3)  # 4 rungs x 3 columns
    tempered = chees._Tempered(lj, betas)
    gen = torch.Generator().manual_seed(0)
    for parity, pairs in ((0, [0, 2]), (1, [1])):
        theta = lj.sample_prior(12, generator=gen)
        sampler = chees._Sampler(tempered, theta.clone(), gen, 1000.0)
        ll = lj.value_and_grad(theta, prior=False)[0].view(4, 3)
        lower, prob, perm = chees._swap(sampler, tempered, 4, parity, gen)
        assert lower.tolist() == pairs
        if perm is not None:  # row i now holds the state that was in row perm[i]
            torch.testing.assert_close(sampler.theta, theta[perm], rtol=0, atol=0)
        b = torch.tensor(LADDER, dtype=torch.float64)
        for i, r in enumerate(pairs):
            expected = torch.exp(torch.clamp((b[r] - b[r + 1]) * (ll[r + 1] - ll[r]), max=0.0))
            torch.testing.assert_close(prob[i], expected, rtol=1e-8, atol=1e-12)
        moved = 0
        for r in range(4):
            for c in range(3):
                row, new = 3 * r + c, sampler.theta[3 * r + c]
                partner = [3 * q + c for q in (r - 1, r + 1) if 0 <= q < 4 and min(q, r) in pairs]
                assert any(torch.equal(new, theta[j]) for j in [row] + partner)
                moved += not torch.equal(new, theta[row])
        value, grad = tempered.value_and_grad(sampler.theta)
        torch.testing.assert_close(sampler.logp, value)
        torch.testing.assert_close(sampler.grad, grad)
        assert moved % 2 == 0  # exchanges move states in pairs


def test_tempered_chains_sample_the_exact_posterior(blr):
    """The beta = 1 rung of a 4-rung ladder (16 chains each) keeps the exact BLR posterior; only its
    chains are returned, every rung's gradients are counted.  Measured over seeds 0-5: the moments
    within tolerance in all six, swap acceptance 0.50-0.53, certified in five (function-space
    R-hat 1.0102 in the other): certification is not what is tested here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="the chees posterior is not certified", category=UserWarning)
        posterior = pyrobdl.fit(blr_model(), blr.x_train, blr.y_train, method="chees", num_chains=64,
                                num_warmup=300, num_samples=200, seed=0, progress=False, temperatures=LADDER)
    assert posterior.num_chains == 16 and posterior.trace.accept_prob.shape == (16, 500)
    assert posterior.diagnostics["function_space"]["rhat_max"] < GOOD_RHAT
    assert_moments(blr_draws(posterior), blr.posterior.mean.numpy(), blr.posterior.covariance.numpy())
    d = posterior.diagnostics
    assert d["num_chains"] == 16 and d["num_chains_all_rungs"] == 64 and d["temperatures"] == LADDER
    # every rung its own step size, rung 0's the one the trace records
    assert len(d["step_size_rungs"]) == 4 and d["step_size_rungs"][0] == d["step_size"] > 0
    assert all(s > 0 for s in d["step_size_rungs"])
    assert len(d["swap_accept_prob"]) == 3 and all(0.2 < a < 0.9 for a in d["swap_accept_prob"])
    leapfrogs = d["leapfrog_steps_warmup"] + d["leapfrog_steps_sampling"]
    assert posterior.cost.gradient_evaluations >= 64 * leapfrogs


def test_respace_ladder_equalises_a_known_barrier():
    """With rejections that are increments of a known cumulative barrier, repeated respacing
    converges to a ladder whose neighbours reject equally (measured: max/min 1.03 after one move,
    1 + 5e-6 after six); equal rates leave any ladder where it is; the ends never move."""
    barrier = lambda b: 0.3 * (-np.log(b)) ** 1.5 + 0.05 * (1 - b)  # noqa: E731
    ladder = list(np.geomspace(1.0, 0.01, 8))
    first = np.diff(barrier(np.array(ladder)))
    assert first.max() / first.min() > 3
    for _ in range(10):
        ladder = chees.respace_ladder(ladder, np.diff(barrier(np.array(ladder))))
        assert ladder[0] == 1.0 and ladder[-1] == 0.01 and all(a > b for a, b in zip(ladder, ladder[1:]))
    rej = np.diff(barrier(np.array(ladder)))
    assert rej.max() / rej.min() < 1 + 1e-6
    assert rej.sum() == pytest.approx(first.sum(), rel=1e-12)  # the barrier is the path's, not the ladder's
    uneven = [1.0, 0.7, 0.2, 0.15, 0.01]
    np.testing.assert_allclose(chees.respace_ladder(uneven, [0.3] * 4), uneven, rtol=1e-12)
    # rates of zero (never rejected) are floored, so the new ladder still decreases strictly
    zero = chees.respace_ladder(uneven, [0.0, 0.0, 0.9, 0.0])
    assert all(a > b for a, b in zip(zero, zero[1:]))
    with pytest.raises(ValueError, match=r"one finite rate per neighbouring pair \(4\)"):
        chees.respace_ladder(uneven, [0.1, 0.2])


def test_replica_tracker_counts_round_trips_and_arrivals_from_the_hot_end():
    """Three rungs of one chain; replicas named by their starting row (0 cold, 2 hot).  A round trip
    is coldest -> hottest -> coldest; an arrival from the hot end is any return to the coldest rung
    after a visit to the hottest (replica 2 starts there: an arrival, not a round trip)."""
    t = chees._ReplicaTracker(3, 3, torch.device("cpu"))
    up, down = torch.tensor([1, 0, 2]), torch.tensor([0, 2, 1])  # exchange rows (0, 1) / rows (1, 2)
    expected = [  # (perm, phase, replicas by row after it, [round trips, arrivals] per phase)
        (None, 0, [0, 1, 2], [[0, 0], [0, 0]]),
        (up, 0, [1, 0, 2], [[0, 0], [0, 0]]),
        (down, 0, [1, 2, 0], [[0, 0], [0, 0]]),   # replica 0 reaches the hot end
        (up, 0, [2, 1, 0], [[0, 1], [0, 0]]),     # replica 2 arrives from the hot end it started in
        (down, 0, [2, 0, 1], [[0, 1], [0, 0]]),   # replica 1 reaches the hot end
        (up, 0, [0, 2, 1], [[1, 2], [0, 0]]),     # replica 0 completes a round trip
        (None, 1, [0, 2, 1], [[1, 2], [0, 0]]),   # staying put counts nothing more
        (up, 1, [2, 0, 1], [[1, 2], [0, 0]]),
        (down, 1, [2, 1, 0], [[1, 2], [0, 0]]),
        (up, 1, [1, 2, 0], [[1, 2], [1, 1]]),     # replica 1: cold (step 2), hot (step 5), cold
    ]
    for perm, phase, rows, counts in expected:
        t.update(perm, phase)
        assert t.replica.tolist() == rows
        assert t.counts.tolist() == counts
    # sampling phase (the last four updates): replica 0 went from rung 0 to 2, replica 1 from 2 to 0,
    # replica 2 moved between rungs 1 and 0
    assert t.span.tolist() == [2, 2, 1]


def test_adapted_ladder_equalises_exchanges_and_keeps_the_posterior(blr):
    """A ladder with its rungs badly placed (1, 0.9, 0.8, then 0.005): the last pair almost never
    exchanges, so no state travels the ladder.  With ``adapt_temperatures`` the inner rungs move
    during warm-up until the exchange rates even out and states make round trips; the beta = 1
    rung keeps the exact BLR posterior either way.  Measured (seeds 0, 1): sampling-phase rates
    0.92 / 0.91 / 0.000 and no round trip fixed; 0.10-0.14 and 53-59 round trips adapted, the
    ladder moved to (1, 0.19, 0.029, 0.005)."""
    ladder = [1.0, 0.9, 0.8, 0.005]
    kw = dict(method="chees", num_chains=64, num_warmup=300, num_samples=200, seed=0, progress=False,
              temperatures=ladder)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="the chees posterior is not certified", category=UserWarning)
        fixed = pyrobdl.fit(blr_model(), blr.x_train, blr.y_train, **kw)
        adapted = pyrobdl.fit(blr_model(), blr.x_train, blr.y_train, adapt_temperatures=True, **kw)
    f, a = fixed.diagnostics, adapted.diagnostics
    assert f["temperatures"] == f["temperatures_initial"] == ladder
    assert min(f["swap_accept_prob_sampling"]) < 0.01 and f["round_trips"] <= 2
    assert a["temperatures_initial"] == ladder and a["temperatures"] != ladder
    b = a["temperatures"]
    assert b[0] == 1.0 and b[-1] == 0.005 and all(u > v for u, v in zip(b, b[1:]))
    rates = a["swap_accept_prob_sampling"]
    assert min(rates) > 0.05 and max(rates) / min(rates) < 2, rates
    assert a["round_trips"] >= 20 and a["hot_arrivals"] >= a["round_trips"]
    # how far states travel in the sampling phase (measured: median span 2 rungs fixed, 3 = the
    # whole ladder adapted)
    assert f["ladder_span"]["median"] <= 2 and a["ladder_span"]["median"] == 3
    for post in (fixed, adapted):
        assert_moments(blr_draws(post), blr.posterior.mean.numpy(), blr.posterior.covariance.numpy())
        replica = post.adaptation["replica"]  # [16 beta = 1 slots, 500 iterations]
        assert replica.shape == (16, 500)
        assert all(len(set(col)) == 16 for col in replica.T)  # one replica per slot at a time
        # the beta = 1 slots change hands only in even iterations, when pair (0, 1) is proposed
        changed = np.flatnonzero((np.diff(replica, axis=1) != 0).any(0)) + 1
        assert changed.size and (changed % 2 == 0).all()
    # three ladder moves, each recomputing all 64 rows, are counted
    leapfrogs = a["leapfrog_steps_warmup"] + a["leapfrog_steps_sampling"]
    assert adapted.cost.gradient_evaluations >= 64 * leapfrogs + 3 * 64


@pytest.mark.slow  # over 20 s on a loaded core: the slow run (CI runs it too) keeps the default run under 5 minutes
def test_replica_exchange_crosses_between_modes():
    """A 1x1 tanh network has two exactly symmetric weight-space modes, (w0, b0, w1) and (-w0, -b0,
    -w1), the same function, separated by a barrier of hundreds of nats: chains without tempering
    each stay in the mode they fell into; with a 12-rung ladder down to beta = 2^-11 the hot rungs
    cross the barrier and exchanges carry the crossings down, so every beta = 1 chain visits both
    (measured, seed 0: per-chain fractions of draws with w1 > 0 of 0.36-0.72 with tempering, 0 or 1
    without)."""
    g = torch.Generator().manual_seed(0)
    x = torch.linspace(-2, 2, 50).unsqueeze(-1)
    y = 2.0 * torch.tanh(1.5 * x[:, 0]) + 0.3 * torch.randn(50, generator=g)

    def model():
        return pyrobdl.BayesianMLP(1, (1,), 1, activation="tanh", prior=pyrobdl.priors.Gaussian(1.0),
                                   likelihood=pyrobdl.likelihoods.Gaussian(1 / 0.09))

    kw = dict(method="chees", num_warmup=300, num_samples=400, seed=0, progress=False)
    plain = pyrobdl.fit(model(), x, y, num_chains=8, **kw)
    tempered = pyrobdl.fit(model(), x, y, num_chains=96, temperatures=[0.5**i for i in range(12)], **kw)
    for post in (plain, tempered):  # the function is the same in both modes: certified either way
        assert post.certification.passed, post.certification.failures
    stuck = (plain.samples["layers.1.weight"][..., 0, 0] > 0).double().mean(1)
    assert set(stuck.tolist()) <= {0.0, 1.0}
    positive = (tempered.samples["layers.1.weight"][..., 0, 0] > 0).double()  # [8 chains, 400 draws]
    per_chain = positive.mean(1)
    assert ((per_chain > 0.1) & (per_chain < 0.9)).all(), per_chain
    # both modes equally likely: the overall fraction is 1/2 within Z Monte Carlo standard errors
    ess = float(convergence(positive.numpy()[..., None])["ess_bulk"][0])
    assert abs(float(positive.mean()) - 0.5) <= Z * math.sqrt(0.25 / ess)


def test_temperatures_built_with_numpy_are_numbers(blr):
    with uncertified():
        post = pyrobdl.fit(blr_model(), blr.x_train, blr.y_train, method="chees",
                           temperatures=np.array([1.0, 0.5], dtype=np.float32), **TINY)
    assert post.diagnostics["temperatures"] == [1.0, 0.5] and post.num_chains == 2


@pytest.mark.parametrize("temperatures, error, match", [
    ([0.5, 0.25], ValueError, r"temperatures\[0\] must be 1"),
    ([1.0, 0.5, 0.5], ValueError, "must decrease strictly from 1 and stay > 0"),
    ([1.0, 0.0], ValueError, "must decrease strictly from 1 and stay > 0"),
    ([1.0], ValueError, "at least 2 inverse temperatures"),
    ([1.0, 0.5, 0.25], ValueError, "num_chains=8 must be a multiple of len\\(temperatures\\)=3"),
    ("hot", TypeError, "temperatures must be None or a sequence"),
    ([1.0, float("nan")], TypeError, "temperatures must hold finite numbers"),
])
def test_temperatures_are_checked_up_front(blr, temperatures, error, match):
    with pytest.raises(error, match=match):
        pyrobdl.fit(blr_model(), blr.x_train, blr.y_train, method="chees", num_chains=8, temperatures=temperatures,
                    progress=False)
    with pytest.raises(ValueError, match="adapt_temperatures=True needs temperatures"):
        pyrobdl.fit(blr_model(), blr.x_train, blr.y_train, method="chees", num_chains=8, adapt_temperatures=True,
                    progress=False)
    with pytest.raises(TypeError, match="adapt_temperatures must be True or False, got 'yes'"):
        pyrobdl.fit(blr_model(), blr.x_train, blr.y_train, method="chees", num_chains=8, temperatures=[1.0, 0.5],
                    adapt_temperatures="yes", progress=False)
    with pytest.raises(ValueError, match="temperatures and superchain_size > 1 cannot be combined"):
        pyrobdl.fit(blr_model(), blr.x_train, blr.y_train, method="chees", num_chains=8, temperatures=[1.0, 0.5],
                    superchain_size=2, progress=False)


# -------------------------------------------------------------------------------- 9. CUDA
@pytest.mark.cuda
@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA device")
def test_cuda_matches_cpu_in_distribution(blr):
    """The same seed on CUDA draws other random numbers (another generator), so the chains differ;
    the posterior means must agree within Z standard errors of their difference."""
    kw = dict(method="chees", num_chains=32, num_warmup=300, num_samples=200, seed=0, progress=False)
    with warnings.catch_warnings():
        # other random numbers: the CUDA run may miss the certificate as one CPU seed in ten does (see
        # test_blr_exact_posterior); certification is not what is compared here
        warnings.filterwarnings("ignore", message="the chees posterior is not certified", category=UserWarning)
        cpu = pyrobdl.fit(blr_model(), blr.x_train, blr.y_train, device="cpu", **kw)
        gpu = pyrobdl.fit(blr_model(), blr.x_train, blr.y_train, device="cuda", **kw)
    assert gpu.samples["layers.0.weight"].device.type == "cuda" and gpu.cost.device.startswith("cuda")
    # the default compile="auto": compiled on CUDA (no fallback), eager on CPU
    assert gpu.settings["compile"] == cpu.settings["compile"] == "auto"
    assert gpu.diagnostics["compile_s"] > 0 and cpu.diagnostics["compile_s"] == 0.0
    # function draws at inputs on the CPU (as a user holds them): moved to the draws' device
    f_gpu = gpu.function_draws(blr.x_train[:5])
    assert f_gpu.device.type == "cuda" and f_gpu.shape == (32, 200, 5, 1)
    a, b = blr_draws(cpu), blr_draws(gpu)
    se = [d.std((0, 1)) / np.sqrt(convergence(d)["ess_bulk"]) for d in (a, b)]
    diff = np.abs(a.mean((0, 1)) - b.mean((0, 1)))
    assert (diff <= Z * np.sqrt(se[0] ** 2 + se[1] ** 2)).all(), diff
    assert_moments(b, blr.posterior.mean.numpy(), blr.posterior.covariance.numpy())


@pytest.mark.cuda
@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA device")
def test_cuda_tempered_chains_sample_the_exact_posterior(blr):
    """``test_tempered_chains_sample_the_exact_posterior`` on CUDA: the ladder's exchanges, its
    per-rung step sizes and the returned beta = 1 rung all stay on the device (compiled, the
    default there), and that rung keeps the exact BLR posterior."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="the chees posterior is not certified", category=UserWarning)
        posterior = pyrobdl.fit(blr_model(), blr.x_train, blr.y_train, method="chees", num_chains=64,
                                num_warmup=300, num_samples=200, seed=0, progress=False, temperatures=LADDER,
                                device="cuda")
    d = posterior.diagnostics
    assert posterior.samples["layers.0.weight"].device.type == "cuda" and d["compile_s"] > 0
    assert posterior.num_chains == 16 and d["num_chains_all_rungs"] == 64
    assert len(d["swap_accept_prob"]) == 3 and all(0.2 < a < 0.9 for a in d["swap_accept_prob"])
    assert_moments(blr_draws(posterior), blr.posterior.mean.numpy(), blr.posterior.covariance.numpy())
