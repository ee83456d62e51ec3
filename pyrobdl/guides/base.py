r"""The base of every pyrobdl guide.

A pyrobdl guide is an ordinary Pyro guide (a ``PyroModule`` whose ``forward`` has one
``pyro.sample`` per latent site of the model) built around one hook,
:meth:`BNNGuide.variational_distributions`, which returns the distribution of each site.
``forward`` samples from those distributions, so ``SVI``/``Predictive`` see a normal guide,
and pyrobdl's :class:`~pyrobdl.inference.DirectELBO` reads the same distributions without
tracing.  Extras (pruning, deterministic predictions) are methods of the guide, never branches
of the training loop.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, ContextManager, Mapping

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from pyro.nn import PyroModule

__all__ = ["BNNGuide", "SiteSpec", "init_values"]

INIT_LOCS = ("linear", "prior", "prior_mean")


class SiteSpec:
    """What a guide needs to know of one latent site of the model.

    Attributes
    ----------
    name : str
        Site name.
    shape : torch.Size
        Event shape of the site.
    support : torch.distributions.constraints.Constraint
        Support of the prior (``real`` for weights, ``positive`` for a precision).
    fan_in : int or None
        Inputs of the layer (weights and biases) or None for other sites.
    prior : pyro.distributions.Distribution
        The model's prior of the site.
    """

    def __init__(self, name: str, prior: dist.Distribution, fan_in: int | None) -> None:
        self.name = name
        self.prior = prior
        self.shape = prior.event_shape
        support = prior.support
        while isinstance(support, constraints.independent):
            support = support.base_constraint
        self.support = support
        self.fan_in = fan_in

    @property
    def key(self) -> str:
        """The name with dots replaced, usable as an attribute name."""
        return self.name.replace(".", "_")

    @property
    def event_dim(self) -> int:
        return len(self.shape)

    @property
    def is_real(self) -> bool:
        """Whether the site is unconstrained (weights and biases)."""
        return isinstance(self.support, type(constraints.real))


def model_sites(model: Any) -> list[SiteSpec]:
    """Latent sites of a :class:`~pyrobdl.BayesianMLP`, in the model's order."""
    fan_in = {s.name: s.fan_in for s in model.sites}
    return [SiteSpec(name, prior, fan_in.get(name)) for name, prior in model.prior_distributions().items()]


