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


# --------------------------------------------------------------------------------- the method
PRECISION, PRIOR_SCALE = 10.0, 1.0
# Every member's MAP on Bayesian linear regression is the exact posterior mean, and the
# maximum-likelihood estimate is least squares.  On 10 points with prior sd 0.3 the two differ by
# 0.63 posterior sd; full-batch Adam (lr 0.05, cosine decay, the loop's averaging, 1000 steps)
# measured errors of 1e-7 sd (float32 data).  0.01 sd is a wide margin that still tells MAP from
# ML apart by a factor of 60.
MEAN_TOL_IN_SD = 0.01
SMALL_PRIOR = 0.3


@pytest.fixture(scope="module")
def blr():
    from pyrobdl.datasets import bayesian_linear_regression

    return bayesian_linear_regression(100, 20, 3, prior_scale=PRIOR_SCALE, precision=PRECISION, seed=0)


@pytest.fixture(scope="module")
def blr_small():
    from pyrobdl.datasets import bayesian_linear_regression

    return bayesian_linear_regression(10, 20, 3, prior_scale=SMALL_PRIOR, precision=PRECISION, seed=0)


def blr_model(prior_scale: float = PRIOR_SCALE) -> pyrobdl.BayesianMLP:
    return pyrobdl.BayesianMLP(3, (), 1, prior=pyrobdl.priors.Gaussian(prior_scale),
                               likelihood=pyrobdl.likelihoods.Gaussian(PRECISION))


@pytest.mark.parametrize("prior", [True, False])
def test_members_reach_the_map_or_the_least_squares_solution(blr_small, prior):
    d = blr_small
    post = pyrobdl.fit(blr_model(SMALL_PRIOR), d.x_train, d.y_train, "ensemble", num_members=2, num_steps=1000,
                       lr=5e-2, lr_schedule="cosine", prior=prior, progress=False)
    x1 = torch.cat([d.x_train.double(), torch.ones(d.x_train.shape[0], 1, dtype=torch.float64)], 1)
    least_squares = torch.linalg.lstsq(x1, d.y_train.double().unsqueeze(-1)).solution.squeeze(-1)
    target, other = (d.posterior.mean, least_squares) if prior else (least_squares, d.posterior.mean)
    sd = d.posterior.posterior_sd
    err = ((post.theta.double() - target) / sd).abs().max().item()
    assert err < MEAN_TOL_IN_SD, f"members off by {err:.3g} posterior sd"
    assert ((target - other) / sd).abs().max().item() > 50 * MEAN_TOL_IN_SD  # the test can tell them apart
    assert post.history.shape == (1000,)
    assert post.diagnostics["objective"] == ("log joint" if prior else "log-likelihood")


