"""The run of method "chees": its iterations (transition, replica exchange, warm-up adaptation),
the extension until the chains are certified, and the checkpoint written along the way."""

from __future__ import annotations

import math
import os
import time
import warnings
from typing import Any, Mapping

import numpy as np
import torch

from ...diagnostics.certification import certification_points, given_inputs
from ...flat import FlatLogJoint
from ...posterior import Posterior
from ..checkpoint import CheckpointError, SamplerCheckpoint, run_identity
from ..mcmc import MCMCPosterior
from .adaptation import (DENSE_WINDOW_LIMIT, QUARTER_PERIOD_ADAPTATIONS, _DualAveraging, chees_gradient, halton,
                         quarter_period)
from .kernel import _compile, _harmonic_mean
from .options import _LATER_OPTIONS, _NOT_IDENTITY
from .result import _result
from .state import _Run, new_window, snapshot
from .tempering import _swap, respace_ladder


def run_chees(model: Any, x: torch.Tensor, y: torch.Tensor, options: Mapping[str, Any], progress: bool) -> Posterior:
    """Run ``num_chains`` lock-step chains of jittered HMC with ChEES adaptation (``fit``'s ``run``).

    Parameters
    ----------
    model : pyrobdl.BayesianMLP
        The model, on the data's device.
    x, y : torch.Tensor
        Validated training data.
    options : Mapping
        Every option of :data:`CHEES_OPTIONS`, plus ``seed``.
    progress : bool
        Show a progress bar over iterations.

    Returns
    -------
    MCMCPosterior
        K chains of ``num_samples`` draws, a :class:`SamplerTrace`, diagnostics (adapted step
        size, trajectory length and mass matrix summary, divergences, steps-cap hits, E-BFMI,
        function-space convergence) and the certification at the first ``diagnostic_points``
        training inputs.

    Raises
    ------
    CheckpointError
        With ``checkpoint`` set: the file belongs to a run of another identity (the message
        names every difference), cannot be read, or is in use by another process; raised
        before any gradient is evaluated.

    Notes
    -----
    With ``checkpoint`` a file path, the whole state of the run (chains, random generators,
    adaptation, the statistics and draws so far) is written there atomically every
    ``checkpoint_every_s`` seconds and after the last iteration; a run given an existing
    checkpoint of the same identity (model, data, seed and every option that shapes the chains)
    continues from it, and gives the same draws, to the bit, as the run never interrupted
    (:mod:`pyrobdl.inference.checkpoint`).  A larger ``num_samples`` than the checkpoint's
    extends a run: the result equals a run started with that ``num_samples``.
    """
    path = options["checkpoint"]
    if path is None:
        return _run_chees(model, x, y, options, progress, None)
    options = {**options, "checkpoint": os.fspath(path)}
    identity = run_identity(model, x, y, options, exclude=_NOT_IDENTITY + _defaulted(options))
    with SamplerCheckpoint(path, identity, options["checkpoint_every_s"]) as ckpt:
        return _run_chees(model, x, y, options, progress, ckpt)


def _defaulted(options: Mapping[str, Any]) -> tuple[str, ...]:
    """The options added after checkpoints were first written that sit at their default (which is
    the behaviour before them): left out of the identity, so those checkpoints still resume."""
    return tuple(name for name, default in _LATER_OPTIONS.items() if options.get(name, default) == default)


