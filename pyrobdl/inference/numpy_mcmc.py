"""Pyro's NUTS tree and HMC trajectory in numpy: the flat shortcut's twin for a one-row potential on the CPU.

:class:`~pyrobdl.inference.flat_mcmc.FlatTree` runs Pyro's tree on one tensor with Pyro's own
operations, bit for bit.  At the quickstart's sizes (a few dozen parameters) each of those
operations is a torch dispatch of 1.5-3 CPU µs around a few dozen numbers, and a leaf is ~20 of
them beside the potential; the same operation in numpy costs 0.2-1 µs.  This module is that tree,
Pyro's velocity Verlet and the doubling loop of Pyro's ``NUTS.sample`` (:func:`doublings`) written on
numpy arrays: the same expressions in the same order, the same random numbers (every draw stays
torch's: :func:`_other_half`, the loop's direction and acceptance), the potential from
:mod:`pyrobdl.flat.numpy_kernel`.  It is not bit for bit: numpy's ``dot``, ``exp`` and
``log1p`` round differently from torch's in the last place, so a chain equals Pyro's up to float
rounding while no accept/reject or U-turn decision falls within that rounding
(``tests/test_flat_mcmc.py`` holds whole chains to Pyro's own tree).

Scalars are numpy scalars of the chain's dtype (a float32 chain computes in float32, as Pyro's
tensors do); the caller runs these functions under ``np.errstate(all="ignore")`` (an overflowing
energy is an infinite one, as in torch).
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import numpy as np
import pyro
import pyro.distributions as dist
import torch

__all__ = ["Context", "Doublings", "Tree", "context", "doublings", "leapfrog", "trajectory", "tree"]


class Tree(NamedTuple):
    """Pyro's ``_TreeInfo`` of one site: arrays and numpy scalars here, tensors in
    :class:`~pyrobdl.inference.flat_mcmc.FlatTree`'s tree on tensors."""

    z_left: Any
    r_left: Any
    r_left_unscaled: Any
    z_left_grads: Any
    z_right: Any
    r_right: Any
    r_right_unscaled: Any
    z_right_grads: Any
    z_proposal: Any
    z_proposal_pe: Any
    z_proposal_grads: Any
    r_sum: Any
    weight: Any
    turning: bool
    diverging: bool
    sum_accept_probs: Any
    num_proposals: int


class Context(NamedTuple):
    """What every leaf of one doubling (or one HMC trajectory) reads."""

    energy: Callable[[np.ndarray], tuple[np.ndarray, np.generic]]  # u -> (dU/du, U)
    inverse_mass: np.ndarray  # [P] (diagonal) or [P, P]
    sqrt_inverse: np.ndarray
    half_step: np.generic  # 0.5 * step, signed by the direction
    step: np.generic
    log_slice: np.generic
    energy_current: np.generic
    max_sliced_energy: float


def context(energy: Callable, inverse_mass: torch.Tensor, sqrt_inverse: torch.Tensor, step: float,
            log_slice: torch.Tensor | None, energy_current: torch.Tensor | None, max_sliced_energy: float,
            dtype: np.dtype) -> Context:
    """A :class:`Context` from Pyro's tensors: ``step`` the signed step size (a Python number, cast to
    the chain's dtype as Pyro's tensor-scalar operations cast it); ``log_slice`` and
    ``energy_current`` 0-d tensors (None for an HMC trajectory, which does not read them)."""
    cast = np.dtype(dtype).type
    scalar = (lambda t: None if t is None else t.detach().numpy()[()])
    return Context(energy, inverse_mass.detach().numpy(), sqrt_inverse.detach().numpy(), cast(0.5 * step),
                   cast(step), scalar(log_slice), scalar(energy_current), max_sliced_energy)


def _mul(matrix: np.ndarray, r: np.ndarray) -> np.ndarray:
    """Pyro's ``_matvecmul`` on one block."""
    return matrix * r if matrix.ndim == 1 else matrix @ r


def leapfrog(ctx: Context, z: np.ndarray, r: np.ndarray, z_grads: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.generic]:
    """Pyro's ``_single_step_verlet``: its expressions in its order."""
    r = r + ctx.half_step * (-z_grads)  # r(n+1/2)
    z = z + ctx.step * _mul(ctx.inverse_mass, r)  # z(n+1)
    z_grads, potential_energy = ctx.energy(z)
    r = r + ctx.half_step * (-z_grads)  # r(n+1)
    return z, r, z_grads, potential_energy


def trajectory(ctx: Context, z: np.ndarray, r: np.ndarray, z_grads: np.ndarray, num_steps: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.generic | None]:
    """Pyro's ``velocity_verlet`` over ``num_steps`` steps (HMC's trajectory)."""
    potential_energy = None
    for _ in range(num_steps):
        z, r, z_grads, potential_energy = leapfrog(ctx, z, r, z_grads)
    return z, r, z_grads, potential_energy


def _leaf(ctx: Context, z: np.ndarray, r: np.ndarray, z_grads: np.ndarray) -> Tree:
    """Pyro's ``_build_basetree`` (multinomial sampling): one step and the new state's energy."""
    z, r, z_grads, potential_energy = leapfrog(ctx, z, r, z_grads)
    cast = type(potential_energy)
    r_unscaled = _mul(ctx.sqrt_inverse, r)
    energy_new = potential_energy + cast(0.5) * r_unscaled.dot(r_unscaled)
    if math.isnan(energy_new):
        energy_new = cast(math.inf)
    sliced_energy = energy_new + ctx.log_slice
    diverging = bool(sliced_energy > ctx.max_sliced_energy)
    accept_prob = np.minimum(np.exp(-(energy_new - ctx.energy_current)), cast(1.0))
    return Tree(z, r, r_unscaled, z_grads, z, r, r_unscaled, z_grads, z, potential_energy, z_grads, r_unscaled,
                -sliced_energy, False, diverging, accept_prob, 1)


