r"""How noisy is each ELBO gradient estimator?  Many gradient draws at fixed guide parameters.

:func:`gradient_variance` takes the parameters of a trained (or freshly initialised) guide,
copies them into a fresh guide of each estimator's kind, and draws many stochastic ELBO
gradients without ever updating those parameters.  The result is a table, per estimator and per
parameter group (each site's means and scales), of the mean gradient, its variance, the
signal-to-noise ratio and the wall time per draw.  It answers "by how much does Bayes by
Backprop's reparameterization gradient beat the score-function gradient of BBVI?" with a
measurement.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import pyro
import torch

from .._validation import check_data
from ..guides import MeanField, ScoreFunction
from ..guides.base import BNNGuide
from ..inference.elbo import KL_TREATMENTS, make_elbo
from ..posterior import Posterior

__all__ = [
    "DEFAULT_ESTIMATORS",
    "ESTIMATORS",
    "GradientVarianceRow",
    "GradientVarianceTable",
    "gradient_variance",
]


@dataclass(frozen=True)
class _Estimator:
    """How to build one estimator: a guide factory (None: the given guide) and its ELBO."""

    guide: Callable[[Any], BNNGuide] | None
    elbo: str | None  # None: "direct" with the ``kl`` argument


#: Estimators by name.  Pathwise ones use pyrobdl's DirectELBO with the ``kl`` argument,
#: score-function ones its trace-free DirectScoreFunctionELBO (equal to Pyro's TraceGraph_ELBO
#: on the same draws, tests/test_bbvi.py; the neural baseline needs Pyro's trace), all with a
#: Monte Carlo KL; ``"native"`` is the given guide itself with the ELBO its method trained with.
ESTIMATORS: dict[str, _Estimator] = {
    "reparameterization": _Estimator(MeanField, None),
    "local_reparameterization": _Estimator(lambda m: MeanField(m, local_reparameterization=True), None),
    "score_function": _Estimator(lambda m: ScoreFunction(m, baseline="none"), "direct_score_function"),
    "score_function+baseline": _Estimator(lambda m: ScoreFunction(m, baseline="decaying_average"), "direct_score_function"),
    "score_function+neural_baseline": _Estimator(lambda m: ScoreFunction(m, baseline="neural"), "trace_graph"),
    "score_function+leave_one_out": _Estimator(lambda m: ScoreFunction(m, baseline="leave_one_out"), "direct_score_function"),
    "score_function+vargrad": _Estimator(lambda m: ScoreFunction(m, baseline="vargrad"), "direct_score_function"),
    "native": _Estimator(None, None),
}

#: Estimators whose baseline is formed from the other particles of the same draw.
_PARTICLE_ESTIMATORS = ("score_function+leave_one_out", "score_function+vargrad")

#: The estimators measured when none are named.
DEFAULT_ESTIMATORS = ("reparameterization", "local_reparameterization", "score_function", "score_function+baseline")

#: Learning rate of the neural baseline's warm-up (the guide's parameters stay fixed).
_BASELINE_WARMUP_LR = 1e-2


@dataclass(frozen=True)
class GradientVarianceRow:
    r"""Gradient statistics of one parameter group under one estimator.

    With :math:`g^{(t)}_j` the gradient of the negative ELBO with respect to element :math:`j`
    of the group in draw :math:`t = 1..T`, :math:`\bar g_j` its mean over draws and
    :math:`s_j^2` its unbiased sample variance:

    Attributes
    ----------
    estimator : str
        Estimator name (see :data:`ESTIMATORS`).
    group : str
        Parameter name in the guide, without ``_unconstrained``; e.g.
        ``layers_0_weight_loc`` (means :math:`\mu`) or ``layers_0_weight_scale`` (gradient with
        respect to the *unconstrained* :math:`\rho`, :math:`\sigma=\operatorname{softplus}(\rho)`,
        which is what the optimizer sees).
    num_elements : int
        Elements :math:`d` of the group.
    mean_abs_gradient : float
        :math:`\frac1d\sum_j|\bar g_j|`.
    variance : float
        :math:`\frac1d\sum_j s_j^2`: the mean per-element variance of one draw (the trace of
        the gradient covariance divided by :math:`d`).
    snr : float
        ``mean_abs_gradient / sqrt(variance)``: group-level signal-to-noise ratio of one draw
        (inf for a deterministic non-zero gradient, nan for 0/0).  ``mean_abs_gradient``
        contains Monte Carlo noise, so values near
        :attr:`GradientVarianceTable.snr_noise_floor` mean "indistinguishable from zero".
    seconds_per_draw : float
        Wall time of one gradient draw (forward and backward), averaged over the draws.
    mean : numpy.ndarray
        :math:`\bar g_j` per element (flattened), float64.
    standard_error : numpy.ndarray
        :math:`s_j/\sqrt T` per element: the Monte Carlo standard error of ``mean``.
    """

    estimator: str
    group: str
    num_elements: int
    mean_abs_gradient: float
    variance: float
    snr: float
    seconds_per_draw: float
    mean: np.ndarray = field(repr=False, compare=False)
    standard_error: np.ndarray = field(repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """The scalar fields as a plain (JSON-serialisable) dict."""
        return {
            "estimator": self.estimator,
            "group": self.group,
            "num_elements": self.num_elements,
            "mean_abs_gradient": self.mean_abs_gradient,
            "variance": self.variance,
            "snr": self.snr,
            "seconds_per_draw": self.seconds_per_draw,
        }


@dataclass(frozen=True)
class GradientVarianceTable:
    """Result of :func:`gradient_variance`: one row per (estimator, parameter group).

    Attributes
    ----------
    rows : tuple of GradientVarianceRow
        Rows in estimator order, then the guide's parameter order.
    num_draws : int
        Gradient draws per estimator (after warm-up).
    num_particles : int
        Vectorized particles per draw.
    batch_size : int or None
        Minibatch size (None: full batch).
    kl : str
        KL treatment of the pathwise estimators.
    baseline_warmup : int
        Draws discarded before measuring estimators with a baseline (decaying average
        filled; neural baseline trained with the guide's parameters fixed).
    seed : int
        Seed of the draws.
    """

    rows: tuple[GradientVarianceRow, ...]
    num_draws: int
    num_particles: int
    batch_size: int | None
    kl: str
    baseline_warmup: int
    seed: int

    @property
    def estimators(self) -> tuple[str, ...]:
        """Estimator names, in order."""
        return tuple(dict.fromkeys(r.estimator for r in self.rows))

    @property
    def groups(self) -> tuple[str, ...]:
        """Parameter groups, in order of first appearance."""
        return tuple(dict.fromkeys(r.group for r in self.rows))

    @property
    def snr_noise_floor(self) -> float:
        r"""SNR that a zero true gradient shows with this many draws, :math:`\sqrt{2/(\pi T)}`.

        :math:`E|\bar g_j| = s_j\sqrt{2/(\pi T)}` when the true gradient is zero, so an SNR at
        or below this value says the draws cannot tell the gradient from zero.
        """
        return math.sqrt(2.0 / (math.pi * self.num_draws))

    def row(self, estimator: str, group: str) -> GradientVarianceRow:
        """The row of ``estimator`` and ``group``.

        Raises
        ------
        KeyError
            When the table has no such row.
        """
        for r in self.rows:
            if r.estimator == estimator and r.group == group:
                return r
        raise KeyError(f"no row ({estimator!r}, {group!r}); estimators {self.estimators}, groups {self.groups}")

    def variance_ratio(self, numerator: str, denominator: str) -> dict[str, float]:
        """``variance`` of ``numerator`` over that of ``denominator``, per shared group."""
        den = {r.group: r.variance for r in self.rows if r.estimator == denominator}
        if not den or numerator not in self.estimators:
            raise KeyError(f"estimators {numerator!r} and {denominator!r} must be in {self.estimators}")
        return {
            r.group: (r.variance / den[r.group] if den[r.group] > 0 else math.inf)
            for r in self.rows
            if r.estimator == numerator and r.group in den
        }

    def to_records(self) -> list[dict[str, Any]]:
        """Scalar fields of every row, as plain dicts."""
        return [r.to_dict() for r in self.rows]

    def to_markdown(self, reference: str | None = "reparameterization") -> str:
        """A Markdown table; with ``reference`` in the table, a column of variance ratios to it."""
        ref = None
        if reference is not None and reference in self.estimators:
            ref = {r.group: r.variance for r in self.rows if r.estimator == reference}
        head = ["estimator", "group", "d", "mean abs grad", "variance", "SNR", "ms/draw"]
        if ref is not None:
            head.append(f"variance / {reference}")
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in self.rows:
            cells = [
                r.estimator, f"`{r.group}`", str(r.num_elements), f"{r.mean_abs_gradient:.3g}",
                f"{r.variance:.3g}", f"{r.snr:.3g}", f"{1e3 * r.seconds_per_draw:.2f}",
            ]
            if ref is not None:
                den = ref.get(r.group)
                cells.append("" if den is None else (f"{r.variance / den:.3g}" if den > 0 else "inf"))
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", f"{self.num_draws} draws, {self.num_particles} particle(s) each; an SNR near "
                  f"{self.snr_noise_floor:.2g} is the noise floor of {self.num_draws} draws (zero true gradient)."]
        return "\n".join(lines)


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _source(guide_params: Any) -> tuple[BNNGuide, dict[str, Any]]:
    if isinstance(guide_params, Posterior):
        guide = getattr(guide_params, "guide", None)
        if not isinstance(guide, BNNGuide):
            raise TypeError(
                f"guide_params is a {type(guide_params).__name__} from method {guide_params.method!r}, "
                "which has no guide; pass an SVI posterior or a pyrobdl guide"
            )
        return guide, guide_params.settings
    if isinstance(guide_params, BNNGuide):
        return guide_params, {}
    raise TypeError(
        f"guide_params must be an SVI Posterior or a pyrobdl.guides.BNNGuide, got {type(guide_params).__name__}"
    )


def _measured(guide: BNNGuide) -> list[tuple[str, torch.nn.Parameter]]:
    """The guide's variational parameters (baseline networks are not part of q)."""
    return [
        (n.removesuffix("_unconstrained"), p)
        for n, p in guide.named_parameters()
        if p.requires_grad and not n.startswith("baseline_nets.")
    ]


def _build(name: str, model: Any, source: BNNGuide, settings: dict[str, Any], kl: str) -> tuple[BNNGuide, str, str]:
    """A guide holding ``source``'s parameters, and the (elbo, kl) of estimator ``name``."""
    spec = ESTIMATORS[name]
    if spec.guide is None:  # "native": the source guide itself, as its method trained it
        guide = copy.deepcopy(source)
        if "elbo" in settings and "kl" in settings:
            return guide, settings["elbo"], settings["kl"]
        reparam = all(q.has_rsample for q in guide.variational_distributions().values())
        return (guide, "direct", kl) if reparam else (guide, "trace_graph", "monte_carlo")
    guide = spec.guide(model).to(_device(source))
    state = source.state_dict()
    needed = {n: p.shape for n, p in guide.named_parameters() if not n.startswith("baseline_nets.")}
    missing = sorted(set(needed) - set(state))
    if missing:
        raise ValueError(
            f"estimator {name!r} needs a mean-field Gaussian guide (MeanField, ScoreFunction); guide_params "
            f"({type(source).__name__}) lacks {missing[:4]}{'...' if len(missing) > 4 else ''}. "
            "Use estimators=('native',) for other guides."
        )
    wrong = [n for n, shape in needed.items() if state[n].shape != shape]
    if wrong:
        raise ValueError(f"guide_params does not fit this model: parameters {wrong[:4]} have other shapes")
    guide.load_state_dict({k: v for k, v in state.items() if k in guide.state_dict()}, strict=False)
    if spec.elbo is None:
        return guide, "direct", kl
    return guide, spec.elbo, "monte_carlo"


def _device(guide: BNNGuide) -> torch.device:
    # CPU for a guide without parameters
    for p in guide.parameters():
        return p.device
    return torch.device("cpu")


def _draw_statistics(
    name: str,
    guide: BNNGuide,
    loss_fn: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    batches: Callable[[], torch.Tensor | None],
    num_draws: int,
    warmup: int,
) -> list[GradientVarianceRow]:
    params = _measured(guide)
    baseline_params = [p for n, p in guide.named_parameters() if n.startswith("baseline_nets.")]
    optimizer = torch.optim.Adam(baseline_params, lr=_BASELINE_WARMUP_LR) if baseline_params else None
    for _ in range(warmup):
        guide.zero_grad(set_to_none=True)
        loss_fn(x, y, batches()).backward()
        if optimizer is not None:
            optimizer.step()
    # Welford's running mean and sum of squared deviations, per element, in float64.
    mean = [torch.zeros(p.numel(), dtype=torch.float64, device=p.device) for _, p in params]
    m2 = [torch.zeros_like(m) for m in mean]
    elapsed = 0.0
    for t in range(1, num_draws + 1):
        subsample = batches()
        if x.device.type == "cuda":
            torch.cuda.synchronize(x.device)
        start = time.perf_counter()
        guide.zero_grad(set_to_none=True)
        loss_fn(x, y, subsample).backward()
        if x.device.type == "cuda":
            torch.cuda.synchronize(x.device)
        elapsed += time.perf_counter() - start
        with torch.no_grad():
            for (_, p), mu, s in zip(params, mean, m2):
                # a parameter the loss does not reach has no .grad: its gradient is zero
                g = mu.new_zeros(p.numel()) if p.grad is None else p.grad.reshape(-1).double()
                delta = g - mu
                mu += delta / t
                s += delta * (g - mu)
    rows = []
    for (group, p), mu, s in zip(params, mean, m2):
        var = s / (num_draws - 1)
        mean_abs = float(mu.abs().mean())
        variance = float(var.mean())
        snr = mean_abs / math.sqrt(variance) if variance > 0 else (math.inf if mean_abs > 0 else math.nan)
        rows.append(
            GradientVarianceRow(
                name, group, p.numel(), mean_abs, variance, snr, elapsed / num_draws,
                mu.cpu().numpy(), (var / num_draws).sqrt().cpu().numpy(),
            )
        )
    return rows


def gradient_variance(
    model: Any,
    x: Any,
    y: Any,
    guide_params: Any,
    estimators: Sequence[str] = DEFAULT_ESTIMATORS,
    *,
    num_draws: int = 500,
    num_particles: int = 1,
    batch_size: int | None = None,
    kl: str = "monte_carlo",
    baseline_warmup: int = 200,
    seed: int = 0,
) -> GradientVarianceTable:
    r"""Variance of stochastic ELBO gradients under several estimators, at fixed parameters.

    Parameters
    ----------
    model : pyrobdl.BayesianMLP
        The model.
    x, y : array-like
        Training data (as for :func:`pyrobdl.fit`).
    guide_params : SVIPosterior or pyrobdl.guides.BNNGuide
        Where to measure: the guide of an SVI posterior, or a guide.  Its parameters are copied
        (``state_dict``) into a fresh guide of each estimator's kind and never changed.
    estimators : sequence of str
        Names from :data:`ESTIMATORS`:

        * ``"reparameterization"`` — :class:`~pyrobdl.guides.MeanField`, pathwise gradient
          (Bayes by Backprop) through pyrobdl's ``DirectELBO``;
        * ``"local_reparameterization"`` — the same with sampled pre-activations;
        * ``"score_function"`` — :class:`~pyrobdl.guides.ScoreFunction` without baseline,
          Pyro's ``TraceGraph_ELBO`` (Rao-Blackwellized log-derivative estimator);
        * ``"score_function+baseline"`` — with Pyro's decaying-average baseline (β = 0.9);
        * ``"score_function+neural_baseline"`` — with the neural baseline;
        * ``"score_function+leave_one_out"`` — each particle's baseline is the mean cost of
          the other particles of the draw (:class:`~pyrobdl.inference.ScoreFunctionELBO`);
          needs ``num_particles >= 2``;
        * ``"score_function+vargrad"`` — the VarGrad estimator (same ELBO); needs
          ``num_particles >= 2``;
        * ``"native"`` — the given guide itself with the ELBO of its method (from the
          posterior's settings; for a bare guide ``"direct"`` when every site is
          reparameterized, else ``"trace_graph"``).  Works for every registered SVI guide.

        All but ``"native"`` need a mean-field Gaussian ``guide_params`` (they share parameter names).
    num_draws : int, default 500
        Gradient draws per estimator (>= 2).
    num_particles : int, default 1
        Vectorized particles averaged in each draw (the same for every estimator, so rows
        compare estimators at a matched number of model evaluations per draw).
    batch_size : int, optional
        Minibatch size: each draw uses a fresh random minibatch, so minibatch noise is part of
        the variance.  None (default) uses the full data.
    kl : {"monte_carlo", "analytic"}, default "monte_carlo"
        KL treatment of the pathwise estimators.  The default estimates the KL by sampling, as
        the score-function estimators must, so rows differ only in how the gradient is formed.
    baseline_warmup : int, default 200
        Draws run and discarded before measuring an estimator whose baseline carries state
        across draws, so the decaying average is filled (and a neural baseline trained, guide fixed).
    seed : int, default 0
        Seed of the draws; every estimator starts from it.  The caller's RNG state is restored.

    Returns
    -------
    GradientVarianceTable

    Raises
    ------
    ValueError
        Unknown estimator (the message lists the valid ones), invalid counts, unknown ``kl``,
        invalid data, or built-in estimators asked of a guide that is not mean-field Gaussian.
    TypeError
        ``guide_params`` is neither an SVI posterior nor a pyrobdl guide.

    Notes
    -----
    For element :math:`j` of a parameter group with draws :math:`g^{(1..T)}_j` of
    :math:`\partial(-\mathcal L)/\partial\phi_j`, the row reports
    :math:`\frac1d\sum_j|\bar g_j|`, :math:`\frac1d\sum_j s_j^2` (unbiased per-element
    variance, averaged over the group) and their ratio
    :math:`\frac1d\sum_j|\bar g_j| / (\frac1d\sum_j s_j^2)^{1/2}`; per-element means and
    standard errors are kept in the row for tests of unbiasedness.  All estimators target the
    same gradient, so their mean gradients agree within Monte Carlo error.

    Each estimator runs in a private Pyro parameter-store scope and inside
    ``torch.random.fork_rng``.

    Examples
    --------
    >>> table = gradient_variance(model, x, y, posterior, num_draws=500)
    >>> table.variance_ratio("score_function", "reparameterization")
    >>> print(table.to_markdown())
    """
    names = tuple(estimators) if not isinstance(estimators, str) else (estimators,)
    unknown = [n for n in names if n not in ESTIMATORS]
    if unknown or not names:
        raise ValueError(f"unknown estimator(s) {unknown or names}; valid: {list(ESTIMATORS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"estimators has duplicates: {list(names)}")
    num_draws = _check_int("num_draws", num_draws, 2)
    num_particles = _check_int("num_particles", num_particles, 1)
    baseline_warmup = _check_int("baseline_warmup", baseline_warmup, 0)
    if batch_size is not None:
        batch_size = _check_int("batch_size", batch_size, 1)
    if kl not in KL_TREATMENTS:
        raise ValueError(f"unknown kl {kl!r}; valid: {list(KL_TREATMENTS)}")
    few = [n for n in names if n in _PARTICLE_ESTIMATORS and num_particles < 2]
    if few:
        raise ValueError(f"estimators {few} compare the particles of a draw: they need num_particles >= 2, "
                         f"got {num_particles}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    source, settings = _source(guide_params)
    needed = getattr(source, "min_num_particles", 1)
    if "native" in names and num_particles < needed:
        raise ValueError(f"estimator 'native': the guide's baseline {getattr(source, 'baseline', '')!r} needs "
                         f"num_particles >= {needed}, got {num_particles}")
    x, y = check_data(model, x, y)
    device = _device(source)
    x, y = x.to(device), y.to(device)
    model.to(device)
    num_data = x.shape[0]
    full_batch = batch_size is None or batch_size >= num_data

    rows: list[GradientVarianceRow] = []
    for name in names:
        gen = torch.Generator().manual_seed(seed)

        def batches() -> torch.Tensor | None:
            if full_batch:
                return None
            return torch.randperm(num_data, generator=gen)[:batch_size].to(device)

        # fork_rng: building a guide draws initial values; the caller's RNG state is restored
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            guide, elbo, kl_used = _build(name, model, source, settings, kl)
            loss_fn = make_elbo(model, guide, elbo=elbo, kl=kl_used, num_particles=num_particles)
            warmup = baseline_warmup if getattr(guide, "stateful_baseline", False) else 0
            torch.manual_seed(seed)
            with pyro.get_param_store().scope():
                rows += _draw_statistics(name, guide, loss_fn, x, y, batches, num_draws, warmup)
    return GradientVarianceTable(
        tuple(rows), num_draws, num_particles, None if full_batch else batch_size, kl, baseline_warmup, seed
    )