def _run_chees(model: Any, x: torch.Tensor, y: torch.Tensor, options: Mapping[str, Any], progress: bool,
               ckpt: SamplerCheckpoint | None) -> Posterior:
    """:func:`run_chees` with its checkpoint (None: none) open."""
    device = x.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    clock = (time.perf_counter(), time.process_time())
    gen = torch.Generator(device=device)
    gen.manual_seed(int(options["seed"]))
    saved = ckpt.load(device) if ckpt is not None else None
    draws = _draws(options, saved, ckpt)
    # the inputs the chains are certified at (and, with max_num_samples, extended until they pass)
    points, recorded_points = certification_points(model, x, options)
    lj = FlatLogJoint(model, x, y, chunk_size=options["chunk_size"])
    if options["trajectory_adaptation"] in QUARTER_PERIOD_ADAPTATIONS and lj.size > DENSE_WINDOW_LIMIT:
        raise ValueError(f"trajectory_adaptation={options['trajectory_adaptation']!r} keeps a dense [P, P] window "
                         f"covariance; this model has P = {lj.size} > {DENSE_WINDOW_LIMIT} parameters: use 'free', "
                         "'projected' or 'anchored'")
    compile_s = _compile(lj, options["num_chains"], options["compile"])
    run = _Run(model, x, options, lj, gen, saved, draws, clock, compile_s)
    saved = None  # the loaded tensors are copied; free them
    run.points, run.recorded_points = points, recorded_points
    # what the posterior records of its options: the certification inputs by their digest
    run.settings = {**options, "certify_inputs": given_inputs(recorded_points)}
    posterior = _sample(run, ckpt, progress)
    diagnostics = posterior.diagnostics
    diagnostics.update(posterior.convergence_summary(points))
    if run.max_draws is not None:
        diagnostics["extensions"] = run.extensions
    _warn_shortened(run, diagnostics["trajectory_length_capped"])
    return posterior


def _draws(options: Mapping[str, Any], saved: Mapping[str, Any] | None, ckpt: SamplerCheckpoint | None) -> int:
    """Draws per chain: ``num_samples``, or the checkpoint's larger number when an earlier process
    extended the run towards ``max_num_samples``; a checkpoint of more draws than both is refused."""
    draws, max_draws = options["num_samples"], options["max_num_samples"]
    if saved is None or not saved["num_samples"] > draws:
        return draws
    if max_draws is not None and saved["num_samples"] <= max_draws:
        return int(saved["num_samples"])  # extended towards max_num_samples by an earlier process
    raise CheckpointError(
        f"checkpoint {ckpt.path} holds a run of num_samples={saved['num_samples']}; a resumed run can "
        f"extend it, not shorten it (num_samples={draws}, max_num_samples={max_draws} now): pass "
        f"num_samples or max_num_samples >= {saved['num_samples']}")


def _sample(run: _Run, ckpt: SamplerCheckpoint | None, progress: bool) -> MCMCPosterior:
    """Iterate to ``num_samples`` draws per chain, saving the checkpoint when it is due; with
    ``max_num_samples``, go on by ``extend_by`` draws until the chains are certified or have
    ``max_num_samples``.  The posterior of the last certification."""
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=run.total, initial=run.first, desc="chees", leave=False)
    while True:
        for it in range(run.first, run.total):
            n = _iterate(run, it)
            if bar is not None:
                bar.update(1)
                if it % 10 == 0:
                    bar.set_postfix(step=f"{run.step:.3g}", T=f"{run.trajectory_length:.3g}", steps=n)
            if ckpt is not None and ckpt.due(final=it == run.total - 1):
                ckpt.save(snapshot(run, it + 1))
        posterior = _result(run, ckpt)
        if run.max_draws is None or not _extend(run, posterior):
            break
        if bar is not None:
            bar.total = run.total
            bar.refresh()
    if bar is not None:
        bar.close()
    return posterior


def _iterate(run: _Run, it: int) -> int:
    """Iteration ``it`` of every chain: a jittered HMC transition, an exchange between the rungs,
    its statistics, and the adaptation (warm-up) or the draw (sampling).  The leapfrog steps taken."""
    run.halton_index += 1
    h = _jitter(run)
    if it < run.warm:  # warm-up trajectories shortened by warmup_trajectory_scale (ChEES sees the shorter one)
        h *= run.options["warmup_trajectory_scale"]
    wanted = math.ceil(h * run.trajectory_length / run.step)
    n = max(1, min(run.cap, wanted))
    run.cap_hits[it] = wanted > run.cap
    theta0, proposal, p1, accept_prob, diverging, energy = run.sampler.transition(
        run.step if run.tempered is None else run.step_rows, n)
    if run.tempered is not None:
        _exchange(run, it)
    kept = run.kept
    run.step_row[it], run.num_steps_row[it], run.length_row[it] = run.step, n, run.trajectory_length
    run.rows["accept_prob"][it] = accept_prob[:kept]
    run.rows["energy"][it] = energy[:kept]
    run.rows["log_joint"][it] = run.sampler.logp[:kept]
    run.diverging_rows[it] = diverging[:kept]
    if it < run.warm:
        _adapt(run, it, h, (theta0, proposal, p1), accept_prob, diverging)
        _restart_stuck(run, it)
    else:
        run.samples[it - run.warm] = run.sampler.theta[:kept]
    return n


