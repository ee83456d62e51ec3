"""The validated suite's vocabulary: its keys, the label rule, and the entries a suite file becomes.

:class:`Suite`, :class:`MethodEntry` and :class:`DatasetEntry` are what
:func:`~pyrobdl.compare.config.parse_suite` returns; the key tuples are what it accepts;
:func:`label_problem` is the label grammar that keeps cell ids collision-free;
:func:`model_components` lists the priors and likelihoods a suite can name.  All are importable
from :mod:`pyrobdl.compare.config` as before.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .. import likelihoods as _likelihoods
from .. import priors as _priors

__all__ = [
    "DATASET_RESERVED", "LABEL_MAX", "LABEL_PATTERN", "LABEL_RULE", "METHOD_RESERVED", "MODEL_KEYS",
    "PRECISION_UNITS", "REFERENCE_REPLICATES", "RESOURCE_KEYS", "SUITE_KEYS", "TOP_KEYS", "ConfigError",
    "DatasetEntry", "MethodEntry", "Suite", "label_problem", "model_components",
]

SUITE_KEYS = (
    "data_dir", "description", "device", "fit_diagnostics", "inference_data", "name", "num_eval_samples",
    "reference", "reference_replicates", "seeds",
)
TOP_KEYS = ("datasets", "gradient_variance", "methods", "model", "suite")
MODEL_KEYS = ("activation", "hidden", "likelihood", "prior")
METHOD_RESERVED = ("gradient_variance", "method", "model", "published", "resources")
#: Keys of a method's ``resources`` table (per cell, for distributed executors).
RESOURCE_KEYS = ("cpu", "gpu")
DATASET_RESERVED = ("methods", "model", "overrides", "reference", "reference_replicates", "source", "splits")
#: Runs of a dataset's reference a suite may ask for: 1, or 2 (a second, independent run whose
#: disagreement with the first is the reference's resolution, ``pyrobdl.diagnostics.reference_resolution``).
REFERENCE_REPLICATES = (1, 2)
PRECISION_UNITS = ("original", "standardized")
#: Dataset and method labels: ASCII letters and digits in runs joined by single '_' or '-'
#: (no '__', no leading or trailing separator, no whitespace), at most :data:`LABEL_MAX` characters.
#: Cell ids join labels with '__' (:func:`pyrobdl.compare.grid.cell_id`), so this grammar makes
#: them collision-free; labels must also differ in more than letter case (case-insensitive disks).
LABEL_PATTERN = re.compile(r"[A-Za-z0-9]+(?:[_-][A-Za-z0-9]+)*")
LABEL_MAX = 64
LABEL_RULE = (f"labels are letters and digits, optionally joined by single '_' or '-' (no '__', "
              f"no leading or trailing '_' or '-'), at most {LABEL_MAX} characters")


def label_problem(label: Any) -> str | None:
    """Why ``label`` is not a valid dataset or method label, or None (see :data:`LABEL_PATTERN`)."""
    if not isinstance(label, str) or len(label) > LABEL_MAX or not LABEL_PATTERN.fullmatch(label):
        return f"invalid label {str(label)[:80]!r}: {LABEL_RULE}"
    return None


class ConfigError(ValueError):
    """An invalid suite: every problem found, one per line, each naming the file and the key."""


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _components(module: Any, base: type) -> dict[str, type]:
    """Concrete classes of ``module.__all__`` deriving from ``base``, by snake-case name."""
    found = {}
    for name in getattr(module, "__all__", ()):
        obj = getattr(module, name, None)
        if isinstance(obj, type) and issubclass(obj, base) and obj is not base:
            found[_snake(name)] = obj
    return found


def model_components() -> dict[str, dict[str, type]]:
    """Prior and likelihood classes a suite can name, by ``kind``.

    Every concrete ``Prior`` of :mod:`pyrobdl.priors` and ``Likelihood`` of
    :mod:`pyrobdl.likelihoods` is available under its class name in snake case
    (``Gaussian`` -> ``"gaussian"``, ``GaussianLearnedPrecision`` -> ``"gaussian_learned_precision"``),
    so a new prior is usable from a suite the day it is exported.
    """
    return {
        "prior": _components(_priors, _priors.Prior),
        "likelihood": _components(_likelihoods, _likelihoods.Likelihood),
    }


def _kwargs_of(cls: type) -> list[str]:
    return [
        p.name
        for p in inspect.signature(cls).parameters.values()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]


@dataclass(frozen=True)
class MethodEntry:
    """One ``[methods.<label>]`` table.

    Attributes
    ----------
    label : str
        The table's name; identifies the entry in results and reports.
    method : str
        Registry name of the inference method.
    options : Mapping[str, Any]
        The options given in the file (defaults are filled in per cell).
    model : Mapping[str, Any]
        Model overrides for this method.
    published : tuple of str
        Keys of published rows (:data:`pyrobdl.compare.published.PUBLISHED`) to compare with.
    gradient_variance : bool
        Whether the gradient-variance diagnostic runs after the fit.
    resources : Mapping[str, float]
        What one cell of this method needs from a distributed executor: ``cpu`` (cores,
        default 1) and ``gpu`` (a device or a fraction of one, default 0).  Not part of a cell's
        configuration hash: changing it does not invalidate stored results.
    """

    label: str
    method: str
    options: Mapping[str, Any]
    model: Mapping[str, Any] = field(default_factory=dict)
    published: tuple[str, ...] = ()
    gradient_variance: bool = False
    resources: Mapping[str, float] = field(default_factory=lambda: {"cpu": 1.0, "gpu": 0.0})


@dataclass(frozen=True)
class DatasetEntry:
    """One ``[datasets.<label>]`` table.

    Attributes
    ----------
    label : str
        The table's name.
    source : str
        Key of :data:`pyrobdl.compare.sources.SOURCES`.
    options : Mapping[str, Any]
        The source's options, defaults filled in.
    splits : tuple of int or "all"
        Split indices (for synthetic sources: data seeds).
    methods : tuple of str
        Method labels run on this dataset.
    reference : str or None
        Method label whose fit is the reference posterior, or None.
    model : Mapping[str, Any]
        Model overrides for this dataset.
    overrides : Mapping[str, Mapping[str, Any]]
        Method label -> options that replace the method's options on this dataset (and an
        optional ``model`` table of model overrides for that method on this dataset).
    reference_replicates : {1, 2}
        Runs of the reference: 2 adds a second, independent run (another seed), from which every
        other cell's evaluation gets the reference's resolution.
    """

    label: str
    source: str
    options: Mapping[str, Any]
    splits: tuple[int, ...] | str
    methods: tuple[str, ...]
    reference: str | None
    model: Mapping[str, Any] = field(default_factory=dict)
    overrides: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    reference_replicates: int = 1


@dataclass(frozen=True)
class Suite:
    """A validated suite.

    Attributes
    ----------
    path : pathlib.Path
        The TOML file (relative paths in it are resolved against its folder).
    name, description : str
        From ``[suite]``.
    seeds : tuple of int
        Fit seeds.
    device : str or None
        Default device.
    num_eval_samples : int
        Posterior draws for metrics and predictions.
    inference_data : bool
        Write ArviZ netCDF per cell.
    fit_diagnostics : bool
        Score each fit on its training data too (:func:`pyrobdl.diagnostics.fit_diagnostics`).
    data_dir : str or None
        Datasets root from the file, already resolved against the file's folder.
    model : Mapping
        The default model spec.
    methods : tuple of MethodEntry
    datasets : tuple of DatasetEntry
    gradient_variance : Mapping or None
        Keyword arguments of the gradient-variance diagnostic.
    raw : Mapping
        The parsed TOML, kept for the results folder.
    """

    path: Path
    name: str
    description: str
    seeds: tuple[int, ...]
    device: str | None
    num_eval_samples: int
    inference_data: bool
    fit_diagnostics: bool
    data_dir: str | None
    model: Mapping[str, Any]
    methods: tuple[MethodEntry, ...]
    datasets: tuple[DatasetEntry, ...]
    gradient_variance: Mapping[str, Any] | None
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False)

    def method(self, label: str) -> MethodEntry:
        """The method entry called ``label``."""
        for m in self.methods:
            if m.label == label:
                return m
        raise KeyError(label)
