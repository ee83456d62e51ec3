"""chees: a warm-up chain stuck on a run of divergences is moved to another chain's state
(option ``restart_after_divergences``), and only then."""

from __future__ import annotations

import pytest
import torch

import pyrobdl
import pyrobdl.inference.chees as chees
from pyrobdl.datasets import bayesian_linear_regression
from pyrobdl.flat import FlatLogJoint
from pyrobdl.inference.chees import run as chees_run
from pyrobdl.inference.chees import state as chees_state


def blr_learned():
    data = bayesian_linear_regression(100, 20, 3, prior_scale=1.0, precision=25.0, seed=0)
    model = pyrobdl.BayesianMLP(3, (), 1, prior=pyrobdl.priors.Gaussian(1.0),
                                likelihood=pyrobdl.likelihoods.GaussianLearnedPrecision(2.0, 0.2))
    return model, data.x_train, data.y_train


def new_run(k=8, superchain_size=1, **options):
    """A real chees run state (starting points, sampler, records) before its first iteration."""
    model, x, y = blr_learned()
    opts = {**chees.CHEES_OPTIONS, "seed": 0, "num_chains": k, "num_warmup": 40, "num_samples": 10,
            "step_size": 0.05, "superchain_size": superchain_size, **options}
    lj = FlatLogJoint(model, x, y)
    gen = torch.Generator().manual_seed(0)
    return chees_state._Run(model, x, opts, lj, gen, None, opts["num_samples"], (0.0, 0.0), 0.0)


def mark_divergent(run, chains, first, last):
    """Record iterations ``first .. last`` of ``chains`` as divergent."""
    run.diverging_rows[first : last + 1, chains] = True


def test_a_chain_diverging_for_the_whole_window_takes_a_calm_chains_state():
    run = new_run(k=8)
    w = run.options["restart_after_divergences"]
    assert w == 10  # the default
    mark_divergent(run, [2], 0, w - 1)
    mark_divergent(run, [5], 3, 3)  # diverged once in the window: not stuck, and not a donor
    before = [t.clone() for t in (run.sampler.theta, run.sampler.logp, run.sampler.grad)]
    chees_run._restart_stuck(run, w - 1)
    [r] = run.restarts
    assert r["iteration"] == w - 1 and r["chain"] == 2 and r["from"] not in (2, 5)
    d = r["from"]
    theta, logp, grad = run.sampler.theta, run.sampler.logp, run.sampler.grad
    assert torch.equal(theta[2], before[0][d]) and torch.equal(logp[2], before[1][d])
    assert torch.equal(grad[2], before[2][d])
    # nothing else moved
    others = [c for c in range(8) if c != 2]
    assert torch.equal(theta[others], before[0][others]) and torch.equal(logp[others], before[1][others])
    # the value and gradient copied are those of the new state
    v, g = run.lj.value_and_grad(theta[2:3])
    torch.testing.assert_close(v[0], logp[2])
    torch.testing.assert_close(g[0], grad[2])


def test_only_whole_windows_of_divergences_restart_a_chain():
    run = new_run(k=8)
    w = run.options["restart_after_divergences"]
    mark_divergent(run, [1], 1, w - 1)  # one iteration short
    theta = run.sampler.theta.clone()
    chees_run._restart_stuck(run, w - 1)
    mark_divergent(run, [3], w - 1, 2 * w - 2)  # a whole run of W, but across two windows
    for it in range(w, 2 * w):
        chees_run._restart_stuck(run, it)
    assert run.restarts == [] and torch.equal(run.sampler.theta, theta)
    mark_divergent(run, [3], w, 2 * w - 1)  # now the whole second window
    chees_run._restart_stuck(run, 2 * w - 2)  # not at a window's end
    assert run.restarts == []
    chees_run._restart_stuck(run, 2 * w - 1)
    assert [r["chain"] for r in run.restarts] == [3]


@pytest.mark.parametrize("options", [{"restart_after_divergences": 0}, {"num_chains": 8, "temperatures": [1.0, 0.5]}])
def test_no_restart_when_off_or_tempered(options):
    run = new_run(**options)
    mark_divergent(run, [0], 0, 9)
    theta = run.sampler.theta.clone()
    chees_run._restart_stuck(run, 9)
    assert run.restarts == [] and torch.equal(run.sampler.theta, theta)


def test_no_restart_when_every_chain_diverges():
    """Then the step size is wrong for all, not one chain stuck: nothing to copy from."""
    run = new_run(k=4)
    mark_divergent(run, [0, 1, 2, 3], 0, 9)
    theta = run.sampler.theta.clone()
    chees_run._restart_stuck(run, 9)
    assert run.restarts == [] and torch.equal(run.sampler.theta, theta)