def _jitter(run: _Run) -> float:
    """This iteration's jitter h in (0, 1] of the trajectory length (option ``jitter``)."""
    jitter = run.options["jitter"]
    if jitter == "halton":
        return halton(run.halton_index)
    if jitter == "uniform":
        return float(run.rng.uniform())
    return 1.0


def _exchange(run: _Run, it: int) -> None:
    """Replica exchange between the rungs of even (odd) lower index at even (odd) ``it``; the
    replicas' journeys and the acceptance of every proposed pair are recorded."""
    lower, prob, perm = _swap(run.sampler, run.tempered, run.rungs, it % 2, run.gen)
    phase = int(it >= run.warm)
    run.tracker.update(perm, phase)
    run.replica_rows[it] = run.tracker.replica[: run.kept]
    in_ladder_window = bool(run.ladder_ends) and run.ladder_start <= it < run.warm
    for j in (phase, 2) if in_ladder_window else (phase,):
        run.swap_sum[j, lower] += prob.double().sum(-1)
        run.swap_count[j, it % 2 : run.rungs - 1 : 2] += run.kept  # the pairs proposed: known from the parity


def _adapt(run: _Run, it: int, h: float, trajectory: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
           accept_prob: torch.Tensor, diverging: torch.Tensor) -> None:
    """Warm-up iteration ``it``'s adaptation: each rung's step size, the trajectory length, the
    mass-matrix window; the ladder, the metric and the warm-up's end where they are due.
    ``trajectory``: the states at its start, its end points and their momenta."""
    kept = run.kept
    weights = torch.where(diverging, torch.zeros_like(accept_prob), accept_prob)
    # each rung's step size on its own chains' acceptance (one rung without tempering;
    # measured on yacht, one step adapted on all rungs let the beta = 1 rung diverge)
    for r in range(run.rungs):
        ap, dv = accept_prob[r * kept : (r + 1) * kept], diverging[r * kept : (r + 1) * kept]
        run.steps[r] = run.das[r].update(_harmonic_mean(ap[~dv]) if bool((~dv).any()) else 0.0, run.target)
    run.step = run.steps[0]
    # the trajectory length is that of the posterior's rung (the number of steps is shared)
    inv_mass = run.sampler.inv_mass[:kept] if run.sampler.inv_mass.dim() == 2 else run.sampler.inv_mass
    theta0, proposal, p1 = trajectory
    g = chees_gradient(theta0[:kept], proposal[:kept], p1[:kept], inv_mass, weights[:kept], h,
                       run.trajectory_length)
    if math.isfinite(g):
        _update_trajectory(run, g)
    run.trajectory_length = run.clamped_length()
    if run.windows and it >= run.window_start:
        run.window.add(run.sampler.theta)
    if (it + 1) in run.ladder_ends:
        _respace(run, it)
    if (it + 1) in run.windows:
        _end_window(run, it)
    if it == run.warm - 1:
        continuous = run.options["step_size_adaptation"] == "continuous"
        run.steps = [math.exp(d.log_step_ma if continuous else d.log_step_bar) for d in run.das]
        run.step = run.steps[0]
        run.wanted_length = math.exp(run.traj.log_t_avg)
        run.trajectory_length = run.clamped_length()
    if run.tempered is not None:
        run.step_rows = run.rung_rows(run.steps).unsqueeze(-1)


