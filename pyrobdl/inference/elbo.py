r"""ELBO estimators behind the SVI loop.

Two interchangeable ``torch.nn.Module`` losses, both called as ``loss(x, y, subsample)`` and
both exposing a ``kl_weight`` attribute for KL annealing:

* :class:`DirectELBO` — pyrobdl's hot path.  It reads the guide's variational distributions and
  the model's priors through their hooks and evaluates the same Monte Carlo ELBO as Pyro's
  ``Trace_ELBO`` (or ``TraceMeanField_ELBO`` with ``analytic_kl=True``) without building a
  trace.  ``tests/test_elbo.py`` checks that value and gradient equal Pyro's for the same
  random draws.
* :class:`PyroELBO` — any of Pyro's ELBOs (``Trace_ELBO``, ``TraceMeanField_ELBO``,
  ``TraceGraph_ELBO``, ``JitTrace_ELBO``) on the unchanged model and guide, for guides the
  direct path cannot handle (score-function sites) and as the reference.
"""

from __future__ import annotations

import functools
from typing import Any

import pyro
import pyro.infer
import torch
from torch.distributions import kl_divergence

from ..poutine import KLWeightMessenger
from .score_function_direct import DirectScoreFunctionELBO
from .score_function_elbo import ScoreFunctionELBO

__all__ = ["DirectELBO", "ELBOS", "KL_TREATMENTS", "PyroELBO", "make_elbo"]

#: Values of the ``elbo`` option of SVI methods.
ELBOS = ("direct", "direct_compiled", "distributions", "trace", "jit_trace", "trace_graph", "direct_score_function")
#: Values of the ``kl`` option of SVI methods.
KL_TREATMENTS = ("analytic", "monte_carlo")


class DirectELBO(torch.nn.Module):
    r"""Negative ELBO evaluated straight from the guide's and model's distributions.

    .. math::

        -\mathcal L = -\frac1P\sum_{p=1}^P\Big[\frac{N}{B}\sum_{n\in\mathcal B}
        \log p(y_n\mid x_n, w^{(p)}) - \beta\,\widehat{\mathrm{KL}}^{(p)}\Big],
        \qquad w^{(p)}\sim q

    where :math:`\widehat{\mathrm{KL}}` is the analytic KL of each site when
    ``analytic_kl=True`` and a ``register_kl`` pair exists (otherwise, per site,
    :math:`\log q(w^{(p)}) - \log p(w^{(p)})`).  Particles are vectorized.

    Parameters
    ----------
    model : pyrobdl.BayesianMLP
        The model.
    guide : pyrobdl.guides.BNNGuide
        A guide whose every site has a reparameterized sampler.
    num_particles : int, default 1
        Number of vectorized samples :math:`P`.
    analytic_kl : bool, default True
        Use closed-form KLs where registered.

    Raises
    ------
    ValueError
        If a guide site cannot be reparameterized (use ``elbo="trace_graph"`` then).
    """

    def __init__(self, model: Any, guide: Any, num_particles: int = 1, analytic_kl: bool = True) -> None:
        super().__init__()
        self.model = model
        self.guide = guide
        self.num_particles = num_particles
        self.analytic_kl = analytic_kl
        self.kl_weight = 1.0
        self._no_analytic: set[tuple[type, type]] = set()
        bad = [n for n, q in guide.variational_distributions().items() if not q.has_rsample]
        if bad:
            raise ValueError(
                f"elbo='direct' needs reparameterized guide sites; {bad} are not. Use elbo='trace_graph'."
            )

    def _kl(self, q: Any, p: Any, value: torch.Tensor) -> torch.Tensor:
        pair = (type(q), type(p))
        if self.analytic_kl and pair not in self._no_analytic:
            try:
                return kl_divergence(q, p)
            except NotImplementedError:
                self._no_analytic.add(pair)
        return q.log_prob(value) - p.log_prob(value)

    def forward(self, x: torch.Tensor, y: torch.Tensor, subsample: torch.Tensor | None = None) -> torch.Tensor:
        """Return the negative ELBO (a differentiable scalar)."""
        qs = self.guide.variational_distributions()
        ps = self.model.prior_distributions()
        shape = torch.Size((self.num_particles,)) if self.num_particles > 1 else torch.Size()
        # idempotent: a [N] target of a 1-output regression becomes [N, 1] (else it broadcasts)
        y = self.model.likelihood.prepare_targets(y, self.model.out_features)
        scale = 1.0
        if subsample is not None:
            scale = x.shape[0] / subsample.shape[0]
            x, y = x[subsample], y[subsample]
        with self.guide.training_context() as handler:
            values = {}
            kl = 0.0
            for name, q in qs.items():
                value = q.rsample(shape)
                values[name] = value
                if handler is not None:
                    handler.observe(name, value, q)
                kl = kl + self._kl(q, ps[name], value)
            log_lik = self.model.log_likelihood(values, x, y).sum(-1)
        elbo = scale * log_lik - self.kl_weight * kl
        return -elbo.mean()


