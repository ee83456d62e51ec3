"""Pyro guides for :class:`~pyrobdl.BayesianMLP`: usable with ``pyro.infer.SVI`` and ``Predictive``."""

from .base import BNNGuide
from .map import MAP
from .mean_field import MeanField

__all__ = ["BNNGuide", "MAP", "MeanField"]
