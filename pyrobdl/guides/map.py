r"""Point-mass guide: maximum a posteriori (MAP) estimation as a baseline."""

from __future__ import annotations

from typing import Any, Mapping

import pyro.distributions as dist
import torch
from pyro.nn import PyroParam

from .base import BNNGuide, init_values

__all__ = ["MAP"]


class MAP(BNNGuide):
    r"""A ``Delta`` at a learned point for every site.

    With a Delta guide the ELBO reduces to :math:`\log p(y\mid w) + \log p(w)` at the point,
    so SVI performs MAP estimation (weight decay :math:`1/(2s^2)` for a Gaussian prior).
    Constrained sites are optimised through ``biject_to(support)`` in their constrained space
    (no Jacobian term, as ``AutoDelta``).  Improper priors make the objective unbounded, so
    ``fit(method="map")`` refuses them.

    Parameters
    ----------
    model : pyrobdl.BayesianMLP
        The model.
    init_loc : {"linear", "prior", "prior_mean"} or dict, default "linear"
        Initial point; see :func:`pyrobdl.guides.base.init_values`.
    """

    def __init__(self, model: Any, init_loc: str | Mapping[str, torch.Tensor] = "linear") -> None:
        super().__init__(model)
        values = init_values(self.site_specs, init_loc)
        for s in self.site_specs:
            setattr(self, f"{s.key}_loc", PyroParam(values[s.name].detach().clone(), constraint=s.support))
        # one vector in the flat layout's order (a positive site stored as its logarithm)
        self._pack("params", [f"{s.key}_loc" for s in self.site_specs])

    def flat_family(self) -> tuple[str, dict[str, torch.Tensor]]:
        """The guide as one packed vector for pyrobdl's flat hot path:
        ``("delta", {"vector": theta, "loc": theta})``."""
        v = self.packed("params")
        return "delta", {"vector": v, "loc": v}

    def variational_distributions(self) -> dict[str, dist.Distribution]:
        return {
            s.name: dist.Delta(self.param(f"{s.key}_loc"), event_dim=s.event_dim) for s in self.site_specs
        }