class PyroELBO(torch.nn.Module):
    """One of Pyro's ELBOs on the model and guide, with KL annealing and the guide's effects.

    Parameters
    ----------
    model, guide
        Model and guide (``torch.nn.Module``).
    elbo : pyro.infer.ELBO
        A configured Pyro ELBO instance.
    """

    def __init__(self, model: Any, guide: Any, elbo: pyro.infer.ELBO) -> None:
        super().__init__()
        self.model = model
        self.guide = guide
        self.elbo = elbo
        self._kl_handler = KLWeightMessenger()

    @property
    def kl_weight(self) -> float:
        return self._kl_handler.beta

    @kl_weight.setter
    def kl_weight(self, value: float) -> None:
        self._kl_handler.beta = value

    def forward(self, x: torch.Tensor, y: torch.Tensor, subsample: torch.Tensor | None = None) -> torch.Tensor:
        """Return Pyro's differentiable negative ELBO (surrogate loss for score-function sites)."""
        # Pyro's JIT traces only tensor arguments, so a missing subsample is left out.
        args = (x, y) if subsample is None else (x, y, subsample)
        model, guide = self._kl_handler(self.model), self._kl_handler(self.guide)
        with self.guide.training_context():
            if isinstance(self.elbo, pyro.infer.TraceGraph_ELBO):
                return _tracegraph_loss(self.elbo, model, guide, *args)
            return self.elbo.differentiable_loss(model, guide, *args)


def _tracegraph_loss(elbo: pyro.infer.TraceGraph_ELBO, model: Any, guide: Any, *args: Any) -> torch.Tensor:
    """``TraceGraph_ELBO`` has no ``differentiable_loss`` in pyro 1.9: value -ELBO, gradient the surrogate's.

    Same convention as ``Trace_ELBO.differentiable_loss``; the surrogate includes the
    baseline losses, so neural baselines train with the guide.
    """
    value, surrogate = elbo._loss_and_surrogate_loss(model, guide, args, {})
    value = torch.as_tensor(value).detach()
    return -value + (surrogate - surrogate.detach())


