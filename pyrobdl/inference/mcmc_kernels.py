"""Pyro's HMC and NUTS kernels as pyrobdl runs them (methods "hmc" and "nuts"): kernels that record
per-iteration statistics (:class:`_Recording`); HMC with NumPyro's step count, jitter and a step cap
(:class:`_HMC`); the potential evaluated without tracing the model (:func:`_direct_potential`,
:func:`_flat_potential`); the
validation of the options they take (:func:`_check_options`).  :mod:`pyrobdl.inference.mcmc` runs
the chains with them and holds their posterior."""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import numpy as np
import torch
from pyro.infer.mcmc import HMC, NUTS

from ..guides.base import model_sites
from .flat_mcmc import FlatTrajectory, FlatTree

#: How each chain's starting point is chosen.
INIT_STRATEGIES = ("median", "sample", "map", "ensemble")
#: How the potential energy (minus the log joint) is evaluated ("auto": :func:`_resolve_potential`).
POTENTIALS = ("auto", "trace", "direct", "flat")

# the largest number of leapfrog steps of one HMC iteration by default: the budget of NUTS's
# default tree depth 10 (2**10 - 1 steps; HMC_OPTIONS of pyrobdl.inference.mcmc says why a cap)
MAX_NUM_STEPS = 1024


class _Counted:
    """A potential function that counts its evaluations (each one is a gradient in Pyro's use)."""

    def __init__(self, fn: Callable[[dict], torch.Tensor]) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, z: dict) -> torch.Tensor:
        self.calls += 1
        return self.fn(z)


class _Recording:
    """Mixin for Pyro's HMC/NUTS kernels: records per-iteration statistics around ``sample``.

    Leapfrog steps are the potential evaluations inside ``sample`` minus those of the step-size
    search (``_find_reasonable_step_size``, a private method of Pyro 1.9's HMC, re-run at the
    end of each warm-up window: ``test_step_size_search_is_not_counted_as_leapfrog_steps``
    fails loudly if a Pyro release changes it).

    The energy is taken in ``_sample_r``: Pyro 1.9's ``HMC.sample`` and ``NUTS.sample`` both
    compute ``energy_current = self._kinetic_energy(r_unscaled) + potential_energy`` right after
    ``self._sample_r(name="r_t=...")``, with ``potential_energy`` the cached
    ``_potential_energy_last`` (recomputed and cached first when the cache was cleared).  Only
    the first draw of each ``sample`` is the trajectory's momentum: the step-size search
    (run after the trajectory, at the end of warm-up windows) draws its own.
    """

    def _start_recording(self, counter: _Counted) -> None:
        self._counter, self._search_calls, self.rows, self.moved = counter, 0, [], 0
        self._energy: float | None = None
        self._want_energy = False

    def _sample_r(self, name):
        r, r_unscaled = super()._sample_r(name)
        if self._want_energy:
            self._want_energy = False
            self._energy = float(self._kinetic_energy(r_unscaled) + self._potential_energy_last)
        return r, r_unscaled

    def _num_steps_capped(self) -> bool:
        """Whether the coming iteration's step count is cut by a cap (only ``_HMC`` has one)."""
        return False

    def _find_reasonable_step_size(self, z):
        before = self._counter.calls
        try:
            return super()._find_reasonable_step_size(z)
        finally:
            self._search_calls += self._counter.calls - before

    def sample(self, params):
        step, t = float(self.step_size), self._t
        mean0, calls0, search0 = self._mean_accept_prob, self._counter.calls, self._search_calls
        divergences0 = len(self._divergences)
        capped = self._num_steps_capped()  # step size and jitter are those of this trajectory
        self._energy, self._want_energy = float("nan"), True
        z = super().sample(params)
        self._want_energy = False
        n = self._t - self._warmup_steps if self._t > self._warmup_steps else self._t
        # Pyro keeps only a running mean of the acceptance statistic; undo the update.
        accept = n * self._mean_accept_prob - (n - 1) * mean0 if n > 1 else self._mean_accept_prob
        steps = (self._counter.calls - calls0) - (self._search_calls - search0)
        diverged = len(self._divergences) > divergences0
        self.rows.append(
            (t, steps, step, accept, diverged, -float(self._potential_energy_last), self._energy, capped)
        )
        self.moved = self._accept_cnt  # sampling iterations whose state changed, before cleanup resets it
        return z


class _NUTS(_Recording, FlatTree, NUTS):
    """Pyro's NUTS, recording; on the flat site its tree runs on one tensor (:class:`FlatTree`)."""