def _logaddexp(x: np.generic, y: np.generic) -> np.generic:
    """Pyro's ``nuts._logaddexp``."""
    minval, maxval = (x, y) if x < y else (y, x)
    return np.log1p(np.exp(minval - maxval)) + maxval


def _other_half(log_prob: np.generic) -> bool:
    """Pyro's ``pyro.sample("is_other_half_tree", Bernoulli(exp(log_prob)))`` outside any handler:
    ``torch.bernoulli`` of the probability (torch's random numbers, as Pyro's tree draws them); a
    probability outside [0, 1] (NaN) goes through Pyro's statement, which validates it."""
    prob = torch.from_numpy(np.asarray(np.exp(log_prob)))
    if not 0.0 <= float(prob) <= 1.0:
        return bool(pyro.sample("is_other_half_tree", dist.Bernoulli(probs=prob)) == 1)
    return bool(torch.bernoulli(prob) == 1)


def _turning(r_left: np.ndarray, r_right: np.ndarray, r_sum: np.ndarray) -> bool:
    """Pyro's ``_is_turning`` on one site."""
    rho = r_sum - (r_left + r_right) / r_sum.dtype.type(2.0)
    return bool(r_left.dot(rho) <= 0) or bool(r_right.dot(rho) <= 0)


def tree(ctx: Context, z: np.ndarray, r: np.ndarray, z_grads: np.ndarray, direction: int, depth: int) -> Tree:
    """Pyro's ``_build_tree`` with multinomial sampling."""
    if depth == 0:
        return _leaf(ctx, z, r, z_grads)
    half = tree(ctx, z, r, z_grads, direction, depth - 1)
    if half.turning or half.diverging:
        return half
    if direction == 1:
        other = tree(ctx, half.z_right, half.r_right, half.z_right_grads, direction, depth - 1)
        left, right = half, other
    else:
        other = tree(ctx, half.z_left, half.r_left, half.z_left_grads, direction, depth - 1)
        left, right = other, half
    weight = _logaddexp(half.weight, other.weight)
    sum_accept_probs = half.sum_accept_probs + other.sum_accept_probs
    r_sum = half.r_sum + other.r_sum
    proposal = other if _other_half(other.weight - weight) else half
    rl, rr = left.r_left_unscaled, right.r_right_unscaled
    turning = other.turning or _turning(rl, rr, r_sum)
    return Tree(left.z_left, left.r_left, rl, left.z_left_grads, right.z_right, right.r_right, rr,
                right.z_right_grads, proposal.z_proposal, proposal.z_proposal_pe, proposal.z_proposal_grads,
                r_sum, weight, turning, other.diverging, sum_accept_probs, half.num_proposals + other.num_proposals)


class Doublings(NamedTuple):
    """What Pyro's ``NUTS.sample`` keeps of its doubling loop: the accepted proposal (state, potential
    energy, gradient; None when no subtree was accepted), the acceptance statistic's sum and count,
    and whether the last subtree diverged."""

    proposal: tuple[np.ndarray, np.generic, np.ndarray] | None
    sum_accept_probs: np.generic
    num_proposals: int
    diverging: bool


def doublings(right: Context, left: Context, z: np.ndarray, r: np.ndarray, r_unscaled: np.ndarray,
              z_grads: np.ndarray, max_tree_depth: int, like: torch.Tensor) -> Doublings:
    """Pyro's ``NUTS.sample`` doubling loop (multinomial sampling) from state ``z`` with momentum ``r``:
    the same draws from torch's generator as its ``pyro.sample`` statements outside any handler (the
    direction a ``torch.bernoulli`` of 0.5, the subtree's acceptance a ``torch.rand``, both of
    ``like``'s dtype), ``right`` and ``left`` the contexts of the two directions."""
    half = torch.full((), 0.5, dtype=like.dtype)
    z_left = z_right = z
    r_left = r_right = r
    ru_left = ru_right = r_unscaled
    g_left = g_right = z_grads
    r_sum = r_unscaled
    sum_accept_probs, num_proposals = 0.0, 0
    tree_weight = r_unscaled.dtype.type(0.0)
    proposal, depth = None, 0
    while depth < max_tree_depth:
        direction = int(torch.bernoulli(half).item())
        if direction == 1:
            new = tree(right, z_right, r_right, g_right, direction, depth)
            z_right, r_right, ru_right, g_right = new.z_right, new.r_right, new.r_right_unscaled, new.z_right_grads
        else:
            new = tree(left, z_left, r_left, g_left, direction, depth)
            z_left, r_left, ru_left, g_left = new.z_left, new.r_left, new.r_left_unscaled, new.z_left_grads
        sum_accept_probs = sum_accept_probs + new.sum_accept_probs
        num_proposals += new.num_proposals
        if new.diverging or new.turning:
            return Doublings(proposal, sum_accept_probs, num_proposals, new.diverging)
        depth += 1
        # Uniform(0, 1).sample() is 0 + rand * (1 - 0): the draw itself
        if float(torch.rand((), dtype=like.dtype)) < float(np.exp(new.weight - tree_weight)):
            proposal = (new.z_proposal, new.z_proposal_pe, new.z_proposal_grads)
        r_sum = r_sum + new.r_sum
        if _turning(ru_left, ru_right, r_sum):
            break
        tree_weight = _logaddexp(tree_weight, new.weight)
    return Doublings(proposal, sum_accept_probs, num_proposals, False)
