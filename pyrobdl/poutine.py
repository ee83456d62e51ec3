r"""Effect handlers used by pyrobdl models and guides.

Every linear layer of a :class:`~pyrobdl.BayesianMLP` goes through :func:`linear`, an
*effectful* operation: with no handler on Pyro's stack it is a plain batched matrix product, and
a handler such as :class:`LocalReparameterizationMessenger` may replace its value while it is
active.  Nothing here patches a torch function; every effect ends with its ``with`` block.
"""

from __future__ import annotations

from typing import Collection

import pyro.distributions as dist
import torch
from pyro.distributions.util import broadcast_shape  # torch.broadcast_shapes imports sympy on first use
from pyro.poutine.messenger import Messenger
from pyro.poutine.runtime import effectful

__all__ = ["KLWeightMessenger", "LocalReparameterizationMessenger", "linear"]


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # weight: [*particles, out, in]; x: [*particles, batch, in] or [batch, in]
    out = x @ weight.transpose(-1, -2)
    if bias is not None:
        out = out + bias.unsqueeze(-2)
    return out


#: ``linear(x, weight, bias)`` = ``x @ weight.T + bias`` with leading particle dimensions;
#: effectful so that handlers (local reparameterization) can intercept it.
linear = effectful(_linear, type="pyrobdl_linear")


def _normal_parts(fn: dist.Distribution) -> tuple[torch.Tensor, torch.Tensor] | None:
    while isinstance(fn, (dist.Independent, torch.distributions.Independent)):
        fn = fn.base_dist
    if isinstance(fn, torch.distributions.Normal):
        return fn.loc, fn.scale
    return None


class LocalReparameterizationMessenger(Messenger):
    r"""Sample pre-activations instead of weights (Kingma, Salimans & Welling, 2015).

    While active, every weight value drawn from a Normal distribution at one of ``sites`` is
    remembered together with that distribution.  When such a weight enters :func:`linear`, the
    output is drawn directly from its exact distribution given the layer input,

    .. math::

        b_{nj} \sim \mathcal N\Big(\textstyle\sum_i x_{ni}\mu_{ji} + \beta_j,\;
                                   \sum_i x_{ni}^2\sigma_{ji}^2\Big),

    independently for each data point, which has the same mean and variance as drawing one
    weight matrix for the whole minibatch but a lower-variance gradient.

    Parameters
    ----------
    sites : collection of str
        Names of the weight sites to reparameterize locally.

    Notes
    -----
    The handler must be on the stack while *both* the guide and the model run (e.g. around
    ``svi.step``); :meth:`pyrobdl.guides.MeanField.training_context` returns one.  The first
    distribution that produced a value is the one used, so under ``Trace_ELBO`` (guide first,
    model replayed) it is the guide's.

    References
    ----------
    D. P. Kingma, T. Salimans, M. Welling. Variational Dropout and the Local
    Reparameterization Trick. NeurIPS 2015.
    """

    def __init__(self, sites: Collection[str]) -> None:
        super().__init__()
        self.sites = frozenset(sites)
        self._drawn: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def __exit__(self, *args):  # type: ignore[no-untyped-def]
        self._drawn.clear()
        return super().__exit__(*args)

    def observe(self, name: str, value: torch.Tensor, fn: dist.Distribution) -> None:
        """Remember that ``value`` at site ``name`` was drawn from ``fn`` (first draw wins)."""
        key = (value.data_ptr(), value.numel())
        if name not in self.sites or key in self._drawn:
            return
        parts = _normal_parts(fn)
        if parts is not None:
            # Keyed by storage, so views of the value (the model drops Pyro's plate slot with
            # a squeeze) are recognised; the value is kept so its storage cannot be reused.
            self._drawn[key] = (value, *parts)

    def _pyro_post_sample(self, msg) -> None:  # type: ignore[no-untyped-def]
        if not msg["is_observed"]:
            self.observe(msg["name"], msg["value"], msg["fn"])

    def preactivation_moments(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Mean and variance of ``linear(x, weight, bias)`` over the weight's distribution.

        Returns None when ``weight`` was not drawn at a locally reparameterized site.
        """
        entry = self._drawn.get((weight.data_ptr(), weight.numel()))
        if entry is None:
            return None
        _, loc, scale = entry
        if loc.dim() > weight.dim():  # Pyro's plate slot in front of the event dims
            loc, scale = loc.squeeze(-3), scale.squeeze(-3)
        mean = _linear(x, loc, bias)
        var = _linear(x * x, scale * scale, None)
        return mean, var

    def _pyro_pyrobdl_linear(self, msg) -> None:  # type: ignore[no-untyped-def]
        x, weight, bias = msg["args"]
        moments = self.preactivation_moments(x, weight, bias)
        if moments is None:
            return
        mean, var = moments
        # One independent draw per particle of the weight and per data point.
        shape = broadcast_shape(weight.shape[:-2] + mean.shape[-2:], mean.shape)
        eps = torch.randn(shape, dtype=mean.dtype, device=mean.device)
        # clamp: sqrt has an infinite gradient at 0 (an all-zero input row after a ReLU).
        msg["value"] = mean + var.clamp_min(1e-30).sqrt() * eps
        msg["done"] = True


class KLWeightMessenger(Messenger):
    r"""Scale the log-densities of latent sites by a KL weight :math:`\beta` (KL annealing).

    Applied to both model and guide, it turns the ELBO into
    :math:`\mathbb E_q[\log p(y\mid w)] - \beta\,\mathrm{KL}(q\,\|\,p)` for Monte Carlo and
    analytic KL estimators alike.  ``beta`` is a plain attribute that the training loop may
    change between steps.
    """

    def __init__(self, beta: float = 1.0) -> None:
        super().__init__()
        self.beta = beta

    def _pyro_sample(self, msg) -> None:  # type: ignore[no-untyped-def]
        if not msg["is_observed"] and self.beta != 1.0:
            msg["scale"] = msg["scale"] * self.beta
