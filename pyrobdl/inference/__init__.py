"""Inference: the SVI loop, its ELBO estimators, MCMC, ensembles, Laplace, the method registry and ``fit``."""

from . import builtin  # noqa: F401  (registers the built-in methods)
from .elbo import DirectELBO, PyroELBO, make_elbo
from .ensemble import EnsemblePosterior, train_members
from .laplace import LaplacePosterior
from .mcmc import MCMCPosterior, SamplerTrace
from .reference import Reference, load_reference, run_reference
from .score_function_direct import DirectScoreFunctionELBO
from .score_function_elbo import ScoreFunctionELBO
from .registry import Method, fit, get_method, methods, register_method, register_svi_method
from .svi import LoopSettings, run_svi

__all__ = [
    "DirectELBO",
    "DirectScoreFunctionELBO",
    "EnsemblePosterior",
    "LaplacePosterior",
    "LoopSettings",
    "MCMCPosterior",
    "Method",
    "PyroELBO",
    "Reference",
    "SamplerTrace",
    "ScoreFunctionELBO",
    "fit",
    "get_method",
    "load_reference",
    "make_elbo",
    "methods",
    "register_method",
    "register_svi_method",
    "run_reference",
    "run_svi",
    "train_members",
]
