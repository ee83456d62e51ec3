"""Pyro's NUTS tree and HMC trajectory on one flat tensor (pyrobdl.inference.flat_mcmc): the chain Pyro's
own methods run, bit for bit, and Pyro's methods wherever the shortcut would not be Pyro's behaviour."""

from __future__ import annotations

import warnings

import numpy as np
import pyro
import pyro.poutine as poutine
import pytest
import torch

import pyrobdl
from pyrobdl.inference import flat_mcmc, numpy_mcmc
from pyrobdl.inference.flat_mcmc import FlatTree, _FlatSiteKernel, _statements_are_plain


def _data(n=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=g)
    return x, torch.sin(2 * x[:, 0]) + 0.1 * torch.randn(n, generator=g)


def _fit(method, likelihood, fast, monkeypatch, tree="torch", **options):
    """One chain from seed 3, with the flat shortcut on (and counted) or off (Pyro's own methods);
    ``tree``: the shortcut's tensors ("torch") or its numpy twin ("numpy")."""
    calls = {"leaf": 0, "step": 0}
    numpy_tree = tree == "numpy"
    monkeypatch.setattr(_FlatSiteKernel, "numpy_tree", numpy_tree)
    module, cls = (numpy_mcmc, numpy_mcmc) if numpy_tree else (_FlatSiteKernel, FlatTree)
    step_name, leaf_name = ("leapfrog", "_leaf") if numpy_tree else ("_flat_step", "_flat_leaf")
    step, leaf = getattr(module, step_name), getattr(cls, leaf_name)

    def counted_step(*a):
        calls["step"] += 1
        return step(*a)

    def counted_leaf(*a):
        calls["leaf"] += 1
        return leaf(*a)

    monkeypatch.setattr(module, step_name, counted_step)
    monkeypatch.setattr(cls, leaf_name, counted_leaf)
    if not fast:
        monkeypatch.setattr(_FlatSiteKernel, "_flat_ready", lambda self: False)
    model = pyrobdl.BayesianMLP(2, (5,), 1, activation="tanh", likelihood=likelihood())
    x, y = _data()
    pyro.set_rng_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # short chains: not certified, trees saturated
        post = pyrobdl.fit(model, x, y, method=method, num_chains=1, num_warmup=40, num_samples=20,
                           potential="flat", progress=False, **options)
    monkeypatch.undo()
    return post, calls


CASES = [
    ("nuts", "fixed", torch.float32, dict(max_tree_depth=4)),
    ("nuts", "learned", torch.float64, dict(max_tree_depth=4)),
    ("nuts", "fixed", torch.float64, dict(max_tree_depth=3, full_mass=True)),
    ("hmc", "fixed", torch.float32, dict(num_steps=6, jitter=0.2)),
    ("hmc", "learned", torch.float64, dict(trajectory_length=0.5, full_mass=True)),
]


def _shortcut_and_pyro(method, likelihood, dtype, options, monkeypatch, tree="torch"):
    """The chain with the flat shortcut (its ``tree``) and Pyro's own, in ``dtype``, and their counts."""
    lik = (lambda: pyrobdl.likelihoods.GaussianLearnedPrecision(3.0, 2.0)) if likelihood == "learned" else (
        lambda: pyrobdl.likelihoods.Gaussian(25.0))
    torch.set_default_dtype(dtype)
    try:
        fast, used = _fit(method, lik, True, monkeypatch, tree=tree, **options)
        pyros, unused = _fit(method, lik, False, monkeypatch, **options)
    finally:
        torch.set_default_dtype(torch.float32)
    return fast, used, pyros, unused


@pytest.mark.parametrize("method,likelihood,dtype,options", CASES)
def test_flat_shortcut_runs_pyros_chain_bit_for_bit(method, likelihood, dtype, options, monkeypatch):
    # the shortcut's tensor operations (numpy_tree off): Pyro's floats exactly
    fast, used, pyros, unused = _shortcut_and_pyro(method, likelihood, dtype, options, monkeypatch)
    # the shortcut ran (else the comparison below would compare Pyro with itself) ...
    assert used["step"] > 100 and (method == "hmc" or used["leaf"] == used["step"])
    assert unused == {"leaf": 0, "step": 0}
    # ... and gave Pyro's chain: every draw, step count, step size, acceptance statistic and energy equal
    assert set(fast.samples) == set(pyros.samples)
    for k in fast.samples:
        assert fast.samples[k].dtype == dtype
        assert torch.equal(fast.samples[k], pyros.samples[k]), k
    for field in ("num_steps", "step_size", "accept_prob", "energy", "log_joint", "diverging"):
        np.testing.assert_array_equal(getattr(fast.trace, field), getattr(pyros.trace, field), err_msg=field)
    assert fast.cost.gradient_evaluations == pyros.cost.gradient_evaluations
    assert max(float(v.std(1).max()) for v in fast.samples.values()) > 0  # the chain moved


def test_tree_statements_are_plain_only_where_pyro_would_sample_them_plainly():
    assert _statements_are_plain()
    with poutine.block():  # MCMC.run's own handler: hides every site
        assert _statements_are_plain()
    with poutine.block(hide=["is_other_half_tree"]):
        assert _statements_are_plain()
    with poutine.block(hide=["something_else"]):  # the tree's statement would pass through to outer handlers
        assert not _statements_are_plain()
    with poutine.trace():  # a handler that records the statement
        assert not _statements_are_plain()
    with poutine.trace(), poutine.block():  # blocked inside: the trace does not see it
        assert _statements_are_plain()


