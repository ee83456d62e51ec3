r"""Where a posterior is certified: a deterministic subset of inputs spread over the data.

A certificate checks R-hat and ESS of the network output :math:`f(x_n)` at some inputs.  Taken as
the first rows in file order, those inputs can all sit in one corner of the data (on the
quickstart's 1-D gap data the first 50 of 200 test inputs lie on the left edge, x from −1.5 to
−0.76, and the gap, where the posteriors differ most, was never checked).  :func:`spread_indices`
picks them by greedy farthest-point sampling (a maximin design) in standardised input space:

1. standardise every input column by its standard deviation (a constant column is left as is);
2. start from the input nearest the column means;
3. repeatedly add the input farthest (Euclidean) from every input chosen so far; ties go to the
   lowest row index.

The result covers every region of the inputs — the edges first, then the gaps between chosen
points, the data's own gaps included — depends on nothing but the inputs and ``n`` (no seed, no
file order beyond ties), and costs :math:`O(N n)`.  Quantiles of each feature would cover each
axis but not their combinations; a seeded permutation covers regions only in proportion to their
density, so a sparse region (a gap) can be missed.

:func:`certification_points` is what every chain method calls to get its certification inputs
(given ``certify_inputs``, else ``diagnostic_points`` training inputs spread this way) and the
record of them that its settings and its certification keep; :func:`check_certify_inputs` refuses
bad given inputs before any work; :func:`given_inputs` is the settings' part of that record.
(All three are also importable from :mod:`pyrobdl.diagnostics.certification`, where they were.)
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping

import numpy as np
import torch

from .._validation import check_inputs

__all__ = ["certification_points", "check_certify_inputs", "given_inputs", "inputs_sha256", "spread_indices"]


def inputs_sha256(x: torch.Tensor) -> str:
    """SHA-256 of inputs ``[N, in_features]`` as float64: how a certification (given inputs) and a
    resolution name the inputs they were computed at."""
    values = x.detach().to("cpu", torch.float64).contiguous().numpy()
    return hashlib.sha256(values.tobytes()).hexdigest()


def spread_indices(x: Any, n: int) -> list[int]:
    """Row indices of ``n`` inputs spread over ``x`` by greedy farthest-point sampling (module docstring).

    Parameters
    ----------
    x : array-like
        Inputs ``[N, in_features]`` (finite).
    n : int
        How many to choose; all ``N`` rows (in order) when ``n >= N``.

    Returns
    -------
    list of int
        Sorted row indices.

    Raises
    ------
    ValueError
        ``x`` not 2-D and non-empty, not finite, or ``n < 1``.
    """
    arr = x.detach().to("cpu", torch.float64).numpy() if isinstance(x, torch.Tensor) else np.asarray(x, float)
    if arr.ndim != 2 or arr.shape[0] == 0:
        raise ValueError(f"x must be inputs [N, in_features] with N >= 1, got shape {list(arr.shape)}")
    if not np.isfinite(arr).all():
        raise ValueError("x must be finite to choose certification inputs from it")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    count = arr.shape[0]
    if n >= count:
        return list(range(count))
    sd = arr.std(0)
    z = (arr - arr.mean(0)) / np.where(sd > 0, sd, 1.0)
    first = int(np.argmin(np.square(z).sum(1)))
    chosen = [first]
    dist = np.square(z - z[first]).sum(1)
    dist[first] = -1.0  # never chosen twice (repeated inputs are distinct rows)
    for _ in range(n - 1):
        nxt = int(np.argmax(dist))  # the first of equal maxima: the lowest index
        chosen.append(nxt)
        dist = np.minimum(dist, np.square(z - z[nxt]).sum(1))
        dist[chosen] = -1.0
    return sorted(chosen)


def check_certify_inputs(model: Any, options: Mapping[str, Any]) -> None:
    """Refuse a chain method's ``certify_inputs`` option before any work when it is not None and
    not inputs ``[n, in_features]`` of ``model`` (the error names the option).

    Raises
    ------
    ValueError, TypeError
        From :func:`pyrobdl._validation.check_inputs`.
    """
    if options.get("certify_inputs") is not None:
        check_inputs(model, options["certify_inputs"], "certify_inputs")


def certification_points(model: Any, x: torch.Tensor, options: Mapping[str, Any]) -> tuple[torch.Tensor, Any]:
    """The inputs an MCMC method certifies its chains at, and what its settings record of them.

    Parameters
    ----------
    model : pyrobdl.BayesianMLP
    x : torch.Tensor
        The training inputs (on the run's device).
    options : Mapping
        The method's options: ``certify_inputs`` (None, or inputs ``[n, in_features]``, e.g.
        held-back test inputs) and ``diagnostic_points``.

    Returns
    -------
    points : torch.Tensor
        ``certify_inputs`` on ``x``'s device and dtype, else ``diagnostic_points`` rows of ``x``
        spread over it (:func:`~pyrobdl.diagnostics.inputs.spread_indices`; never the first rows
        in file order, which can all lie in one corner of the data).
    recorded : dict
        For the posterior's settings in place of the tensor, and the certification's ``inputs``:
        ``source`` ("certify_inputs" or "training inputs"), ``points``, and the SHA-256 of given
        inputs' float64 values or the chosen rows' ``indices``.

    Raises
    ------
    ValueError
        ``certify_inputs`` not 2-D with the model's ``in_features`` columns, empty or not finite.
    """
    given = options.get("certify_inputs")
    if given is None:
        rows = spread_indices(x, int(options["diagnostic_points"]))
        return x[rows], {"source": "training inputs", "points": len(rows), "indices": rows}
    points = check_inputs(model, given, "certify_inputs").to(device=x.device, dtype=x.dtype)
    return points, {"source": "certify_inputs", "points": int(points.shape[0]), "sha256": inputs_sha256(points)}


def given_inputs(recorded: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """What a method's settings record of its ``certify_inputs`` option: the record of
    :func:`certification_points` when the caller gave them, None when it chose them itself."""
    return recorded if recorded.get("source") == "certify_inputs" else None
