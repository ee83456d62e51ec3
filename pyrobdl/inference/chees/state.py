"""What a run of method "chees" carries from one iteration to the next (:class:`_Run`), how it
starts (fresh, or from a checkpoint's :func:`snapshot`), and the snapshot a checkpoint saves."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Any, Mapping

import numpy as np
import torch

from ...flat import FlatLogJoint
from .adaptation import (QUARTER_PERIOD_ADAPTATIONS, WindowVariance, _DualAveraging, _TrajectoryAdam, _window_start,
                         warmup_windows)
from .kernel import _Sampler
from .starts import _starting_points
from .tempering import _ReplicaTracker, _rung_rows, _Tempered

# the tracker's tensors a checkpoint saves
_TRACKER = ("replica", "label", "counts", "lo", "hi")
# the per-iteration records on the host, saved and restored as tensors
_HOST_ROWS = ("step_row", "length_row", "num_steps_row", "cap_hits")


class _Run:
    """The state of one run: chains, adaptation, records of every iteration, and its bookkeeping.

    Built in the order the original single function built it, so the random streams are drawn in
    the same order: the starting points, the first step-size search, then the iterations.

    Parameters
    ----------
    model, x : the model and the training inputs (their device and dtype are the run's).
    options : Mapping
        Every option of :data:`~pyrobdl.inference.chees.CHEES_OPTIONS`, plus ``seed``.
    lj : FlatLogJoint
        The (possibly compiled) flat log joint.
    gen : torch.Generator
        The seeded generator of the chains.
    saved : Mapping or None
        A checkpoint's :func:`snapshot` to resume from.
    draws : int
        Draws per chain (a checkpoint's larger ``num_samples`` when it was extended).
    clock : tuple of float
        This process's start: ``time.perf_counter()`` and ``time.process_time()``.
    compile_s : float
        This process's seconds spent compiling ``lj``.
    """

    def __init__(self, model: Any, x: torch.Tensor, options: Mapping[str, Any], lj: FlatLogJoint,
                 gen: torch.Generator, saved: Mapping[str, Any] | None, draws: int, clock: tuple[float, float],
                 compile_s: float) -> None:
        self.model, self.options, self.lj, self.gen = model, options, lj, gen
        self.clock, self.compile_s = clock, compile_s
        self.device, self.dtype = x.device, x.dtype
        self.k, self.warm, self.draws = options["num_chains"], options["num_warmup"], draws
        self.max_draws = options["max_num_samples"]
        # set by the caller: the inputs the chains are certified at, as tensors and as recorded,
        # and the options as the posterior records them
        self.points: torch.Tensor | None = None
        self.recorded_points: Mapping[str, Any] | None = None
        self.settings: dict[str, Any] = dict(options)
        self.total = self.warm + self.draws
        self._start_chains(saved)
        self._start_adaptation(saved)
        self._start_records()
        self.rng = np.random.default_rng(int(options["seed"]))
        self.first, self.elapsed = 0, (0.0, 0.0, 0.0)  # wall, CPU and compile seconds of earlier processes
        self.resumed_at: list[int] = []
        # one row per certification of a run with max_num_samples: draws per chain, passed, failures
        self.extensions: list[dict[str, Any]] = []
        # warm-up chains moved off a run of divergences (option restart_after_divergences)
        self.restarts: list[dict[str, int]] = []
        if saved is not None:
            _restore(self, saved)

    def _start_chains(self, saved: Mapping[str, Any] | None) -> None:
        """Starting points, the rungs of replica exchange and the sampler."""
        options, k = self.options, self.k
        if saved is None:
            theta, self.map_grads = _starting_points(self.model, self.lj, k // options["superchain_size"], options,
                                                     self.gen)
            # superchains (Margossian et al. 2024): chains c*M .. (c+1)*M - 1 share start c, so that
            # nested R-hat can tell whether they have forgotten it
            theta = theta.repeat_interleave(options["superchain_size"], dim=0)
        else:
            theta, self.map_grads = saved["theta"], int(saved["map_grads"])
        # replica exchange: rung r is rows r*C .. (r+1)*C - 1 at inverse temperature beta_r; rung 0
        # (beta = 1) is the posterior and the only one kept
        self.betas = [float(b) for b in options["temperatures"]] if options["temperatures"] is not None else [1.0]
        self.rungs = len(self.betas)
        self.kept = k // self.rungs
        self.tempered = None
        if self.rungs > 1:
            self.tempered = _Tempered(self.lj, _rung_rows(self.betas, self.kept, self.dtype, self.device))
        self.sampler = _Sampler(self.tempered if self.tempered is not None else self.lj, theta, self.gen,
                                float(options["divergence_threshold"]),
                                (saved["logp"], saved["grad"]) if saved is not None else None)
        # exchange acceptance summed per pair: [warm-up, sampling, current ladder window]
        self.swap_sum = torch.zeros(3, max(self.rungs - 1, 0), dtype=torch.float64, device=self.device)
        self.swap_count = np.zeros((3, max(self.rungs - 1, 0)), dtype=np.int64)
        self.tracker = _ReplicaTracker(k, self.rungs, self.device) if self.tempered is not None else None
        self.initial_betas = list(self.betas)
        self.ladder_ends = (set(warmup_windows(self.warm)) if options["adapt_temperatures"] and self.rungs > 2
                            else set())
        self.ladder_start = _window_start(self.warm)

    def _start_adaptation(self, saved: Mapping[str, Any] | None) -> None:
        """Step sizes (searched when not given), trajectory length and the mass-matrix windows."""
        options = self.options
        self.target, self.cap = float(options["target_accept_prob"]), int(options["max_num_steps"])
        step = options["step_size"]
        self.search_grads = 0
        if step is None and saved is None:
            before = self.sampler.gradients
            step = self.sampler.find_step_size(0.1, rows=self.kept)
            self.search_grads += self.sampler.gradients - before
        self.step = float(saved["step"]) if saved is not None else float(step)
        # one step size per rung, each adapted on its own rung's acceptance (in its own metric the
        # beta = 0.1 rung of yacht wants a step 60x the beta = 1 rung's: measured); rung 0's is `step`,
        # the posterior's, which also sets the number of leapfrog steps
        self.steps = [self.step] * self.rungs
        self.das = [_DualAveraging.start(self.step) for _ in self.steps]
        self.step_rows = self.rung_rows(self.steps).unsqueeze(-1) if self.tempered is not None else None
        self.traj = _TrajectoryAdam(log_t=math.log(options["init_trajectory_length"]),
                                    lr=float(options["trajectory_lr"]))
        self.traj.log_t_avg = self.traj.log_t
        self.windows = set(warmup_windows(self.warm)) if options["adapt_mass_matrix"] else set()
        self.window_start = _window_start(self.warm) if self.windows else 0
        self.window = new_window(options, self.rungs)
        # the slowest direction's quarter period of the last window (trajectory_adaptation "ceiling"
        # and "eigen"), unbounded before the first window ends
        self.ceiling = math.inf
        self.halton_index = 0
        self.trajectory_length = self.wanted_length = math.exp(self.traj.log_t)

    def _start_records(self) -> None:
        """Per-iteration statistics and the draws.  They stay on the device until the end (no host
        round trip per iteration in the sampling phase; warm-up needs one scalar sync per iteration
        for the adaptation)."""
        total, kept, device = self.total, self.kept, self.device
        self.rows = {name: torch.zeros(total, kept, dtype=torch.float64, device=device)
                     for name in ("accept_prob", "energy", "log_joint")}
        self.diverging_rows = torch.zeros(total, kept, dtype=torch.bool, device=device)
        self.replica_rows = (torch.zeros(total, kept, dtype=torch.int64, device=device) if self.tracker is not None
                             else None)
        self.step_row = np.zeros(total)
        self.length_row = np.zeros(total)  # the unjittered trajectory length T of each iteration
        self.num_steps_row = np.zeros(total, dtype=np.int64)
        self.cap_hits = np.zeros(total, dtype=bool)
        self.samples = torch.empty(self.draws, kept, self.lj.size, dtype=self.dtype, device=device)

    def rung_rows(self, values: list[float]) -> torch.Tensor:
        """``[K]``: each rung's value (inverse temperature, step size) for its rows."""
        return _rung_rows(values, self.kept, self.dtype, self.device)

    def clamped_length(self) -> float:
        """The moving average of the adapted T (``"eigen"``: the ceiling once there is one), at least
        one step and at most ``max_num_steps`` steps and the ceiling."""
        wanted = math.exp(self.traj.log_t_avg)
        if self.options["trajectory_adaptation"] == "eigen" and math.isfinite(self.ceiling):
            wanted = self.ceiling
        return min(max(min(wanted, self.ceiling), self.step), self.cap * self.step)


def new_window(options: Mapping[str, Any], rungs: int) -> WindowVariance:
    """An empty mass-matrix window; with the dense second moment where the trajectory needs it."""
    return WindowVariance(options["mass_matrix"], groups=rungs,
                          outer=options["trajectory_adaptation"] in QUARTER_PERIOD_ADAPTATIONS)


def _restore(run: _Run, saved: Mapping[str, Any]) -> None:
    """The random streams, the adaptation and the chains where the checkpoint ``saved`` left them."""
    first = run.first = int(saved["next_iteration"])
    run.resumed_at = [*saved["resumed_at"], first]
    run.extensions = [dict(e) for e in saved.get("extensions", [])]
    run.restarts = [dict(e) for e in saved.get("restarts", [])]
    run.elapsed = (float(saved["wall_s"]), float(saved["cpu_s"]), float(saved["compile_s"]))
    run.search_grads = int(saved["search_grads"])
    run.gen.set_state(saved["generator"].cpu())
    run.rng.bit_generator.state = json.loads(saved["numpy_rng"])
    run.sampler.inv_mass, run.sampler.gradients = saved["inv_mass"], int(saved["gradients"])
    run.steps = [float(v) for v in saved["steps"]]
    run.das = [_DualAveraging(**d) for d in saved["dual_averaging"]]
    run.traj = _TrajectoryAdam(**saved["trajectory_adam"])
    run.trajectory_length, run.wanted_length = float(saved["trajectory_length"]), float(saved["wanted_length"])
    run.window = new_window(run.options, run.rungs)
    run.window.shift, run.window.total, run.window.total_sq = (saved["window"][n] for n in ("shift", "total", "total_sq"))
    run.window.total_outer = saved["window"].get("total_outer")
    run.ceiling = float(saved.get("ceiling", math.inf))
    run.window.n, run.window_start = int(saved["window"]["n"]), int(saved["window_start"])
    run.betas, run.ladder_start = [float(b) for b in saved["betas"]], int(saved["ladder_start"])
    run.swap_sum, run.swap_count = saved["swap_sum"], saved["swap_count"].cpu().numpy().copy()
    if run.tempered is not None:
        run.tempered.beta = run.rung_rows(run.betas)
        run.step_rows = run.rung_rows(run.steps).unsqueeze(-1)
        for name in _TRACKER:
            setattr(run.tracker, name, saved["tracker"][name])
    # a run may be extended (num_samples grown): the arrays are longer, the first rows the same
    for name in run.rows:
        run.rows[name][:first] = saved["rows"][name][:first]
    run.diverging_rows[:first] = saved["diverging_rows"][:first]
    if run.replica_rows is not None:
        run.replica_rows[:first] = saved["replica_rows"][:first]
    for name in _HOST_ROWS:
        getattr(run, name)[:first] = saved[name][:first].cpu().numpy()
    run.samples[: max(0, first - run.warm)] = saved["samples"]
    run.halton_index = first


def snapshot(run: _Run, next_iteration: int) -> dict[str, Any]:
    """Everything the loop carries from one iteration to the next, after ``next_iteration - 1``
    (slices cloned: ``torch.save`` of a view would write the whole array)."""
    wall = run.elapsed[0] + time.perf_counter() - run.clock[0]
    sampler, window = run.sampler, run.window
    return {
        "next_iteration": next_iteration, "num_samples": run.draws, "resumed_at": run.resumed_at,
        "wall_s": wall, "cpu_s": run.elapsed[1] + time.process_time() - run.clock[1],
        "compile_s": run.elapsed[2] + run.compile_s,
        "map_grads": run.map_grads, "search_grads": run.search_grads, "step": run.step, "steps": run.steps,
        "generator": run.gen.get_state(), "numpy_rng": json.dumps(run.rng.bit_generator.state),
        "theta": sampler.theta, "logp": sampler.logp, "grad": sampler.grad, "inv_mass": sampler.inv_mass,
        "gradients": sampler.gradients,
        "dual_averaging": [dataclasses.asdict(d) for d in run.das],
        "trajectory_adam": dataclasses.asdict(run.traj),
        "trajectory_length": run.trajectory_length, "wanted_length": run.wanted_length,
        "window": {"shift": window.shift, "total": window.total, "total_sq": window.total_sq, "n": window.n,
                   "total_outer": window.total_outer},
        "ceiling": run.ceiling,
        "window_start": run.window_start, "betas": run.betas, "ladder_start": run.ladder_start,
        "swap_sum": run.swap_sum, "swap_count": torch.from_numpy(run.swap_count.copy()),
        "tracker": ({name: getattr(run.tracker, name) for name in _TRACKER} if run.tracker is not None else None),
        "rows": {name: v[:next_iteration].clone() for name, v in run.rows.items()},
        "diverging_rows": run.diverging_rows[:next_iteration].clone(),
        "replica_rows": run.replica_rows[:next_iteration].clone() if run.replica_rows is not None else None,
        **{name: torch.from_numpy(getattr(run, name)[:next_iteration].copy()) for name in _HOST_ROWS},
        "samples": run.samples[: max(0, next_iteration - run.warm)].clone(),
        "extensions": run.extensions,
        "restarts": run.restarts,
    }
