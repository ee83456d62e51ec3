"""Diagnostics: posterior-quality metrics, ArviZ conversion and convergence, certification of
reference posteriors, gradient variance."""

from . import metrics, plots
from .arviz_adapter import convergence
from .certification import Certification, CertificationCriteria, certify
from .evaluate import evaluate, fit_diagnostics, vi_pareto_k
from .gradient_variance import gradient_variance

__all__ = [
    "Certification",
    "CertificationCriteria",
    "certify",
    "convergence",
    "evaluate",
    "fit_diagnostics",
    "gradient_variance",
    "metrics",
    "plots",
    "vi_pareto_k",
]
