"""Registry entries of the methods that ship with pyrobdl's foundation (imported by ``pyrobdl``)."""

from __future__ import annotations

from ..guides import MAP, MeanField
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
