"""What the flat log joint implements (refusals by name, before any work) and its CPU chunk size."""

from __future__ import annotations

import math
from typing import Any

from .. import likelihoods as _lik
from .. import priors as _priors


def auto_chunk_size(num_data: int, width: int, budget: int = 400_000) -> int:
    """Rows of ``theta`` per call on CPU: a power of two near ``budget / (num_data * width)``."""
    rows = max(1.0, budget / max(1, num_data * width))
    return 2 ** round(math.log2(rows))


def _check_supported(model: Any, prior: bool = True) -> None:
    """Raise for what the flat log joint does not implement; ``prior=False``: the likelihood
    and network alone (a variational family that brings its own KL to an improper prior)."""
    lik = model.likelihood
    if prior:
        _check_prior(model.prior)
    if type(lik) not in (_lik.Gaussian, _lik.GaussianLearnedPrecision, _lik.Categorical):
        raise TypeError(
            "the flat log joint supports likelihoods Gaussian, GaussianLearnedPrecision and Categorical, "
            f"not {type(lik).__name__}"
        )
    if model.activation not in ("relu", "tanh"):
        raise TypeError(f"the flat log joint supports relu and tanh activations, not {model.activation!r}")


def _check_prior(prior: Any) -> None:
    if not getattr(prior, "proper", True):
        raise ValueError(f"the prior {prior!r} is improper: there is no log joint to sample or optimise")
    if type(prior) is not _priors.Gaussian:
        raise TypeError(f"the flat log joint supports priors.Gaussian, not {type(prior).__name__}")

