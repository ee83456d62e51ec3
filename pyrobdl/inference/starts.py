r"""Starting points from given weights: what ``fit(..., init=...)`` means for each kind of method.

:func:`~pyrobdl.inference.registry.fit` turns ``init`` (a trained ``torch.nn`` network or its
``state_dict``) into the model's weight and bias site values once, with
:func:`pyrobdl.torch_interop.init_sites`, before any work; a method that lists ``init`` among
its options then starts there:

* SVI methods (``map``, ``mean_field``, ``bbvi``, the dropout families): the guide's locations
  (``init_loc`` given by ``init``);
* ``laplace``: the MAP fit starts at ``init``, or, with ``fit_map=False``, the Gaussian is
  centred at ``init`` itself (post-hoc Laplace);
* ``ensemble``: member 0 starts at ``init``; the others at fresh ``nn.Linear``-style draws
  (``init_spread=None``) or at ``init`` plus ``init_spread`` times standard normal noise;
* ``chees``: every chain (every superchain) starts at ``init`` plus ``init_spread`` times
  standard normal noise.

The noise is added in the flat, unconstrained coordinates of :mod:`pyrobdl.flat` (weights as
they are, a noise precision as its logarithm).  Sites ``init`` does not give (a learned noise
precision: a plain network has none) start at their prior mean.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from ..flat import FlatLogJoint
from ..guides.base import init_values, model_sites

__all__ = ["INIT_REPLACES", "check_spread", "init_members", "spread_starts"]

#: Options a given ``init`` replaces; ``fit`` refuses them beside it.
INIT_REPLACES = ("init_loc", "init_strategy")


def check_spread(value: Any, allow_none: bool) -> None:
    """Raise ``ValueError`` unless ``init_spread`` is a finite float >= 0 (or None where allowed)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        also = " or None" if allow_none else ""
        raise ValueError(f"init_spread must be a finite number >= 0{also}, got {value!r}")


def init_members(model: Any, lj: FlatLogJoint, num_members: int, init_loc: Any = "linear") -> torch.Tensor:
    """K independent starting points from :func:`pyrobdl.guides.base.init_values`, packed in the
    flat layout.

    Parameters
    ----------
    model : pyrobdl.BayesianMLP
        The model.
    lj : FlatLogJoint
        Its flat log joint (gives the layout, dtype and device).
    num_members : int
        K.
    init_loc : str or dict, default "linear"
        ``"linear"``: ``nn.Linear``'s uniform, other sites at their prior mean; ``"prior"``:
        prior draws; see :func:`~pyrobdl.guides.base.init_values`.  Draws use the global torch RNG.

    Returns
    -------
    torch.Tensor
        ``[K, P]``.
    """
    sites = model_sites(model)
    rows = [lj.layout.pack(init_values(sites, init_loc)) for _ in range(num_members)]
    return torch.stack(rows).to(dtype=lj.dtype, device=lj.device)


def spread_starts(model: Any, lj: FlatLogJoint, init: Mapping[str, torch.Tensor], num: int, spread: float | None,
                  *, keep_first: bool = False, generator: torch.Generator | None = None) -> torch.Tensor:
    """``num`` starting points ``[num, P]`` around the given site values.

    Parameters
    ----------
    model : pyrobdl.BayesianMLP
        The model.
    lj : FlatLogJoint
        Its flat log joint (layout, dtype, device).
    init : Mapping[str, torch.Tensor]
        Site values (from :func:`pyrobdl.torch_interop.init_sites`); missing sites start at
        their prior mean.
    num : int
        Rows.
    spread : float or None
        Standard deviation of the Gaussian noise added to every unconstrained coordinate;
        None: the rows other than the first are fresh ``"linear"`` starts
        (:func:`~pyrobdl.guides.base.init_values`).
    keep_first : bool, default False
        Row 0 is ``init`` itself, without noise.
    generator : torch.Generator, optional
        For the noise (default the global torch RNG).

    Returns
    -------
    torch.Tensor
        ``[num, P]`` in ``lj``'s dtype and device.
    """
    sites = model_sites(model)
    base = lj.layout.pack(init_values(sites, init)).to(dtype=lj.dtype, device=lj.device)
    rows = base.unsqueeze(0).repeat(num, 1)
    first = 1 if keep_first else 0
    if spread is None:
        if num > first:
            rows[first:] = init_members(model, lj, num - first, "linear")
    elif num > first:
        noise = torch.randn(num - first, lj.size, dtype=lj.dtype, device=lj.device, generator=generator)
        rows[first:] += spread * noise
    return rows