def _restart_stuck(run: _Run, it: int) -> None:
    """Every ``restart_after_divergences`` (W) warm-up iterations, move each chain whose last W
    transitions all diverged to the state of another chain drawn at random from those that did not
    diverge in that time (of its own superchain when it has one; ``run.gen``'s stream).

    Such a chain sits where the adapted step cannot integrate: the step size adapts on the chains
    that do not diverge (as BlackJAX's ChEES), so nothing brings it out, and from there on it adds
    only divergences and a frozen draw (measured on the benchmark BNN at K = 128: one chain of 128
    in 2 of 3 seeds, stuck from warm-up iteration ~100 on, the certificate failed).  Warm-up states
    are not draws, so moving one leaves the sampling kernel and its target unchanged; a region the
    adapted step cannot integrate still shows in the sampling phase's divergences, which the
    certification counts.  Off with W = 0, and with ``temperatures`` (replica exchange moves such a
    chain instead)."""
    w = run.options["restart_after_divergences"]
    if not w or run.tempered is not None or (it + 1) % w:
        return
    recent = run.diverging_rows[it + 1 - w : it + 1]
    stuck, calm = recent.all(0), ~recent.any(0)
    if not bool(stuck.any()):
        return
    if not bool(calm.any()):
        return  # every chain diverged: the step size is wrong for all, no chain is stuck alone
    m, sampler = run.options["superchain_size"], run.sampler
    for c in torch.nonzero(stuck).flatten().tolist():
        first = c - c % m  # its superchain: chains first .. first + m - 1
        donors = torch.nonzero(calm[first : first + m]).flatten() + first
        if donors.numel() == 0:
            donors = torch.nonzero(calm).flatten()
        d = int(donors[torch.randint(donors.numel(), (1,), generator=run.gen, device=run.gen.device)])
        sampler.theta[c], sampler.logp[c], sampler.grad[c] = sampler.theta[d], sampler.logp[d], sampler.grad[d]
        run.restarts.append({"iteration": it, "chain": c, "from": d})


def _update_trajectory(run: _Run, gradient: float) -> None:
    """One Adam step of log T up the ChEES ``gradient``, kept within reach of the consumed T as
    option ``trajectory_adaptation`` asks: ``"anchored"`` restarts log T from the log of the T
    consumed this iteration (BlackJAX's scheme: the moving average then moves by at most its weight
    times one clipped update), ``"projected"`` clips it to [log step, log(max_num_steps * step)]
    after the step, ``"free"`` leaves it (the iterate can then drift far past what the steps cap
    lets the chains consume, without feedback); ``"ceiling"`` and ``"eigen"`` clip it to at most the
    last window's quarter period (:func:`~pyrobdl.inference.chees.adaptation.quarter_period`)."""
    mode, traj = run.options["trajectory_adaptation"], run.traj
    if mode == "anchored":
        traj.log_t = math.log(run.trajectory_length)
    traj.update(gradient)
    if mode == "projected":
        traj.log_t = min(max(traj.log_t, math.log(run.step)), math.log(run.cap * run.step))
    elif mode in QUARTER_PERIOD_ADAPTATIONS and math.isfinite(run.ceiling):
        # not also onto the steps' cap: early in the warm-up a small step would pull log T down with
        # it (measured on the quickstart's gap data: T collapsed to 0.02, not certified)
        traj.log_t = min(traj.log_t, math.log(run.ceiling))


def _respace(run: _Run, it: int) -> None:
    """The inner rungs move to equalise the exchange rejection measured since the last move; every
    row's tempered log joint and gradient are recomputed (counted)."""
    rates = run.swap_sum[2].cpu().numpy() / np.maximum(run.swap_count[2], 1)
    run.betas = respace_ladder(run.betas, 1.0 - rates)
    run.tempered.beta = run.rung_rows(run.betas)
    sampler = run.sampler
    sampler.logp, sampler.grad = run.tempered.value_and_grad(sampler.theta)
    sampler.gradients += run.k
    run.swap_sum[2].zero_()
    run.swap_count[2] = 0
    run.ladder_start = it + 1


