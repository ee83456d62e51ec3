r"""Your own tabular data: a CSV/TSV/TXT file with a header row, or an NPZ file.

:func:`load_csv` is what a suite's ``source = "file"`` dataset runs, callable from Python:
a random train/test partition (seeded by ``split``), features and targets standardised with
training statistics (regression), the result a :class:`RegressionData` or
:class:`ClassificationData` like every other loader's.
"""

from __future__ import annotations

import csv
import os
import zipfile
from pathlib import Path
import numpy as np
import torch

from typing import Any

from ._data import FLOAT32_MAX, MAX_CLASSES, ClassificationData, RegressionData, check_float32_range

__all__ = ["CONTINUOUS_DISTINCT", "MIN_ROWS_PER_LABEL", "TASKS", "check_class_labels", "load_csv", "read_table"]

#: Values of ``task``.
TASKS = ("regression", "classification")


def read_table(path: str | os.PathLike[str], target: str | int, delimiter: str = ",") -> tuple[np.ndarray, np.ndarray]:
    """Features and target column of a CSV/TSV/TXT file (header row) or an NPZ file.

    Parameters
    ----------
    path : str or os.PathLike
        The file.  An NPZ holds arrays ``x`` and ``y``, or one 2-D array with an integer
        ``target`` column.
    target : str or int
        Target column: its header name, or its index.
    delimiter : str, default ","
        Field separator of a text file.

    Returns
    -------
    (numpy.ndarray, numpy.ndarray)
        Features ``[N, D]`` (float) and targets ``[N]``.

    Raises
    ------
    ValueError
        Naming the file (and the line and column, never the contents): too few rows, a
        non-numeric or non-finite value or one beyond float32's range, ragged rows, an unknown
        or out-of-range target.

    Notes
    -----
    The first non-empty line is a header only if one of its fields is not a number, so a file
    without a header never loses its first data row.
    """
    return _read_table(Path(path), target, delimiter)


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
        with path.open(newline="", encoding="utf-8-sig") as fh:  # a byte-order mark is not part of a name
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
        dup = sorted({h for h in header if header.count(h) > 1})
        if dup:
            raise ValueError(f"{path}: duplicate column name(s) in the header line: {[h[:40] for h in dup[:10]]}; "
                             "give every column its own name")
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


def _npz(loaded: Any) -> Any:
    """``loaded`` as a context manager (np.load returns a bare array for a .npy file)."""
    import contextlib

    return loaded if hasattr(loaded, "__enter__") else contextlib.nullcontext(loaded)


def _read_npz(path: Path, target: Any) -> tuple[Any, Any, Any]:
    """``(x, y, None)`` from arrays 'x' and 'y', or ``(None, None, table)`` from a single 2-D array;
    object arrays are refused (``allow_pickle=False``)."""
    with path.open("rb") as fh, _npz(np.load(fh, allow_pickle=False)) as data:  # fh: numpy leaks its own on errors
        if not hasattr(data, "files"):
            raise ValueError(f"{path}: a single .npy array, not an NPZ archive; write it with numpy.savez")
        if "x" in data and "y" in data:
            x, y = np.asarray(data["x"], dtype=float), np.asarray(data["y"], dtype=float)
            if x.ndim != 2 or y.ndim != 1 or x.shape[0] != y.shape[0]:
                raise ValueError(f"{path}: 'x' must be [N, D] and 'y' [N], got shapes {x.shape} and {y.shape}")
            check_float32_range(x, f"{path}: array 'x'")
            check_float32_range(y, f"{path}: array 'y'")
            return x, y, None
        if len(data.files) != 1 or not isinstance(target, int):
            raise ValueError(
                f"{path}: an NPZ file needs arrays 'x' and 'y', or one 2-D array and an integer "
                f"`target` column; found arrays {data.files[:20]}"
            )
        table = np.asarray(data[data.files[0]], dtype=float)
    if table.ndim != 2:
        raise ValueError(f"{path}: expected a 2-D table, got shape {table.shape}")
    check_float32_range(table, f"{path}")
    return None, None, table


def _read_table(path: Path, target: Any, delimiter: str) -> tuple[np.ndarray, np.ndarray]:
    """Features and target column of a delimited text file (header optional) or an NPZ file."""
    if isinstance(target, bool) or not isinstance(target, (int, str)):
        raise TypeError(f"{path}: target must be a column name or an integer index, got {target!r}")
    if path.suffix == ".npz":
        try:
            x, y, table = _read_npz(path, target)
        except (OSError, EOFError, ValueError, TypeError, zipfile.BadZipFile, KeyError) as e:
            if str(e).startswith(f"{path}: "):
                raise
            raise ValueError(f"{path}: not a readable NPZ file of numeric arrays ({type(e).__name__}: "
                             f"{str(e)[:120]}); write it with numpy.savez") from None
        if table is None:
            return x, y
        header = [str(i) for i in range(table.shape[1])]
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


#: A classification target with more distinct values than this, and fewer than
#: :data:`MIN_ROWS_PER_LABEL` rows per value on average, looks like a continuous measurement.
CONTINUOUS_DISTINCT = 20
#: See :data:`CONTINUOUS_DISTINCT`.
MIN_ROWS_PER_LABEL = 5


