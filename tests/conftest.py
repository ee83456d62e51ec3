"""Shared test set-up: a clean Pyro state per test, fixed seeds, and device parametrisation."""

from __future__ import annotations

import os
from pathlib import Path

import pyro
import pytest
import torch

# Tiny models on a 2-core machine: one thread avoids OpenMP oversubscription (DESIGN.md traps).
torch.set_num_threads(1)

#: Where the shared datasets live: PYROBDL_DATA_DIR, else ../shared/datasets beside the repo.
DATA_DIR = Path(os.environ.get("PYROBDL_DATA_DIR", Path(__file__).resolve().parents[2] / "shared" / "datasets"))

#: Devices every device-aware test runs on: CPU always, CUDA when present.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

#: torch.compile's CPU backend and the fused kernel build C++: their tests need a compiler (.ci/run installs g++).
needs_cxx = pytest.mark.skipif(
    __import__("shutil").which(os.environ.get("CXX", "g++")) is None,
    reason="torch.compile and the fused kernel on CPU need a C++ compiler (g++, or $CXX)",
)


def leapfrog_inputs(lj, k: int, scale: float = 1.0, seed: int = 5):
    """A leapfrog block's inputs for ``lj``'s tests: positions (prior draws x ``scale``), momenta, the step times
    an inverse mass, and each row's own step and final coefficient (half its step)."""
    g = torch.Generator().manual_seed(seed)
    theta = lj.sample_prior(k, generator=g) * scale
    p = torch.randn(k, lj.size, generator=g)
    step = torch.rand(k, 1, generator=g) * 0.05
    scaled = step * torch.rand(lj.size, generator=g).add(0.5)
    return theta, p, scaled, step, 0.5 * step


def leapfrog_steps(value_and_grad, theta, p, scaled, step, last, m: int):
    """``m`` leapfrog steps one by one through ``value_and_grad``: positions, momenta, value and gradient at the end."""
    for i in range(m):
        theta = theta + scaled * p
        value, grad = value_and_grad(theta)
        p = p + (step if i < m - 1 else last) * grad
    return theta, p, value, grad


@pytest.fixture(autouse=True)
def _reset_pyro():
    """Clear the parameter store and reseed before each test (Pyro's own tests do the same)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    yield
    pyro.clear_param_store()


@pytest.fixture
def data_dir() -> Path:
    """The datasets root; tests that need real data are skipped when it is absent."""
    if not DATA_DIR.is_dir():
        pytest.skip(f"datasets directory {DATA_DIR} not found (set PYROBDL_DATA_DIR)")
    return DATA_DIR


@pytest.fixture(params=["torch", "numpy"])
def flat_kernel(request, monkeypatch):
    """Each of the two implementations behind the flat paths' value and gradient: the torch kernel,
    and the numpy twin that small CPU calls go to by default (pyrobdl/flat/numpy_kernel.py,
    pyrobdl/inference/numpy_elbo.py); with "numpy" the test must have been served by it."""
    from pyrobdl.flat import FlatLogJoint, numpy_kernel
    from pyrobdl.inference import numpy_elbo

    monkeypatch.setattr(FlatLogJoint, "numpy_kernel", request.param == "numpy")
    calls = []
    for module, name in ((numpy_kernel, "value_and_grad"), (numpy_kernel, "log_likelihood"),
                         (numpy_elbo, "lrt_likelihood"), (numpy_elbo, "normal_loss_and_grad"),
                         (numpy_elbo, "vd_loss_and_grads"), (numpy_elbo, "score_loss_and_grad")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real: calls.append(1) or real(*a))
    yield request.param
    assert bool(calls) == (request.param == "numpy")
