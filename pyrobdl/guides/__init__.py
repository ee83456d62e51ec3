"""Pyro guides for :class:`~pyrobdl.BayesianMLP`: usable with ``pyro.infer.SVI`` and ``Predictive``."""

from .base import BNNGuide
from .dropout import Dropout
from .map import MAP
from .mean_field import MeanField
from .score_function import ScoreFunction
from .variational_dropout import VariationalDropout, pruned_posterior

__all__ = ["BNNGuide", "Dropout", "MAP", "MeanField", "ScoreFunction", "VariationalDropout", "pruned_posterior"]
