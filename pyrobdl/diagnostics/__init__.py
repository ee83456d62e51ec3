"""Diagnostics: posterior-quality metrics, ArviZ conversion, convergence (rank-normalised R-hat
and ESS, batched), certification of reference posteriors, gradient variance.

The modules sit in two layers (docs/architecture.md): the array core (``rhat``,
``rank_diagnostics``, ``energy``, ``chain_outliers``, ``inputs``, ``metrics``, ``certification``,
``arviz_adapter``) below the posterior contract, which samplers and the posterior use; and the
evaluation of posteriors (``agreement``, ``resolution``, ``evaluate``, ``plots``,
``gradient_variance``) above the inference methods.  So that importing a core module does not run
the upper layer, the names below are imported on first use (PEP 562 module ``__getattr__``).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import TYPE_CHECKING, Any

#: Public name -> (module, attribute); attribute None means the module itself.
_LAZY: dict[str, tuple[str, str | None]] = {
    "Certification": ("pyrobdl.diagnostics.certification", "Certification"),
    "CertificationCriteria": ("pyrobdl.diagnostics.certification", "CertificationCriteria"),
    "REFERENCE_CRITERIA": ("pyrobdl.diagnostics.certification", "REFERENCE_CRITERIA"),
    "Resolution": ("pyrobdl.diagnostics.resolution", "Resolution"),
    "certify": ("pyrobdl.diagnostics.certification", "certify"),
    "convergence": ("pyrobdl.diagnostics.rank_diagnostics", "convergence"),
    "evaluate": ("pyrobdl.diagnostics.evaluate", "evaluate"),
    "fit_diagnostics": ("pyrobdl.diagnostics.evaluate", "fit_diagnostics"),
    "gradient_variance": ("pyrobdl.diagnostics.gradient_variance", "gradient_variance"),
    "metrics": ("pyrobdl.diagnostics.metrics", None),
    "plots": ("pyrobdl.diagnostics.plots", None),
    "reference_criteria": ("pyrobdl.diagnostics.certification", "reference_criteria"),
    "reference_resolution": ("pyrobdl.diagnostics.resolution", "reference_resolution"),
    "vi_pareto_k": ("pyrobdl.diagnostics.evaluate", "vi_pareto_k"),
}

__all__ = sorted(_LAZY)

if TYPE_CHECKING:  # static tools see the eager imports
    from . import metrics, plots
    from .certification import REFERENCE_CRITERIA, Certification, CertificationCriteria, certify, reference_criteria
    from .evaluate import evaluate, fit_diagnostics, vi_pareto_k
    from .gradient_variance import gradient_variance
    from .rank_diagnostics import convergence
    from .resolution import Resolution, reference_resolution


def __getattr__(name: str) -> Any:
    if name not in _LAZY:  # a submodule not imported yet, e.g. ``pyrobdl.diagnostics.energy``
        if name.startswith("_") or importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module 'pyrobdl.diagnostics' has no attribute {name!r}")
        return importlib.import_module(f"{__name__}.{name}")
    module, attr = _LAZY[name]
    mod = importlib.import_module(module)
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


class _Package(types.ModuleType):
    """This package, keeping the functions ``evaluate`` and ``gradient_variance`` its attributes
    when their submodules of the same names are imported (the import system sets a package's
    attribute to every submodule it loads; the eager imports this package had overrode that)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _LAZY.get(name, (None, None))[1] == name:
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