class _HMC(_Recording, FlatTrajectory, HMC):
    r"""Pyro's HMC with NumPyro's step count and a jittered trajectory length.

    A given ``num_steps`` stays fixed while the step size adapts; otherwise
    :math:`\lceil L/\epsilon \rceil` steps cover the trajectory length :math:`L`.  (Pyro floors,
    which collapses to a single Langevin step whenever the adapted step size exceeds
    :math:`L/2`: measured on Bayesian linear regression with :math:`L=\pi/2`, one step per
    iteration and a bulk ESS of 118 of 600 draws.)  With ``jitter`` :math:`j > 0` each
    iteration scales the length (or the step count) by :math:`u \sim \mathcal U(1-j, 1+j)`,
    drawn from torch's generator, which breaks the periodicity of a fixed length in directions
    where it is close to a multiple of half a period (Neal 2011 recommends choosing the step
    size or the trajectory length at random from a small interval).

    No iteration takes more than ``max_num_steps`` steps: when the step size collapses (a bad
    start in warm-up), :math:`\lceil L/\epsilon \rceil` is unbounded.
    """

    def __init__(self, *args: Any, fixed_num_steps: int | None = None, jitter: float = 0.0,
                 max_num_steps: int = MAX_NUM_STEPS, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fixed_num_steps, self._jitter, self._scale = fixed_num_steps, jitter, 1.0
        self._max_num_steps = max_num_steps

    def sample(self, params):
        if self._jitter:
            self._scale = 1.0 + self._jitter * (2.0 * float(torch.rand(())) - 1.0)
        return super().sample(params)

    def _wanted_num_steps(self) -> float:
        """The step count before the cap; a float, so a collapsed step size gives inf, not an error."""
        if self._fixed_num_steps is not None:
            return float(max(1, round(self._fixed_num_steps * self._scale)))
        step = float(self.step_size)
        ratio = self._scale * self.trajectory_length / step if step > 0 else math.inf
        return float(max(1, math.ceil(ratio))) if math.isfinite(ratio) else math.inf

    def _num_steps_capped(self) -> bool:
        return self._wanted_num_steps() > self._max_num_steps

    @property
    def num_steps(self) -> int:
        return int(min(self._max_num_steps, self._wanted_num_steps()))


# --------------------------------------------------------------------------------- potential
def _direct_potential(model: Any, x: torch.Tensor, y: torch.Tensor, transforms: Mapping[str, Any]) -> Callable:
    r"""Minus the log joint in Pyro's unconstrained space, evaluated without tracing the model.

    The same terms Pyro's traced potential sums, from the same objects: each site's prior
    (``model.prior_distributions()``), the likelihood (``model.log_likelihood``) and, for
    constrained sites, :math:`-\log|\partial u / \partial c|` of the site's transform.
    """
    priors = model.prior_distributions()
    real = {s.name for s in model_sites(model) if s.is_real}
    y = model.likelihood.prepare_targets(y, model.out_features)

    def potential(z: Mapping[str, torch.Tensor]) -> torch.Tensor:
        params, log_joint = {}, 0.0
        for name, prior in priors.items():
            u = z[name]
            if name in real:
                value = u
            else:
                value = transforms[name].inv(u)
                log_joint = log_joint - transforms[name].log_abs_det_jacobian(value, u).sum()
            params[name] = value
            log_joint = log_joint + prior.log_prob(value)
        return -(log_joint + model.log_likelihood(params, x, y).sum())

    return potential


class _FlatPotentialFn(torch.autograd.Function):
    """Minus the flat log joint of Pyro's one flat site, with its hand-written gradient as the backward."""

    @staticmethod
    def forward(ctx: Any, u: torch.Tensor, site: "_FlatSite") -> torch.Tensor:
        # inference mode: no autograd bookkeeping on the kernel's ~50 small ops (1.25x less CPU per
        # call at one chain); its tensors are only read outside it (an inference tensor cannot be
        # saved for backward: the gradient is kept on ctx, and is never written in place)
        value, ctx.grad = site.log_joint_and_grad(u)
        return -value  # a normal tensor: made outside inference mode

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return -ctx.grad * grad_output, None


class _FlatSite:
    r"""Pyro's sites as one site :attr:`NAME` for its HMC and NUTS, with the potential energy of
    :class:`pyrobdl.flat.FlatLogJoint`: its value and its hand-written gradient.

    The flat log joint is minus Pyro's potential on the unchanged model, value and gradient
    (``tests/test_flat.py``).  The one site holds each site's unconstrained tensor concatenated in
    Pyro's own order (sorted by name: the order of its diagonal mass matrix, its momentum draws and
    its adaptation), so the chain is the chain Pyro runs on the model's sites, while Pyro's
    integrator, mass matrix and tree update one tensor per step instead of one per site (NUTS on
    the quickstart's gap network: 1.22-1.29x fewer CPU seconds, docs/methods/mcmc.md).  Pyro's transform
    of a positive site is the exponential, the layout's ``"exp"``.  Refuses a model the flat path
    does not implement (``TypeError``/``ValueError`` from ``FlatLogJoint``) when it is built,
    before any chain runs.
    """

    NAME = "_flat"

    def __init__(self, model: Any, x: torch.Tensor, y: torch.Tensor) -> None:
        from ..flat import FlatLogJoint

        self.lj = FlatLogJoint(model, x, y)
        self.sites = sorted(self.lj.layout.sites, key=lambda s: s.name)  # Pyro's order
        to_pyro = torch.cat([torch.arange(s.start, s.stop) for s in self.sites]).to(x.device)
        identity = bool((to_pyro == torch.arange(len(to_pyro), device=x.device)).all())
        # u (Pyro's order) -> theta (the layout's) and the layout's gradient -> Pyro's order
        self.to_pyro = None if identity else to_pyro
        self.to_layout = None if identity else torch.argsort(to_pyro)

    def log_joint_and_grad(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The log joint ``[]`` at ``u`` (Pyro's order) and its gradient ``[P]``, inference tensors."""
        with torch.inference_mode():
            theta = u if self.to_layout is None else u[self.to_layout]
            value, grad = self.lj.value_and_grad(theta.unsqueeze(0))
            return value[0], grad[0] if self.to_pyro is None else grad[0, self.to_pyro]

    def numpy_energy(self) -> Callable | None:
        """``u -> (dU/du, U)`` on numpy arrays (Pyro's order; :mod:`pyrobdl.flat.numpy_kernel`), for the
        numpy tree (:mod:`pyrobdl.inference.numpy_mcmc`); None where that kernel does not serve one row
        (not on the CPU in float32/64, too much data, or ``FlatLogJoint.numpy_kernel`` off).  The same
        floats as :meth:`energy_and_grad` with the numpy kernel (the permutations and the negation are exact)."""
        from ..flat import numpy_kernel

        lj = self.lj
        if not (lj.numpy_kernel and numpy_kernel.usable_rows(lj, 1, None)):
            return None
        plan = numpy_kernel.plan_of(lj)
        to_layout = None if self.to_layout is None else self.to_layout.numpy()
        to_pyro = None if self.to_pyro is None else self.to_pyro.numpy()

        def energy(u: np.ndarray) -> tuple[np.ndarray, np.generic]:
            theta = (u if to_layout is None else u[to_layout])[None]
            value, grad = numpy_kernel.value_and_grad_np(plan, lj, theta, None, True)
            return -(grad[0] if to_pyro is None else grad[0, to_pyro]), -value[0]

        return energy

    def energy_and_grad(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The potential energy at ``u`` and its gradient, Pyro's ``potential_grad`` without autograd:
        the same floats (its backward multiplies the same negated gradient by 1), normal tensors."""
        value, grad = self.log_joint_and_grad(u)
        return -value, -grad

    def potential(self, z: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Pyro's potential energy of ``{NAME: u}``."""
        return _FlatPotentialFn.apply(z[self.NAME], self)

    def pack(self, z: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Pyro's unconstrained sites ``{name: tensor}`` as ``{NAME: u}``."""
        return {self.NAME: torch.cat([z[s.name].reshape(-1) for s in self.sites])}

    def site_potential(self, z: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The same potential as a function of Pyro's unconstrained sites (gradients flow to each)."""
        return self.potential(self.pack(z))

    def unpack(self, u: torch.Tensor, transforms: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Draws ``[..., P]`` of the one site as constrained draws ``[..., *shape]`` of each site."""
        out, pos, batch = {}, 0, tuple(u.shape[:-1])
        for s in self.sites:
            v = u[..., pos : pos + s.size].reshape(batch + tuple(s.shape))
            out[s.name] = transforms[s.name].inv(v) if s.name in transforms else v
            pos += s.size
        return out


def _flat_potential(model: Any, x: torch.Tensor, y: torch.Tensor) -> Callable:
    """:class:`_FlatSite`'s potential as a function of Pyro's unconstrained sites (tests, benchmarks)."""
    return _FlatSite(model, x, y).site_potential


def _resolve_potential(model: Any, options: Mapping[str, Any]) -> str:
    """The potential ``potential="auto"`` stands for: ``"trace"`` under ``jit_compile`` (which
    compiles Pyro's traced potential) or for a model the flat log joint does not implement (a
    user's own prior or likelihood class), else ``"flat"``; any other value is returned as given."""
    if options["potential"] != "auto":
        return options["potential"]
    if options["jit_compile"]:
        return "trace"
    from ..flat import _check_supported

    try:
        _check_supported(model)
    except (TypeError, ValueError):
        return "trace"
    return "flat"


def _check_direct(direct: Callable, traced: Callable, z: Mapping[str, torch.Tensor], name: str = "direct") -> None:
    with torch.no_grad():
        a, b = float(direct(z)), float(traced(z))
    # float32 sums over N data points; anything beyond rounding means the model has grown a
    # site or a term the direct potential does not know.
    if not math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-3):
        raise ValueError(
            f"potential={name!r} gives {a:.6g} but Pyro's traced model gives {b:.6g} at the initial "
            f"point: the model has terms the {name} potential does not cover; use potential='trace'"
        )


# ----------------------------------------------------------------------------------- options
def _int(options: Mapping[str, Any], name: str, low: int) -> None:
    v = options[name]
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")


def _positive(options: Mapping[str, Any], name: str) -> None:
    v = options[name]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {v!r}")


def _check_options(options: Mapping[str, Any]) -> None:
    for name in ("num_warmup",):
        _int(options, name, 0)
    for name in ("num_samples", "num_chains", "map_num_steps", "diagnostic_points"):
        _int(options, name, 1)
    for name in ("step_size", "map_lr"):
        _positive(options, name)
    p = options["target_accept_prob"]
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p < 1:
        raise ValueError(f"target_accept_prob must be in (0, 1), got {p!r}")
    for name in ("adapt_step_size", "adapt_mass_matrix", "full_mass", "jit_compile"):
        if not isinstance(options[name], bool):
            raise TypeError(f"{name} must be True or False, got {options[name]!r}")
    if options["init_strategy"] not in INIT_STRATEGIES:
        raise ValueError(f"unknown init_strategy {options['init_strategy']!r}; valid: {list(INIT_STRATEGIES)}")

    if options["potential"] not in POTENTIALS:
        raise ValueError(f"unknown potential {options['potential']!r}; valid: {list(POTENTIALS)}")
    if options["jit_compile"] and options["potential"] not in ("trace", "auto"):
        raise ValueError("jit_compile=True compiles Pyro's traced potential: it needs potential='trace' (or 'auto')")
    if "max_tree_depth" in options:
        _int(options, "max_tree_depth", 1)
    if "trajectory_length" in options:
        _positive(options, "trajectory_length")
        j = options["jitter"]
        if isinstance(j, bool) or not isinstance(j, (int, float)) or not 0 <= j < 1:
            raise ValueError(f"jitter must be in [0, 1), got {j!r}")
        _int(options, "max_num_steps", 1)
        if options["num_steps"] is not None:
            _int(options, "num_steps", 1)
            if options["num_steps"] > options["max_num_steps"]:
                raise ValueError(f"num_steps={options['num_steps']} exceeds max_num_steps="
                                 f"{options['max_num_steps']}: raise max_num_steps or lower num_steps")


class _ChainBar:
    """One chain's progress bar, named by method and chain (Pyro's own bar says only "Warmup" or
    "Sample", and each chain here is a separate one-chain run); driven by MCMC's ``hook_fn``."""

    def __init__(self, method: str, chain: int, num_chains: int, total: int) -> None:
        from tqdm.auto import tqdm

        self.name = f"{method} chain {chain + 1}/{num_chains}"
        self.bar = tqdm(total=total, desc=f"{self.name} warmup", leave=False, mininterval=0.5)
        self.stage = "Warmup"

    def hook(self, kernel: Any, params: Any, stage: str, i: int) -> None:
        if stage != self.stage:
            self.stage = stage
            self.bar.set_description(f"{self.name} {stage.lower()}")  # shown at once: the switch to sampling is news
        self.bar.set_postfix(kernel.logging(), refresh=False)
        self.bar.update()

    def close(self) -> None:
        self.bar.close()


def _chain_bar(method: str, chain: int, options: Mapping[str, Any], progress: bool) -> _ChainBar | None:
    if not progress:
        return None
    return _ChainBar(method, chain, options["num_chains"], options["num_warmup"] + options["num_samples"])
