"""Dataset containers and data-directory resolution shared by the loaders.

The containers are frozen dataclasses holding ``torch`` tensors, so a loaded
dataset can be passed around without being modified by accident.  Moving a
dataset to another device returns a new object (:meth:`RegressionData.to`).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import pathlib
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "ClassificationData",
    "DATA_DIR_ENV_VAR",
    "FLOAT32_MAX",
    "MAX_CLASSES",
    "RegressionData",
    "check_float32_range",
    "resolve_data_dir",
]

#: Name of the environment variable consulted when no ``data_dir`` is given.
DATA_DIR_ENV_VAR = "PYROBDL_DATA_DIR"

#: Most classes a classification dataset may have: the model has one output per class, and a
#: stray label (e.g. 1,000,000) would otherwise build a network with a million outputs.
MAX_CLASSES = 1000

#: Largest magnitude a data value may have: models compute in float32.
FLOAT32_MAX = float(np.finfo(np.float32).max)


def check_float32_range(values: np.ndarray, what: str, columns: object = None) -> None:
    """Refuse non-finite values and values beyond float32's range, naming where the first one is.

    Values are checked before standardisation: a column near 1e307 overflows the mean and
    standard deviation in float64 and would come out as all zeros; anything beyond
    :data:`FLOAT32_MAX` cannot be represented by the model anyway.

    Parameters
    ----------
    values : numpy.ndarray
        A ``[N]`` or ``[N, D]`` array.
    what : str
        Names the data in the message (e.g. ``"file data.csv"``).
    columns : sequence of int, optional
        The file's column number of each column of ``values`` (default its position).

    Raises
    ------
    ValueError
        Naming the (0-based) row and column of the first offending value, without the value.
    """
    a = np.asarray(values, dtype=np.float64)
    a2 = a.reshape(a.shape[0], -1) if a.ndim else a.reshape(1, 1)
    names = list(columns) if columns is not None else list(range(a2.shape[1]))
    bad = ~np.isfinite(a2)
    if bad.any():
        r, c = (int(i[0]) for i in np.nonzero(bad))
        raise ValueError(f"{what}: NaN or infinite value at row {r}, column {names[c]}")
    big = np.abs(a2) > FLOAT32_MAX
    if big.any():
        r, c = (int(i[0]) for i in np.nonzero(big))
        c = names[c]
        raise ValueError(f"{what}: value at row {r}, column {c} is beyond float32's range "
                         f"(|x| > {FLOAT32_MAX:.3g}); rescale the column")


def _move(value: object, device: torch.device | str) -> object:
    """Return ``value`` on ``device`` when it is a tensor or has its own ``to``.

    Nested frozen dataclasses (such as an exact posterior stored inside a
    synthetic dataset) implement ``to`` themselves, so they are moved too.
    """
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if dataclasses.is_dataclass(value) and hasattr(value, "to"):
        return value.to(device)  # type: ignore[union-attr]
    return value


def _check_tensor(value: object, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(value).__name__}")
    return value


# Argument validators shared by the loaders and generators; each names the
# offending argument in its message.


def _positive_real(value: object, name: str, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be a real number, got {type(value).__name__}")
    value = float(value)
    if not (math.isfinite(value) and (value > 0.0 or (allow_zero and value == 0.0))):
        bound = ">=" if allow_zero else ">"
        raise ValueError(f"`{name}` must be finite and {bound} 0, got {value}")
    return value


def _count(value: object, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}` must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}, got {value}")
    return int(value)


def _generator(seed: object) -> torch.Generator:
    seed = _count(seed, "seed", 0)
    return torch.Generator().manual_seed(seed)


def _as_float64(value: object, name: str) -> torch.Tensor:
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"`{name}` must be a torch.Tensor or numpy.ndarray, got {type(value).__name__}"
        )
    if value.is_complex() or value.dtype == torch.bool:
        raise TypeError(f"`{name}` must be real-valued, got dtype {value.dtype}")
    return value.detach().to(torch.float64)


@dataclass(frozen=True)
class RegressionData:
    """Train/test split of a regression dataset with a single target.

    Parameters
    ----------
    name : str
        Short dataset name (for example ``"boston"`` or ``"gap"``).
    x_train : torch.Tensor
        Training inputs, shape ``[N, D]``, float32.
    y_train : torch.Tensor
        Training targets, shape ``[N]``, float32.
    x_test : torch.Tensor
        Test inputs, shape ``[M, D]``, float32.
    y_test : torch.Tensor
        Test targets, shape ``[M]``, float32.
    y_mean : float, default 0.0
        Offset used to standardise the targets.
    y_std : float, default 1.0
        Scale used to standardise the targets.  Together with ``y_mean`` it
        maps stored targets back to the original scale (see Notes).
    x_mean : torch.Tensor or None, default None
        Per-feature training mean, shape ``[D]``, used to standardise the
        inputs; ``None`` when the inputs are not standardised.
    x_std : torch.Tensor or None, default None
        Per-feature training scale, shape ``[D]``; ``None`` when the inputs
        are not standardised.

    Raises
    ------
    TypeError
        If a data field is not a tensor.
    ValueError
        If the shapes are inconsistent (inputs not 2-D, targets not 1-D,
        differing row counts or feature counts) or ``y_std`` is not positive.

    Notes
    -----
    Stored targets :math:`\\tilde y` relate to the original ones through

    .. math:: y = \\tilde y \\, \\sigma_y + \\mu_y,

    so metrics such as the RMSE or the Gaussian log-likelihood can be reported
    on the original scale; an RMSE scales by :math:`\\sigma_y` and a
    log-density shifts by :math:`-\\log \\sigma_y`.
    """

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    y_mean: float = 0.0
    y_std: float = 1.0
    x_mean: torch.Tensor | None = None
    x_std: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"`name` must be a str, got {type(self.name).__name__}")
        for split in ("train", "test"):
            x = _check_tensor(getattr(self, f"x_{split}"), f"x_{split}")
            y = _check_tensor(getattr(self, f"y_{split}"), f"y_{split}")
            if x.dim() != 2:
                raise ValueError(f"`x_{split}` must be 2-D [N, D], got shape {tuple(x.shape)}")
            if y.dim() != 1:
                raise ValueError(f"`y_{split}` must be 1-D [N], got shape {tuple(y.shape)}")
            if x.shape[0] != y.shape[0]:
                raise ValueError(
                    f"`x_{split}` has {x.shape[0]} rows but `y_{split}` has {y.shape[0]}"
                )
        if self.x_train.shape[1] != self.x_test.shape[1]:
            raise ValueError(
                f"`x_train` has {self.x_train.shape[1]} features but `x_test` has "
                f"{self.x_test.shape[1]}"
            )
        if not float(self.y_std) > 0.0:
            raise ValueError(f"`y_std` must be positive, got {self.y_std}")
        for stat in ("x_mean", "x_std"):
            value = getattr(self, stat)
            if value is not None:
                _check_tensor(value, stat)
                if tuple(value.shape) != (self.num_features,):
                    raise ValueError(
                        f"`{stat}` must have shape [{self.num_features}], "
                        f"got {tuple(value.shape)}"
                    )

    @property
    def num_features(self) -> int:
        """int: Number of input features ``D``."""
        return int(self.x_train.shape[1])

    def to(self, device: torch.device | str) -> RegressionData:
        """Return a copy with every tensor moved to ``device``.

        Parameters
        ----------
        device : torch.device or str
            Target device, e.g. ``"cuda"``.

        Returns
        -------
        RegressionData
            A new object of the same class; ``self`` is unchanged.
        """
        changes = {
            f.name: _move(getattr(self, f.name), device) for f in dataclasses.fields(self)
        }
        return dataclasses.replace(self, **changes)

    def unstandardize_y(self, y: torch.Tensor) -> torch.Tensor:
        """Map standardised targets (or predictions) back to the original scale.

        Parameters
        ----------
        y : torch.Tensor
            Values on the stored (possibly standardised) scale.

        Returns
        -------
        torch.Tensor
            ``y * y_std + y_mean``.

        Raises
        ------
        TypeError
            If ``y`` is not a tensor.
        """
        _check_tensor(y, "y")
        return y * self.y_std + self.y_mean


@dataclass(frozen=True)
class ClassificationData:
    """Train/test split of a classification dataset.

    Parameters
    ----------
    name : str
        Dataset name (for example ``"mnist"``).
    x_train : torch.Tensor
        Training inputs, float32, shape ``[N, D]`` (or ``[N, C, H, W]`` for
        unflattened images).
    y_train : torch.Tensor
        Training labels, int64, shape ``[N]``, values in ``0 .. num_classes-1``.
    x_test : torch.Tensor
        Test inputs with the same trailing shape as ``x_train``.
    y_test : torch.Tensor
        Test labels, int64, shape ``[M]``.
    num_classes : int
        Number of classes.

    Raises
    ------
    TypeError
        If a data field is not a tensor, labels are not int64 or
        ``num_classes`` is not an int.
    ValueError
        If the shapes are inconsistent or ``num_classes`` is not positive.
    """

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int

    def __post_init__(self) -> None:
        for split in ("train", "test"):
            x = _check_tensor(getattr(self, f"x_{split}"), f"x_{split}")
            y = _check_tensor(getattr(self, f"y_{split}"), f"y_{split}")
            if x.dim() < 2:
                raise ValueError(f"`x_{split}` must be at least 2-D, got shape {tuple(x.shape)}")
            if y.dim() != 1:
                raise ValueError(f"`y_{split}` must be 1-D [N], got shape {tuple(y.shape)}")
            if y.dtype != torch.int64:
                raise TypeError(f"`y_{split}` must be int64, got {y.dtype}")
            if x.shape[0] != y.shape[0]:
                raise ValueError(
                    f"`x_{split}` has {x.shape[0]} rows but `y_{split}` has {y.shape[0]}"
                )
        if self.x_train.shape[1:] != self.x_test.shape[1:]:
            raise ValueError(
                f"`x_train` example shape {tuple(self.x_train.shape[1:])} differs from "
                f"`x_test` example shape {tuple(self.x_test.shape[1:])}"
            )
        if isinstance(self.num_classes, bool) or not isinstance(self.num_classes, int):
            raise TypeError(f"`num_classes` must be an int, got {type(self.num_classes).__name__}")
        if self.num_classes < 1:
            raise ValueError(f"`num_classes` must be positive, got {self.num_classes}")
        if self.num_classes > MAX_CLASSES:
            raise ValueError(f"`num_classes` is {self.num_classes}; at most {MAX_CLASSES} classes are supported "
                             "(one model output per class)")

    @property
    def input_shape(self) -> tuple[int, ...]:
        """tuple of int: Shape of one input example (``(784,)`` for flat MNIST)."""
        return tuple(int(s) for s in self.x_train.shape[1:])

    def to(self, device: torch.device | str) -> ClassificationData:
        """Return a copy with every tensor moved to ``device``.

        Parameters
        ----------
        device : torch.device or str
            Target device.

        Returns
        -------
        ClassificationData
            A new object; ``self`` is unchanged.
        """
        changes = {
            f.name: _move(getattr(self, f.name), device) for f in dataclasses.fields(self)
        }
        return dataclasses.replace(self, **changes)


def resolve_data_dir(data_dir: str | os.PathLike | None, subdir: str) -> pathlib.Path:
    """Find the directory holding one family of datasets.

    Parameters
    ----------
    data_dir : str, os.PathLike or None
        Either the datasets root (which contains ``subdir``) or ``subdir``
        itself.  When ``None``, the environment variable ``PYROBDL_DATA_DIR``
        is used instead.
    subdir : str
        Name of the dataset family folder below the root, e.g. ``"uci"``,
        ``"mnist"`` or ``"fashion-mnist"``.

    Returns
    -------
    pathlib.Path
        ``root / subdir`` when that is a directory, otherwise ``root`` itself
        (so the family folder may be passed directly).

    Raises
    ------
    TypeError
        If ``data_dir`` is not a path-like object or ``subdir`` not a str.
    ValueError
        If neither ``data_dir`` nor ``PYROBDL_DATA_DIR`` is set, or the
        directory does not exist.

    Notes
    -----
    Nothing is downloaded: the package never fetches data on its own, so the
    files have to be placed under the root by the user.
    """
    if not isinstance(subdir, str) or not subdir:
        raise TypeError(f"`subdir` must be a non-empty str, got {subdir!r}")
    if data_dir is None:
        env_value = os.environ.get(DATA_DIR_ENV_VAR, "")
        if not env_value:
            raise ValueError(
                f"no data directory given: pass `data_dir` or set the environment "
                f"variable {DATA_DIR_ENV_VAR} to the datasets root (containing '{subdir}/')"
            )
        source = f"{DATA_DIR_ENV_VAR}={env_value!r}"
        data_dir = env_value
    else:
        if not isinstance(data_dir, (str, os.PathLike)):
            raise TypeError(
                f"`data_dir` must be a str, os.PathLike or None, got {type(data_dir).__name__}"
            )
        source = "`data_dir`"
    root = pathlib.Path(data_dir).expanduser()
    if not root.is_dir():
        raise ValueError(f"data directory from {source} does not exist (data_dir: '{root}')")
    candidate = root / subdir
    if candidate.is_dir():
        return candidate
    # The user may have pointed straight at the family folder (e.g. ".../uci").
    return root