def test_nuts_under_a_recording_handler_takes_pyros_tree(monkeypatch):
    # A handler innermost of MCMC.run's block would see the tree's sample statements: Pyro's tree runs.
    real = flat_mcmc._statements_are_plain
    monkeypatch.setattr(flat_mcmc, "_statements_are_plain", lambda: False)
    post, calls = _fit("nuts", lambda: pyrobdl.likelihoods.Gaussian(25.0), True, monkeypatch, max_tree_depth=3)
    assert calls["leaf"] == 0 and post.samples
    assert real()


def test_flat_site_energy_and_grad_equal_pyros_potential_grad():
    from pyro.infer.autoguide.initialization import init_to_sample
    from pyro.infer.mcmc.util import initialize_model
    from pyro.ops.integrator import potential_grad

    from pyrobdl.inference.mcmc_kernels import _FlatSite

    model = pyrobdl.BayesianMLP(2, (5,), 1, activation="tanh",
                                likelihood=pyrobdl.likelihoods.GaussianLearnedPrecision(3.0, 2.0))
    x, y = _data()
    site = _FlatSite(model, x, y)
    pyro.set_rng_seed(0)
    z, _, _, _ = initialize_model(model, (x, y), init_strategy=init_to_sample)
    u = site.pack(z)
    grads, pe = potential_grad(site.potential, u)
    pe2, g2 = site.energy_and_grad(u[site.NAME])
    assert torch.equal(pe, pe2) and torch.equal(grads[site.NAME], g2)
    assert not g2.is_inference() and not pe2.is_inference()  # Pyro caches and adapts with them
    # the numpy tree's potential: the same floats on arrays (permutations and negation are exact)
    g3, pe3 = site.numpy_energy()(u[site.NAME].detach().numpy())
    assert site.to_pyro is not None  # the permutation to Pyro's order is exercised
    assert np.array_equal(g3, g2.numpy()) and pe3 == pe2.item() and g3.dtype == np.float32


# The numpy twin (pyrobdl.inference.numpy_mcmc) computes the same expressions, but numpy's dot, exp and
# log1p round differently from torch's in the last place.  In float64 that stays ~1e-9 relative over
# whole adapted chains (measured 1e-13 to 4e-6, growing along long trajectories); in float32 the step-size adaptation feeds an acceptance
# statistic one ulp apart back into the step size and the chains part after some iterations (measured:
# NUTS case 1 differed in its tree sizes by the end of warm-up), so the float32 NUTS case runs at a fixed
# step size and mass matrix, where the tree's own arithmetic and decisions are what is compared.
NUMPY_CASES = [
    ("nuts", "fixed", torch.float32, dict(max_tree_depth=4, step_size=0.01, adapt_step_size=False,
                                           adapt_mass_matrix=False)),
    ("nuts", "fixed", torch.float64, dict(max_tree_depth=4)),
    *CASES[1:],
]


@pytest.mark.parametrize("method,likelihood,dtype,options", NUMPY_CASES)
def test_numpy_tree_runs_pyros_chain_up_to_rounding(method, likelihood, dtype, options, monkeypatch):
    fast, used, pyros, _ = _shortcut_and_pyro(method, likelihood, dtype, options, monkeypatch, tree="numpy")
    # the numpy tree ran every leaf and step (Pyro's tree none: _fit counted only numpy's) ...
    assert used["step"] > 100 and (method == "hmc" or used["leaf"] == used["step"])
    # ... and gave Pyro's chain up to rounding: the same tree sizes and decisions, the draws within 1e-5 (a
    # last-place difference grows along each trajectory: the float64 NUTS case, 60 iterations of 15-step
    # trees, measured 3.9e-6 at most, the other cases 3e-9 or less, the float32 ones 0)
    tol = 1e-5
    for k in fast.samples:
        assert fast.samples[k].dtype == dtype
        torch.testing.assert_close(fast.samples[k], pyros.samples[k], rtol=tol, atol=tol, msg=k)
    for field in ("num_steps", "diverging"):
        np.testing.assert_array_equal(getattr(fast.trace, field), getattr(pyros.trace, field), err_msg=field)
    for field in ("step_size", "accept_prob", "energy", "log_joint"):
        np.testing.assert_allclose(getattr(fast.trace, field), getattr(pyros.trace, field), rtol=tol, atol=tol,
                                   err_msg=field)
    assert fast.cost.gradient_evaluations == pyros.cost.gradient_evaluations
    assert max(float(v.std(1).max()) for v in fast.samples.values()) > 0


def test_numpy_doubling_loop_counts_pyros_divergences(monkeypatch):
    # a fixed step size too large for part of the posterior: the numpy loop (FlatTree.sample) records the
    # divergent iterations Pyro's own NUTS.sample records, at the same iterations
    options = dict(max_tree_depth=4, step_size=0.05, adapt_step_size=False, adapt_mass_matrix=False)
    fast, used, pyros, _ = _shortcut_and_pyro("nuts", "fixed", torch.float64, options, monkeypatch, tree="numpy")
    assert used["leaf"] == used["step"] > 100
    diverging = np.asarray(fast.trace.diverging)
    assert diverging.sum() > 0 and not diverging.all()  # some divergent iterations, and the chain moves
    np.testing.assert_array_equal(diverging, np.asarray(pyros.trace.diverging))
    np.testing.assert_array_equal(fast.trace.num_steps, pyros.trace.num_steps)
    for k in fast.samples:
        torch.testing.assert_close(fast.samples[k], pyros.samples[k], rtol=1e-5, atol=1e-5, msg=k)
