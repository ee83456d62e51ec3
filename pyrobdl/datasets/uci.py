"""Loader for the standard UCI regression benchmark splits.

Expects the layout used by Hernández-Lobato & Adams (2015) and Gal &
Ghahramani (2016): ``<root>/uci/<folder>/data.txt`` plus index files (see
:func:`load_uci`).  Nothing is downloaded.
"""

from __future__ import annotations

import os
import pathlib

import numpy as np
import torch

from ._data import RegressionData, check_float32_range, resolve_data_dir

__all__ = [
    "UCI_DATASETS",
    "load_uci",
    "uci_hyperparameter_grid",
    "uci_num_splits",
]

#: Canonical dataset name -> folder name below ``<root>/uci``.
UCI_DATASETS: dict[str, str] = {
    "boston": "bostonHousing",
    "concrete": "concrete",
    "energy": "energy",
    "kin8nm": "kin8nm",
    "naval": "naval-propulsion-plant",
    "power": "power-plant",
    "protein": "protein-tertiary-structure",
    "wine": "wine-quality-red",
    "yacht": "yacht",
}

def _canonical_name(name: object) -> str:
    """Map a canonical or folder name (any case) to the canonical name."""
    if not isinstance(name, str):
        raise TypeError(f"`name` must be a str, got {type(name).__name__}")
    key = name.strip().lower()
    for canonical, folder in UCI_DATASETS.items():
        if key in (canonical, folder.lower()):
            return canonical
    valid = ", ".join(sorted(UCI_DATASETS))
    raise ValueError(
        f"unknown UCI dataset `name`={name!r}; valid names: {valid} "
        f"(folder names such as 'bostonHousing' are accepted too)"
    )


def _dataset_dir(name: object, data_dir: str | os.PathLike | None) -> tuple[str, pathlib.Path]:
    canonical = _canonical_name(name)
    folder = resolve_data_dir(data_dir, "uci") / UCI_DATASETS[canonical]
    if not folder.is_dir():
        raise ValueError(
            f"UCI dataset folder for {canonical!r} not found at '{folder}' "
            f"(check `data_dir`: it should contain uci/{UCI_DATASETS[canonical]}/)"
        )
    return canonical, folder


def _load_text(path: pathlib.Path, ndmin: int) -> np.ndarray:
    """``np.loadtxt`` of a UCI file as float64; a missing or unparsable file is named in the error."""
    if not path.is_file():
        raise FileNotFoundError(f"missing UCI file: '{path}'")
    try:
        return np.loadtxt(path, dtype=np.float64, ndmin=ndmin)
    except ValueError as err:
        raise ValueError(f"could not parse UCI file '{path}': {err}") from err


def _read_ints(path: pathlib.Path) -> np.ndarray:
    """Read whitespace-separated integers (index files) as a 1-D int64 array."""
    values = _load_text(path, 1)
    # Index files are written as plain integers, but reading through float
    # and checking keeps a stray "3.0" from silently truncating.
    if values.ndim != 1 or not np.all(np.isfinite(values)) or np.any(values != np.round(values)):
        raise ValueError(f"UCI file '{path}' must hold a column of integers")
    return values.astype(np.int64)


def _read_floats(path: pathlib.Path) -> list[float]:
    if not path.is_file():
        return []
    try:
        return [float(v) for v in np.loadtxt(path, dtype=np.float64, ndmin=1)]
    except ValueError as err:
        raise ValueError(f"could not parse UCI file '{path}': {err}") from err


def _count_splits(folder: pathlib.Path) -> int:
    n_splits_file = folder / "n_splits.txt"
    if n_splits_file.is_file():
        values = _read_ints(n_splits_file)
        if values.size != 1 or values[0] < 1:
            raise ValueError(f"'{n_splits_file}' must hold one positive integer")
        return int(values[0])
    count = 0
    while (folder / f"index_train_{count}.txt").is_file():
        count += 1
    if count == 0:
        raise FileNotFoundError(f"no split files (index_train_0.txt) in '{folder}'")
    return count


