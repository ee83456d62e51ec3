"""The fused SVI step (``elbo="direct_compiled"``, pyrobdl.inference.flat_step): the loss and the
parameters after many steps equal to the flat ELBO stepped by PackedAdam and by torch's Adam,
eagerly (the same operations) and compiled (equal to float rounding); the loop's schedule, KL
warm-up and averaging go through it unchanged; what it cannot run is refused by name.
"""

from __future__ import annotations

import copy

import pyro
import pytest
import torch
from test_flat import TOL64, float64, make_data, make_model  # noqa: F401
from test_flat_dropout import VD_CASES, vd_setup

import pyrobdl
from pyrobdl.guides import MAP, Dropout, MeanField, VariationalDropout
from pyrobdl.inference import flat_step
from pyrobdl.inference.elbo import make_elbo
from pyrobdl.inference.flat_step import FusedFlatAdam
from pyrobdl.inference.svi import PackedAdam

CASES = [
    # (guide, kl, likelihood, hidden, activation, particles); "mean_field_lrt": with local reparameterization
    ("mean_field", "analytic", "gaussian-1", (5,), "relu", 1),
    ("mean_field", "monte_carlo", "gaussian-2", (4, 3), "tanh", 1),
    ("mean_field", "analytic", "learned-1", (5,), "tanh", 3),
    ("mean_field", "monte_carlo", "learned-2", (4, 3), "relu", 2),
    ("mean_field", "analytic", "categorical-3", (5,), "relu", 1),
    ("map", "monte_carlo", "learned-1", (5,), "relu", 1),
    ("map", "monte_carlo", "categorical-3", (4, 3), "tanh", 1),
    ("mean_field_lrt", "analytic", "learned-1", (4, 3), "relu", 2),
    ("mean_field_lrt", "monte_carlo", "gaussian-1", (5,), "tanh", 1),
    ("mean_field_lrt", "analytic", "categorical-3", (5,), "relu", 1),
    ("dropout", "analytic", "gaussian-1", (5,), "relu", 1),
    ("dropout", "monte_carlo", "learned-1", (4, 3), "tanh", 2),  # two packed vectors: the fallback's too
    ("gaussian_dropout", "analytic", "categorical-3", (5,), "relu", 1),
    # variational dropout: ("vd-<variant>-<local|weights>", kl, VD_CASES index, -, -, particles)
    ("vd-sparse-local", "analytic", 0, None, None, 1),
    ("vd-kingma-local", "analytic", 1, None, None, 2),
    ("vd-ard-weights", "analytic", 2, None, None, 1),
    ("vd-sparse-weights", "monte_carlo", 4, None, None, 3),
    ("vd-kingma-weights", "monte_carlo", 3, None, None, 1),
]


def _pair(case, dtype=torch.float64):
    guide_name, kl, lik, hidden, act, particles = case
    if guide_name.startswith("vd-"):  # test_flat_dropout's variational dropout set-up (its spread of log alpha)
        _, variant, local = guide_name.split("-")
        model, guide = vd_setup(VD_CASES[lik], variant, local == "local", seed=1)
        x, y = make_data(model, n=40, dtype=dtype)
        ref = make_elbo(model, guide, kl=kl, num_particles=particles)
        fused = make_elbo(model, copy.deepcopy(guide), elbo="direct_compiled", kl=kl, num_particles=particles)
        return ref, fused, x, y
    model = make_model("per_layer", lik, hidden, act).to(dtype)
    x, y = make_data(model, n=40, dtype=dtype)
    if guide_name == "map":
        guide = MAP(model).to(dtype)
    elif guide_name.endswith("dropout"):
        guide = Dropout(model, p=0.2, sigma=0.05, kind="bernoulli" if guide_name == "dropout" else "gaussian").to(dtype)
    else:
        guide = MeanField(model, init_scale=0.1, local_reparameterization=guide_name == "mean_field_lrt").to(dtype)
    ref = make_elbo(model, guide, kl=kl, num_particles=particles)
    fused = make_elbo(model, copy.deepcopy(guide), elbo="direct_compiled", kl=kl, num_particles=particles)
    return ref, fused, x, y