def make_elbo(
    model: Any, guide: Any, *, elbo: str = "direct", kl: str = "analytic", num_particles: int = 1
) -> torch.nn.Module:
    """Build the loss module for the SVI loop.

    Parameters
    ----------
    model, guide
        Model and guide.
    elbo : {"direct", "direct_compiled", "distributions", "trace", "jit_trace", "trace_graph", "direct_score_function"}
        Estimator.  ``"direct"``: pyrobdl's own hot path — the flat
        :class:`~pyrobdl.inference.flat_elbo.FlatELBO` when the guide has a packed family and the
        model is one the flat log joint implements (Gaussian prior, relu/tanh, Gaussian or
        categorical likelihood), otherwise :class:`DirectELBO`.  ``"direct_compiled"``: the flat
        ELBO always (an error where it cannot run), whose whole step — ELBO, gradient and Adam
        update — the SVI loop compiles into one graph
        (:class:`~pyrobdl.inference.flat_step.FusedFlatAdam`; mean field, with or without local
        reparameterization, MAP and variational dropout).  ``"distributions"``:
        :class:`DirectELBO` always.  Or Pyro's ``Trace_ELBO`` family; ``"trace_graph"`` is
        :class:`~pyrobdl.inference.ScoreFunctionELBO`, Pyro's ``TraceGraph_ELBO`` with the
        particle baselines added, and ``"direct_score_function"`` its trace-free fast path for
        :class:`~pyrobdl.guides.ScoreFunction` guides, equal on the same draws: the flat
        :class:`~pyrobdl.inference.flat_score_function.FlatScoreFunctionELBO` when the model is
        one the flat log joint implements, otherwise
        :class:`~pyrobdl.inference.DirectScoreFunctionELBO`.
    kl : {"analytic", "monte_carlo"}
        KL treatment.  ``"analytic"`` with ``"trace"``/``"jit_trace"`` selects Pyro's
        ``TraceMeanField_ELBO``/``JitTraceMeanField_ELBO``, and with ``"trace_graph"``
        closed-form KL terms in :class:`~pyrobdl.inference.ScoreFunctionELBO` (the score
        function then estimates only the gradient of the expected log-likelihood).
    num_particles : int
        Vectorized particles per step.

    Raises
    ------
    ValueError
        For an unknown ``elbo`` or ``kl`` value, an impossible combination, or fewer particles
        than the guide's baseline needs (``guide.min_num_particles``).
    """
    if elbo not in ELBOS:
        raise ValueError(f"unknown elbo {elbo!r}; valid: {list(ELBOS)}")
    needed = getattr(guide, "min_num_particles", 1)
    if num_particles < needed:
        raise ValueError(
            f"num_particles={num_particles!r} is too few: the guide's baseline "
            f"{getattr(guide, 'baseline', '')!r} needs at least {needed} particles per step"
        )
    if kl not in KL_TREATMENTS:
        raise ValueError(f"unknown kl {kl!r}; valid: {list(KL_TREATMENTS)}")
    if elbo in ("direct", "direct_compiled"):
        from .flat_elbo import FlatELBO, flat_support

        reason = flat_support(model, guide, kl == "analytic")
        if reason is None:
            return FlatELBO(model, guide, num_particles=num_particles, analytic_kl=kl == "analytic")
        if elbo == "direct_compiled":
            raise ValueError(f"elbo='direct_compiled' needs the flat path, which cannot run: {reason}; use elbo='direct'")
        return DirectELBO(model, guide, num_particles=num_particles, analytic_kl=kl == "analytic")
    if elbo == "distributions":
        return DirectELBO(model, guide, num_particles=num_particles, analytic_kl=kl == "analytic")
    if elbo == "direct_score_function":
        from .flat_score_function import FlatScoreFunctionELBO, flat_score_function_support

        reason = flat_score_function_support(model, guide)
        if reason is None:
            return FlatScoreFunctionELBO(model, guide, num_particles=num_particles, analytic_kl=kl == "analytic")
        return DirectScoreFunctionELBO(model, guide, num_particles=num_particles, analytic_kl=kl == "analytic")
    classes = {
        ("trace", "monte_carlo"): pyro.infer.Trace_ELBO,
        ("trace", "analytic"): pyro.infer.TraceMeanField_ELBO,
        ("jit_trace", "monte_carlo"): pyro.infer.JitTrace_ELBO,
        ("jit_trace", "analytic"): pyro.infer.JitTraceMeanField_ELBO,
        ("trace_graph", "monte_carlo"): ScoreFunctionELBO,
        ("trace_graph", "analytic"): functools.partial(ScoreFunctionELBO, analytic_kl=True),
    }
    cls = classes[(elbo, kl)]
    return PyroELBO(
        model,
        guide,
        cls(num_particles=num_particles, vectorize_particles=num_particles > 1, max_plate_nesting=1),
    )
