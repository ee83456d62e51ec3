r"""Score-function (black-box) VI: the mean-field Gaussian with non-reparameterized samples.

:class:`ScoreFunction` is :class:`~pyrobdl.guides.MeanField` with every sample marked
non-reparameterized (:class:`NonReparameterized`, ``has_rsample == False``), so Pyro's
``TraceGraph_ELBO`` estimates the ELBO gradient with the log-derivative trick, Rao-Blackwellized
by the dependency structure it tracks, and with Pyro's per-site baselines as control variates
(``Trace_ELBO`` also accepts the guide, without either).  The leave-one-out and VarGrad
baselines, formed from the other particles of a step, need
:class:`pyrobdl.inference.ScoreFunctionELBO` (a ``TraceGraph_ELBO`` subclass).  The objective and the family are those
of Bayes by Backprop; only the gradient estimator differs.  Nothing here computes an ELBO: the
guide only says how each site is sampled and which baseline Pyro should use.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import pyro
import pyro.distributions as dist
import torch
from pyro.poutine.runtime import get_plates

from .mean_field import MeanField

__all__ = ["BASELINES", "PARTICLE_BASELINES", "MinibatchBaseline", "NonReparameterized", "ScoreFunction"]

#: Values of the ``baseline`` option of :class:`ScoreFunction`.
BASELINES = ("none", "decaying_average", "neural", "leave_one_out", "vargrad")
#: Baselines formed from the other particles of the same step (see
#: :class:`pyrobdl.inference.ScoreFunctionELBO`); they need >= 2 vectorized particles.
PARTICLE_BASELINES = ("leave_one_out", "vargrad")


class NonReparameterized(dist.Independent):
    """An ``Independent`` whose samples carry no pathwise gradient.

    ``has_rsample_(False)`` on an instance does not survive ``expand`` (which Pyro's plates
    call under vectorized particles) and cannot be set on ``Independent`` or
    ``TransformedDistribution``, whose flag is a read-only property of the base.  A class
    attribute does survive: ``expand`` keeps the subclass.
    """

    has_rsample = False


def _cost_shape() -> torch.Size:
    """Shape of a global site's downstream cost in ``TraceGraph_ELBO`` under the active plates.

    Pyro sums the cost to the site's plates and then drops leading size-1 dims
    (``MultiFrameTensor.sum_to``): ``[]`` without vectorized particles, ``[P, 1]`` with them.
    """
    frames = [f for f in get_plates() if f.vectorized]
    if not frames:
        return torch.Size()
    shape = [1] * max(-f.dim for f in frames)
    for f in frames:
        shape[f.dim] = f.size
    while shape and shape[0] == 1:
        shape.pop(0)
    return torch.Size(shape)


class MinibatchBaseline(torch.nn.Module):
    r"""A small network predicting a site's downstream cost from the minibatch.

    .. math::

        b(\mathcal B) = \frac{N}{|\mathcal B|}\sum_{n\in\mathcal B} g_\psi(x_n, y_n),

    with :math:`g_\psi` a one-hidden-layer tanh network whose output layer starts at zero, so
    the neural baseline starts out equal to the decaying average it corrects.  The minibatch
    (not the weights of the site) is the input, which keeps the score-function estimator
    unbiased: the baseline does not depend on the sample it multiplies.

    Parameters
    ----------
    in_features : int
        Width of the per-datum features :math:`[x_n, y_n]`.
    hidden : int
        Hidden units of :math:`g_\psi`.
    """

    def __init__(self, in_features: int, hidden: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(in_features, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1)
        )
        torch.nn.init.zeros_(self.net[-1].weight)
        torch.nn.init.zeros_(self.net[-1].bias)

    def forward(self, features: torch.Tensor, num_data: int, shape: torch.Size) -> torch.Tensor:
        """Baseline value, ``features`` ``[B, in_features]``, expanded to ``shape``."""
        value = num_data * self.net(features).mean()
        return value.expand(shape)


class ScoreFunction(MeanField):
    r"""Mean-field Gaussian trained with score-function gradients: black-box VI.

    Same family, parameters and initialisation as :class:`~pyrobdl.guides.MeanField`
    (:math:`q(w)=\prod_i\mathcal N(w_i;\mu_i,\operatorname{softplus}(\rho_i)^2)`), but its
    samples carry no pathwise gradient, so ``TraceGraph_ELBO`` uses, for each site :math:`k`,

    .. math::

        \nabla_{\phi_k}\mathcal L \approx \nabla_{\phi_k}\log q(w_k;\phi_k)\,
        \big(c_k(w) - b_k\big),\qquad
        c_k(w) = \log p(w_k) - \log q(w_k) + \sum_n \log p(y_n\mid x_n, w),

    where :math:`c_k` keeps only the terms downstream of :math:`w_k` (Rao-Blackwellization)
    and :math:`b_k` is a baseline that does not depend on :math:`w_k`.

    Parameters
    ----------
    model : pyrobdl.BayesianMLP
        The model whose sites the guide covers.
    init_scale : float, default 1e-2
        Initial standard deviation of every site (> 0).
    init_loc : {"linear", "prior", "prior_mean"} or dict, default "linear"
        Initial means; see :func:`pyrobdl.guides.base.init_values`.
    baseline : {"none", "decaying_average", "neural", "leave_one_out", "vargrad"}, default "decaying_average"
        Control variate per site.  ``"leave_one_out"``: the mean downstream cost of the same
        site over the *other* particles of the step (Kool et al. 2019).  ``"vargrad"``: the
        gradient of the variance of the whole log-ratio over the particles (Richter et al.
        2020).  Both need :class:`pyrobdl.inference.ScoreFunctionELBO` (plain
        ``TraceGraph_ELBO`` rejects their site options) and >= 2 vectorized particles.
        ``"decaying_average"``: Pyro's exponential moving average
        of the site's past downstream costs, :math:`b \leftarrow \beta b + (1-\beta) c`.
        ``"neural"``: that average plus a :class:`MinibatchBaseline` network (a submodule of
        the guide, trained by the same optimizer on Pyro's squared-error baseline loss) that
        learns the part of the cost explained by the minibatch.
    baseline_beta : float, default 0.9
        Decay :math:`\beta \in (0, 1)` of the moving average.
    baseline_hidden : int, default 16
        Hidden units of the neural baseline.

    Raises
    ------
    ValueError
        For an unknown ``baseline`` (the message lists the valid ones) or an out-of-range
        ``baseline_beta``/``baseline_hidden``, before any parameter is created.

    Notes
    -----
    The guide's constructor draws its initial means exactly as ``MeanField`` does (baseline
    networks are created afterwards), so with the same seed and init options a ``"bbvi"`` fit
    and a ``"mean_field"`` fit start from identical loc and scale parameters.

    Pyro keeps the decaying average in its global parameter store (as
    ``__baseline_avg_downstream_cost_<site>``) and re-registers it each step.  It is not a
    trainable parameter: optimize ``guide.parameters()`` with one torch optimizer, inside
    ``pyro.get_param_store().scope()`` (``pyrobdl.fit`` does both), not with ``pyro.optim``
    wrappers, which create a new optimizer for every re-registered tensor.  With plain
    ``pyro.infer.SVI`` it works as in any Pyro program.

    The neural baseline reads ``(x, y, subsample)`` from the guide's arguments (the model's);
    without ``y`` (prediction) it is skipped.  With full-batch training its input is constant,
    so it learns a constant correction of the moving average.

    References
    ----------
    R. Ranganath, S. Gerrish, D. Blei. Black Box Variational Inference. AISTATS 2014.
    W. Kool, H. van Hoof, M. Welling. Buy 4 REINFORCE Samples, Get a Baseline for Free! 2019.
    L. Richter et al. VarGrad: A Low-Variance Gradient Estimator for Variational Inference.
    NeurIPS 2020.
    J. Schulman, N. Heess, T. Weber, P. Abbeel. Gradient Estimation Using Stochastic
    Computation Graphs. NeurIPS 2015.
    A. Mnih, K. Gregor. Neural Variational Inference and Learning in Belief Networks.
    ICML 2014.

    Examples
    --------
    >>> guide = ScoreFunction(model, baseline="decaying_average")
    >>> svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}),
    ...                      pyro.infer.TraceGraph_ELBO())
    >>> guide = ScoreFunction(model, baseline="leave_one_out")
    >>> svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}),
    ...                      pyrobdl.inference.ScoreFunctionELBO(num_particles=4, max_plate_nesting=1))
    """

    def __init__(
        self,
        model: Any,
        init_scale: float = 1e-2,
        init_loc: str | Mapping[str, torch.Tensor] = "linear",
        baseline: str = "decaying_average",
        baseline_beta: float = 0.9,
        baseline_hidden: int = 16,
    ) -> None:
        if baseline not in BASELINES:
            raise ValueError(f"unknown baseline {baseline!r}; valid: {list(BASELINES)}")
        if isinstance(baseline_beta, bool) or not isinstance(baseline_beta, (int, float)) or not (
            0.0 < baseline_beta < 1.0
        ):
            raise ValueError(f"baseline_beta must be a number in (0, 1), got {baseline_beta!r}")
        if isinstance(baseline_hidden, bool) or not isinstance(baseline_hidden, int) or baseline_hidden < 1:
            raise ValueError(f"baseline_hidden must be an integer >= 1, got {baseline_hidden!r}")
        super().__init__(model, init_scale=init_scale, init_loc=init_loc, local_reparameterization=False)
        self.baseline = baseline
        self.baseline_beta = float(baseline_beta)
        self._task = model.likelihood.task
        self._out_features = model.out_features
        if baseline == "neural":
            width = model.in_features + model.out_features
            self.baseline_nets = torch.nn.ModuleDict(
                {s.key: MinibatchBaseline(width, baseline_hidden) for s in self.site_specs}
            ).to(model.device)

    @property
    def min_num_particles(self) -> int:
        """Fewest vectorized particles per step the baseline works with (2 for particle baselines)."""
        return 2 if self.baseline in PARTICLE_BASELINES else 1

    @property
    def stateful_baseline(self) -> bool:
        """Whether the baseline carries state across steps (a moving average, a network)."""
        return self.baseline in ("decaying_average", "neural")

    def variational_distributions(self) -> dict[str, dist.Distribution]:
        """MeanField's distributions with their samplers marked non-reparameterized."""
        out = {}
        for name, q in super().variational_distributions().items():
            if isinstance(q, torch.distributions.Independent):
                out[name] = NonReparameterized(q.base_dist, q.reinterpreted_batch_ndims)
            else:
                out[name] = NonReparameterized(q, 0)
        return out

    def site_infer(self, name: str, baseline_input: torch.Tensor | None = None, num_data: int = 0) -> dict:
        """Pyro's per-site baseline configuration (``infer={"baseline": ...}``).

        Parameters
        ----------
        name : str
            Site name.
        baseline_input : torch.Tensor, optional
            Per-datum features ``[B, in + out]`` of the minibatch for the neural baseline;
            without them only the decaying average is used.
        num_data : int
            Dataset size :math:`N` (scales the neural baseline's minibatch mean).

        Returns
        -------
        dict
            ``{}`` for ``baseline="none"``, else ``{"baseline": {...}}`` as read by
            ``TraceGraph_ELBO`` (and, for the particle baselines, ``ScoreFunctionELBO``).
        """
        if self.baseline == "none":
            return {}
        if self.baseline in PARTICLE_BASELINES:
            return {"baseline": {self.baseline: True}}
        config: dict[str, Any] = {"use_decaying_avg_baseline": True, "baseline_beta": self.baseline_beta}
        if self.baseline == "neural" and baseline_input is not None:
            key = name.replace(".", "_")
            config["nn_baseline"] = functools.partial(
                self.baseline_nets[key], num_data=num_data, shape=_cost_shape()
            )
            config["nn_baseline_input"] = baseline_input
        return {"baseline": config}

    def _baseline_features(self, args: tuple, kwargs: dict) -> tuple[torch.Tensor | None, int]:
        x = args[0] if len(args) > 0 else kwargs.get("x")
        y = args[1] if len(args) > 1 else kwargs.get("y")
        subsample = args[2] if len(args) > 2 else kwargs.get("subsample")
        if x is None or y is None:
            return None, 0
        num_data = x.shape[0]
        if subsample is not None:
            x, y = x[subsample], y[subsample]
        if self._task == "classification":
            y = torch.nn.functional.one_hot(y.long().reshape(-1), self._out_features).to(x.dtype)
        else:
            y = y.reshape(y.shape[0], -1).to(x.dtype)
        return torch.cat([x, y], dim=-1), num_data

    def forward(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        """Sample every site with its baseline configuration; arguments are the model's."""
        features, num_data = None, 0
        if self.baseline == "neural":
            features, num_data = self._baseline_features(args, kwargs)
        return {
            name: pyro.sample(name, q, infer=self.site_infer(name, features, num_data))
            for name, q in self.variational_distributions().items()
        }