def gap_data(n: int = 40):
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.rand(n // 2, 1, generator=g) - 1.5, torch.rand(n // 2, 1, generator=g) + 0.5])
    return x, torch.sin(2 * x[:, 0]) + 0.1 * torch.randn(n, generator=g)


def test_members_differ_and_sample_cycles_through_them():
    x, y = gap_data()
    model = pyrobdl.BayesianMLP(1, (8,), 1, activation="tanh", likelihood=pyrobdl.likelihoods.Gaussian(100.0))
    post = pyrobdl.fit(model, x, y, "ensemble", num_members=3, num_steps=300, batch_size=10, progress=False)
    members = post.members
    draws = post.sample(7)
    for name, v in draws.items():
        assert v.shape[0] == 7
        for i in range(7):
            torch.testing.assert_close(v[i], members[name][i % 3], rtol=0, atol=0)
    w = members["layers.0.weight"].reshape(3, -1)
    assert (w[0] - w[1]).abs().max() > 1e-2 and (w[1] - w[2]).abs().max() > 1e-2
    pred = post.predict(torch.linspace(-2, 2, 5).unsqueeze(-1), num_samples=6)
    assert pred.samples.shape == (6, 5, 1)
    torch.testing.assert_close(pred.samples[:3], pred.samples[3:])  # members in order, twice
    assert (pred.epistemic_variance > 0).all()


def test_cost_counts_every_members_gradients(blr):
    post = pyrobdl.fit(blr_model(), blr.x_train, blr.y_train, "ensemble", num_members=3, num_steps=50,
                       batch_size=20, progress=False)
    assert post.cost.gradient_evaluations == 50 * 3
    assert post.cost.epochs == pytest.approx(50 * 3 * 20 / 100)
    assert post.cost.cpu_time_s is not None and post.cost.cpu_time_s > 0


def test_each_member_has_its_own_minibatch_order():
    from pyrobdl.inference.ensemble import _MemberBatches

    torch.manual_seed(0)
    batches = _MemberBatches(4, 12, 3, torch.device("cpu"))
    epoch = torch.cat([batches.next() for _ in range(4)], 1)  # one epoch: [K, N]
    for row in epoch:
        assert sorted(row.tolist()) == list(range(12))  # without replacement within an epoch
    assert len({tuple(r.tolist()) for r in epoch}) == 4  # four different orders
    assert _MemberBatches(4, 12, 12, torch.device("cpu")).next() is None  # full batch


def test_seed_makes_the_ensemble_reproducible(blr):
    kw = dict(num_members=2, num_steps=20, batch_size=10, progress=False)
    a = pyrobdl.fit(blr_model(), blr.x_train, blr.y_train, "ensemble", seed=3, **kw)
    b = pyrobdl.fit(blr_model(), blr.x_train, blr.y_train, "ensemble", seed=3, **kw)
    c = pyrobdl.fit(blr_model(), blr.x_train, blr.y_train, "ensemble", seed=4, **kw)
    assert torch.equal(a.theta, b.theta) and not torch.equal(a.theta, c.theta)


def test_nan_objective_names_the_step(blr):
    with pytest.raises(FloatingPointError, match=r"log joint became -inf at step 1; last finite log joint -\d\.\d+e\+23 at step 0"):
        # a finite first step, then a learning rate of 1e25 throws the weights to inf: NaN
        pyrobdl.fit(blr_model(), blr.x_train, blr.y_train * 1e10, "ensemble", num_members=2, num_steps=20,
                    lr=1e25, progress=False)


@pytest.mark.parametrize("options, error, match", [
    ({"num_members": 0}, ValueError, "num_members"),
    ({"prior": "yes"}, TypeError, "prior"),
    ({"batch_size": 0}, ValueError, "batch_size"),
    ({"lr_schedule": "step"}, ValueError, "lr_schedule"),
    ({"chunk_size": -1}, ValueError, "chunk_size"),
    ({"num_particles": 4}, ValueError, "num_particles"),
])
def test_bad_options_fail_before_any_work(blr, options, error, match):
    with pytest.raises(error, match=match):
        pyrobdl.fit(blr_model(), blr.x_train, blr.y_train, "ensemble", progress=False, **options)


def test_improper_prior_is_refused():
    model = pyrobdl.BayesianMLP(2, (3,), 1, prior=pyrobdl.priors.LogUniform())
    with pytest.raises(ValueError, match="improper"):
        pyrobdl.fit(model, torch.randn(8, 2), torch.randn(8), "ensemble", progress=False)


# ------------------------------------------------------------------ ensemble-initialised chains
def test_chees_chains_start_from_ensemble_members(monkeypatch):
    from pyrobdl.inference import chees, ensemble

    starts, trained = [], []
    real_init, real_train = chees._Sampler.__init__, ensemble.train_members

    def spy_init(self, lj, theta, *a, **k):
        starts.append(theta.clone())
        real_init(self, lj, theta, *a, **k)

    def spy_train(lj, theta, *a, **k):
        out = real_train(lj, theta, *a, **k)
        trained.append((theta.clone(), out.theta.clone()))
        return out

    monkeypatch.setattr(chees._Sampler, "__init__", spy_init)
    monkeypatch.setattr(ensemble, "train_members", spy_train)
    x, y = gap_data(20)
    model = pyrobdl.BayesianMLP(1, (4,), 1, activation="tanh", likelihood=pyrobdl.likelihoods.Gaussian(100.0))
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="the chees posterior is not certified", category=UserWarning)
        post = pyrobdl.fit(model, x, y, "chees", init_strategy="ensemble", map_num_steps=30, num_chains=4,
                           num_warmup=10, num_samples=10, seed=1, progress=False)
    [(before, after)] = trained
    [start] = starts
    assert torch.equal(start, after) and start.shape == (4, before.shape[1])
    # nn.Linear-style starts: every weight inside +-1/sqrt(fan_in) (prior draws would not be)
    assert before.abs().max() <= 1.0
    assert post.diagnostics["map_chain_gradients"] == 4 * 30
    assert post.cost.gradient_evaluations >= 4 * 30 + post.diagnostics["leapfrog_steps_warmup"] * 4


def test_member_batches_visit_every_point_once_per_epoch():
    """Issue 38: an epoch ends with the N mod B points left (as DataLoader does), never drops them."""
    from pyrobdl.inference.ensemble import _MemberBatches

    torch.manual_seed(0)
    n, b, k = 23, 5, 3
    batches = _MemberBatches(k, n, b, torch.device("cpu"))
    for _ in range(3):  # three epochs
        sizes, seen = [], []
        while sum(sizes) < n:
            idx = batches.next()
            assert idx.shape[0] == k
            sizes.append(idx.shape[1])
            seen.append(idx)
        assert sizes == [5, 5, 5, 5, 3]
        epoch = torch.cat(seen, 1)
        for member in epoch:  # each member: a permutation of all points
            assert torch.equal(member.sort().values, torch.arange(n))
        assert not torch.equal(epoch[0], epoch[1])  # independent orders
