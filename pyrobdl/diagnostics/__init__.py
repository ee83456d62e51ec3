"""Diagnostics: posterior-quality metrics, ArviZ conversion and convergence, gradient variance."""

from .arviz_adapter import convergence

__all__ = ["convergence"]
