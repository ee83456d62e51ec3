"""Pyro's NUTS tree on one flat tensor: the same arithmetic as Pyro 1.9's ``NUTS._build_tree``, fewer layers.

Pyro's NUTS builds its trajectory in ``_build_basetree`` (one leapfrog step through
``velocity_verlet``, the gradient through ``potential_grad``'s autograd round trip) and
``_build_tree`` (the recursive doubling, a ``pyro.sample`` of a Bernoulli at every inner node).
With :class:`~pyrobdl.inference.mcmc_kernels._FlatSite` the chain has one site, so the dictionaries,
the autograd graph and the sample statement's machinery are overhead around a few ops on one tensor
(py-spy of NUTS on the quickstart's gap network: Pyro's tree and integrator ~60% of its CPU, the
autograd round trip ~15%).  :class:`FlatTree` runs the same operations, in the same order, on the
flat tensor: the same floats, the same random numbers, the same chain — bit for bit
(``tests/test_flat_mcmc.py`` compares whole chains with Pyro's own tree, in float32 and float64, for
diagonal and dense mass matrices and a learned precision).

Where the shortcut would not be Pyro's behaviour it steps aside and Pyro's methods run: a Pyro
handler that would see the tree's sample statements (``MCMC.run``'s own ``poutine.block``, innermost,
hides them all: then a statement is its distribution's ``sample()``), slice sampling instead of
multinomial, a mass-matrix adapter other than Pyro's ``BlockMassMatrix``, or no flat site.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import pyro
import pyro.distributions as dist
import torch
from pyro.distributions.util import scalar_like
from pyro.infer.mcmc.adaptation import BlockMassMatrix
from pyro.infer.mcmc.nuts import _logaddexp, _TreeInfo
from pyro.ops.integrator import _EXCEPTION_HANDLERS
from pyro.poutine.block_messenger import BlockMessenger
from pyro.poutine.runtime import _PYRO_STACK

from . import numpy_mcmc

__all__ = ["FlatTrajectory", "FlatTree"]


def _numbers(like: torch.Tensor, *values: float) -> tuple:
    """``values`` as 0-d CPU tensors of ``like``'s dtype: torch 2.13 copies a Python number into a fresh
    0-d tensor at every tensor-scalar operation (``aten::to``, ~1.3 µs); an operation with a 0-d tensor
    of the same dtype computes the same bits (the number is cast to that dtype either way).  Half
    precision keeps the numbers (its scalars are computed in float)."""
    if like.dtype not in (torch.float32, torch.float64):
        return values
    return tuple(torch.tensor(v, dtype=like.dtype) for v in values)


def _array(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as an array (no copy)."""
    return t.detach().numpy()


