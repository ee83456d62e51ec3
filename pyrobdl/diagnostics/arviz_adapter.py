r"""The one module of pyrobdl that imports ArviZ.

Every ArviZ call (``ess``, ``rhat``, ``loo``, ``InferenceData`` construction, plots) goes through
this file, so moving to ArviZ 1.x touches one module.  Arrays in, plain numpy/dicts out.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

with warnings.catch_warnings():
    # ArviZ 0.23 announces its 1.0 rewrite with a FutureWarning on import (DESIGN.md traps).
    warnings.simplefilter("ignore", FutureWarning)
    import arviz as az

__all__ = ["az", "convergence"]


def convergence(draws: Any) -> dict[str, np.ndarray]:
    r"""Split-R-hat and bulk/tail effective sample sizes of each scalar quantity.

    Parameters
    ----------
    draws : array-like
        Shape ``[chain, draw, *dims]``.

    Returns
    -------
    dict
        ``{"rhat", "ess_bulk", "ess_tail"}``, each of shape ``dims`` (rank-normalised split
        R-hat and ESS of Vehtari et al. 2021, computed by ArviZ).

    References
    ----------
    A. Vehtari, A. Gelman, D. Simpson, B. Carpenter, P.-C. Bürkner. Rank-normalization,
    folding, and localization: an improved R-hat. Bayesian Analysis, 2021.
    """
    arr = np.asarray(draws, dtype=float)
    if arr.ndim < 2:
        raise ValueError(f"draws must have shape [chain, draw, ...], got {arr.shape}")
    dataset = az.convert_to_dataset({"x": arr})
    return {
        "rhat": np.asarray(az.rhat(dataset)["x"].values),
        "ess_bulk": np.asarray(az.ess(dataset, method="bulk")["x"].values),
        "ess_tail": np.asarray(az.ess(dataset, method="tail")["x"].values),
    }