def test_a_superchains_stuck_chain_takes_a_state_of_its_own_superchain():
    run = new_run(k=8, superchain_size=4)  # superchains 0-3 and 4-7
    mark_divergent(run, [5], 0, 9)
    for _ in range(20):  # the donor is drawn at random: always within chains 4, 6, 7
        run.restarts = []
        chees_run._restart_stuck(run, 9)
        assert run.restarts[0]["chain"] == 5 and run.restarts[0]["from"] in (4, 6, 7)
    # when the whole rest of its superchain diverged too, any calm chain
    mark_divergent(run, [4, 6, 7], 5, 5)
    run.restarts = []
    chees_run._restart_stuck(run, 9)
    assert run.restarts[0]["from"] in (0, 1, 2, 3)


def test_a_checkpoint_carries_the_restarts():
    run = new_run(k=4)
    run.restarts = [{"iteration": 9, "chain": 1, "from": 3}]
    saved = chees_state.snapshot(run, 10)
    assert saved["restarts"] == run.restarts
    resumed = new_run(k=4)
    chees_state._restore(resumed, saved)
    assert resumed.restarts == run.restarts


def test_an_older_checkpoint_resumes_with_restarts_off_and_is_refused_by_name_without():
    from pyrobdl.inference.checkpoint import run_identity

    model, x, y = blr_learned()
    opts = {**chees.CHEES_OPTIONS, "seed": 0}
    old = {k: v for k, v in opts.items() if k != "restart_after_divergences"}

    def identity(o):
        return run_identity(model, x, y, o, exclude=chees._NOT_IDENTITY + chees_run._defaulted(o))

    assert identity(old) == identity({**opts, "restart_after_divergences": 0})
    assert identity(old) != identity(opts)


@pytest.mark.parametrize("value", [-1, 2.5, True, None])
def test_bad_restart_option_raises_before_running(value):
    model, x, y = blr_learned()
    with pytest.raises(ValueError, match=r"restart_after_divergences must be an integer >= 0"):
        pyrobdl.fit(model, x, y, method="chees", num_chains=4, restart_after_divergences=value, progress=False)


def far_start(monkeypatch, log_tau_shift):
    """Chain 0 starts with its noise precision multiplied by exp(log_tau_shift)."""
    real = chees_state._starting_points

    def starts(model, lj, num, options, gen):
        theta, grads = real(model, lj, num, options, gen)
        theta[0, lj.precision_index] += log_tau_shift
        return theta, grads

    monkeypatch.setattr(chees_state, "_starting_points", starts)


def test_a_chain_started_where_the_step_cannot_integrate_is_stuck_without_restarts_and_freed_with(monkeypatch):
    """End to end: chain 0 starts at a noise precision e^12 times the posterior's, where the
    likelihood's curvature makes every trajectory of the other chains' step diverge.  The step
    adapts on the chains that do not diverge, so without restarts chain 0 never moves (and its far
    log precision inflates the cross-chain mass matrix, so the step shrinks for everyone); with
    them it takes a calm chain's state at the end of the first window of W = 10 iterations that
    has a calm chain, and samples like the rest."""
    model, x, y = blr_learned()
    far_start(monkeypatch, 12.0)
    warm = 150
    kw = dict(method="chees", num_chains=8, num_warmup=warm, num_samples=100, seed=0, progress=False,
              step_size=0.05, step_size_adaptation="continuous")
    with pytest.warns(UserWarning, match="not certified"):
        stuck = pyrobdl.fit(model, x, y, restart_after_divergences=0, **kw)
    assert stuck.diagnostics["warmup_restarts"] == []
    assert stuck.trace.diverging[0].all()  # every iteration, warm-up and sampling
    assert not stuck.trace.diverging[1:, warm:].any()
    with pytest.warns(UserWarning, match="not certified"):  # 8 x 100 draws: too few for a reference
        freed = pyrobdl.fit(blr_learned()[0], x, y, **kw)
    [r] = freed.diagnostics["warmup_restarts"]
    assert r["chain"] == 0 and r["from"] != 0 and r["iteration"] % 10 == 9 and r["iteration"] < warm
    assert freed.trace.diverging[0, : r["iteration"] + 1].all()
    assert not freed.trace.diverging[:, warm:].any()
    assert freed.diagnostics["step_size"] > 5 * stuck.diagnostics["step_size"]
    # chain 0's precision draws now lie among the other chains' (it started e^12 ~ 1.6e5 times away)
    tau = freed.samples["precision"]
    assert tau[1:].min() <= tau[0].median() <= tau[1:].max()
