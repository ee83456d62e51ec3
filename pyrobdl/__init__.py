"""pyrobdl: Bayesian MLPs in Pyro, their inference methods side by side, and honest reports."""

from . import datasets, diagnostics, guides, likelihoods, poutine, priors
from .inference import fit, methods
from .model import BayesianMLP
from .posterior import Cost, Posterior, Prediction

__version__ = "0.1.0"

__all__ = [
    "BayesianMLP",
    "Cost",
    "Posterior",
    "Prediction",
    "__version__",
    "datasets",
    "diagnostics",
    "fit",
    "guides",
    "likelihoods",
    "methods",
    "poutine",
    "priors",
]
