"""The report's "objective still improving" flag (pyrobdl.report.verdicts.still_improving).

It reads the rise of the objective over the final quarter of the run's learning-rate mass against
the noise of the block means there, so it must (a) see an objective still rising when a cosine
schedule ended, which the old rule (the last 10% of steps gaining > 5% of the run's gain) could
not, and (b) stay quiet on a converged noisy objective (MC dropout's ELBO), on which the old rule
fired in about 40% of runs.  Synthetic histories are drawn in learning-rate mass with iid noise,
200 seeds per case; the counts allowed come from the test's own 1% level (binomial tails).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_report import record, store

import pyrobdl
from pyrobdl.report.verdicts import (
    STILL_IMPROVING_NATS,
    _lr_mass,
    beyond_chance,
    method_flags,
    still_improving,
)

STEPS = 3000
SEEDS = 200
# A converged objective is flagged with probability <= 1% per run (plus the nats floor, which only
# lowers it): P(more than 9 of 200 | p = 0.01) = 5e-5.
MAX_FALSE = 9


def fires(history, lr_schedule) -> bool:
    trend = still_improving(history, lr_schedule)
    return trend is not None and trend.flagged


def synthetic(seed, lr_schedule, curve, noise_sd, steps=STEPS):
    """``curve(mass)`` plus iid normal noise, ``mass`` the run's learning-rate mass so far."""
    rng = np.random.default_rng(seed)
    return curve(_lr_mass(steps, lr_schedule)) + noise_sd * rng.standard_normal(steps)


def count(lr_schedule, curve, noise_sd):
    return sum(fires(synthetic(seed, lr_schedule, curve, noise_sd), lr_schedule) for seed in range(SEEDS))


def converged_noisy(mass):  # MC dropout on the gap data: a quick rise, then flat under noise 10x the rise
    return -450.0 - 50.0 * np.exp(-mass / 0.01)


def still_rising(mass):  # mean field on the gap data at its budget: far from its limit of -10
    return -10.0 - 60.0 * np.exp(-mass / 1.5)


def plateau(mass):  # converged by a fifth of the run, then a long plateau
    return -100.0 + 90.0 * (1.0 - np.exp(-mass / 0.08))


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_a_converged_noisy_objective_is_not_flagged(schedule):
    assert count(schedule, converged_noisy, 100.0) <= MAX_FALSE


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear"])
def test_an_objective_still_rising_under_a_decaying_schedule_is_flagged(schedule):
    # the old rule read a share <= 0.03 here in every run (the last steps barely move under cosine)
    assert count(schedule, still_rising, 3.0) == SEEDS


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_a_plateau_with_noise_is_not_flagged(schedule):
    assert count(schedule, plateau, 5.0) <= MAX_FALSE


def test_a_noiseless_creep_is_flagged_only_above_one_nat():
    """Full-batch MAP: no noise, so any rise is significant; below STILL_IMPROVING_NATS it is
    immaterial."""
    mass = _lr_mass(STEPS, "constant")
    for total, flagged in ((4 * 0.5 * STILL_IMPROVING_NATS, False), (4 * 2 * STILL_IMPROVING_NATS, True)):
        trend = still_improving(30.0 + total * mass, "constant")  # the last quarter rises total / 4
        assert trend.gain == pytest.approx(total / 4, rel=1e-6) and trend.se < 1e-9
        assert trend.flagged is flagged


def test_the_window_is_the_last_quarter_of_the_learning_rate_mass():
    flat = np.zeros(STEPS)
    assert still_improving(flat, "constant").steps == STEPS // 4
    # cosine from 1 to 0.1: the last quarter of its mass is the last half of its steps
    assert still_improving(flat, "cosine").steps == pytest.approx(STEPS / 2, abs=0.02 * STEPS)
    assert still_improving(flat, None).steps == STEPS // 4  # no schedule recorded: constant
    assert still_improving(np.zeros(150), "constant") is None  # 37 steps: fewer than 5 per block
    # non-finite steps are left out, not propagated
    h = synthetic(0, "constant", plateau, 5.0)
    h[-7] = np.nan
    assert math.isfinite(still_improving(h, "constant").gain)


def test_the_standard_error_matches_the_spread_over_seeds():
    """The rise's standard error is honest: over 200 noisy plateaus, the rises' own standard
    deviation and the mean reported standard error agree to within their Monte Carlo error."""
    trends = [still_improving(synthetic(s, "cosine", converged_noisy, 100.0), "cosine") for s in range(SEEDS)]
    gains, ses = np.array([t.gain for t in trends]), np.array([t.se for t in trends])
    sd = gains.std(ddof=1)
    # sd of a sample sd of 200 normals: sd / sqrt(2 * 199); the mean se varies less than that
    assert abs(np.sqrt(np.mean(ses**2)) - sd) < 4 * sd / math.sqrt(2 * (SEEDS - 1))
    assert abs(gains.mean()) < 4 * sd / math.sqrt(SEEDS)


def blr_fit(num_steps, seed):
    torch.manual_seed(0)
    x = torch.randn(100, 3)
    y = x @ torch.tensor([1.0, -0.5, 0.3]) + 0.3 * torch.randn(100)
    model = pyrobdl.BayesianMLP(3, (), 1, likelihood=pyrobdl.likelihoods.Gaussian(10.0))
    return pyrobdl.fit(model, x, y, method="mean_field", num_steps=num_steps, lr=0.01, lr_schedule="cosine",
                       seed=seed, progress=False)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_real_mean_field_fit_is_flagged_at_a_short_budget_only(seed):
    """Mean field on a small linear regression (100 points, cosine schedule): at 200 steps the
    ELBO is still rising and flagged; at 3,000 it has converged and is not (measured: rises of
    3-36 nats at 200 steps, 0.03-0.3 nats at 3,000)."""
    short, long = blr_fit(200, seed), blr_fit(3000, seed)
    assert fires(short.history, short.settings["lr_schedule"])
    assert not fires(long.history, long.settings["lr_schedule"])


def test_one_flagged_cell_in_twenty_is_chance():
    assert beyond_chance(1, 1) and not beyond_chance(0, 1)
    assert not beyond_chance(1, 2) and beyond_chance(2, 2)
    assert not beyond_chance(2, 20) and beyond_chance(3, 20)


def test_method_flags_reads_the_schedule_from_the_records(tmp_path):
    """A method of 20 cells: converged noisy histories are not flagged; still-rising histories under
    the cosine schedule are, with the rise in nats and in standard errors."""
    from pyrobdl.compare import list_results

    def cells(name, curve, noise, schedule):
        items = []
        for split in range(20):
            _, rec, arrays = record("toy", name, split, metrics={"test_ll": 0.0},
                                    history=synthetic(split, schedule, curve, noise))
            rec["settings"] = {"lr_schedule": schedule}
            items.append((f"toy__{name}__split-{split}__seed-0", rec, arrays))
        return list_results(store(tmp_path / name, items))

    assert method_flags(cells("dropout", converged_noisy, 100.0, "cosine")) == []
    (flag,) = method_flags(cells("mean_field", still_rising, 3.0, "cosine"))
    assert flag.startswith("not converged in 20 of 20 cells: the objective still rose by ")
    assert "standard errors) over the last 1,5" in flag and "final 25% of its learning-rate schedule" in flag
    # the same rising histories read as a constant-rate run: the window is the last quarter of steps
    (flag,) = method_flags(cells("mean_field_constant", still_rising, 3.0, "constant"))
    assert "over the last 750 steps" in flag
