"""pyrobdl: Bayesian MLPs in Pyro, their inference methods side by side, and honest reports.

The public names below are imported on first use (PEP 562 module ``__getattr__``), so that
``import pyrobdl`` and ``pyrobdl --version``/``--help`` do not pay for torch, Pyro, ArviZ and
matplotlib; ``from pyrobdl import BayesianMLP`` and ``pyrobdl.fit(...)`` work as usual.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import _version

__version__ = _version.__version__

#: Public name -> (module, attribute); attribute None means the module itself.
_LAZY: dict[str, tuple[str, str | None]] = {
    "BayesianMLP": ("pyrobdl.model", "BayesianMLP"),
    "Cost": ("pyrobdl.posterior", "Cost"),
    "Posterior": ("pyrobdl.posterior", "Posterior"),
    "Prediction": ("pyrobdl.posterior", "Prediction"),
    "datasets": ("pyrobdl.datasets", None),
    "diagnostics": ("pyrobdl.diagnostics", None),
    "fit": ("pyrobdl.inference", "fit"),
    "guides": ("pyrobdl.guides", None),
    "likelihoods": ("pyrobdl.likelihoods", None),
    "load_posterior": ("pyrobdl.saving", "load_posterior"),
    "methods": ("pyrobdl.inference", "methods"),
    "poutine": ("pyrobdl.poutine", None),
    "priors": ("pyrobdl.priors", None),
    "references": ("pyrobdl.references", None),
    "retain_freed_memory": ("pyrobdl._allocator", "retain_freed_memory"),
}

__all__ = sorted([*_LAZY, "__version__"])

if TYPE_CHECKING:  # static tools see the eager imports
    from . import datasets, diagnostics, guides, likelihoods, poutine, priors
    from .inference import fit, methods
    from .model import BayesianMLP
    from .posterior import Cost, Posterior, Prediction
    from .saving import load_posterior


def __getattr__(name: str) -> Any:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'pyrobdl' has no attribute {name!r}") from None
    mod = importlib.import_module(module)
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
