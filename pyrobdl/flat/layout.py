"""Where each latent site lives in the flat vector: :class:`SiteSlice` and :class:`FlatLayout`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch


@dataclass(frozen=True)
class SiteSlice:
    """Where one site lives in the flat vector.

    Attributes
    ----------
    name : str
        Pyro site name.
    shape : tuple of int
        The site's shape (constrained and unconstrained coincide for every supported site).
    start, stop : int
        ``theta[..., start:stop]`` holds the site, flattened row-major.
    transform : str
        ``"identity"`` (real-valued) or ``"exp"`` (positive: stored as its logarithm).
    """

    name: str
    shape: tuple[int, ...]
    start: int
    stop: int
    transform: str

    @property
    def size(self) -> int:
        """Number of scalars of the site."""
        return self.stop - self.start


class FlatLayout:
    """The packing of a model's latent sites into one unconstrained vector ``[P]``.

    Parameters
    ----------
    model : pyrobdl.BayesianMLP
        The model whose sites are packed.

    Attributes
    ----------
    sites : tuple of SiteSlice
        In the model's site order.
    size : int
        P, the total number of unconstrained coordinates.
    """

    def __init__(self, model: Any) -> None:
        slices, start = [], 0
        positive = set(model.likelihood.latent_distributions(model.device))
        for name, prior in model.prior_distributions().items():
            shape = tuple(prior.event_shape) if name not in positive else tuple(prior.batch_shape + prior.event_shape)
            n = math.prod(shape)
            slices.append(SiteSlice(name, shape, start, start + n, "exp" if name in positive else "identity"))
            start += n
        self.sites: tuple[SiteSlice, ...] = tuple(slices)
        self.size = start
        self._by_name = {s.name: s for s in self.sites}

    def __getitem__(self, name: str) -> SiteSlice:
        return self._by_name[name]

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __repr__(self) -> str:
        return f"FlatLayout(size={self.size}, sites={[s.name for s in self.sites]})"

    def unpack(self, theta: torch.Tensor, *, constrained: bool = True) -> dict[str, torch.Tensor]:
        """Split ``theta`` ``[*B, P]`` into per-site tensors ``[*B, *shape]``.

        Parameters
        ----------
        theta : torch.Tensor
            Flat unconstrained vectors.
        constrained : bool, default True
            Map positive sites back through ``exp`` (their support); otherwise return the
            unconstrained coordinates.
        """
        batch = theta.shape[:-1]
        out = {}
        for s in self.sites:
            v = theta[..., s.start : s.stop].reshape(tuple(batch) + s.shape)
            out[s.name] = v.exp() if constrained and s.transform == "exp" else v
        return out

    def pack(self, values: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`unpack`: constrained site values ``[*B, *shape]`` -> ``[*B, P]``.

        Raises
        ------
        KeyError
            If a site is missing from ``values``.
        """
        parts = []
        for s in self.sites:
            v = values[s.name]
            batch = v.shape[: v.dim() - len(s.shape)]
            v = v.log() if s.transform == "exp" else v
            parts.append(v.reshape(tuple(batch) + (s.size,)))
        return torch.cat(parts, -1)
