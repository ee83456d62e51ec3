r"""Where a suite's datasets come from: a small registry of data sources.

Each source has options with defaults (the keys a ``[datasets.<label>]`` table may hold), a
check run when the suite is validated, and a loader ``load(options, split, data_dir) -> data``
returning :class:`~pyrobdl.datasets.RegressionData` or
:class:`~pyrobdl.datasets.ClassificationData`.  For sources without fixed splits the split index
is the seed of the data (synthetic sets) or of a random train/test partition (user files).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from .. import datasets as _ds

__all__ = ["REQUIRED", "SOURCES", "Source", "load_dataset"]

#: Marker of an option without default.
REQUIRED = "<required>"

Check = Callable[[Mapping[str, Any], Path], Iterable[tuple[str, str]]]


@dataclass(frozen=True)
class Source:
    """A kind of dataset a suite can name.

    Attributes
    ----------
    name : str
        The ``source`` value.
    options : Mapping[str, Any]
        Option -> default (:data:`REQUIRED` when it has none).
    load : callable
        ``load(options, split, data_dir, base) -> RegressionData | ClassificationData``;
        ``base`` is the suite file's folder.
    num_splits : callable or None
        ``num_splits(options, data_dir) -> int`` for sources with fixed splits (``splits = "all"``).
    check : callable
        ``check(options, base)`` yielding ``(key, reason)`` for invalid options.
    summary : str
        One line for the docs.
    """

    name: str
    options: Mapping[str, Any]
    load: Callable[..., Any]
    num_splits: Callable[[Mapping[str, Any], Any], int] | None
    check: Check
    summary: str = ""


def _typed(types: Mapping[str, tuple[type, ...]]) -> Check:
    def check(options: Mapping[str, Any], base: Path) -> Iterable[tuple[str, str]]:
        for key, allowed in types.items():
            value = options.get(key)
            if value == REQUIRED:
                yield key, "is required"
            elif value is not None and (isinstance(value, bool) is not (bool in allowed) or not isinstance(value, allowed)):
                yield key, f"must be of type {'/'.join(t.__name__ for t in allowed)}, got {value!r}"

    return check


def _load_blr(options: Mapping[str, Any], split: int, data_dir: Any, base: Path) -> Any:
    return _ds.bayesian_linear_regression(
        options["num_train"], options["num_test"], options["in_features"],
        prior_scale=options["prior_scale"], precision=options["precision"], seed=split,
    )


def _load_gap(options: Mapping[str, Any], split: int, data_dir: Any, base: Path) -> Any:
    return _ds.gap_regression(options["num_train"], options["num_test"], noise_sd=options["noise_sd"], seed=split)


def _load_uci(options: Mapping[str, Any], split: int, data_dir: Any, base: Path) -> Any:
    return _ds.load_uci(options["name"], split, data_dir=data_dir)


def _uci_splits(options: Mapping[str, Any], data_dir: Any) -> int:
    return _ds.uci_num_splits(options["name"], data_dir=data_dir)


def _check_uci(options: Mapping[str, Any], base: Path) -> Iterable[tuple[str, str]]:
    name = options.get("name")
    canonical = {k.lower() for k in _ds.UCI_DATASETS} | {v.lower() for v in _ds.UCI_DATASETS.values()}
    if not isinstance(name, str) or name.lower() not in canonical:
        yield "name", f"unknown UCI dataset {name!r}; valid: {sorted(_ds.UCI_DATASETS)}"


def _load_mnist(options: Mapping[str, Any], split: int, data_dir: Any, base: Path) -> Any:
    if split != 0:
        raise ValueError(f"{options['name']} has one standard split (0), got split {split}")
    max_train = options["max_train"] or None
    return _ds.load_mnist(data_dir=data_dir, name=options["name"], max_train=max_train)


def _check_mnist(options: Mapping[str, Any], base: Path) -> Iterable[tuple[str, str]]:
    if options.get("name") not in _ds.MNIST_NAMES:
        yield "name", f"unknown dataset {options.get('name')!r}; valid: {sorted(_ds.MNIST_NAMES)}"
    yield from _typed({"max_train": (int,)})(options, base)


def _load_file(options: Mapping[str, Any], split: int, data_dir: Any, base: Path) -> Any:
    path = Path(options["path"]).expanduser()
    return _ds.load_csv(path if path.is_absolute() else base / path, options["target"], task=options["task"],
                        test_fraction=options["test_fraction"], split=split, delimiter=options["delimiter"],
                        standardize=options["standardize"])


def _check_file(options: Mapping[str, Any], base: Path) -> Iterable[tuple[str, str]]:
    yield from _typed({"path": (str,), "delimiter": (str,), "task": (str,), "standardize": (bool,)})(options, base)
    target = options.get("target")
    if target == REQUIRED:
        yield "target", "is required (a column name, or an index for NPZ/CSV)"
    elif isinstance(target, bool) or not isinstance(target, (str, int)):
        yield "target", f"must be a column name or index, got {target!r}"
    if options.get("task") not in ("regression", "classification"):
        yield "task", f"unknown task {options.get('task')!r}; valid: ['classification', 'regression']"
    tf = options.get("test_fraction")
    if isinstance(tf, bool) or not isinstance(tf, (int, float)) or not 0 < tf < 1:
        yield "test_fraction", f"must be a number in (0, 1), got {tf!r}"
    p = options.get("path")
    if isinstance(p, str) and p != REQUIRED:
        full = Path(p).expanduser()
        full = full if full.is_absolute() else base / full
        if not full.is_file():
            yield "path", f"file {full} not found"
        elif full.suffix not in (".csv", ".npz", ".txt", ".tsv"):
            yield "path", f"unsupported file type {full.suffix!r}; valid: .csv/.txt/.tsv (header line optional), .npz"


#: Every data source a suite can name.
SOURCES: dict[str, Source] = {
    "blr": Source(
        "blr",
        {"num_train": 100, "num_test": 100, "in_features": 3, "prior_scale": 1.0, "precision": 10.0},
        _load_blr, None,
        _typed({"num_train": (int,), "num_test": (int,), "in_features": (int,),
                "prior_scale": (int, float), "precision": (int, float)}),
        "synthetic Bayesian linear regression with its exact posterior (split = data seed)",
    ),
    "gap": Source(
        "gap", {"num_train": 160, "num_test": 200, "noise_sd": 0.1}, _load_gap, None,
        _typed({"num_train": (int,), "num_test": (int,), "noise_sd": (int, float)}),
        "1-D regression with a gap between two clusters (split = data seed)",
    ),
    "uci": Source(
        "uci", {"name": REQUIRED}, _load_uci, _uci_splits, _check_uci,
        "UCI regression benchmark, standard splits, standardised with training statistics",
    ),
    "mnist": Source(
        "mnist", {"name": "mnist", "max_train": 0}, _load_mnist, lambda o, d: 1, _check_mnist,
        "MNIST / Fashion-MNIST IDX files (one split; max_train = 0 keeps all 60,000)",
    ),
    "file": Source(
        "file",
        {"path": REQUIRED, "target": REQUIRED, "task": "regression", "test_fraction": 0.1,
         "delimiter": ",", "standardize": True},
        _load_file, None, _check_file,
        "your CSV (optional header line) or NPZ file; split k = random train/test partition with seed k",
    ),
}


def load_dataset(source: str, options: Mapping[str, Any], split: int, data_dir: str | os.PathLike | None,
                 base: Path) -> Any:
    """Load split ``split`` of a dataset described by ``source`` and its ``options``."""
    return SOURCES[source].load(options, split, data_dir, base)