def check_class_labels(y: np.ndarray, where: str) -> None:
    """Refuse a classification target that is not class labels, saying what it looks like.

    Parameters
    ----------
    y : numpy.ndarray
        The target column.
    where : str
        Names the file and column in the message.

    Raises
    ------
    ValueError
        If values are not whole numbers (with how many), negative, or so many distinct values
        with so few rows each (more than :data:`CONTINUOUS_DISTINCT` distinct values, fewer than
        :data:`MIN_ROWS_PER_LABEL` rows per value) that the target looks continuous, e.g.
        scikit-learn's diabetes progression score (214 distinct values in 442 rows).
    """
    y = np.asarray(y, dtype=float)
    fractional = int(np.sum(y != np.round(y)))
    distinct = len(np.unique(y))
    fix = "use task = \"regression\", or number the classes 0..K-1"
    if fractional:
        raise ValueError(f"{where}: classification targets must be integer labels >= 0, but {fractional} of "
                         f"{y.size} values are not whole numbers ({distinct} distinct values): it looks "
                         f"continuous; {fix}")
    if y.min() < 0:
        raise ValueError(f"{where}: classification targets must be integer labels >= 0, got {y.min():g}; {fix}")
    if distinct > CONTINUOUS_DISTINCT and y.size < MIN_ROWS_PER_LABEL * distinct:
        raise ValueError(f"{where}: {distinct} distinct target values in {y.size} rows ({y.size / distinct:.1f} rows "
                         f"per value): it looks continuous, not like class labels; {fix}")


def load_csv(
    path: str | os.PathLike[str],
    target: str | int,
    *,
    task: str = "regression",
    test_fraction: float = 0.1,
    split: int = 0,
    delimiter: str = ",",
    standardize: bool = True,
) -> RegressionData | ClassificationData:
    """Load a table of your own as a train/test split (a suite's ``source = "file"``).

    Parameters
    ----------
    path : str or os.PathLike
        CSV/TSV/TXT with a header row, or NPZ (see :func:`read_table`).
    target : str or int
        The target column (name or index).
    task : {"regression", "classification"}, default "regression"
        Classification targets must be integer labels >= 0.
    test_fraction : float, default 0.1
        Share of rows held out, in (0, 1).
    split : int, default 0
        Seed of the random partition (split k of a suite).
    delimiter : str, default ","
        Field separator of a text file.
    standardize : bool, default True
        Standardise inputs (and regression targets) with training-set mean and sd; the
        statistics are kept on the result (``y_mean``, ``y_std``, ``x_mean``, ``x_std``).

    Returns
    -------
    RegressionData or ClassificationData

    Raises
    ------
    FileNotFoundError
        If ``path`` does not exist.
    ValueError
        For an unknown ``task``, a ``test_fraction`` outside (0, 1), NaN/inf in the file, too few
        rows, or a classification target that is not class labels (see
        :func:`check_class_labels`: non-integer values, or one that looks continuous).

    Examples
    --------
    >>> data = load_csv("wine.csv", target="quality", test_fraction=0.2, split=0)
    >>> data.x_train.shape, data.y_std
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; valid: {list(TASKS)}")
    if isinstance(test_fraction, bool) or not isinstance(test_fraction, (int, float)) or not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be a number in (0, 1), got {test_fraction!r}")
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"no such data file: {path}")
    x, y = read_table(path, target, delimiter)
    if not np.isfinite(x).all() or not np.isfinite(y.astype(float)).all():
        raise ValueError(f"{path}: contains NaN or infinite values")
    n = x.shape[0]
    rng = np.random.default_rng(split)
    perm = rng.permutation(n)
    n_test = max(1, int(round(test_fraction * n)))
    test, train = perm[:n_test], perm[n_test:]
    if train.size < 2:
        raise ValueError(f"{path}: too few rows ({n}) for test_fraction={test_fraction}")
    x_mean, x_std = x[train].mean(0), x[train].std(0)
    x_std = np.where(x_std > 0, x_std, 1.0)
    if not standardize:
        x_mean, x_std = np.zeros_like(x_mean), np.ones_like(x_std)
    xs = torch.as_tensor((x - x_mean) / x_std, dtype=torch.float32)
    name = path.stem
    if task == "classification":
        check_class_labels(y, f"{path}: column {target!r}")
        num_classes = int(y.max()) + 1
        if num_classes > MAX_CLASSES:
            raise ValueError(f"{path}: the largest class label is {int(y.max())}, i.e. {num_classes} classes "
                             f"({len(np.unique(y))} distinct labels); at most {MAX_CLASSES} are supported: "
                             "number the classes 0..K-1")
        labels = torch.as_tensor(y.astype(np.int64))
        return ClassificationData(name, xs[train], labels[train], xs[test], labels[test], num_classes)
    y_mean, y_std = (float(y[train].mean()), float(y[train].std())) if standardize else (0.0, 1.0)
    y_std = y_std if y_std > 0 else 1.0
    ys = torch.as_tensor((y - y_mean) / y_std, dtype=torch.float32)
    return RegressionData(
        name, xs[train], ys[train], xs[test], ys[test], y_mean=y_mean, y_std=y_std,
        x_mean=torch.as_tensor(x_mean, dtype=torch.float32), x_std=torch.as_tensor(x_std, dtype=torch.float32),
    )
