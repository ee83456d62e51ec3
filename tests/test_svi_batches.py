"""The SVI loop's minibatches (pyrobdl.inference.svi._Batches) keep the N mod B leftover points.

Every epoch visits every training point once, its last batch the ``N mod B`` points left (as the
ensemble's trainer and ``torch.utils.data.DataLoader`` do), and every estimator scales each
batch's likelihood by ``N`` over that batch's own size.  The proof that the estimator stays
unbiased is exact, not Monte Carlo: on N = 5 points in batches of 2 (2 + 2 + 1 per epoch), the
minibatch ELBO averaged over all 5! = 120 shuffles, at every step of the epoch, equals the
full-data ELBO in value and gradient at the same guide draws (float64, to rounding).
"""

from __future__ import annotations

import itertools

import pyro
import pytest
import torch
from test_flat import TOL64, float64, make_data, make_model  # noqa: F401

import pyrobdl
from pyrobdl.guides import Dropout, MeanField
from pyrobdl.inference.elbo import make_elbo
from pyrobdl.inference.svi import _Batches, _epochs_covered

N, B = 5, 2  # epochs of 2 + 2 + 1


def epoch_of(batches: _Batches) -> list[torch.Tensor]:
    return [batches.next() for _ in range(-(-batches.num_data // batches.batch_size))]


@pytest.mark.parametrize("n, b", [(10, 4), (10, 5), (7, 3), (5, 2)])
def test_every_epoch_visits_every_point_once_with_the_leftover_last(n, b):
    torch.manual_seed(0)
    batches = _Batches(n, b, torch.device("cpu"))
    sizes = [b] * (n // b) + ([n % b] if n % b else [])
    for _ in range(3):
        epoch = epoch_of(batches)
        assert [len(i) for i in epoch] == sizes
        assert sorted(torch.cat(epoch).tolist()) == list(range(n))


def test_full_batch_gives_no_indices():
    assert _Batches(5, 5, torch.device("cpu")).next() is None
    assert _Batches(5, 9, torch.device("cpu")).next() is None


@pytest.mark.parametrize("steps, n, b, epochs", [(9, 10, 4, 3.0), (10, 10, 4, 3.4), (40, 100, 25, 10.0),
                                                 (40, 100, 30, 10.0), (7, 10, 10, 7.0)])
def test_epochs_covered_counts_points_visited(steps, n, b, epochs):
    torch.manual_seed(1)
    batches = _Batches(n, b, torch.device("cpu"))
    visited = sum(n if (i := batches.next()) is None else len(i) for _ in range(steps))
    assert _epochs_covered(steps, n, b) == pytest.approx(epochs) == pytest.approx(visited / n)


def test_fit_records_the_epochs_of_the_leftover_batches():
    torch.manual_seed(0)
    x, y = torch.randn(100, 2), torch.randn(100)
    p = pyrobdl.fit(pyrobdl.BayesianMLP(2, (), 1), x, y, num_steps=40, batch_size=30, progress=False)
    assert p.cost.epochs == pytest.approx(10.0)  # 4 steps per epoch: 30 + 30 + 30 + 10


# ------------------------------------------------------------------ the estimator stays unbiased
def guide_for(kind, model):
    return {"mean_field": lambda: MeanField(model, init_scale=0.3),
            "dropout": lambda: Dropout(model, p=0.3)}[kind]()


def loss_and_grad(fn, guide, x, y, idx, seed):
    """The loss and its gradient in the guide's parameters at the draws of ``seed``; the flat path
    through ``loss_and_grad`` (what the SVI loop calls), the others through autograd."""
    torch.manual_seed(seed)
    pyro.set_rng_seed(seed)
    if hasattr(fn, "loss_and_grad"):
        loss = fn.loss_and_grad(x, y, idx)
        return loss.detach(), torch.cat([v.grad.reshape(-1) for v in fn.parameters_to_optimize()])
    params = [p for p in guide.parameters() if p.requires_grad]
    with pyro.get_param_store().scope():
        loss = fn(x, y, idx)
        grads = torch.autograd.grad(loss, params)
    return loss.detach(), torch.cat([g.reshape(-1) for g in grads])


@pytest.mark.parametrize("kind, elbo, kl", [
    ("mean_field", "direct", "analytic"),        # the flat path (FlatELBO)
    ("mean_field", "direct", "monte_carlo"),
    ("mean_field", "distributions", "analytic"),  # DirectELBO
    ("mean_field", "trace", "monte_carlo"),       # Pyro's Trace_ELBO through the model's plate
    ("dropout", "direct", "analytic"),            # the flat MC-dropout path
])
def test_expected_minibatch_elbo_over_an_epoch_is_the_full_elbo(float64, monkeypatch, kind, elbo, kl):
    torch.manual_seed(3)
    model = make_model("scalar", "learned-1", (4,), "tanh")
    x, y = make_data(model, n=N)
    y = model.likelihood.prepare_targets(y, model.out_features)
    guide = guide_for(kind, model)
    with torch.no_grad():  # away from the initialisation
        for p in guide.parameters():
            p.add_(0.2 * torch.randn_like(p))
    fn = make_elbo(model, guide, elbo=elbo, kl=kl)
    fn.kl_weight = 0.7  # the KL term is not scaled by the batch, only the likelihood
    full_loss, full_grad = loss_and_grad(fn, guide, x, y, None, seed=11)

    perms = [torch.tensor(p) for p in itertools.permutations(range(N))]
    feed = iter(perms)
    monkeypatch.setattr(torch, "randperm", lambda n, device=None: next(feed))
    batches = _Batches(N, B, torch.device("cpu"))
    per_step = [[], [], []]  # step of the epoch -> (loss, grad) over all shuffles
    for _ in perms:
        for step, idx in enumerate(epoch_of(batches)):
            per_step[step].append(loss_and_grad(fn, guide, x, y, idx, seed=11))
    for step, pairs in enumerate(per_step):
        loss = torch.stack([p[0] for p in pairs]).mean()
        grad = torch.stack([p[1] for p in pairs]).mean(0)
        assert abs(float(loss - full_loss)) / max(1.0, abs(float(full_loss))) < TOL64, step
        assert float((grad - full_grad).abs().max() / full_grad.abs().max()) < TOL64, step
    # the leftover batch alone, weighted by its share of the epoch, makes the epoch's sum exact:
    # sum over the batches of (B_j / N) * minibatch loss = full loss, for every single shuffle
    for shuffle in range(0, len(perms), 37):
        total = sum(len(i) / N * per_step[j][shuffle][0] for j, i in
                    enumerate((perms[shuffle][:2], perms[shuffle][2:4], perms[shuffle][4:])))
        assert abs(float(total - full_loss)) / max(1.0, abs(float(full_loss))) < TOL64
