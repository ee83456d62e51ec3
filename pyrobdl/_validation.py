"""Input checks shared by ``fit``, ``predict`` and the datasets: clear errors before any work."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

__all__ = ["as_tensor", "available_memory", "check_data", "check_fit_sizes", "check_inputs", "check_memory",
           "check_option_values", "nesting_depth", "positive_number", "resolve_device"]

#: Deepest nesting of lists and dicts accepted in a parsed suite file or result record (a record is
#: about 5 deep, a suite file about 4; this only stops hostile files).
MAX_NESTING = 64


def nesting_depth(obj: Any, limit: int = MAX_NESTING) -> int:
    """Nesting depth of parsed TOML or JSON (dicts and lists), without recursion; stops counting
    once past ``limit`` (so the answer does not depend on Python's recursion limit, which
    ``torch.compile`` raises for the rest of the process)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        item, d = stack.pop()
        deepest = max(deepest, d)
        if d > limit:
            break
        if isinstance(item, dict):
            stack.extend((v, d + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, d + 1) for v in item)
    return deepest


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


def available_memory() -> int | None:
    """Bytes of memory this machine can still give (``MemAvailable`` on Linux, else the physical
    memory); None when unknown."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import os

        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):  # pragma: no cover - not POSIX
        return None


def check_memory(name: str, value: Any, nbytes: float, *, available: int | None = None) -> None:
    """Refuse an option whose value needs more memory than the machine has, before allocating.

    Parameters
    ----------
    name : str
        The option's name (``num_steps``, ``hidden``, ...), named in the message.
    value : Any
        Its value (shown, shortened).
    nbytes : float
        A lower bound of the bytes the value needs.
    available : int, optional
        Bytes available; default :func:`available_memory`.

    Raises
    ------
    ValueError
        ``nbytes`` exceeds what is available.
    """
    available = available_memory() if available is None else available
    if available is not None and nbytes > available:
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise ValueError(f"{name}={shown} needs at least {nbytes / 2**30:.3g} GiB of memory, more than the "
                         f"{available / 2**30:.3g} GiB this machine has available: lower {name}")


def check_option_values(method: str, defaults: Any, options: Any) -> None:
    """Type checks every method shares, before a method sees its options: an option whose default
    is a real number takes a real number (a boolean is not one: ``lr=True`` is not 1.0), and a
    finite one (or a list of such, e.g. dropout's per-layer ``p``).  Counts (integer defaults) are
    checked by each method.

    Raises
    ------
    TypeError
        A boolean, or a non-number, given for a numeric option.
    ValueError
        A NaN or infinite value for a numeric option.
    """
    for key, value in options.items():
        default = defaults.get(key)
        if not isinstance(default, float):
            continue  # a count (each method checks its own: "must be an integer >= 1"), a flag, a choice, None
        if isinstance(value, (list, tuple)) and value:  # per-layer values (dropout's p): each a number
            for v in value:
                _check_number(method, key, default, v)
            continue
        _check_number(method, key, default, value)


def check_counts(method: str, defaults: Any, options: Any) -> None:
    """A count (an option named ``num_*`` or ``*_num_*`` whose default is an integer) cannot be
    negative: refused when a suite is planned, before any cell runs (``fit`` leaves the range to
    each method's own check and message).

    Raises
    ------
    ValueError
        A negative integer for a count, naming the method and the option.
    """
    for key, value in options.items():
        default = defaults.get(key)
        if not ("num_" in key and isinstance(default, int) and not isinstance(default, bool)):
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            raise ValueError(f"method {method!r}: option {key} is a count and must be >= 0 (default {default}), "
                             f"got {value}")


def _check_number(method: str, key: str, default: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"method {method!r}: option {key} must be a number (default {default!r}), got "
                        f"{value!r} ({type(value).__name__})" + ("; a boolean is not a number"
                                                                 if isinstance(value, bool) else ""))
    if isinstance(value, float) and not math.isfinite(value) and key not in _RANGE_CHECKED:
        raise ValueError(f"method {method!r}: option {key} must be a finite number, got {value!r}")


#: Real-valued options whose method checks the range itself, with its own message (NaN included).
_RANGE_CHECKED = frozenset({"checkpoint_every_s"})


#: Options that multiply the memory of a fit: name -> what one unit holds ("params": one copy of
#: the network's parameters; "step": one float per step, the loss history).
_SIZE_OPTIONS = {"num_steps": "step", "map_num_steps": "step", "num_particles": "params", "num_samples": "params",
                 "num_members": "params", "max_num_samples": "params"}


def check_fit_sizes(model: Any, options: Any) -> None:
    """Refuse sizes no fit on this machine can hold (each a lower bound), naming the option.

    The network itself (``hidden``: parameters, their scales, gradients and optimiser state, four
    float copies at least), the loss history (``num_steps``), and per-draw or per-particle
    copies of the parameters (``num_samples`` x ``num_chains``, ``num_particles``, ...).

    Raises
    ------
    ValueError
        Naming the option (or ``hidden`` / ``in_features``) and the memory it needs.
    """
    widths = [model.in_features, *model.hidden, model.out_features] if hasattr(model, "hidden") else None
    if widths is None:
        return
    params = sum((a + 1) * b for a, b in zip(widths[:-1], widths[1:]))
    available = available_memory()
    what = "hidden" if any(model.hidden) else "in_features"
    check_memory(what, list(model.hidden) if what == "hidden" else model.in_features, 4.0 * 4 * params,
                 available=available)
    chains = options.get("num_chains", 1)
    chains = chains if isinstance(chains, int) and not isinstance(chains, bool) and chains >= 1 else 1
    for key, unit in _SIZE_OPTIONS.items():
        value = options.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            continue
        per = 4.0 if unit == "step" else 4.0 * params * (chains if key in ("num_samples", "max_num_samples") else 1)
        check_memory(key, value, per * value, available=available)
