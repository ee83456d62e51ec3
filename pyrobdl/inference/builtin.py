"""Registry entries of the methods that ship with pyrobdl's foundation (imported by ``pyrobdl``)."""

from __future__ import annotations

import functools

from ..guides import MAP, Dropout, MeanField, ScoreFunction, VariationalDropout
from . import chees, ensemble, laplace, mcmc  # noqa: F401  (register "chees", "ensemble", "laplace", "nuts", "hmc")
from .registry import register_svi_method, require_proper_prior

register_svi_method(
    "mean_field",
    MeanField,
    {"init_scale": 1e-2, "init_loc": "linear", "local_reparameterization": False},
    summary="Mean-field Gaussian VI, Bayes by Backprop (Blundell et al. 2015)",
)

register_svi_method(
    "map",
    MAP,
    {"init_loc": "linear"},
    summary="Maximum a posteriori point estimate (baseline)",
    loop_defaults={"kl": "monte_carlo"},
    check_model=require_proper_prior,
)

# Two names rather than one with a ``kind`` option: a report row is a registry name, and the
# Bernoulli and Gaussian variants are different posteriors.
register_svi_method(
    "dropout",
    Dropout,
    {"p": 0.05, "sigma": 1e-3, "init_loc": "linear"},
    summary="MC dropout as VI, Bernoulli mixture rows (Gal & Ghahramani 2016)",
)

register_svi_method(
    "gaussian_dropout",
    functools.partial(Dropout, kind="gaussian"),
    {"p": 0.05, "sigma": 1e-3, "init_loc": "linear"},
    summary="Gaussian dropout as VI, multiplicative N(1, p/(1-p)) rows",
)

# Same family and initialisation as "mean_field"; only the gradient estimator differs
# (docs/methods/bbvi.md).  Defaults are the best measured at matched gradient budgets
# (comparisons/research/bbvi_budget.py): the leave-one-out baseline needs >= 2 particles, and at a fixed
# number of gradient evaluations 4 particles x more steps beat 16 particles x fewer steps.
# The estimator runs on its trace-free fast path, equal in value and gradient to Pyro's
# TraceGraph_ELBO on the same draws (tests/test_bbvi.py) at ~1/10 of its cost (issue 38,
# docs/benchmarks.md); elbo="trace_graph" keeps Pyro's path, and is what baseline="neural" needs.
register_svi_method(
    "bbvi",
    ScoreFunction,
    {"init_scale": 1e-2, "init_loc": "linear", "baseline": "leave_one_out", "baseline_beta": 0.9},
    summary="Black-box VI: mean-field Gaussian, score-function gradients, leave-one-out baselines "
            "(Ranganath et al. 2014; Kool et al. 2019)",
    loop_defaults={"elbo": "direct_score_function", "kl": "monte_carlo", "num_particles": 4},
)

# Molchanov et al. 2017's recipe: Adam 1e-3 with linear decay (docs/methods/variational_dropout.md).
# No check_model: the guide itself rejects a model without a log-uniform prior, and a method
# with a check_model would drop out of the "valid guides" list of require_proper_prior.
register_svi_method(
    "variational_dropout",
    VariationalDropout,
    {"sparse": True, "ard": False, "init_log_sigma2": -10.0, "init_loc": "linear", "local_reparameterization": True},
    summary="Variational dropout with a log-uniform prior: sparse VD (Molchanov et al. 2017) / Kingma et al. 2015",
    loop_defaults={"lr": 1e-3, "lr_schedule": "linear"},
)
