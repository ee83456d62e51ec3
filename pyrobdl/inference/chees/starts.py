"""Starting points of the chains of method "chees" (``init_strategy``): prior draws, MAP fits from
them, or a deep ensemble's members."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ...flat import FlatLogJoint
from ..starts import spread_starts


def _map_init(lj: FlatLogJoint, theta: torch.Tensor, num_steps: int, lr: float, strategy: str = "map") -> torch.Tensor:
    """K MAP estimates at once from ``theta`` ``[K, P]``: the ensemble's trainer, i.e. the one
    optimisation loop of every SVI method (Adam, Polyak averaging over the last 10% of steps).

    Raises
    ------
    FloatingPointError
        When a fit's log joint becomes non-finite, naming ``init_strategy`` and what to change.
    """
    from ..ensemble import train_members
    from ..svi import LoopSettings

    try:
        return train_members(lj, theta, LoopSettings(num_steps=num_steps, lr=lr), desc=f"chees {strategy} start").theta
    except FloatingPointError as err:
        raise FloatingPointError(
            f"chees init_strategy={strategy!r}: the MAP fits of the chains' starting points diverged ({err}); "
            "lower map_lr or use init_strategy='prior'"
        ) from err


def _starting_points(model: Any, lj: FlatLogJoint, num: int, options: Mapping[str, Any],
                     gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """``num`` independent starting points ``[num, P]`` by ``init_strategy``, and the chain-gradients
    their MAP or ensemble fits cost."""
    if options.get("init") is not None:
        return spread_starts(model, lj, options["init"], num, options["init_spread"], generator=gen), 0
    theta = lj.sample_prior(num, generator=gen)
    if options["init_strategy"] == "map":
        return _map_init(lj, theta, options["map_num_steps"], options["map_lr"]), num * options["map_num_steps"]
    if options["init_strategy"] == "ensemble":
        # a deep ensemble (nn.Linear-style starts, the ensemble's trainer), one member per start
        from ..ensemble import init_members

        members = _map_init(lj, init_members(model, lj, num, "linear"), options["map_num_steps"], options["map_lr"],
                            "ensemble")
        return members, num * options["map_num_steps"]
    return theta, 0