def init_values(
    sites: list[SiteSpec], init_loc: str | Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    r"""Initial values of every site, in the site's constrained space.

    Parameters
    ----------
    sites : list of SiteSpec
        The model's latent sites.
    init_loc : {"linear", "prior", "prior_mean"} or mapping
        ``"linear"`` draws weights and biases like ``torch.nn.Linear``
        (:math:`\mathcal U(-1/\sqrt{\text{fan\_in}}, 1/\sqrt{\text{fan\_in}})`) and puts other
        sites at their prior mean; ``"prior"`` draws every site from its prior; ``"prior_mean"``
        uses prior means (zero weights; only sensible for linear models); a mapping gives values
        by site name (missing sites fall back to ``"linear"``).

    Notes
    -----
    Draws use the global torch RNG, like ``torch.nn.Linear``; seed it for reproducibility
    (``pyrobdl.fit`` does).  Initialising from the prior is a poor start when the prior is
    wide (Gal's length-scale gives scale 100), hence the ``nn.Linear`` default.
    """
    given: Mapping[str, torch.Tensor] = {}
    if not isinstance(init_loc, str):
        given = init_loc
        unknown = set(given) - {s.name for s in sites}
        if unknown:
            raise ValueError(f"init_loc names unknown sites {sorted(unknown)}; valid: {[s.name for s in sites]}")
        init_loc = "linear"
    if init_loc not in INIT_LOCS:
        raise ValueError(f"unknown init_loc {init_loc!r}; valid: {list(INIT_LOCS)} or a dict of tensors")
    values = {}
    for s in sites:
        if s.name in given:
            v = torch.as_tensor(given[s.name], dtype=torch.get_default_dtype()).detach().clone()
            if v.shape != s.shape:
                raise ValueError(f"init_loc[{s.name!r}] has shape {list(v.shape)}, expected {list(s.shape)}")
        elif init_loc == "prior":
            v = s.prior.sample()
        elif init_loc == "linear" and s.fan_in is not None:
            bound = 1.0 / math.sqrt(s.fan_in)
            v = torch.empty(s.shape).uniform_(-bound, bound)
        else:
            v = s.prior.mean
            if not torch.isfinite(v).all():
                v = s.prior.sample()
        values[s.name] = v.detach().to(s.prior.mean.device)
    return values


class BNNGuide(PyroModule):
    """Base class: a Pyro guide defined by its per-site variational distributions.

    Subclasses implement :meth:`variational_distributions`.  The guide keeps no reference to
    the model; it reads the model's sites once, at construction.
    """

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.site_specs = model_sites(model)
        self._transform_cache: dict[str, Any] = {}
        self._packs: dict[str, tuple[str, ...]] = {}

    # ------------------------------------------------------------------ packed parameters
    def _pack(self, group: str, names: list[str]) -> None:
        """Make the unconstrained parameters of the PyroParams ``names`` views of one buffer.

        Each named parameter stays an ordinary ``nn.Parameter`` (Pyro, ``state_dict`` and plain
        optimizers see per-site tensors under their usual names), but its storage is a slice of
        one contiguous vector, in the order given, which :meth:`packed` returns.  pyrobdl's flat
        hot path reads and updates that vector in one operation.
        """
        self._packs[group] = tuple(names)
        self._repack(group)

    def _repack(self, group: str) -> torch.Tensor:
        params = [self._parameters[n + "_unconstrained"] for n in self._packs[group]]
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in params])
        start = 0
        for p in params:
            n = p.numel()
            p.data = flat[start : start + n].view(p.shape)
            start += n
        # not a buffer: nn.Module must not move it independently of the views (see _apply)
        self.__dict__["_packed_" + group] = flat
        return flat

    def packed(self, group: str) -> torch.Tensor:
        """The contiguous vector behind the parameters of ``group`` (``"params"`` for pyrobdl's guides).

        The per-site parameters are views of it.  Whatever broke the sharing (``copy.deepcopy``,
        a Pyro parameter store that substituted its own tensor) is repaired here: the current
        per-site values are gathered into a new vector and the parameters become its views
        again.  Call it before each run, not inside a training step.

        Raises
        ------
        KeyError
            If the guide has no packed group of that name.
        """
        names = self._packs[group]
        flat = self.__dict__.get("_packed_" + group)
        if flat is not None:
            start, base, size = 0, flat.data_ptr(), flat.element_size()
            for n in names:
                p = self._parameters[n + "_unconstrained"]
                if (
                    p.data_ptr() != base + start * size
                    or not p.is_contiguous()
                    or p.dtype != flat.dtype
                    or p.device != flat.device
                ):
                    break
                start += p.numel()
            else:
                if start == flat.numel():
                    return flat
        return self._repack(group)

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        # .to()/.double()/.cuda() convert each parameter on its own, which breaks the sharing
        out = super()._apply(fn, *args, **kwargs)
        for group in getattr(self, "_packs", {}):
            self._repack(group)
        return out

    def variational_distributions(self) -> dict[str, dist.Distribution]:
        """Return ``{site name: q(site)}``, each with empty batch shape and the site's event shape."""
        raise NotImplementedError

    def param(self, name: str) -> torch.Tensor:
        """Constrained value of the ``PyroParam`` attribute ``name``.

        Inside the guide's ``forward`` (a Pyro context) this is ordinary attribute access, which
        emits the ``pyro.param`` statement SVI and handlers rely on.  Outside it (pyrobdl's
        DirectELBO, prediction) it reads the unconstrained parameter and applies the
        constraint's transform directly, skipping ``PyroModule.__getattr__``'s bookkeeping,
        which measured about a third of a millisecond per step for a 1x50 network.
        """
        if self._pyro_context.active:
            return getattr(self, name)
        constraint, _ = self._pyro_params[name]
        transform = self._transform_cache.get(name)
        if transform is None:
            transform = self._transform_cache[name] = torch.distributions.transform_to(constraint)
        return transform(self._parameters[name + "_unconstrained"])

    def flat_family(self) -> tuple[str, dict[str, torch.Tensor]] | None:
        """The guide's parameters as packed vectors over the flat layout, for pyrobdl's flat
        ELBO (``("normal", {"vector", "loc", "scale"})`` or ``("delta", {"vector", "loc"})``,
        where ``vector`` is the one tensor an optimizer steps), or None (the
        default) when the guide is only available through its distributions."""
        return None

    def site_infer(self, name: str) -> dict:
        """Extra ``infer`` settings of a site's ``pyro.sample`` (e.g. a score-function baseline)."""
        return {}

    def training_context(self) -> ContextManager[Any]:
        """Effect handler to keep active around training steps (none by default)."""
        return contextlib.nullcontext()

    def forward(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        """Sample every latent site; arguments (the model's) are ignored."""
        return {
            name: pyro.sample(name, q, infer=self.site_infer(name))
            for name, q in self.variational_distributions().items()
        }

    @torch.no_grad()
    def sample_params(self, num_samples: int) -> dict[str, torch.Tensor]:
        """Draw ``num_samples`` joint draws of all sites: ``{name: [num_samples, *shape]}``."""
        # detached: a point-mass guide's draws are views of its parameters
        return {name: q.sample((num_samples,)).detach() for name, q in self.variational_distributions().items()}
