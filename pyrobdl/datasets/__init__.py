"""Datasets for Bayesian deep learning experiments.

Synthetic problems with known answers (:func:`bayesian_linear_regression`,
:func:`gap_regression`), the standard UCI regression splits
(:func:`load_uci`), MNIST / Fashion-MNIST (:func:`load_mnist`) and your own CSV/NPZ tables
(:func:`load_csv`).  Real data
are read from a local directory given as ``data_dir`` or through the
``PYROBDL_DATA_DIR`` environment variable; nothing is downloaded.
"""

from __future__ import annotations

from ._data import DATA_DIR_ENV_VAR, ClassificationData, RegressionData, resolve_data_dir
from .mnist import MNIST_NAMES, load_mnist, read_idx
from .tabular import load_csv, read_table
from .synthetic import (
    BLRData,
    ExactBLRPosterior,
    bayesian_linear_regression,
    blr_posterior,
    gap_regression,
)
from .uci import UCI_DATASETS, load_uci, uci_hyperparameter_grid, uci_num_splits

__all__ = [
    "BLRData",
    "ClassificationData",
    "DATA_DIR_ENV_VAR",
    "ExactBLRPosterior",
    "MNIST_NAMES",
    "RegressionData",
    "UCI_DATASETS",
    "bayesian_linear_regression",
    "blr_posterior",
    "gap_regression",
    "load_csv",
    "load_mnist",
    "load_uci",
    "read_idx",
    "read_table",
    "resolve_data_dir",
    "uci_hyperparameter_grid",
    "uci_num_splits",
]