def _end_window(run: _Run, it: int) -> None:
    """The end of a mass-matrix window: the new metric, a fresh Adam state of log T, and with
    ``step_size_adaptation="windowed"`` a new step-size search in it and fresh dual averaging
    (``"continuous"``: the dual averaging goes on in the new metric)."""
    sampler = run.sampler
    sampler.inv_mass = run.window.variance().to(run.dtype)
    if run.window.outer:
        run.ceiling = quarter_period(run.window, sampler.inv_mass)
    run.window = new_window(run.options, run.rungs)
    run.window_start = it + 1
    if run.options["step_size_adaptation"] == "windowed":
        before = sampler.gradients
        run.step = run.steps[0] = sampler.find_step_size(run.step, rows=run.kept)
        run.search_grads += sampler.gradients - before
        run.das = [_DualAveraging.start(s) for s in run.steps]
    # a fresh Adam state in the new metric: the second moment otherwise remembers the
    # huge gradients of the first iterations, when chains fall from their prior draws,
    # and freezes log T (measured with a learned noise precision: T stuck at 1.05)
    run.traj.v, run.traj.t = 0.0, 0
    run.trajectory_length = run.clamped_length()


def _extend(run: _Run, posterior: MCMCPosterior) -> bool:
    """Record ``posterior``'s certification; when it failed and the chains have fewer than
    ``max_num_samples`` draws, make room for ``extend_by`` more (every chain goes on where it
    stands, so the draws are those of a run started with the larger ``num_samples``) and return
    True."""
    cert = posterior.certification
    run.extensions.append({"num_samples": run.draws, "certified": bool(cert.passed), "failures": list(cert.failures),
                           "rhat_split_max": cert.rhat_split_max, "rhat_nested_max": cert.rhat_nested_max})
    if cert.passed or run.draws >= run.max_draws:
        return False
    add = min(int(run.options["extend_by"]), run.max_draws - run.draws)
    run.rows = {name: _grow(v, add) for name, v in run.rows.items()}
    run.diverging_rows, run.samples = _grow(run.diverging_rows, add), _grow(run.samples, add)
    if run.replica_rows is not None:
        run.replica_rows = _grow(run.replica_rows, add)
    run.step_row, run.length_row, run.num_steps_row, run.cap_hits = (
        np.concatenate([a, np.zeros(add, dtype=a.dtype)])
        for a in (run.step_row, run.length_row, run.num_steps_row, run.cap_hits))
    run.first, run.draws, run.total = run.total, run.draws + add, run.total + add
    return True


def _grow(t: torch.Tensor, add: int) -> torch.Tensor:
    """``t`` with ``add`` rows of zeros appended along its first dimension."""
    return torch.cat([t, t.new_zeros((add, *t.shape[1:]))])


def _warn_shortened(run: _Run, capped_length: bool) -> None:
    """Warn when the adapted trajectory length, or some sampling trajectories, needed more than
    ``max_num_steps`` leapfrog steps (attributed, as before the split, to ``run_chees``'s caller)."""
    cap, step = run.cap, run.step
    if capped_length:
        warnings.warn(
            f"chees: the adapted trajectory length {run.wanted_length:.3g} needs more than max_num_steps={cap} "
            f"leapfrog steps of the adapted step size {step:.3g}, so it was cut to {cap * step:.3g}: the "
            "chains move less per iteration than the adaptation asked for; raise max_num_steps (cost) or "
            "expect lower ESS per iteration", UserWarning, stacklevel=4)
    if run.cap_hits[run.warm:].any():
        warnings.warn(
            f"chees: the trajectory needed more than max_num_steps={cap} leapfrog steps in "
            f"{int(run.cap_hits[run.warm:].sum())} of {run.draws} sampling iterations, so those trajectories were "
            "shortened; raise max_num_steps or check the adapted step size", UserWarning, stacklevel=4)
