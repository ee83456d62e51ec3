r"""Score-function ELBO gradients with baselines formed from the other particles of a step.

:class:`ScoreFunctionELBO` is Pyro's ``TraceGraph_ELBO`` — the same traces, the same
provenance-tracked downstream costs per non-reparameterized site (Rao-Blackwellization), the same
support for Pyro's own baselines (decaying average, neural, fixed value) — plus two baselines
that Pyro does not have, both computed from the vectorized particles of the current step:

``"leave_one_out"`` (Salimans & Knowles 2014; Kool, van Hoof & Welling 2019, "RLOO")
    Site :math:`k`'s downstream cost of particle :math:`p` is compared with the mean of the
    same site's downstream costs of the *other* particles,

    .. math::

        \hat g_k = \frac1P\sum_{p=1}^P \nabla_{\phi_k}\log q(w_k^{(p)})
        \Big(c_k^{(p)} - \frac1{P-1}\sum_{p'\ne p} c_k^{(p')}\Big),

    unbiased because particle :math:`p`'s baseline does not depend on :math:`w^{(p)}`.

``"vargrad"`` (Richter, Boustati, Nüsken, Ruiz & Akyildiz 2020)
    The gradient of half the sample variance over particles of the log-ratio
    :math:`f^{(p)} = \log q(w^{(p)}) - \log p(y, w^{(p)})`, with the samples held fixed:

    .. math::

        \nabla_\phi \tfrac12\widehat{\operatorname{Var}}_p\big[f^{(p)}\big]
        = \frac1{P-1}\sum_p \nabla_\phi\log q(w^{(p)})\,\big(f^{(p)} - \bar f\big),

    which is the leave-one-out estimator applied to the *whole* log-ratio instead of each
    site's downstream cost (:math:`c - \bar c_{-p} = \tfrac{P}{P-1}(c - \bar c)`).  Richter et
    al. differentiate the variance with a :math:`1/P` normaliser, which multiplies this by
    :math:`2(P-1)/P`; the factor is dropped here so that the estimator is unbiased for the ELBO
    gradient and directly comparable with the others.  It cannot use Rao-Blackwellization: the
    terms of other sites stay in every site's cost.

Both need :math:`P \ge 2` vectorized particles.  A site asks for one with
``infer={"baseline": {"leave_one_out": True}}`` (or ``{"vargrad": True}``), or the ELBO's
``baseline`` argument applies one to every non-reparameterized site without a baseline of its
own.  Plain ``TraceGraph_ELBO`` rejects those per-site options ("Unrecognized baseline
options"), so a guide configured for them cannot silently run without a baseline.

With ``analytic_kl=True`` a site whose guide and prior distributions have a registered KL and
whose prior depends on no other latent contributes :math:`-\mathrm{KL}(q_k\,\|\,p_k)` in closed
form (differentiated pathwise in the guide's parameters) instead of the Monte Carlo
:math:`\log p(w_k) - \log q(w_k)`, and those terms leave every downstream cost: the score
function then only has to estimate the gradient of the expected log-likelihood (Ranganath et
al. 2014 use the same split when the entropy is known, and Pyro's ``TraceMeanField_ELBO`` does
it for pathwise gradients).  The loss value is then that of ``TraceMeanField_ELBO``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Mapping

import torch
from pyro.distributions.util import broadcast_shape, is_identically_zero  # broadcast_shape: torch's imports sympy
from pyro.infer import TraceGraph_ELBO
from pyro.infer.tracegraph_elbo import _construct_baseline
from pyro.infer.util import MultiFrameTensor
from pyro.ops.provenance import detach_provenance, get_provenance
from torch.distributions import kl_divergence

__all__ = ["PARTICLE_BASELINES", "ScoreFunctionELBO"]

#: Baselines formed from the other particles of the same step (need >= 2 vectorized particles).
PARTICLE_BASELINES = ("leave_one_out", "vargrad")

_PARTICLE_PLATE = "num_particles_vectorized"  # the name Pyro's ELBO gives its particle plate


class ScoreFunctionELBO(TraceGraph_ELBO):
    r"""``TraceGraph_ELBO`` with leave-one-out and VarGrad baselines, and optional analytic KL.

    Parameters
    ----------
    num_particles : int, default 2
        Particles per step (>= 2 for a particle baseline).
    max_plate_nesting : int or float, default inf
        As in Pyro (the particle plate is added outside it).
    vectorize_particles : bool, default True
        Must be True for a particle baseline: the baseline compares particles of one trace.
    baseline : {None, "leave_one_out", "vargrad"}, default None
        Baseline for non-reparameterized sites that configure none themselves; ``None`` leaves
        them without one.  Sites with Pyro's own options keep them.
    analytic_kl : bool, default False
        Closed-form KL terms where available (module docstring).
    **kwargs
        Other arguments of :class:`pyro.infer.ELBO`.

    Raises
    ------
    ValueError
        For an unknown ``baseline``, or a particle baseline with fewer than two vectorized
        particles (here, or at the first site that asks for one).

    Examples
    --------
    >>> elbo = ScoreFunctionELBO(num_particles=16, baseline="leave_one_out", max_plate_nesting=1)
    >>> svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), elbo)

    References
    ----------
    T. Salimans, D. A. Knowles. On Using Control Variates with Stochastic Approximation for
    Variational Bayes and its Connection to Stochastic Linear Regression. arXiv:1401.1022, 2014.
    W. Kool, H. van Hoof, M. Welling. Buy 4 REINFORCE Samples, Get a Baseline for Free!
    ICLR workshop, 2019.
    L. Richter, A. Boustati, N. Nüsken, F. J. R. Ruiz, Ö. D. Akyildiz. VarGrad: A Low-Variance
    Gradient Estimator for Variational Inference. NeurIPS 2020.
    R. Ranganath, S. Gerrish, D. Blei. Black Box Variational Inference. AISTATS 2014.
    """

    def __init__(
        self,
        num_particles: int = 2,
        max_plate_nesting: float = float("inf"),
        vectorize_particles: bool = True,
        baseline: str | None = None,
        analytic_kl: bool = False,
        **kwargs: Any,
    ) -> None:
        if baseline is not None and baseline not in PARTICLE_BASELINES:
            raise ValueError(f"unknown baseline {baseline!r}; valid: {[None, *PARTICLE_BASELINES]}")
        if baseline is not None:
            _check_particles(baseline, "every site", num_particles, vectorize_particles)
        super().__init__(
            num_particles=num_particles,
            max_plate_nesting=max_plate_nesting,
            vectorize_particles=vectorize_particles,
            **kwargs,
        )
        self.baseline = baseline
        self.analytic_kl = bool(analytic_kl)

    def _loss_and_surrogate_loss_particle(self, model_trace: Any, guide_trace: Any) -> tuple[Any, Any]:
        return self._compute_elbo(model_trace, guide_trace)

    def _site_baseline(self, name: str, site: dict) -> str | None:
        """The particle baseline of guide site ``name`` (None: Pyro's options, or none)."""
        options = site["infer"].get("baseline", {})
        chosen = [k for k in PARTICLE_BASELINES if options.get(k)]
        if len(chosen) > 1 or (chosen and len(options) > 1):
            raise ValueError(
                f"site {name!r}: baseline options {sorted(options)} cannot be combined; "
                f"{chosen[0]!r} is a baseline on its own"
            )
        kind = chosen[0] if chosen else (self.baseline if not options else None)
        if kind is not None:
            _check_particles(kind, f"site {name!r}", self.num_particles, self.vectorize_particles)
        return kind

    def _analytic_kls(self, model_trace: Any, guide_trace: Any) -> dict[str, torch.Tensor]:
        """Per site, ``scale * KL(q || p)`` where it has a closed form and the prior is a root."""
        out: dict[str, torch.Tensor] = {}
        if not self.analytic_kl:
            return out
        for name, site in guide_trace.nodes.items():
            if site["type"] != "sample" or name not in model_trace.nodes:
                continue
            prior = model_trace.nodes[name]
            if get_provenance(prior["log_prob_sum"]) - {name}:
                continue  # the prior's parameters depend on another latent: keep Monte Carlo
            try:
                kl = kl_divergence(site["fn"], prior["fn"])
            except NotImplementedError:
                continue
            out[name] = detach_provenance(kl) * prior["scale"]
        return out

    def _compute_elbo(self, model_trace: Any, guide_trace: Any) -> tuple[torch.Tensor, torch.Tensor]:
        # Same bookkeeping as Pyro's tracegraph_elbo._compute_elbo (value, surrogate, downstream
        # costs from provenance), with particle baselines and analytic KL terms added.
        kls = self._analytic_kls(model_trace, guide_trace)
        elbo, surrogate, costs, total, particle_frame = _log_ratio_terms(model_trace, guide_trace, kls)
        baseline_loss: Any = 0.0
        for node, cost in costs.items():
            guide_site = guide_trace.nodes[node]
            cost, loss_term = self._baselined_cost(node, guide_site, cost, total, particle_frame)
            baseline_loss = baseline_loss + loss_term
            surrogate = surrogate + (guide_site["score_parts"].score_function * cost.detach()).sum()

        surrogate_loss = -surrogate + baseline_loss
        return detach_provenance(elbo), detach_provenance(surrogate_loss)

    def _baselined_cost(self, node: str, guide_site: Any, cost: MultiFrameTensor, total: MultiFrameTensor,
                        particle_frame: Any) -> tuple[torch.Tensor, Any]:
        """Site ``node``'s downstream cost less its baseline, and the baseline's own loss (0.0 for the
        particle baselines, which have none)."""
        stack = guide_site["cond_indep_stack"]
        cost = cost.sum_to(stack)
        kind = self._site_baseline(node, guide_site)
        if kind is None:
            used, loss_term, value = _construct_baseline(node, guide_site, cost)
            return (cost - value, loss_term) if used else (cost, 0.0)
        dim = _particle_dim(particle_frame, cost, node)
        p = cost.shape[dim]
        if kind == "leave_one_out":
            return cost - (cost.sum(dim, keepdim=True) - cost) / (p - 1), 0.0
        # vargrad: the whole log-ratio, centred, times P / (P - 1)
        whole = total.sum_to(stack)
        whole = whole.expand(broadcast_shape(whole.shape, cost.shape))
        return (whole - whole.mean(dim, keepdim=True)) * (p / (p - 1)), 0.0


def _log_ratio_terms(model_trace: Any, guide_trace: Any, kls: Mapping[str, torch.Tensor]
                     ) -> tuple[Any, Any, dict, Any, Any]:
    """The ELBO, the surrogate before the score-function terms, each guide site's downstream cost
    (by provenance), the whole per-particle log-ratio (for VarGrad) and the particle plate's frame."""
    elbo: Any = 0.0
    surrogate: Any = 0.0
    costs: dict[str, MultiFrameTensor] = defaultdict(MultiFrameTensor)
    total = MultiFrameTensor()
    for name, site in model_trace.nodes.items():
        if site["type"] != "sample" or name in kls:
            continue
        elbo = elbo + site["log_prob_sum"]
        surrogate = surrogate + site["log_prob_sum"]
        term = (site["cond_indep_stack"], site["log_prob"])
        total.add(term)
        for key in get_provenance(site["log_prob_sum"]):
            costs[key].add(term)
    particle_frame = None
    for name, site in guide_trace.nodes.items():
        if site["type"] != "sample":
            continue
        particle_frame = particle_frame or next(
            (f for f in site["cond_indep_stack"] if f.name == _PARTICLE_PLATE), None
        )
        if name in kls:
            elbo = elbo - kls[name].sum()
            surrogate = surrogate - kls[name].sum()
            continue
        elbo = elbo - site["log_prob_sum"]
        entropy_term = site["score_parts"].entropy_term
        if not is_identically_zero(entropy_term):
            surrogate = surrogate - entropy_term.sum()
        term = (site["cond_indep_stack"], -site["log_prob"])
        total.add(term)
        for key in get_provenance(site["log_prob_sum"]):
            costs[key].add(term)
    return elbo, surrogate, costs, total, particle_frame


def _check_particles(kind: str, where: str, num_particles: int, vectorize: bool) -> None:
    if isinstance(num_particles, bool) or not isinstance(num_particles, int) or num_particles < 2 or not vectorize:
        raise ValueError(
            f"baseline {kind!r} ({where}) compares the particles of one step: it needs "
            f"num_particles >= 2 with vectorize_particles=True, got num_particles={num_particles!r}, "
            f"vectorize_particles={vectorize!r}"
        )


def _particle_dim(frame: Any, cost: torch.Tensor, node: str) -> int:
    if frame is None or cost.dim() < -frame.dim or cost.shape[frame.dim] < 2:
        raise ValueError(f"site {node!r}: no particle dimension in its downstream cost {tuple(cost.shape)}")
    return frame.dim

