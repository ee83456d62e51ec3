r"""Scoring draws of an approximate posterior against a stored reference.

The 1-D Wasserstein-2 distance between two distributions on the real line is the :math:`L^2`
distance between their quantile functions, :math:`W_2^2(P, R) = \int_0^1 (Q_P(p) - Q_R(p))^2\,dp`.
The store keeps the reference's quantile function at the midpoints :math:`p_i = (i + 1/2)/L` of
``L`` equal bins, and :func:`score` evaluates the user's empirical quantile function at the same
levels, so the integral becomes the midpoint sum :math:`W_2^2 \approx \frac1L \sum_i (Q_P(p_i) -
Q_R(p_i))^2`, per test input; ``w2_function`` is its square root averaged over the inputs.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ._store import Reference, array_sha256, empirical_quantiles, load, mixture_test_ll

SCALES = ("original", "model")


def _as_array(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor, without importing torch
        value = value.detach().cpu().numpy()
    return np.asarray(value, dtype=np.float64)


def _check_f(f_draws: Any, ref: Reference) -> np.ndarray:
    f = _as_array(f_draws)
    n = ref.num_inputs
    if f.ndim == 3 and f.shape[-1] == 1:
        f = f[..., 0]
    if f.ndim != 2 or f.shape[1] != n or f.shape[0] < 2:
        raise ValueError(f"f_draws must have shape [S, N={n}] or [S, {n}, 1] with S >= 2 draws "
                         f"(reference {ref.name!r} split {ref.split} has {n} test inputs), got {list(f.shape)}")
    if not np.all(np.isfinite(f)):
        raise ValueError(f"f_draws has {int(np.sum(~np.isfinite(f)))} non-finite values")
    return f


def _check_noise(noise_sd_draws: Any, num_draws: int) -> np.ndarray:
    s = _as_array(noise_sd_draws)
    if s.ndim == 0:
        s = np.full(num_draws, float(s))
    if s.ndim == 2 and s.shape[1] == 1:
        s = s[:, 0]
    if s.shape != (num_draws,):
        raise ValueError(f"noise_sd_draws must be a scalar or have shape [S={num_draws}] (one noise sd per "
                         f"f draw), got {list(s.shape)}")
    if not np.all(np.isfinite(s)) or not np.all(s > 0):
        raise ValueError("noise_sd_draws must be finite and > 0")
    return s


def _check_y(y_test: Any, ref: Reference, scale: str) -> np.ndarray:
    y = _as_array(y_test)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.shape != (ref.num_inputs,):
        raise ValueError(f"y_test must have shape [N={ref.num_inputs}], got {list(y.shape)}")
    if not np.all(np.isfinite(y)):
        raise ValueError("y_test has non-finite values")
    model = y if scale == "model" else (y - ref.y_mean) / ref.y_std
    if array_sha256(model) != ref.meta["y_sha256"] and not _same_synthetic_targets(model, ref):
        raise ValueError(
            f"y_test does not match the targets of reference {ref.name!r} split {ref.split} (SHA-256 of the "
            f"float32-rounded model-scale targets differs): use the split's test targets in their order, on the "
            f"{scale} scale, computed in float64 (e.g. data.y_test.double() * data.y_std + data.y_mean)")
    return y if scale == "original" else y * ref.y_std + ref.y_mean


#: How far model-scale targets may lie from a synthetic reference's stored ones: relative to their
#: spread and size.  Regenerated synthetic targets are float32 arithmetic (blr's x @ w, gap's sin)
#: whose last bits are the machine's math library's: on an AMD EPYC 3 of blr's 100 targets came out
#: 4 ulps (~5e-7) from those an Intel Xeon stored; a wrong order or scale is off by ~1.
SYNTHETIC_TARGETS_RTOL = 1e-5


def _same_synthetic_targets(model: np.ndarray, ref: Reference) -> bool:
    """Whether ``model`` (model-scale targets) are a synthetic reference's stored ones up to the float32
    rounding of the machine that regenerated them (:data:`SYNTHETIC_TARGETS_RTOL`); False without them."""
    if ref.y_test is None:  # real data: targets are read, not computed, and must hash the same
        return False
    stored = (np.asarray(ref.y_test, dtype=np.float64) - ref.y_mean) / ref.y_std
    bound = SYNTHETIC_TARGETS_RTOL * (np.std(stored) + np.abs(stored))
    return bool(np.all(np.abs(model - stored) <= bound))


def check_inputs(name: str, split: int, x_test: Any, *, root: str | os.PathLike | None = None) -> None:
    """Check that ``x_test`` are the reference's test inputs (by their stored SHA-256).

    Parameters
    ----------
    name, split
        The reference (:func:`available`).
    x_test : array-like ``[N, D]``
        The inputs as the model sees them (``pyrobdl.datasets`` standardises UCI inputs with the
        training split's statistics), in the test set's order.
    root : path-like, optional
        Store folder.

    Raises
    ------
    ValueError
        If the reference does not exist or the inputs differ.
    """
    ref = load(name, split, root=root)
    if array_sha256(_as_array(x_test)) != ref.meta["x_sha256"]:
        raise ValueError(f"x_test does not match the test inputs of reference {name!r} split {split} "
                         "(SHA-256 of the float32-rounded inputs differs)")


def _w2(q_user: np.ndarray, q_ref: np.ndarray) -> np.ndarray:
    """Per-row 1-D W2 from quantiles at the same midpoint levels: ``sqrt(mean_i (a_i - b_i)^2)``."""
    return np.sqrt(np.mean((q_user - q_ref) ** 2, axis=-1))


def score(name: str, split: int, f_draws: Any, *, noise_sd_draws: Any = None, y_test: Any = None,
          scale: str = "original", root: str | os.PathLike | None = None) -> dict[str, Any]:
    r"""Score draws of :math:`f` at the reference's test inputs against the stored reference.

    Parameters
    ----------
    name, split
        The reference (:func:`available`).
    f_draws : array-like ``[S, N]`` or ``[S, N, 1]``
        Draws of the network output at the test inputs (in the test set's order), one row per
        posterior draw.  Numpy arrays and torch tensors are accepted.
    noise_sd_draws : float or array-like ``[S]``, optional
        Noise sd paired with each draw (a scalar for a fixed noise).  Gives ``noise_w2``, and with
        ``y_test`` the test log-likelihood.
    y_test : array-like ``[N]``, optional
        The split's test targets, checked against the stored SHA-256.  Gives ``rmse``, and with
        ``noise_sd_draws`` ``test_ll``.
    scale : {"original", "model"}, default "original"
        Scale of ``f_draws``, ``noise_sd_draws`` and ``y_test``: the original targets', or the
        standardised one the model was trained on (converted with the stored ``y_mean``/``y_std``).
        Every returned number is on the original scale.
    root : path-like, optional
        Store folder (default: the package's own).

    Returns
    -------
    dict
        ``w2_function`` (mean over inputs of the 1-D W2 between the draws and the reference),
        ``w2_function_in_sd`` (each input's W2 in units of the reference sd there, averaged),
        ``mean_error``/``sd_error`` (mean absolute error of the per-input mean and sd),
        ``mean_error_in_sd`` and ``sd_error_relative`` (``|s/s_ref - 1|``), ``num_draws``,
        ``num_inputs``, ``certified`` (the reference's), ``rounding_floor_w2`` (the largest
        rounding error of the stored quantiles); with noise draws ``noise_w2``; with targets
        ``rmse`` and ``reference_rmse``; with both ``test_ll`` and ``reference_test_ll``.

    Raises
    ------
    ValueError
        Before any computation, for a reference that is not stored (listing those that are), a bad
        ``scale``, draws of the wrong shape or with non-finite values, non-positive noise sds, or
        targets that are not the reference's.
    """
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {list(SCALES)}, got {scale!r}")
    ref = load(name, split, root=root)
    f = _check_f(f_draws, ref)
    noise = None if noise_sd_draws is None else _check_noise(noise_sd_draws, f.shape[0])
    y = None if y_test is None else _check_y(y_test, ref, scale)
    if scale == "model":
        f = f * ref.y_std + ref.y_mean
        noise = None if noise is None else noise * ref.y_std
    q_ref = ref.quantiles
    w2 = _w2(empirical_quantiles(f, ref.num_levels).T, q_ref)
    m, s = f.mean(0), f.std(0, ddof=1)
    out: dict[str, Any] = {
        "w2_function": float(w2.mean()),
        "w2_function_in_sd": float(np.mean(w2 / ref.sd)),
        "mean_error": float(np.mean(np.abs(m - ref.mean))),
        "mean_error_in_sd": float(np.mean(np.abs(m - ref.mean) / ref.sd)),
        "sd_error": float(np.mean(np.abs(s - ref.sd))),
        "sd_error_relative": float(np.mean(np.abs(s / ref.sd - 1.0))),
        "num_draws": int(f.shape[0]), "num_inputs": ref.num_inputs, "certified": ref.certified,
        "rounding_floor_w2": float(ref.meta["rounding"]["quantile_max_abs"]),
    }
    if noise is not None:
        out["noise_w2"] = float(_w2(empirical_quantiles(noise, ref.num_levels), ref.noise_sd_quantiles))
    if y is not None:
        out["rmse"] = float(np.sqrt(np.mean((m - y) ** 2)))
        out["reference_rmse"] = float(ref.meta["reference_metrics"]["rmse"])
        if noise is not None:
            out["test_ll"] = mixture_test_ll(f, noise, y)
            out["reference_test_ll"] = float(ref.meta["reference_metrics"]["test_ll"])
    return out