def _mul(matrix: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Pyro's ``_matvecmul`` on a one-site block (its ``torch.cat`` of one tensor is a copy)."""
    return matrix.mul(r) if matrix.dim() == 1 else matrix.matmul(r)


# what Pyro's handlers read of the tree's sample statement (pyro.poutine.block_messenger._block_fn)
_TREE_STATEMENT = {"type": "sample", "name": "is_other_half_tree", "is_observed": False}


def _statements_are_plain() -> bool:
    """Whether ``pyro.sample`` of the tree's statement is its distribution's ``sample()``: no handler,
    or the innermost one a ``BlockMessenger`` that hides it (no handler outside it sees the statement,
    and the block itself leaves its value to the default, ``fn()``)."""
    if not _PYRO_STACK:
        return True
    top = _PYRO_STACK[-1]
    return isinstance(top, BlockMessenger) and bool(top.hide_fn(dict(_TREE_STATEMENT)))


class _FlatSiteKernel:
    """What both mixins share: the flat site's name, potential and counter, and the gradient step."""

    _flat: tuple[str, Callable, Any] | None = None
    _numpy_energy: Callable | None = None
    #: Run the tree and trajectory in numpy (:mod:`pyrobdl.inference.numpy_mcmc`) when the site has a
    #: numpy potential; False: always the torch operations (Pyro's chain bit for bit).
    numpy_tree = True

    def use_flat_site(self, name: str, energy_and_grad: Callable, counter: Any,
                      numpy_energy: Callable | None = None) -> None:
        """Run on the one site ``name``: ``energy_and_grad(u) -> (U, dU/du)`` as plain tensors (Pyro's
        ``potential_grad`` without autograd), each call counted on ``counter.calls`` as Pyro's
        evaluations of the counted potential are; ``numpy_energy(u) -> (dU/du, U)`` the same on numpy
        arrays, where the site has it (then the tree runs in numpy, see :attr:`numpy_tree`)."""
        self._flat = (name, energy_and_grad, counter)
        self._numpy_energy = numpy_energy

    def _numpy_context(self, z: torch.Tensor, step: float, log_slice: Any, energy_current: Any):
        """The :class:`numpy_mcmc.Context` of one doubling or trajectory, or None where the tree runs on
        tensors (no numpy potential, or :attr:`numpy_tree` off)."""
        if self._numpy_energy is None or not self.numpy_tree:
            return None
        name, _, counter = self._flat
        energy = self._numpy_energy

        def counted(u: np.ndarray) -> tuple[np.ndarray, np.generic]:
            counter.calls += 1
            return energy(u)

        key = (name,)
        adapter = self.mass_matrix_adapter
        return numpy_mcmc.context(counted, adapter.inverse_mass_matrix[key], adapter._mass_matrix_sqrt_inverse[key],
                                  step, log_slice, energy_current, self._max_sliced_energy, _array(z).dtype)

    def _flat_energy(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``potential_grad`` of Pyro on the flat site: (gradient, potential energy)."""
        _, energy_and_grad, counter = self._flat
        counter.calls += 1
        try:
            pe, grad = energy_and_grad(z)
        except Exception as e:  # Pyro's registered handlers (e.g. a singular matrix) give NaN
            if any(h(e) for h in _EXCEPTION_HANDLERS.values()):
                return z.new_zeros(z.shape), z.new_tensor(float("nan"))
            raise
        return grad, pe

    def _flat_step(self, z, r, z_grads, steps, inverse_mass):
        """Pyro's ``_single_step_verlet`` on tensors, its expressions in its order; ``steps``: (0.5 * step,
        step) as :func:`_numbers` (Pyro's ``0.5 * step_size * (-g)`` multiplies by the number 0.5 * step)."""
        half_step, step = steps
        r = r + half_step * (-z_grads)  # r(n+1/2)
        z = z + step * _mul(inverse_mass, r)  # z(n+1)
        z_grads, potential_energy = self._flat_energy(z)
        r = r + half_step * (-z_grads)  # r(n+1)
        return z, r, z_grads, potential_energy

    def _end_iteration(self, z: dict, z_grads: dict, accepted: bool, accept_prob: torch.Tensor) -> dict:
        """The end of Pyro 1.9's ``HMC.sample`` and ``NUTS.sample`` (the same lines in both): the iteration
        count, the acceptance count after warm-up or the adaptation step during it, the running mean of
        the acceptance statistic; returns the state."""
        self._t += 1
        if self._t > self._warmup_steps:
            n = self._t - self._warmup_steps
            if accepted:
                self._accept_cnt += 1
        else:
            n = self._t
            self._adapter.step(self._t, z, accept_prob, z_grads)
        self._mean_accept_prob += (accept_prob.item() - self._mean_accept_prob) / n
        return z.copy()

    def _flat_ready(self) -> bool:
        return self._flat is not None and type(self.mass_matrix_adapter) is BlockMassMatrix


class FlatTree(_FlatSiteKernel):
    """Mixin for Pyro's ``NUTS`` (before it in the bases): its tree on one flat site
    (:meth:`use_flat_site` switches it on)."""

    def _flat_applies(self) -> bool:
        return self._flat_ready() and self.use_multinomial_sampling and _statements_are_plain()

    def sample(self, params):
        """Pyro 1.9's ``NUTS.sample`` with its doubling loop and tree in numpy (:func:`numpy_mcmc.doublings`)
        where the site has a numpy potential; Pyro's own otherwise (and at a first call or a cleared cache,
        whose doublings then take :meth:`_build_tree` on tensors)."""
        z, potential_energy, z_grads = self._fetch_from_cache()
        if z is None or not z or z_grads is None or not self._flat_applies() or self._numpy_energy is None \
                or not self.numpy_tree:
            return super().sample(params)
        name = self._flat[0]
        r, r_unscaled = self._sample_r(name="r_t={}".format(self._t))
        energy_current = self._kinetic_energy(r_unscaled) + potential_energy
        log_slice = -energy_current  # multinomial sampling (_flat_applies)
        right = self._numpy_context(z[name], self.step_size, log_slice, energy_current)
        left = self._numpy_context(z[name], -self.step_size, log_slice, energy_current)
        with np.errstate(all="ignore"):  # an overflowing energy is infinite, as in torch
            out = numpy_mcmc.doublings(right, left, _array(z[name]), _array(r[name]), _array(r_unscaled[(name,)]),
                                       _array(z_grads[name]), self._max_tree_depth, energy_current)
        if out.diverging and self._t >= self._warmup_steps:
            self._divergences.append(self._t - self._warmup_steps)
        accepted = out.proposal is not None
        if accepted:
            u, pe, g = out.proposal
            z, z_grads = {name: torch.from_numpy(u)}, {name: torch.from_numpy(g)}
            self._cache(z, torch.from_numpy(np.asarray(pe)), z_grads)
        accept_prob = torch.from_numpy(np.asarray(out.sum_accept_probs / out.num_proposals))
        return self._end_iteration(z, z_grads, accepted, accept_prob)

    def _build_tree(self, z, r, z_grads, log_slice, direction, tree_depth, energy_current):
        if z_grads is None or not self._flat_applies():
            return super()._build_tree(z, r, z_grads, log_slice, direction, tree_depth, energy_current)
        name = self._flat[0]
        key = (name,)
        adapter = self.mass_matrix_adapter
        step = self.step_size if direction == 1 else -self.step_size
        # the adapter's matrices of the one block (read per doubling: adaptation replaces them)
        ctx = (adapter.inverse_mass_matrix[key], adapter._mass_matrix_sqrt_inverse[key],
               _numbers(energy_current, 0.5 * step, step, 0.5, 2.0), log_slice, energy_current)
        t = self._flat_tree(z[name], r[name], z_grads[name], direction, tree_depth, ctx)
        d = lambda v: {name: v}  # noqa: E731
        u = lambda v: {key: v}  # noqa: E731
        return _TreeInfo(d(t.z_left), d(t.r_left), u(t.r_left_unscaled), d(t.z_left_grads), d(t.z_right),
                         d(t.r_right), u(t.r_right_unscaled), d(t.z_right_grads), d(t.z_proposal), t.z_proposal_pe,
                         d(t.z_proposal_grads), u(t.r_sum), t.weight, t.turning, t.diverging, t.sum_accept_probs,
                         t.num_proposals)

    def _flat_leaf(self, z, r, z_grads, ctx) -> numpy_mcmc.Tree:
        """Pyro's ``_build_basetree``: one velocity Verlet step and the new state's energy."""
        inverse_mass, sqrt_inverse, numbers, log_slice, energy_current = ctx
        z, r, z_grads, potential_energy = self._flat_step(z, r, z_grads, numbers[:2], inverse_mass)
        r_unscaled = _mul(sqrt_inverse, r)
        # Pyro's kinetic energy is 0.5 * (0.0 + r.r): adding 0.0 to a sum of squares changes no bit
        energy_new = potential_energy + numbers[2] * r_unscaled.dot(r_unscaled)
        if math.isnan(energy_new.item()):
            energy_new = torch.tensor(float("inf"), dtype=energy_new.dtype, device=energy_new.device)
        sliced_energy = energy_new + log_slice
        diverging = bool(sliced_energy > self._max_sliced_energy)
        accept_prob = (-(energy_new - energy_current)).exp().clamp(max=1.0)
        return numpy_mcmc.Tree(z, r, r_unscaled, z_grads, z, r, r_unscaled, z_grads, z, potential_energy, z_grads,
                     r_unscaled, -sliced_energy, False, diverging, accept_prob, 1)

    def _flat_tree(self, z, r, z_grads, direction: int, depth: int, ctx) -> numpy_mcmc.Tree:
        """Pyro's ``_build_tree`` (multinomial sampling) on tensors."""
        if depth == 0:
            return self._flat_leaf(z, r, z_grads, ctx)
        half = self._flat_tree(z, r, z_grads, direction, depth - 1, ctx)
        if half.turning or half.diverging:
            return half
        if direction == 1:
            other = self._flat_tree(half.z_right, half.r_right, half.z_right_grads, direction, depth - 1, ctx)
            left, right = half, other
        else:
            other = self._flat_tree(half.z_left, half.r_left, half.z_left_grads, direction, depth - 1, ctx)
            left, right = other, half
        weight = _logaddexp(half.weight, other.weight)
        sum_accept_probs = half.sum_accept_probs + other.sum_accept_probs
        r_sum = half.r_sum + other.r_sum
        proposal = other if self._is_other_half(other.weight - weight) else half
        rl, rr = left.r_left_unscaled, right.r_right_unscaled
        turning = other.turning or self._flat_turning(rl, rr, r_sum, ctx[2][3])
        return numpy_mcmc.Tree(left.z_left, left.r_left, rl, left.z_left_grads, right.z_right, right.r_right, rr,
                     right.z_right_grads, proposal.z_proposal, proposal.z_proposal_pe, proposal.z_proposal_grads,
                     r_sum, weight, turning, other.diverging, sum_accept_probs,
                     half.num_proposals + other.num_proposals)

    @staticmethod
    def _is_other_half(log_prob: torch.Tensor) -> bool:
        """Pyro's ``pyro.sample("is_other_half_tree", Bernoulli(exp(log_prob)))`` outside any handler:
        ``torch.bernoulli`` of the same probability, the same random numbers.  A probability outside
        [0, 1] (NaN) goes through Pyro's statement, which validates it as Pyro would."""
        prob = log_prob.exp()
        p = prob.item()
        if not 0.0 <= p <= 1.0:
            return bool(pyro.sample("is_other_half_tree", dist.Bernoulli(probs=prob)) == 1)
        return bool(torch.bernoulli(prob) == 1)  # (no graph to keep out: prob does not require grad)

    @staticmethod
    def _flat_turning(r_left: torch.Tensor, r_right: torch.Tensor, r_sum: torch.Tensor, two: Any) -> bool:
        """Pyro's ``_is_turning`` (Betancourt 2017, A.4.2) on one site; ``0.0 +`` a dot product changes no
        comparison with 0."""
        rho = r_sum - (r_left + r_right) / two  # two: 2 as a 0-d tensor (_numbers)
        return bool(r_left.dot(rho) <= 0) or bool(r_right.dot(rho) <= 0)


class FlatTrajectory(_FlatSiteKernel):
    """Mixin for Pyro's ``HMC`` (before it in the bases): its trajectory on one flat site.

    ``sample`` is Pyro 1.9's ``HMC.sample`` with ``velocity_verlet`` on the one tensor (its only
    change); the momentum, the Metropolis test's uniform and the adaptation are Pyro's own calls.
    """

    def sample(self, params):
        z, potential_energy, z_grads = self._fetch_from_cache()
        if z is None or not z or z_grads is None or not self._flat_ready():  # Pyro's own (a first call, a cleared cache)
            return super().sample(params)
        name = self._flat[0]
        r, r_unscaled = self._sample_r(name="r_t={}".format(self._t))
        energy_current = self._kinetic_energy(r_unscaled) + potential_energy
        u, p, g = z[name], r[name], z_grads[name]
        inverse_mass, step = self.mass_matrix_adapter.inverse_mass_matrix[(name,)], self.step_size
        ctx_np = self._numpy_context(u, step, None, None)
        if ctx_np is not None:
            with np.errstate(all="ignore"):
                u, p, g, pe = numpy_mcmc.trajectory(ctx_np, _array(u), _array(p), _array(g), self.num_steps)
            u, p, g, potential_energy_new = (torch.from_numpy(np.asarray(v)) for v in (u, p, g, pe))
        else:
            steps = _numbers(u, 0.5 * step, step)
            for _ in range(self.num_steps):
                u, p, g, potential_energy_new = self._flat_step(u, p, g, steps, inverse_mass)
        z_new, z_grads_new = {name: u}, {name: g}
        energy_proposal = self._kinetic_energy(self.mass_matrix_adapter.unscale({name: p})) + potential_energy_new
        delta_energy = energy_proposal - energy_current
        if math.isnan(delta_energy.item()):  # a diverging trajectory (a large step size)
            delta_energy = torch.tensor(float("inf"), dtype=delta_energy.dtype, device=delta_energy.device)
        if delta_energy > self._max_sliced_energy and self._t >= self._warmup_steps:
            self._divergences.append(self._t - self._warmup_steps)
        accept_prob = (-delta_energy).exp().clamp(max=1.0)
        rand = pyro.sample("rand_t={}".format(self._t),
                           dist.Uniform(scalar_like(accept_prob, 0.0), scalar_like(accept_prob, 1.0)))
        accepted = False
        if rand < accept_prob:
            accepted, z, z_grads = True, z_new, z_grads_new
            self._cache(z, potential_energy_new, z_grads)
        return self._end_iteration(z, z_grads, accepted, accept_prob)
