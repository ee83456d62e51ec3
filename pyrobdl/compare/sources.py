r"""Where a suite's datasets come from: a small registry of data sources.

Each source has options with defaults (the keys a ``[datasets.<label>]`` table may hold), a
check run when the suite is validated, and a loader ``load(options, split, data_dir) -> data``
returning :class:`~pyrobdl.datasets.RegressionData` or
:class:`~pyrobdl.datasets.ClassificationData`.  For sources without fixed splits the split index
is the seed of the data (synthetic sets) or of a random train/test partition (user files).
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch

from .. import datasets as _ds
from ..datasets._data import FLOAT32_MAX, MAX_CLASSES, check_float32_range

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


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _read_csv(path: Path, delimiter: str) -> tuple[np.ndarray, list[str] | None]:
    """A numeric table from a delimited text file, and its header (None when it has none).

    The first non-empty line is a header only if one of its fields is not a number, so a file
    without a header never loses its first data row (a header of numbers only is read as data).
    Errors name the line and column (1-based) but never quote the file's contents.
    """
    rows: list[tuple[int, list[str]]] = []
    try:
        with path.open(newline="", encoding="utf-8") as fh:
            reader = csv.reader(fh, delimiter=delimiter)
            for r in reader:
                if any(v.strip() for v in r):
                    rows.append((reader.line_num, r))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte offset {e.start})") from None
    except csv.Error as e:
        raise ValueError(f"{path}: line {reader.line_num}: not a valid delimited line ({type(e).__name__})") from None
    if not rows:
        raise ValueError(f"{path}: no data rows")
    first = rows[0][1]
    header = None
    if any(_number(v) is None for v in first):
        header = [h.strip() for h in first]
        rows = rows[1:]
        if not rows:
            raise ValueError(f"{path}: a header line and no data rows")
    width = len(header) if header is not None else len(rows[0][1])
    table = np.empty((len(rows), width))
    for i, (line, r) in enumerate(rows):
        if len(r) != width:
            raise ValueError(f"{path}: line {line} has {len(r)} fields, expected {width}")
        for j, v in enumerate(r):
            x = _number(v)
            if x is None:
                raise ValueError(f"{path}: line {line}, column {j + 1}: not a number")
            if not np.isfinite(x) or abs(x) > FLOAT32_MAX:
                raise ValueError(f"{path}: line {line}, column {j + 1}: NaN, infinite, or beyond float32's range "
                                 f"(|x| > {FLOAT32_MAX:.3g})")
            table[i, j] = x
    return table, header


def _read_table(path: Path, target: Any, delimiter: str) -> tuple[np.ndarray, np.ndarray]:
    """Features and target column of a delimited text file (header optional) or an NPZ file."""
    if path.suffix == ".npz":
        with np.load(path) as data:
            if "x" in data and "y" in data:
                x, y = np.asarray(data["x"], dtype=float), np.asarray(data["y"], dtype=float)
                if x.ndim != 2 or y.ndim != 1 or x.shape[0] != y.shape[0]:
                    raise ValueError(f"{path}: 'x' must be [N, D] and 'y' [N], got shapes {x.shape} and {y.shape}")
                check_float32_range(x, f"{path}: array 'x'")
                check_float32_range(y, f"{path}: array 'y'")
                return x, y
            if len(data.files) != 1 or not isinstance(target, int):
                raise ValueError(
                    f"{path}: an NPZ file needs arrays 'x' and 'y', or one 2-D array and an integer "
                    f"`target` column; found arrays {data.files}"
                )
            table = np.asarray(data[data.files[0]], dtype=float)
            header = [str(i) for i in range(table.shape[1])] if table.ndim == 2 else []
        if table.ndim != 2:
            raise ValueError(f"{path}: expected a 2-D table, got shape {table.shape}")
        check_float32_range(table, f"{path}")
    else:
        table, header = _read_csv(path, delimiter)
    if isinstance(target, int):
        if not 0 <= target < table.shape[1]:
            raise ValueError(f"{path}: target column {target} out of range 0..{table.shape[1] - 1}")
        col = target
    elif header is None:
        raise ValueError(f"{path}: has no header line (its first line is all numbers), so `target` must be a "
                         f"column index 0..{table.shape[1] - 1}, not a name")
    else:
        if target not in header:
            raise ValueError(f"{path}: no column named {target[:80]!r}; columns: {[h[:40] for h in header[:50]]}")
        col = header.index(target)
    return np.delete(table, col, axis=1), table[:, col]


def _load_file(options: Mapping[str, Any], split: int, data_dir: Any, base: Path) -> Any:
    path = Path(options["path"]).expanduser()
    path = path if path.is_absolute() else base / path
    x, y = _read_table(path, options["target"], options["delimiter"])
    n = x.shape[0]
    rng = np.random.default_rng(split)
    perm = rng.permutation(n)
    n_test = max(1, int(round(options["test_fraction"] * n)))
    test, train = perm[:n_test], perm[n_test:]
    if train.size < 2:
        raise ValueError(f"{path}: too few rows ({n}) for test_fraction={options['test_fraction']}")
    # float64 statistics of values within float32's range (checked above) cannot overflow
    x_mean, x_std = x[train].mean(0), x[train].std(0)
    x_std = np.where(x_std > 0, x_std, 1.0)
    if not options["standardize"]:
        x_mean, x_std = np.zeros_like(x_mean), np.ones_like(x_std)
    xs = torch.as_tensor((x - x_mean) / x_std, dtype=torch.float32)
    name = path.stem
    if options["task"] == "classification":
        if not np.all(y == np.round(y)) or y.min() < 0:
            raise ValueError(f"{path}: classification targets must be integer labels >= 0")
        num_classes = int(y.max()) + 1
        if num_classes > MAX_CLASSES:
            raise ValueError(f"{path}: the largest class label is {int(y.max())}, i.e. {num_classes} classes "
                             f"({len(np.unique(y))} distinct labels); at most {MAX_CLASSES} are supported: "
                             "number the classes 0..K-1")
        labels = torch.as_tensor(y.astype(np.int64))
        return _ds.ClassificationData(name, xs[train], labels[train], xs[test], labels[test], num_classes)
    y_mean, y_std = (float(y[train].mean()), float(y[train].std())) if options["standardize"] else (0.0, 1.0)
    y_std = y_std if y_std > 0 else 1.0
    ys = torch.as_tensor((y - y_mean) / y_std, dtype=torch.float32)
    return _ds.RegressionData(
        name, xs[train], ys[train], xs[test], ys[test], y_mean=y_mean, y_std=y_std,
        x_mean=torch.as_tensor(x_mean, dtype=torch.float32), x_std=torch.as_tensor(x_std, dtype=torch.float32),
    )


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

