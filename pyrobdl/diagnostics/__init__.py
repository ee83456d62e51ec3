"""Diagnostics: posterior-quality metrics, ArviZ conversion, convergence (rank-normalised R-hat
and ESS, batched), certification of reference posteriors, gradient variance."""

from . import metrics, plots
from .certification import REFERENCE_CRITERIA, Certification, CertificationCriteria, certify, reference_criteria
from .evaluate import evaluate, fit_diagnostics, vi_pareto_k
from .gradient_variance import gradient_variance
from .rank_diagnostics import convergence
from .resolution import Resolution, reference_resolution

__all__ = [
    "Certification",
    "CertificationCriteria",
    "REFERENCE_CRITERIA",
    "Resolution",
    "certify",
    "convergence",
    "evaluate",
    "fit_diagnostics",
    "gradient_variance",
    "metrics",
    "plots",
    "reference_criteria",
    "reference_resolution",
    "vi_pareto_k",
]
