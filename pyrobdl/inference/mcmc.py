r"""NUTS and HMC for Bayesian MLPs through ``pyro.infer.mcmc``, and their posterior.

``fit(model, x, y, method="nuts" | "hmc", ...)`` runs Pyro's own ``NUTS``/``HMC`` kernels under
``pyro.infer.mcmc.MCMC`` on the unchanged :class:`~pyrobdl.BayesianMLP`.  pyrobdl adds three
things around the kernels and changes nothing inside them:

* **chains run one after the other in this process**, each with its own seed derived from
  ``seed`` (reproducible, no worker processes, and the same code on CPU and CUDA);
* **per-iteration statistics** (leapfrog steps, step size, acceptance statistic, divergence,
  log density, the Hamiltonian at the start of the trajectory) are recorded while the chain
  runs, because Pyro resets the kernel's counters at the end of ``MCMC.run`` (DESIGN.md, known
  traps) and keeps no energy at all;
* **convergence diagnostics** (R-hat, bulk/tail ESS through
  :func:`pyrobdl.diagnostics.convergence`, equal to ArviZ's) on the weights and, more usefully for
  a neural network, on the function values at fixed inputs.

The result, :class:`MCMCPosterior`, keeps every draw and obeys the shared posterior contract.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np
import pyro
import torch
from pyro.infer.autoguide.initialization import init_to_median, init_to_sample, init_to_value
from pyro.infer.mcmc import MCMC
from pyro.infer.mcmc.util import initialize_model

from ..diagnostics.rank_diagnostics import convergence
from ..posterior import Cost, Posterior
from .mcmc_kernels import (
    INIT_STRATEGIES,
    MAX_NUM_STEPS,
    POTENTIALS,
    _chain_bar,
    _check_direct,
    _check_options,
    _Counted,
    _direct_potential,
    _FlatSite,
    _HMC,
    _resolve_potential,
    _NUTS,
)
from .registry import Method, fit, register_method, require_proper_prior
from .svi import _peak_memory

__all__ = ["INIT_STRATEGIES", "POTENTIALS", "MCMCPosterior", "SamplerTrace", "chain_seeds", "run_mcmc"]

_COMMON = {
    "num_warmup": 500,
    "num_samples": 500,
    "num_chains": 4,
    "target_accept_prob": 0.8,
    "step_size": 1.0,
    "adapt_step_size": True,
    "adapt_mass_matrix": True,
    "full_mass": False,
    "jit_compile": False,
    "potential": "auto",
    "init_strategy": "sample",
    "map_num_steps": 1000,
    "map_lr": 1e-2,
    "diagnostic_points": 50,
    "certify_inputs": None,
}
NUTS_OPTIONS = {**_COMMON, "max_tree_depth": 10}
# A quarter period of a unit-scale Gaussian (the scale the adapted mass matrix aims at): an
# exact trajectory of length pi/2 maps x to the fresh momentum, i.e. an independent draw,
# whereas Pyro's default 2*pi is a full oscillation that returns near the start (DESIGN.md).
# max_num_steps bounds one iteration's gradients: with a collapsed step size, ceil(L/eps) steps
# are unbounded (measured: eps = 8.4e-6 after 4 warm-up iterations, ~190,000 gradients in one
# iteration).  1024 is the budget of NUTS's default tree depth 10 (2**10 - 1 steps).
HMC_OPTIONS = {**_COMMON, "trajectory_length": math.pi / 2, "num_steps": None, "jitter": 0.5,
               "max_num_steps": MAX_NUM_STEPS}


@dataclass(frozen=True)
class SamplerTrace:
    r"""Per-iteration sampler statistics, shape ``[chain, num_warmup + num_samples]``.

    Attributes
    ----------
    num_warmup : int
        The first ``num_warmup`` columns are warm-up iterations.
    num_steps : numpy.ndarray
        Leapfrog steps (gradient evaluations) of each iteration.
    step_size : numpy.ndarray
        Step size the iteration's trajectory used.
    accept_prob : numpy.ndarray
        Acceptance statistic (mean Metropolis acceptance over the trajectory for NUTS), the
        quantity step-size adaptation drives towards ``target_accept_prob``.
    diverging : numpy.ndarray
        Whether Pyro flagged the iteration divergent (Pyro flags sampling iterations only).
    tree_depth : numpy.ndarray or None
        NUTS doublings, :math:`\lceil\log_2(\text{num\_steps}+1)\rceil`; None for HMC.
    log_joint : numpy.ndarray
        Log joint density of the current state in Pyro's unconstrained space (including the
        log-Jacobian of constrained sites), i.e. minus the potential energy.
    energy : numpy.ndarray or None
        Hamiltonian at the start of the iteration's trajectory, :math:`H = U(z) + K(r)`: the
        potential energy of the state the iteration starts from (``-log_joint`` of the previous
        iteration) plus the kinetic energy :math:`\tfrac12 r^\top M^{-1} r` of the momentum just
        drawn, exactly Pyro's ``energy_current``.  What E-BFMI and ``az.plot_energy`` read;
        None when not recorded.
    superchain_size : int, default 1
        How the chains were started: chains ``c*M .. (c+1)*M - 1`` (``M = superchain_size``)
        from one common point, different superchains from independent points (what nested
        R-hat needs, :func:`pyrobdl.diagnostics.nested_rhat`); 1: every chain from its own point.
    """

    num_warmup: int
    num_steps: np.ndarray
    step_size: np.ndarray
    accept_prob: np.ndarray
    diverging: np.ndarray
    tree_depth: np.ndarray | None
    log_joint: np.ndarray
    energy: np.ndarray | None = None
    superchain_size: int = 1


def chain_seeds(seed: int, num_chains: int) -> list[int]:
    """Independent per-chain seeds derived from ``seed`` with ``numpy.random.SeedSequence``."""
    return [int(s) for s in np.random.SeedSequence(seed).generate_state(num_chains)]


def _check_model(model: Any, options: Mapping[str, Any]) -> None:
    require_proper_prior(model, options)
    _check_options(options)
    from ..diagnostics.certification import check_certify_inputs

    check_certify_inputs(model, options)
    # the ensemble start and the flat potential use the flat log joint: refuse what it cannot do
    if options["init_strategy"] == "ensemble" or options["potential"] == "flat":
        from ..flat import _check_supported

        _check_supported(model)


# ----------------------------------------------------------------------------------- running
def _init_strategy(model: Any, x: torch.Tensor, y: torch.Tensor, options: Mapping[str, Any], seed: int,
                   member: Mapping[str, torch.Tensor] | None = None):
    name = options["init_strategy"]
    if name == "ensemble":  # this chain's member of the ensemble trained before the chains
        return init_to_value(values=dict(member)), 0
    if name == "median":
        return init_to_median, 0
    if name == "sample":
        return init_to_sample, 0
    point = fit(model, x, y, method="map", seed=seed, progress=False,
                num_steps=options["map_num_steps"], lr=options["map_lr"])
    values = {k: v[0] for k, v in point.sample(1).items()}
    return init_to_value(values=values), point.cost.gradient_evaluations


def run_mcmc(
    model: Any, x: torch.Tensor, y: torch.Tensor, options: Mapping[str, Any], progress: bool, *, method: str
) -> MCMCPosterior:
    """Run ``options["num_chains"]`` chains of NUTS or HMC one after another (``fit``'s ``run``).

    Parameters
    ----------
    model : pyrobdl.BayesianMLP
        The model, on the data's device.
    x, y : torch.Tensor
        Validated training data.
    options : Mapping
        Every option of the method (see ``NUTS_OPTIONS``/``HMC_OPTIONS``), plus ``seed``.
    progress : bool
        Show one progress bar per chain, named by method and chain (``mcmc_kernels._ChainBar``).
    method : {"nuts", "hmc"}
        The kernel.

    Returns
    -------
    MCMCPosterior

    Raises
    ------
    ValueError
        With ``potential="direct"`` or ``"flat"``, if that potential disagrees with Pyro's traced
        one at a chain's starting point (the model has terms it does not know).
    TypeError
        With ``potential="flat"``, for a prior, likelihood or activation the flat log joint does
        not implement (before any chain runs).

    Warns
    -----
    UserWarning
        When ``max_num_steps`` cut some HMC trajectory (warm-up or sampling), or some NUTS
        sampling iteration reached ``max_tree_depth``; the counts are in ``diagnostics``.

    Notes
    -----
    Chain ``c`` is seeded with ``chain_seeds(seed, num_chains)[c]`` before its initial point is
    drawn, so its draws do not depend on the number of chains.
    """
    device = x.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start, cpu_start = time.perf_counter(), time.process_time()
    options = {**options, "potential": _resolve_potential(model, options)}  # the settings say which ran
    jit = options["jit_compile"] and options["potential"] == "trace"
    # One potential for all chains, built before the per-chain seeds take over, so a
    # jit-compiled potential is traced once rather than once per chain.
    _, traced, transforms, _ = initialize_model(
        model, (x, y), jit_compile=jit, skip_jit_warnings=True, init_strategy=init_to_sample
    )
    flat = _FlatSite(model, x, y) if options["potential"] == "flat" else None
    if options["potential"] == "direct":
        potential = _direct_potential(model, x, y, transforms)
    else:
        potential = traced if flat is None else flat.potential
    map_grads, members = 0, None
    if options["init_strategy"] == "ensemble":
        # one batched deep ensemble (docs/methods/ensemble.md), one member per chain
        ens = fit(model, x, y, method="ensemble", num_members=options["num_chains"], seed=options["seed"],
                  progress=False, num_steps=options["map_num_steps"], lr=options["map_lr"])
        members = ens.members
        map_grads += ens.cost.gradient_evaluations
    chains = []
    for chain, seed in enumerate(chain_seeds(options["seed"], options["num_chains"])):
        pyro.set_rng_seed(seed)
        member = None if members is None else {k: v[chain] for k, v in members.items()}
        strategy, grads = _init_strategy(model, x, y, options, seed, member)
        map_grads += grads
        chains.append(_run_chain(model, x, y, method, (potential, transforms, flat), strategy, options, progress, chain))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    clock = (time.perf_counter() - start, time.process_time() - cpu_start)
    posterior, points, recorded_points = _posterior(model, x, method, chains, map_grads, options, clock)
    _warn_saturation(posterior.diagnostics, options)
    # reference certification at the same points (fit warns when it fails; docs/diagnostics.md):
    # the reference criteria with split R-hat (never two superchains here: independent starts, or
    # init "median"'s one common start)
    from ..diagnostics.certification import attach_certification, reference_criteria

    attach_certification(posterior, points, reference_criteria(1), inputs=recorded_points)
    return posterior


def _posterior(model: Any, x: torch.Tensor, method: str, chains: list[tuple], map_grads: int,
               options: Mapping[str, Any], clock: tuple[float, float]) -> tuple[MCMCPosterior, torch.Tensor, Any]:
    """The chains (:func:`_run_chain`'s results) as the posterior with its sampler diagnostics and
    convergence summary, and the inputs it is certified at (as tensors and as recorded); ``clock``:
    the run's wall and CPU seconds."""
    samples, rows, accept_rates, other_grads = (list(c) for c in zip(*chains))
    draws = {k: torch.cat([s[k] for s in samples]).detach() for k in samples[0]}
    draws = {name: draws[name] for name in model.prior_distributions()}
    # init "median" starts every chain from the same point: one superchain
    trace = _trace(rows, options["num_warmup"], method,
                   options["num_chains"] if options["init_strategy"] == "median" else 1)
    capped = np.array([[r[7] for r in chain] for chain in rows], dtype=bool) if method == "hmc" else None
    leapfrog = int(trace.num_steps.sum())
    cost = Cost(wall_time_s=clock[0], gradient_evaluations=leapfrog + map_grads, epochs=float(leapfrog + map_grads),
                peak_memory_bytes=_peak_memory(x.device), device=str(x.device), cpu_time_s=clock[1])
    # certified at certify_inputs (e.g. held-back inputs), else the first diagnostic_points training inputs
    from ..diagnostics.certification import certification_points, given_inputs

    points, recorded_points = certification_points(model, x, options)
    posterior = MCMCPosterior(model, draws, trace, method=method,
                              settings={**options, "certify_inputs": given_inputs(recorded_points)}, cost=cost)
    diagnostics = _sampler_summary(trace, accept_rates, other_grads, map_grads, options, capped)
    diagnostics.update(posterior.convergence_summary(points))
    posterior.diagnostics = diagnostics
    return posterior, points, recorded_points


def _run_chain(model: Any, x: torch.Tensor, y: torch.Tensor, method: str, potential: tuple[Callable, Mapping],
               strategy: Callable, options: Mapping[str, Any], progress: bool,
               chain: int) -> tuple[dict, list, float, int]:
    """One chain of ``method`` from ``strategy``'s starting point; ``potential``: the potential and
    the sites' transforms and the :class:`_FlatSite` the potential is of (None: a function of the
    model's sites).  Returns its draws ``[1, draws, ...]`` per site, its per-iteration rows,
    the fraction of sampling iterations that moved, and its potential evaluations outside the
    leapfrog steps (step-size searches, initialisation); ``chain`` (0-based) names its progress bar."""
    potential, transforms, flat = potential
    init, plain, _, _ = initialize_model(model, (x, y), init_strategy=strategy)
    if options["potential"] != "trace":
        _check_direct(potential if flat is None else flat.site_potential, plain, init, options["potential"])
    if flat is not None:  # Pyro's sampler moves the one flat site (unconstrained: no transforms)
        init, site_transforms, transforms = flat.pack(init), transforms, {}
    counter = _Counted(potential)
    kernel = _make_kernel(method, counter, transforms, options)
    kernel._start_recording(counter)
    if flat is not None:  # _NUTS and _HMC run their trajectories on the one tensor
        kernel.use_flat_site(flat.NAME, flat.energy_and_grad, counter, flat.numpy_energy())
    bar = _chain_bar(method, chain, options, progress)
    mcmc = MCMC(kernel, num_samples=options["num_samples"], warmup_steps=options["num_warmup"],
                initial_params=init, disable_progbar=True, transforms=transforms,
                hook_fn=None if bar is None else bar.hook)
    try:
        mcmc.run()
    finally:
        if bar is not None:
            bar.close()
    samples = mcmc.get_samples(group_by_chain=True)
    if flat is not None:
        samples = flat.unpack(samples[flat.NAME], site_transforms)
    return (samples, kernel.rows, kernel.moved / options["num_samples"],
            counter.calls - sum(r[1] for r in kernel.rows))


def _make_kernel(method: str, potential: Callable, transforms: Mapping[str, Any], options: Mapping[str, Any]):
    common = dict(
        potential_fn=potential, transforms=transforms, step_size=options["step_size"],
        adapt_step_size=options["adapt_step_size"], adapt_mass_matrix=options["adapt_mass_matrix"],
        full_mass=options["full_mass"], target_accept_prob=options["target_accept_prob"],
    )
    if method == "nuts":
        return _NUTS(max_tree_depth=options["max_tree_depth"], **common)
    hmc = dict(jitter=options["jitter"], max_num_steps=options["max_num_steps"], **common)
    if options["num_steps"] is not None:
        return _HMC(num_steps=options["num_steps"], fixed_num_steps=options["num_steps"], **hmc)
    return _HMC(trajectory_length=options["trajectory_length"], **hmc)


def _trace(rows: list[list[tuple]], num_warmup: int, method: str, superchain_size: int) -> SamplerTrace:
    # a row: (t, steps, step size, accept, diverged, log joint, energy, capped)
    arr = np.array([[r[1:7] for r in chain] for chain in rows], dtype=float)  # [C, T, 6]
    steps = arr[..., 0].astype(np.int64)
    depth = np.vectorize(int.bit_length, otypes=[np.int64])(steps) if method == "nuts" else None
    return SamplerTrace(num_warmup, steps, arr[..., 1], arr[..., 2], arr[..., 3].astype(bool), depth, arr[..., 4],
                        energy=arr[..., 5], superchain_size=superchain_size)


def _sampler_summary(trace: SamplerTrace, accept_rates: list[float], other_grads: list[int], map_grads: int,
                     options: Mapping[str, Any], capped: np.ndarray | None = None) -> dict[str, Any]:
    """The sampler part of ``diagnostics``; ``capped`` [chain, iteration] marks HMC iterations whose
    step count ``max_num_steps`` cut (None for NUTS)."""
    w = trace.num_warmup
    out: dict[str, Any] = {
        "num_chains": options["num_chains"],
        "num_warmup": w,
        "num_samples": options["num_samples"],
        "divergences": [int(d) for d in trace.diverging[:, w:].sum(1)],
        "step_size": [float(s) for s in trace.step_size[:, -1]],
        "accept_prob": [float(a) for a in trace.accept_prob[:, w:].mean(1)],
        "acceptance_rate": accept_rates,
        "leapfrog_steps_warmup": [int(s) for s in trace.num_steps[:, :w].sum(1)],
        "leapfrog_steps_sampling": [int(s) for s in trace.num_steps[:, w:].sum(1)],
        "other_gradient_evaluations": [int(g) for g in other_grads],
        "map_gradient_evaluations": int(map_grads),
    }
    if trace.tree_depth is not None:
        depth = trace.tree_depth[:, w:]
        out["mean_tree_depth"] = [float(d) for d in depth.mean(1)]
        out["max_tree_depth_fraction"] = [float(f) for f in (depth >= options["max_tree_depth"]).mean(1)]
    if capped is not None:
        out["num_steps_cap_hits_warmup"] = [int(c) for c in capped[:, :w].sum(1)]
        out["num_steps_cap_hits_sampling"] = [int(c) for c in capped[:, w:].sum(1)]
    if trace.energy is not None:
        # E-BFMI, sum of squared successive differences of the sampling iterations' energy over its
        # sum of squared deviations (= az.bfmi); the one implementation is the certification's
        from ..diagnostics.certification import ebfmi

        # nan (a one-draw chain, constant energy) is not JSON: None instead
        out["ebfmi"] = [float(b) if math.isfinite(b) else None for b in ebfmi(trace.energy[:, w:])]
    return out


def _warn_saturation(diagnostics: Mapping[str, Any], options: Mapping[str, Any]) -> None:
    """One UserWarning when HMC's step cap or NUTS's tree depth limited some trajectory."""
    if "num_steps_cap_hits_warmup" in diagnostics:
        warmup, sampling = diagnostics["num_steps_cap_hits_warmup"], diagnostics["num_steps_cap_hits_sampling"]
        hits = sum(warmup) + sum(sampling)
        if hits:
            total = options["num_chains"] * (options["num_warmup"] + options["num_samples"])
            warnings.warn(
                f"hmc: max_num_steps={options['max_num_steps']} cut the leapfrog steps of {hits} of {total} "
                f"iterations (per chain: {warmup} in warm-up, {sampling} while sampling), so their "
                "trajectories were shorter than asked. Usually the step size collapsed in warm-up (see "
                "diagnostics['step_size']): try a longer warm-up, another init_strategy (e.g. 'map'), "
                "a larger max_num_steps, or NUTS.",
                UserWarning, stacklevel=5,  # the caller of fit (fit -> run -> run_mcmc)
            )
    fractions = diagnostics.get("max_tree_depth_fraction")
    if fractions and max(fractions) > 0:
        per_chain = ", ".join(f"{100 * f:.3g}%" for f in fractions)  # 3 digits: 1 of 2000 is not "0%"
        warnings.warn(
            f"nuts: {per_chain} of sampling iterations (per chain) hit max_tree_depth="
            f"{options['max_tree_depth']}, so their trajectories stopped before a U-turn: the "
            "draws are more correlated than the sampler intended. Check function-space ESS, or raise "
            "max_tree_depth (each level doubles the cost of a saturated iteration).",
            UserWarning, stacklevel=5,  # the caller of fit (fit -> run -> run_mcmc)
        )


# --------------------------------------------------------------------------------- posterior
def _summary(conv: Mapping[str, np.ndarray]) -> dict[str, float]:
    def stat(fn: Callable, key: str) -> float:
        values = conv[key][np.isfinite(conv[key])]
        return float(fn(values)) if values.size else float("nan")

    return {
        "rhat_max": stat(np.max, "rhat"),
        "ess_bulk_min": stat(np.min, "ess_bulk"),
        "ess_bulk_median": stat(np.median, "ess_bulk"),
        "ess_tail_min": stat(np.min, "ess_tail"),
        "ess_tail_median": stat(np.median, "ess_tail"),
        "num_quantities": int(conv["rhat"].size),
    }


class MCMCPosterior(Posterior):
    r"""Every draw of an MCMC run, grouped by chain.

    Parameters
    ----------
    model : pyrobdl.BayesianMLP
        The model.
    samples : dict
        Site name -> draws ``[chain, draw, *site_shape]`` (constrained space).
    trace : SamplerTrace or None
        Per-iteration sampler statistics.
    **kwargs
        ``method``, ``settings``, ``cost`` and optionally ``diagnostics`` of :class:`Posterior`.

    Notes
    -----
    ``history`` (unless given) is the per-iteration log joint density of the chains' current
    states, averaged over chains, warm-up included: ``trace.log_joint.mean(0)``, length
    ``num_warmup + num_samples`` (the per-chain values are in ``trace.log_joint``).  It plays the
    part the ELBO trace plays for SVI: a rising, then flat, curve shows the chains reaching the
    typical set.

    :meth:`sample` (and so the shared :meth:`Posterior.predict`) is deterministic: the
    ``C * D`` draws are pooled in chain-major order, and ``S`` of them are returned at evenly
    spaced positions :math:`\lfloor i\,CD/S \rfloor` when ``S <= CD`` (a thinned set that
    covers every chain), or cycled, :math:`i \bmod CD`, when ``S > CD``.  ``S = CD`` returns
    every draw once; the ``seed`` argument has no effect.
    """

    def __init__(self, model: Any, samples: Mapping[str, torch.Tensor], trace: SamplerTrace | None = None,
                 **kwargs: Any) -> None:
        if kwargs.get("history") is None and trace is not None and np.size(trace.log_joint):
            kwargs["history"] = np.asarray(trace.log_joint, dtype=float).mean(0)
        super().__init__(model, **kwargs)
        shapes = {tuple(v.shape[:2]) for v in samples.values()}
        if len(shapes) != 1:
            raise ValueError(f"samples must share their [chain, draw] dims, got {sorted(shapes)}")
        self.samples = dict(samples)
        self.trace = trace
        self.num_chains, self.num_draws = shapes.pop()

    def _draw(self, num_samples: int) -> dict[str, torch.Tensor]:
        total = self.num_chains * self.num_draws
        ar = torch.arange(num_samples)
        idx = (ar * total) // num_samples if num_samples <= total else ar % total
        out = {}
        for name, v in self.samples.items():
            idx_dev = idx.to(v.device)
            out[name] = v.reshape(total, *v.shape[2:])[idx_dev]
        return out

    def _state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors = {f"samples/{k}": v for k, v in self.samples.items()}
        extra: dict[str, Any] = {"trace": None}
        if self.trace is not None:
            fields = {f.name: getattr(self.trace, f.name) for f in dataclasses.fields(self.trace)}
            extra["trace"] = {"num_warmup": int(fields.pop("num_warmup")),
                              "superchain_size": int(fields.pop("superchain_size")),
                              "present": sorted(k for k, v in fields.items() if v is not None)}
            tensors.update({f"trace/{k}": torch.from_numpy(np.ascontiguousarray(v))
                            for k, v in fields.items() if v is not None})
        return tensors, extra

    @classmethod
    def _from_state(cls, model: Any, tensors: Mapping[str, torch.Tensor], extra: Mapping[str, Any],
                    common: Mapping[str, Any]) -> MCMCPosterior:
        samples = {k.removeprefix("samples/"): v for k, v in tensors.items() if k.startswith("samples/")}
        trace = None
        if extra.get("trace") is not None:
            names = [f.name for f in dataclasses.fields(SamplerTrace) if f.name not in ("num_warmup", "superchain_size")]
            trace = SamplerTrace(extra["trace"]["num_warmup"], **{
                k: tensors[f"trace/{k}"].cpu().numpy() if k in extra["trace"]["present"] else None for k in names},
                superchain_size=int(extra["trace"].get("superchain_size", 1)))
        return cls(model, samples, trace, **common)

    def _chains(self, num_samples: int) -> dict[str, torch.Tensor]:
        """The stored Markov chains, ``[chain, draw, ...]`` (``num_samples`` is ignored)."""
        return dict(self.samples)

    def _sample_stats(self, num_samples: int) -> dict[str, Any]:
        """Sampling-phase statistics under ArviZ's names, ``[chain, draw]``, aligned with
        :meth:`_chains` (empty when the per-iteration trace is not kept, e.g. thinned draws)."""
        tr = self.trace
        if tr is None or tr.num_steps.shape[1] - tr.num_warmup != self.num_draws:
            return {}
        w = tr.num_warmup
        stats = {
            "diverging": tr.diverging[:, w:],
            "step_size": tr.step_size[:, w:],
            "n_steps": tr.num_steps[:, w:],
            "acceptance_rate": tr.accept_prob[:, w:],
            "lp": tr.log_joint[:, w:],
        }
        if tr.energy is not None:
            stats["energy"] = tr.energy[:, w:]
        if tr.tree_depth is not None:
            stats["tree_depth"] = tr.tree_depth[:, w:]
        return stats

    def function_draws(self, x: Any, chunk: int = 256) -> torch.Tensor:
        """Network outputs at ``x`` for every draw, ``[chain, draw, N, out]`` (chunked over draws).

        ``x`` (``[N, in_features]``, a tensor on any device or an array) is validated and moved to
        the device of the draws; the result lives there too.
        """
        from .._validation import check_inputs

        x = check_inputs(self.model, x).to(self.model.device)
        total = self.num_chains * self.num_draws
        flat = {k: v.reshape(total, *v.shape[2:]) for k, v in self.samples.items()}
        with torch.no_grad():
            f = torch.cat([
                self.model.network({k: v[i : i + chunk] for k, v in flat.items()}, x)
                for i in range(0, total, chunk)
            ])
        return f.reshape(self.num_chains, self.num_draws, *f.shape[1:])

    def function_space_convergence(self, x: Any) -> dict[str, np.ndarray]:
        r"""R-hat and bulk/tail ESS of the predictions at inputs ``x``.

        Regression: the network output :math:`f(x_n)`; classification: the class
        probabilities (logits are not identifiable: adding a constant changes nothing).

        Returns
        -------
        dict
            ``{"rhat", "ess_bulk", "ess_tail"}``, each ``[N, out]``.
        """
        f = self.function_draws(x)
        if self.model.likelihood.task == "classification":
            f = torch.softmax(f, dim=-1)
        return convergence(f)  # on the posterior's device, in float64

    def weight_space_convergence(self) -> dict[str, np.ndarray]:
        """R-hat and bulk/tail ESS of every scalar weight and latent, flattened in site order."""
        flat = torch.cat([v.reshape(self.num_chains, self.num_draws, -1) for v in self.samples.values()], -1)
        return convergence(flat)

    def convergence_summary(self, x: torch.Tensor) -> dict[str, Any]:
        """Summaries (max R-hat, min/median ESS) in weight space, function space at ``x``, and per
        likelihood latent: the ``weight_space``/``function_space``/``latents`` diagnostics."""
        out: dict[str, Any] = {
            "weight_space": _summary(self.weight_space_convergence()),
            "function_space": {**_summary(self.function_space_convergence(x)), "num_points": int(x.shape[0])},
        }
        latents = {}
        for name in self.model.likelihood.latent_distributions(self.model.device):
            conv = convergence(self.samples[name])
            latents[name] = {k: float(v) for k, v in conv.items()}
        out["latents"] = latents
        return out

    def certify(self, x: Any, criteria: Any = None) -> Any:
        """Certify the chains as a reference posterior at inputs ``x``; store and return the result.

        Parameters
        ----------
        x : array-like
            Inputs ``[N, in_features]`` at which the function draws are diagnosed.
        criteria : pyrobdl.diagnostics.CertificationCriteria, optional
            Default: the criteria of the fit's own certification (nested R-hat for ``chees``
            chains started in superchains), else posteriordb's thresholds with split R-hat.

        Returns
        -------
        pyrobdl.diagnostics.Certification
            Also kept in :attr:`certification` (see :func:`pyrobdl.diagnostics.certify`).
        """
        from ..diagnostics.certification import certify

        if criteria is None and getattr(self, "certification", None) is not None:
            criteria = self.certification.criteria
        self.certification = certify(self, x, criteria)
        return self.certification


def _register(name: str, options: dict[str, Any], summary: str) -> None:
    def run(model: Any, x: torch.Tensor, y: torch.Tensor, opts: Mapping[str, Any], progress: bool) -> Posterior:
        return run_mcmc(model, x, y, opts, progress, method=name)

    register_method(Method(name, options, run, summary, check_model=_check_model))


_register("nuts", NUTS_OPTIONS, "No-U-Turn Sampler, Pyro's NUTS kernel (Hoffman & Gelman 2014); reference posteriors")
_register("hmc", HMC_OPTIONS, "Hamiltonian Monte Carlo with a fixed trajectory length, Pyro's HMC kernel (Neal 2011)")
