"""Input checks shared by ``fit``, ``predict`` and the datasets: clear errors before any work."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

__all__ = ["as_tensor", "check_data", "check_inputs", "positive_number", "resolve_device"]


def positive_number(name: str, value: Any) -> float:
    """Return ``value`` as a float if it is a finite number > 0, else raise naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def as_tensor(name: str, value: Any, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Convert an array-like to a tensor, or raise TypeError naming ``name``.

    Torch tensors and numpy arrays are treated alike: floating point of any precision
    (float16, bfloat16, float32, float64) becomes torch's default dtype unless ``dtype`` is
    given, integers and booleans keep their type, and complex or non-numeric input is refused.
    """
    if isinstance(value, torch.Tensor):
        if value.is_complex():
            raise TypeError(f"{name} must be real-valued, got complex dtype {value.dtype}")
        if dtype is not None:
            return value.to(dtype)
        return value.to(torch.get_default_dtype()) if value.is_floating_point() else value
    if isinstance(value, (np.ndarray, list, tuple)):
        arr = np.asarray(value)
        if arr.dtype.kind not in "biuf":
            raise TypeError(f"{name} must be numeric, got dtype {arr.dtype}")
        t = torch.from_numpy(np.ascontiguousarray(arr))
        if dtype is not None:
            return t.to(dtype)
        return t.to(torch.get_default_dtype()) if t.is_floating_point() else t
    raise TypeError(f"{name} must be a torch.Tensor or numpy array, got {type(value).__name__}")


def _finite(name: str, t: torch.Tensor) -> None:
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise ValueError(f"{name} contains {bad} NaN or infinite value(s)")


def check_inputs(model: Any, x: Any, name: str = "x") -> torch.Tensor:
    """Return ``x`` as a float tensor of shape ``[N, model.in_features]`` or raise ValueError."""
    x = as_tensor(name, x)
    if not x.is_floating_point():
        x = x.to(torch.get_default_dtype())
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [N, {model.in_features}], got {x.dim()}-D shape {list(x.shape)}")
    if x.shape[1] != model.in_features:
        raise ValueError(f"{name} has {x.shape[1]} features but the model has in_features={model.in_features}")
    if x.shape[0] == 0:
        raise ValueError(f"{name} has no rows")
    _finite(name, x)
    return x


def check_data(model: Any, x: Any, y: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a training set for ``model``; return ``(x, y)`` with ``y`` in the likelihood's shape.

    Raises
    ------
    ValueError
        ``x`` not 2-D or with the wrong number of features, ``y`` of the wrong length or shape,
        NaN/inf anywhere, class labels outside ``0 .. out_features - 1``.
    TypeError
        Non-numeric or complex input, non-integer labels for classification, or integer-coded
        targets for regression.
    """
    x = check_inputs(model, x)
    y = as_tensor("y", y)
    if y.dim() == 0 or y.shape[0] != x.shape[0]:
        raise ValueError(f"y must have one row per row of x ({x.shape[0]}), got shape {list(y.shape)}")
    if model.likelihood.task == "classification":
        if y.is_floating_point():
            if not bool((y == y.round()).all()):
                raise TypeError("y must hold integer class labels for a categorical likelihood")
        y = y.long()
        if bool((y < 0).any()) or bool((y >= model.out_features).any()):
            raise ValueError(f"y has labels outside 0..{model.out_features - 1}")
    else:
        if not y.is_floating_point():
            raise TypeError(
                f"y holds {y.dtype} values, but a regression likelihood needs real-valued targets; integer "
                "labels suggest classification (likelihoods.Categorical), otherwise convert y to float"
            )
        y = y.to(x.dtype)
        _finite("y", y)
    return x, model.likelihood.prepare_targets(y, model.out_features)


def resolve_device(device: Any, default: torch.device) -> torch.device:
    """Return a ``torch.device``; None means ``default`` (the data's device).

    Raises
    ------
    ValueError
        For an unparsable device or ``"cuda"`` when CUDA is not available.
    """
    if device is None:
        return default
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a valid torch device") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return dev