def uci_num_splits(name: str, data_dir: str | os.PathLike | None = None) -> int:
    """Number of train/test splits available for a UCI dataset.

    Parameters
    ----------
    name : str
        Canonical name (a key of :data:`UCI_DATASETS`) or folder name.
    data_dir : str, os.PathLike or None, default None
        Datasets root or its ``uci`` folder; see
        :func:`~pyrobdl.datasets.resolve_data_dir`.

    Returns
    -------
    int
        The value in ``n_splits.txt`` when present, otherwise the number of
        consecutive ``index_train_<k>.txt`` files starting at ``k = 0``.

    Raises
    ------
    TypeError
        If ``name`` is not a str.
    ValueError
        If ``name`` is unknown or the data directory is missing.
    FileNotFoundError
        If the folder has neither ``n_splits.txt`` nor split files.
    """
    _, folder = _dataset_dir(name, data_dir)
    return _count_splits(folder)


def uci_hyperparameter_grid(
    name: str, data_dir: str | os.PathLike | None = None
) -> dict[str, list[float]]:
    """Hyperparameter grids shipped with the benchmark (Gal's grid search).

    Parameters
    ----------
    name : str
        Canonical or folder name of the dataset.
    data_dir : str, os.PathLike or None, default None
        Datasets root or its ``uci`` folder.

    Returns
    -------
    dict
        ``{"dropout_rates": [...], "tau_values": [...]}`` read from
        ``dropout_rates.txt`` and ``tau_values.txt``; a missing file gives an
        empty list.

    Raises
    ------
    TypeError
        If ``name`` is not a str.
    ValueError
        If ``name`` is unknown, the directory is missing, or a file cannot be
        parsed.

    Notes
    -----
    The :math:`\\tau` values are observation-noise precisions on the
    *original* target scale; with standardised targets the corresponding
    precision is :math:`\\tau \\sigma_y^2`.
    """
    _, folder = _dataset_dir(name, data_dir)
    return {
        "dropout_rates": _read_floats(folder / "dropout_rates.txt"),
        "tau_values": _read_floats(folder / "tau_values.txt"),
    }