def _run_both(ref, fused, x, y, steps, compile, minibatch=True):
    """The eager loop (FlatELBO.loss_and_grad, PackedAdam.step) and the fused step on the same
    minibatches and draws, with a changing learning rate and KL weight; losses [steps] and final vectors."""
    vecs = ref.parameters_to_optimize()
    start = torch.cat(vecs).clone()
    adam = PackedAdam(vecs, lr=0.02)
    opt = FusedFlatAdam(fused, lr=0.02, compile=compile)
    g = torch.Generator().manual_seed(1)
    idxs = [torch.randperm(x.shape[0], generator=g)[:16] if minibatch else None for _ in range(steps)]
    out = []
    for which in ("ref", "fused"):
        pyro.set_rng_seed(7)
        losses = []
        for step, idx in enumerate(idxs):
            lr, beta = 0.02 * (1 - step / (2 * steps)), min(1.0, (step + 1) / 10)
            if which == "ref":
                ref.kl_weight, adam.param_groups[0]["lr"] = beta, lr
                losses.append(ref.loss_and_grad(x, y, idx))
                adam.step()
            else:
                fused.kl_weight, opt.param_groups[0]["lr"] = beta, lr
                losses.append(opt.loss_and_step(x, y, idx))
        out.append(torch.stack(losses))
    assert opt.t == steps
    assert float((torch.cat(vecs) - start).abs().max()) > 1e-3  # the parameters moved
    return out[0], out[1], torch.cat(vecs), torch.cat(opt.params)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_eager_fused_step_equals_flat_elbo_and_packed_adam(float64, case):
    """The same operations in the same order: equal (to TOL64) over 40 steps, every case."""
    ref, fused, x, y = _pair(case)
    l_ref, l_fused, v_ref, v_fused = _run_both(ref, fused, x, y, 40, compile=False)
    assert float((l_ref - l_fused).abs().max() / l_ref.abs().max()) < TOL64
    assert float((v_ref - v_fused).abs().max() / v_ref.abs().max()) < TOL64


def test_fused_step_equals_torch_adam_on_the_per_site_parameters(float64):
    """Against torch.optim.Adam (what pyro.optim.Adam wraps) over the guide's per-site
    parameters, with the gradient from autograd through FlatELBO.forward: equal after 60 steps."""
    ref, fused, x, y = _pair(CASES[2])
    guide = ref.guide
    params = [guide._parameters[n + "_unconstrained"] for n in guide._packs["params"]]
    adam = torch.optim.Adam(params, lr=0.03)
    opt = FusedFlatAdam(fused, lr=0.03, compile=False)
    pyro.set_rng_seed(3)
    for _ in range(60):
        adam.zero_grad()
        ref(x, y).backward()
        adam.step()
    pyro.set_rng_seed(3)
    for _ in range(60):
        opt.loss_and_step(x, y, None)
    per_site = torch.cat([p.detach().reshape(-1) for p in params])
    assert float((per_site - opt.vector).abs().max() / per_site.abs().max()) < TOL64


@pytest.mark.slow
# one case per family, the cheapest to compile (Inductor needed 2.5–5 minutes for two-layer local
# reparameterization with 2 particles on this project's loaded 2-core machine)
@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[5], CASES[9], CASES[11], CASES[13], CASES[16]],
                         ids=lambda c: "-".join(map(str, c)))
def test_compiled_fused_step_equals_flat_elbo_and_packed_adam(float64, case):
    """Compiled (Inductor may reorder sums and fuse): equal to float64 rounding over 40 steps,
    minibatch and full batch (two graph shapes; minibatch only for the local-reparameterization
    graphs, the slowest to compile)."""
    local = case[0] == "mean_field_lrt" or case[0].endswith("-local")
    for minibatch in (True,) if local else (True, False):
        ref, fused, x, y = _pair(case)
        l_ref, l_fused, v_ref, v_fused = _run_both(ref, fused, x, y, 40, compile=True, minibatch=minibatch)
        assert float((l_ref - l_fused).abs().max() / l_ref.abs().max()) < TOL64
        assert float((v_ref - v_fused).abs().max() / v_ref.abs().max()) < TOL64


