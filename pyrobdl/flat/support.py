"""What the flat log joint implements (refusals by name, before any work) and its CPU chunk size."""

from __future__ import annotations

import math
from typing import Any

from .. import likelihoods as _lik
from .. import priors as _priors


#: Bytes of one layer's activations per call that ``chunk_size="auto"`` allows on CPU: half of
#: glibc's 32 MB ceiling for blocks kept on the heap.  A larger block is mapped afresh by every call
#: and faulted in page by page (3.0-3.2x the CPU per chain-gradient at the UCI shapes), a smaller
#: chunk only adds calls (docs/benchmarks/chees.md, "chunk_size and glibc's 32 MB ceiling").
AUTO_CHUNK_BYTES = 16 * 2**20


def auto_chunk_size(num_data: int, width: int, itemsize: int = 4, budget: int = AUTO_CHUNK_BYTES) -> int:
    """Rows of ``theta`` per call on CPU: the power of two nearest (in log scale) the rows whose
    ``[num_data, rows, width]`` activations of ``itemsize``-byte numbers take ``budget`` bytes, so
    at most sqrt(2) x ``budget`` (22.6 MiB, under glibc's 32 MiB ceiling); at least 1."""
    rows = max(1.0, budget / max(1, num_data * width * itemsize))
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