def _standardize(train: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Column mean and std (ddof=0) of ``train`` with a guard for constant columns."""
    mean = train.mean(axis=0)
    std = train.std(axis=0)
    # A constant column can give a tiny non-zero std from rounding in the mean
    # (naval's column 11, all 0.998, gives ~2e-13), so detect constancy exactly.
    constant = np.all(train == train[:1], axis=0) | (std == 0.0)
    if np.any(constant):
        mean = np.where(constant, train[0], mean)
        std = np.where(constant, 1.0, std)
    return mean, std


def load_uci(
    name: str,
    split: int = 0,
    *,
    data_dir: str | os.PathLike | None = None,
    standardize: bool = True,
) -> RegressionData:
    """Load one train/test split of a UCI regression benchmark dataset.

    Parameters
    ----------
    name : str
        Canonical name (``boston``, ``concrete``, ``energy``, ``kin8nm``,
        ``naval``, ``power``, ``protein``, ``wine``, ``yacht``) or the folder
        name (e.g. ``bostonHousing``); case is ignored.
    split : int, default 0
        Split index in ``0 .. uci_num_splits(name) - 1``.
    data_dir : str, os.PathLike or None, default None
        Datasets root (containing ``uci/``) or the ``uci`` folder itself;
        ``None`` reads the ``PYROBDL_DATA_DIR`` environment variable.
    standardize : bool, default True
        Standardise inputs and target with training-split statistics.

    Returns
    -------
    RegressionData
        Float32 tensors; ``name`` is the canonical name.  When standardised,
        ``x_mean``/``x_std`` (shape ``[D]``) and ``y_mean``/``y_std`` hold the
        training statistics; otherwise they are ``None`` and ``0``/``1``.

    Raises
    ------
    TypeError
        If ``name`` is not a str, ``split`` not an int or ``standardize`` not
        a bool.
    ValueError
        If ``name`` is unknown, ``split`` is out of range, the data directory
        is missing, or the files are malformed (indices out of range, train
        and test overlapping, non-finite values).
    FileNotFoundError
        If a required file is missing; the message names the file.

    Notes
    -----
    Files read from ``<root>/uci/<folder>/``: ``data.txt`` (whitespace
    separated, one row per example), ``index_features.txt`` and
    ``index_target.txt`` (0-based columns), ``index_train_<k>.txt`` and
    ``index_test_<k>.txt`` (0-based rows).

    Standardisation uses the training rows only:

    .. math:: \\tilde x_{nd} = (x_{nd} - \\mu_d) / \\sigma_d, \\qquad
              \\tilde y_n = (y_n - \\mu_y) / \\sigma_y,

    with :math:`\\sigma` the population standard deviation (``ddof=0``).  A
    column that is constant on the training rows would give
    :math:`\\sigma_d = 0`; its scale is set to 1 and its centre to the
    constant value, so the standardised training column is exactly 0 (the
    benchmark's naval dataset has two such columns).

    References
    ----------
    .. [1] J. M. Hernández-Lobato, R. P. Adams, "Probabilistic
       Backpropagation for Scalable Learning of Bayesian Neural Networks",
       ICML 2015.
    .. [2] Y. Gal, Z. Ghahramani, "Dropout as a Bayesian Approximation:
       Representing Model Uncertainty in Deep Learning", ICML 2016.
    """
    canonical = _canonical_name(name)
    if isinstance(split, bool) or not isinstance(split, (int, np.integer)):
        raise TypeError(f"`split` must be an int, got {type(split).__name__}")
    if not isinstance(standardize, bool):
        raise TypeError(f"`standardize` must be a bool, got {type(standardize).__name__}")
    split = int(split)
    _, folder = _dataset_dir(canonical, data_dir)
    num_splits = _count_splits(folder)
    if not 0 <= split < num_splits:
        raise ValueError(
            f"`split`={split} out of range for {canonical!r}: valid range is 0..{num_splits - 1}"
        )
    data, features, target, train_rows, test_rows = _read_split(folder, split)
    x_train = data[np.ix_(train_rows, features)]
    x_test = data[np.ix_(test_rows, features)]
    y_train = data[train_rows, target]
    y_test = data[test_rows, target]

    x_mean = x_std = None
    y_mean, y_std = 0.0, 1.0
    if standardize:
        x_mean, x_std = _standardize(x_train)
        y_mean_arr, y_std_arr = _standardize(y_train[:, None])
        y_mean, y_std = float(y_mean_arr[0]), float(y_std_arr[0])
        # Centre/scale in float64 and only then cast, to avoid float32
        # cancellation on columns with a large offset (e.g. naval, protein).
        x_train = (x_train - x_mean) / x_std
        x_test = (x_test - x_mean) / x_std
        y_train = (y_train - y_mean) / y_std
        y_test = (y_test - y_mean) / y_std

    def as_tensor(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))

    return RegressionData(
        name=canonical,
        x_train=as_tensor(x_train),
        y_train=as_tensor(y_train),
        x_test=as_tensor(x_test),
        y_test=as_tensor(y_test),
        y_mean=y_mean,
        y_std=y_std,
        x_mean=None if x_mean is None else as_tensor(x_mean),
        x_std=None if x_std is None else as_tensor(x_std),
    )


def _read_split(folder: pathlib.Path, split: int) -> tuple[np.ndarray, np.ndarray, int, np.ndarray, np.ndarray]:
    """``data.txt`` (float64) with split ``split``'s feature columns, target column, train and test rows,
    each checked: indices in range, train and test disjoint, values representable in float32."""
    features = _read_ints(folder / "index_features.txt")
    target = _read_ints(folder / "index_target.txt")
    if target.size != 1:
        raise ValueError(f"'{folder / 'index_target.txt'}' must hold exactly one column index")
    train_rows = _read_ints(folder / f"index_train_{split}.txt")
    test_rows = _read_ints(folder / f"index_test_{split}.txt")
    data_file = folder / "data.txt"
    data = _load_text(data_file, 2)

    num_rows, num_cols = data.shape
    columns = np.concatenate([features, target])
    if columns.size and (columns.min() < 0 or columns.max() >= num_cols):
        raise ValueError(f"column indices in '{folder}' out of range for {num_cols} columns")
    for label, rows in (("train", train_rows), ("test", test_rows)):
        if rows.size == 0:
            raise ValueError(f"'{folder / f'index_{label}_{split}.txt'}' lists no rows")
        if rows.min() < 0 or rows.max() >= num_rows:
            raise ValueError(
                f"row indices in '{folder / f'index_{label}_{split}.txt'}' out of range "
                f"for {num_rows} rows in data.txt"
            )
    if np.intersect1d(train_rows, test_rows).size:
        raise ValueError(f"train and test rows of split {split} in '{folder}' overlap")
    check_float32_range(data[:, columns], f"'{data_file}'", columns.tolist())
    return data, features, int(target[0]), train_rows, test_rows
