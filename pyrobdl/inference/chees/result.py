"""The chains of a run of method "chees" as an :class:`~pyrobdl.inference.mcmc.MCMCPosterior`: its
trace, cost, diagnostics (adaptation, replica exchange, divergences, E-BFMI) and certification."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Mapping

import numpy as np
import torch

from ...diagnostics.certification import attach_certification, ebfmi, reference_criteria
from ...posterior import Cost
from ..checkpoint import SamplerCheckpoint
from ..mcmc import MCMCPosterior, SamplerTrace
from ..svi import _peak_memory
from .state import _Run


def _result(run: _Run, ckpt: SamplerCheckpoint | None) -> MCMCPosterior:
    """The chains so far as the posterior, with its diagnostics and certification (not yet the
    convergence summary: its weight-space part costs ~10x the certification)."""
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)
    # every process's seconds: a resumed run costs what all its parts cost (work lost after the
    # last checkpoint of a killed process is not counted)
    wall = run.elapsed[0] + time.perf_counter() - run.clock[0]
    cpu = run.elapsed[1] + time.process_time() - run.clock[1]
    stats = {name: v.t().cpu().numpy() for name, v in run.rows.items()}
    diverging_row = run.diverging_rows.t().cpu().numpy()

    site_draws = {name: v.transpose(0, 1).contiguous() for name, v in run.lj.layout.unpack(run.samples).items()}
    trace = SamplerTrace(
        num_warmup=run.warm, num_steps=np.tile(run.num_steps_row, (run.kept, 1)),
        step_size=np.tile(run.step_row, (run.kept, 1)), accept_prob=stats["accept_prob"], diverging=diverging_row,
        tree_depth=None, log_joint=stats["log_joint"], energy=stats["energy"],
        superchain_size=run.options["superchain_size"],
    )
    gradients = run.sampler.gradients + run.map_grads
    cost = Cost(wall_time_s=wall, gradient_evaluations=int(gradients), epochs=float(gradients),
                peak_memory_bytes=_peak_memory(run.device), device=str(run.device), cpu_time_s=cpu)
    posterior = MCMCPosterior(run.model, site_draws, trace, method="chees", settings=run.settings, cost=cost)
    diagnostics = _tempering_diagnostics(run)
    diagnostics.update(_sampler_diagnostics(run, stats, diverging_row, gradients, cpu, ckpt))
    posterior.diagnostics = diagnostics
    posterior.adaptation = {"step_size": run.step_row, "trajectory_length": run.length_row,
                            "num_steps": run.num_steps_row}
    if run.replica_rows is not None:
        # [kept chains, iterations]: the replica (0 .. K-1, its starting row) in each beta = 1 slot
        posterior.adaptation["replica"] = run.replica_rows.t().cpu().numpy()
    _certify(posterior, run.points, run.options["certify_rhat"], run.recorded_points)
    return posterior


def _tempering_diagnostics(run: _Run) -> dict[str, Any]:
    """The rungs, their step sizes, and how the replicas moved between them."""
    sums = run.swap_sum.cpu().numpy()
    count = run.swap_count
    rates = [(sums[0] + sums[1]) / np.maximum(count[0] + count[1], 1), sums[1] / np.maximum(count[1], 1)]
    tracker = run.tracker
    counts = tracker.counts.cpu().numpy() if tracker is not None else np.zeros((2, 2), dtype=np.int64)
    return {
        "num_chains": run.kept,
        "num_chains_all_rungs": run.k,
        "temperatures": run.betas,
        "temperatures_initial": run.initial_betas,
        "step_size_rungs": [float(v) for v in run.steps],
        # mean acceptance probability of the exchanges proposed between rungs r and r + 1, over the
        # whole run and over the sampling phase alone (the ladder's final form when it is adapted)
        "swap_accept_prob": [float(v) for v in rates[0]],
        "swap_accept_prob_sampling": [float(v) for v in rates[1]],
        # replicas that went coldest -> hottest -> coldest, and states reaching the beta = 1 rung
        # after a visit to the hottest one, in the sampling phase (and in warm-up)
        "round_trips": int(counts[1, 0]),
        "round_trips_warmup": int(counts[0, 0]),
        "hot_arrivals": int(counts[1, 1]),
        "hot_arrivals_warmup": int(counts[0, 1]),
        # how many rungs each replica spanned in the sampling phase: median and largest
        "ladder_span": ({"median": float(tracker.span.double().median()), "max": int(tracker.span.max())}
                        if tracker is not None else {"median": 0.0, "max": 0}),
    }


def _sampler_diagnostics(run: _Run, stats: Mapping[str, np.ndarray], diverging_row: np.ndarray, gradients: int,
                         cpu: float, ckpt: SamplerCheckpoint | None) -> dict[str, Any]:
    """Adapted step size, trajectory length and mass matrix; divergences, steps-cap hits, the
    gradients spent, checkpoints, E-BFMI."""
    warm, leapfrog, inv_mass = run.warm, run.num_steps_row, run.sampler.inv_mass
    return {
        "num_warmup": warm,
        "num_samples": run.draws,
        "step_size": float(run.step),
        "trajectory_length": float(run.trajectory_length),
        "mean_num_steps_sampling": float(leapfrog[warm:].mean()) if run.draws else 0.0,
        "inverse_mass_matrix": {"min": float(inv_mass.min()), "median": float(inv_mass.median()),
                                "max": float(inv_mass.max())},
        "divergences": [int(d) for d in diverging_row[:, warm:].sum(1)],
        "divergences_warmup": int(diverging_row[:, :warm].sum()),
        # chains moved off a run of restart_after_divergences divergent warm-up transitions
        "warmup_restarts": [dict(r) for r in run.restarts],
        "accept_prob": [float(a) for a in stats["accept_prob"][:, warm:].mean(1)],
        "num_steps_cap_hits_warmup": int(run.cap_hits[:warm].sum()),
        "num_steps_cap_hits_sampling": int(run.cap_hits[warm:].sum()),
        "leapfrog_steps_warmup": int(leapfrog[:warm].sum()),
        "leapfrog_steps_sampling": int(leapfrog[warm:].sum()),
        "chain_gradients": int(gradients),
        "step_size_search_chain_gradients": int(run.search_grads),
        "map_chain_gradients": int(run.map_grads),
        "cpu_time_s": cpu,
        "compile_s": float(run.compile_s + run.elapsed[2]),
        "kernel": run.lj.kernel,  # the log joint's kernel: "fused", "inductor" or "eager" (FlatLogJoint.kernel)
        # iterations at which this run was resumed from its checkpoint, and writes of it
        "resumed_at": run.resumed_at,
        "checkpoint_saves": ckpt.saves if ckpt is not None else 0,
        "ebfmi": [float(e) for e in ebfmi(stats["energy"][:, warm:])],
        "trajectory_length_wanted": float(run.wanted_length),
        "trajectory_length_capped": bool(run.wanted_length > run.cap * run.step * (1 + 1e-12)),
        # trajectory_adaptation "ceiling" / "eigen": the last window's slowest quarter period
        "trajectory_quarter_period": float(run.ceiling) if math.isfinite(run.ceiling) else None,
    }


def _certify(posterior: MCMCPosterior, x_points: torch.Tensor, rhat: str, inputs: Mapping[str, Any]) -> None:
    """Attach the certification against :data:`~pyrobdl.diagnostics.REFERENCE_CRITERIA` with the
    ``certify_rhat`` option's R-hat; ``"auto"``: split and nested R-hat over the superchains the
    trace records when the chains were started in superchains, else split R-hat alone
    (:func:`~pyrobdl.diagnostics.certification.reference_criteria`)."""
    criteria = reference_criteria(posterior.trace.superchain_size)
    if rhat != "auto":
        criteria = dataclasses.replace(criteria, rhat=rhat)
    attach_certification(posterior, x_points, criteria, inputs=inputs)
