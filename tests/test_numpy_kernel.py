"""The flat log joint's numpy kernel (pyrobdl.flat.numpy_kernel): which calls it serves, and what it
returns at the edges. Its values and gradients against Pyro's potential and the autograd twin are
in tests/test_flat.py (the ``kernel`` fixture runs those tests on both kernels)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import pyrobdl
from pyrobdl.flat import FlatLogJoint, numpy_kernel


def log_joint(n: int = 20, hidden=(5,), dtype=torch.float32) -> FlatLogJoint:
    g = torch.Generator().manual_seed(0)
    model = pyrobdl.BayesianMLP(2, hidden, 1, activation="tanh", likelihood=pyrobdl.likelihoods.Gaussian(10.0))
    return FlatLogJoint(model, torch.randn(n, 2, generator=g, dtype=dtype), torch.randn(n, generator=g, dtype=dtype))


def test_small_cpu_calls_go_to_numpy_and_the_rest_to_torch():
    """Rows x data points x the widest layer at most MAX_NUMPY_ELEMENTS, one minibatch (or none),
    float32/64 and no autograd: numpy; otherwise the torch kernel."""
    lj = log_joint(n=20)  # widest layer 5: 100 elements per row
    limit = numpy_kernel.MAX_NUMPY_ELEMENTS
    theta = torch.zeros(limit // 100, lj.size)
    assert numpy_kernel.usable(lj, theta, None)
    assert not numpy_kernel.usable(lj, torch.zeros(limit // 100 + 1, lj.size), None)
    assert numpy_kernel.usable(lj, torch.zeros(limit // 10, lj.size), torch.arange(2))  # B = 2: 10 per row
    assert not numpy_kernel.usable(lj, theta[:2], torch.zeros(2, 3, dtype=torch.long))  # a minibatch per row
    assert not numpy_kernel.usable(lj, theta[:2].requires_grad_(), None)
    half = log_joint(dtype=torch.float64)
    half.dtype = torch.float16  # (the flat path's dtypes are the data's; only float32/64 go to numpy)
    assert not numpy_kernel.usable(half, theta[:2], None)


def test_the_numpy_kernel_runs_only_when_switched_on(monkeypatch):
    lj = log_joint()
    theta = lj.sample_prior(2, generator=torch.Generator().manual_seed(1))
    calls = []
    real = numpy_kernel.value_and_grad
    monkeypatch.setattr(numpy_kernel, "value_and_grad", lambda *a: calls.append(1) or real(*a))
    lj.value_and_grad(theta)
    assert len(calls) == 1
    monkeypatch.setattr(FlatLogJoint, "numpy_kernel", False)
    lj.value_and_grad(theta)
    assert len(calls) == 1


def test_overflow_gives_inf_without_numpy_warnings_as_torch_does():
    """Huge parameters: the same non-finite pattern as the torch kernel, and no numpy
    RuntimeWarning (the samplers and the SVI loop detect non-finite values themselves)."""
    lj = log_joint()
    theta = torch.full((2, lj.size), 3e19)
    theta[1] = 0.1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        v_np, g_np = lj.value_and_grad(theta)
    lj_torch = log_joint()
    lj_torch.numpy_kernel = False
    v_t, g_t = lj_torch.value_and_grad(theta)
    assert torch.equal(torch.isfinite(v_np), torch.isfinite(v_t))
    assert not torch.isfinite(v_np[0]) and torch.isfinite(v_np[1])
    assert torch.isfinite(g_np[1]).all()


def test_outputs_are_fresh_tensors_and_theta_is_left_alone():
    """The results own their memory (a caller adding into them changes nothing of the log joint's
    state), theta is not written, and a non-contiguous theta gives the contiguous one's results."""
    lj = log_joint(dtype=torch.float64)
    theta = lj.sample_prior(3, generator=torch.Generator().manual_seed(2))
    before = theta.clone()
    v1, g1 = lj.value_and_grad(theta)
    g1.add_(1.0)
    v1.add_(1.0)
    v2, g2 = lj.value_and_grad(theta)
    assert torch.equal(theta, before)
    assert torch.equal(v2 + 1.0, v1) and torch.equal(g2 + 1.0, g1)
    wide = torch.zeros(3, 2 * lj.size, dtype=torch.float64)
    wide[:, ::2] = theta
    v3, g3 = lj.value_and_grad(wide[:, ::2])
    assert torch.equal(v3, v2) and torch.equal(g3, g2)
    assert not np.shares_memory(g2.numpy(), lj._numpy_plan.neg_prior_prec)


def test_inference_mode_and_the_svi_loop_use_it():
    """Inside inference mode (the samplers' and SVI loop's) the numpy kernel serves the call and
    its outputs behave like the torch kernel's there."""
    lj = log_joint()
    theta = lj.sample_prior(1, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        v, g = lj.value_and_grad(theta)
        g.mul_(2.0)
    lj_torch = log_joint()
    lj_torch.numpy_kernel = False
    v_t, g_t = lj_torch.value_and_grad(theta)
    torch.testing.assert_close(v, v_t, rtol=1e-5, atol=0)
    torch.testing.assert_close(g, 2.0 * g_t, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["map", "mean_field", "ensemble"])
def test_a_fit_through_the_numpy_kernel_follows_the_torch_kernels(method, monkeypatch):
    """Whole SVI fits in float64 from one seed, numpy kernel against torch kernel: the first 20 steps'
    objectives agree to float64 rounding (TOL64 of tests/test_flat.py: the same function evaluated
    two ways), and after 3,000 steps both sit in the same basin (the means of their last 200
    objectives closer than the two fits' own spread there). A MAP fit's later steps amplify the
    kernels' rounding differences (measured 0.08 relative at step 1,000 while the objective still
    climbs), so the steps in between are not compared."""
    import pyro

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(40, 1, generator=g)
        y = torch.sin(2 * x[:, 0]) + 0.1 * torch.randn(40, generator=g)
        model = pyrobdl.BayesianMLP(1, (8,), 1, activation="tanh", likelihood=pyrobdl.likelihoods.Gaussian(100.0))
        histories, calls = {}, []
        real = numpy_kernel.value_and_grad_np  # what every numpy path of the step calls
        monkeypatch.setattr(numpy_kernel, "value_and_grad_np", lambda *a: calls.append(1) or real(*a))
        for use in (True, False):
            monkeypatch.setattr(FlatLogJoint, "numpy_kernel", use)
            assert len(calls) == (0 if use else 3000)  # one call a step, only with the numpy kernel on
            pyro.set_rng_seed(5)
            post = pyrobdl.fit(model, x, y, method=method, num_steps=3000, lr=0.01, progress=False)
            histories[use] = np.asarray(post.history, dtype=np.float64)
    finally:
        torch.set_default_dtype(old)
    a, b = histories[True], histories[False]
    assert a.shape == b.shape == (3000,)
    early = np.abs(a[:20] - b[:20]) / np.maximum(np.abs(b[:20]), 1.0)
    assert early.max() < 1e-10
    assert abs(a[-200:].mean() - b[-200:].mean()) < a[-200:].std() + b[-200:].std()