@pytest.mark.slow
def test_compiled_fit_float32_matches_the_eager_fit_and_reuses_its_graph():
    """fit(elbo="direct_compiled") in float32 against fit(elbo="direct") with the same seed,
    schedule, warm-up and averaging: the ELBO histories and guides agree to float32 rounding
    (relative 1e-7 per operation, a few hundred steps: 1e-4); a second fit of the same shapes
    compiles no new graph."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = pyrobdl.BayesianMLP(3, (8,), 1, prior=pyrobdl.priors.Gaussian(1.0),
                                likelihood=pyrobdl.likelihoods.GaussianLearnedPrecision(3.0, 2.0))
    x = torch.randn(200, 3)
    y = torch.sin(x[:, 0]) + 0.1 * torch.randn(200)
    opts = dict(num_steps=300, lr=1e-2, batch_size=32, lr_schedule="cosine", kl_warmup=50, average_last=0.2,
                progress=False, seed=4)
    eager = pyrobdl.fit(model, x, y, "mean_field", **opts)
    compiled = pyrobdl.fit(model, x, y, "mean_field", elbo="direct_compiled", **opts)
    assert abs(eager.history - compiled.history).max() < 1e-4 * abs(eager.history).max()
    a, b = eager.guide.packed("params"), compiled.guide.packed("params")
    assert float((a - b).abs().max()) < 1e-4 * float(a.abs().max())
    graphs = counters["stats"]["unique_graphs"]
    again = pyrobdl.fit(model, x, y, "mean_field", elbo="direct_compiled", **{**opts, "seed": 5})
    assert counters["stats"]["unique_graphs"] == graphs
    assert not torch.equal(again.guide.packed("params"), b)  # another seed, the same graph


def test_fit_through_the_fused_step_equals_the_flat_fit(float64, monkeypatch):
    """The loop with the fused optimizer (compilation switched off here; the slow test above
    compiles): the learning-rate schedule, KL warm-up and Polyak averaging give the same fit."""
    monkeypatch.setattr(flat_step.torch, "compile", lambda fn, **kw: fn)
    model = make_model("scalar", "learned-1", (5,), "tanh")
    x, y = make_data(model, n=60)
    opts = dict(num_steps=120, lr=1e-2, batch_size=16, lr_schedule="linear", kl_warmup=30, average_last=0.3,
                progress=False, seed=2)
    for method, extra in (("mean_field", {}), ("mean_field", {"local_reparameterization": True}), ("map", {}),
                          ("dropout", {}), ("gaussian_dropout", {})):
        a = pyrobdl.fit(model, x, y, method, **opts, **extra)
        b = pyrobdl.fit(model, x, y, method, elbo="direct_compiled", **opts, **extra)
        assert abs(a.history - b.history).max() < TOL64 * abs(a.history).max()
        va = torch.cat([p.detach().reshape(-1) for p in a.guide.parameters()])
        vb = torch.cat([p.detach().reshape(-1) for p in b.guide.parameters()])
        assert float((va - vb).abs().max() / va.abs().max()) < TOL64
        assert b.settings["elbo"] == "direct_compiled"
    vd = pyrobdl.BayesianMLP(3, (5,), 1, activation="tanh", prior=pyrobdl.priors.LogUniform())
    for local in (True, False):
        a = pyrobdl.fit(vd, x, y, "variational_dropout", local_reparameterization=local, **opts)
        b = pyrobdl.fit(vd, x, y, "variational_dropout", local_reparameterization=local, elbo="direct_compiled", **opts)
        assert abs(a.history - b.history).max() < TOL64 * abs(a.history).max()
        va, vb = a.guide.packed("params"), b.guide.packed("params")
        assert float((va - vb).abs().max() / va.abs().max()) < TOL64


def test_what_the_fused_step_cannot_run_is_refused_by_name():
    model = pyrobdl.BayesianMLP(2, (3,), 1)
    x, y = torch.randn(20, 2), torch.randn(20)
    with pytest.raises(ValueError, match="direct_compiled.*flat path.*Monte Carlo KL"):
        pyrobdl.fit(model, x, y, "gaussian_dropout", elbo="direct_compiled", kl="monte_carlo", num_steps=2, progress=False)
    with pytest.raises(ValueError, match="DirectELBO is not pyrobdl's flat ELBO"):
        FusedFlatAdam(make_elbo(model, MeanField(model), elbo="distributions"), lr=0.01)
    with pytest.raises(ValueError, match="direct_compiled.*flat path"):
        pyrobdl.fit(model, x, y, "bbvi", elbo="direct_compiled", num_steps=2, progress=False)
    vd = pyrobdl.BayesianMLP(2, (3,), 1, prior=pyrobdl.priors.LogUniform())
    vd_guide = VariationalDropout(vd)
    with torch.no_grad():
        vd_guide.layers_0_weight_mask[0, 0] = 0.0  # pruned: no flat form
    with pytest.raises(ValueError, match="direct_compiled.*flat path"):
        make_elbo(vd, vd_guide, elbo="direct_compiled")


def test_new_data_rebuild_the_step(float64):
    """The step is built for the data of its first call; other data tensors rebuild it (as
    FlatELBO rebuilds its log joint), so the loss is that of the data passed."""
    ref, fused, x, y = _pair(CASES[2])
    opt = FusedFlatAdam(fused, lr=0.0, compile=False)  # lr 0: the parameters stay put
    x2, y2 = x[:25].clone(), y[:25].clone()
    for data in ((x, y), (x2, y2), (x, y)):
        pyro.set_rng_seed(11)
        expected = ref.loss_and_grad(*data)
        pyro.set_rng_seed(11)
        assert float(opt.loss_and_step(*data, None)) == pytest.approx(float(expected), rel=TOL64)
