"""The flat log joint's value and gradient in numpy, for a few rows at a time on the CPU.

At one or a few rows of ``theta`` (an SVI step, a NUTS leaf) the torch kernel
(:mod:`pyrobdl.flat.kernel`) is dispatch-bound: ~35 small tensor operations of 1.5-3 CPU µs each,
on arrays of a few hundred numbers.  A numpy operation on arrays that small costs 0.5-1 µs, so the
same algebra written here runs ~2-3x faster (``comparisons/benchmarks/numpy_kernel.py``); at many
rows the torch kernel's batched products and in-place passes win, and
:meth:`FlatLogJoint._vg <pyrobdl.flat.FlatLogJoint>` picks this one only below
:data:`MAX_NUMPY_ELEMENTS` hidden activations per call.

The arrays are views of the torch tensors' memory (``Tensor.numpy()``, no copy); the results are
fresh arrays, returned as tensors by :func:`value_and_grad`.  The algebra is that of
:meth:`FlatLogJoint.log_joint <pyrobdl.flat.FlatLogJoint.log_joint>` (Pyro's model, proven equal to
it in ``tests/test_flat.py``) with the backward pass written out, in the natural layout
``[K, B, H]``; its float rounding differs from the torch kernel's (numpy's own ``tanh`` and
products), within the tolerances the tests hold both kernels to.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

#: Use the numpy kernel when rows x data points x the widest layer is at most this (and on the CPU).
#: ``comparisons/benchmarks/numpy_kernel.py`` (2026-11-29, CPU µs a call, numpy / torch): gap's shape
#: (N = 80, 1 x 10) 0.39x at 800 elements, 0.80x at 12,800, 1.38x at 51,200; wine's (N = 1,439,
#: 1 x 50) 1.30x at 71,950: the crossover near 25,000, this bound below it.
MAX_NUMPY_ELEMENTS = 16384


class NumpyPlan:
    """What :func:`value_and_grad_np` reads of a :class:`~pyrobdl.flat.FlatLogJoint`, as numpy arrays
    sharing the tensors' memory, and the layout's slices."""

    def __init__(self, lj: Any) -> None:
        self.x = lj.x.detach().numpy()
        self.y = lj.y.detach().numpy()
        self.neg_prior_prec = lj._neg_prior_prec.numpy()
        self.layers = []
        for i in range(lj._num_layers):
            w = lj.layout[f"layers.{i}.weight"]
            b = lj.layout[f"layers.{i}.bias"] if f"layers.{i}.bias" in lj.layout else None
            self.layers.append((slice(w.start, w.stop), tuple(w.shape), None if b is None else slice(b.start, b.stop)))
        self.tanh = lj._act == "tanh"
        self.classification = lj.task == "classification"
        self.learned = lj._learned
        self.u = lj._prec_slice.start if lj._learned else None


def plan_of(lj: Any) -> NumpyPlan:
    """The :class:`NumpyPlan` of ``lj``, made at its first use and kept on it."""
    if lj._numpy_plan is None:
        lj._numpy_plan = NumpyPlan(lj)
    return lj._numpy_plan


def usable(lj: Any, theta: torch.Tensor, idx: torch.Tensor | None) -> bool:
    """Whether :func:`value_and_grad` serves this call: CPU, float32/64, no gradient tracking, one
    minibatch for every row (or none) and few enough activations."""
    return not theta.requires_grad and usable_rows(lj, theta.shape[0], idx)


def usable_rows(lj: Any, rows: int, idx: torch.Tensor | None) -> bool:
    """:func:`usable` for ``rows`` rows (or particles) without autograd."""
    if lj.device.type != "cpu" or lj.dtype not in (torch.float32, torch.float64):
        return False
    if idx is not None and idx.dim() != 1:
        return False
    return fits(lj, rows, lj.num_data if idx is None else idx.shape[0])


def fits(lj: Any, rows: int, batch: int) -> bool:
    """The size rule alone: ``rows`` x ``batch`` data points x the widest layer within :data:`MAX_NUMPY_ELEMENTS`."""
    return rows * batch * lj._widest <= MAX_NUMPY_ELEMENTS


def precision_log_prior(lj: Any, u: Any, dt: Any) -> tuple[Any, Any]:
    """:meth:`FlatLogJoint.precision_log_prior <pyrobdl.flat.FlatLogJoint.precision_log_prior>` on arrays (or
    numbers) ``u`` = log tau of dtype ``dt``: log Gamma(tau; a, b) + u and its derivative in u."""
    tau = np.exp(u)
    return dt(lj._gamma_const) + dt(lj._a) * u - dt(lj._b) * tau, dt(lj._a) - dt(lj._b) * tau


def value_and_grad(lj: Any, theta: torch.Tensor, idx: torch.Tensor | None, prior: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Log joint ``[K]`` and gradient ``[K, P]`` of ``lj`` at ``theta`` ``[K, P]`` (the torch kernel's
    contract: ``idx`` ``[B]`` scales the likelihood by N/B), computed in numpy."""
    plan = plan_of(lj)
    with np.errstate(all="ignore"):  # overflow gives inf and nan silently, as in torch (the callers check)
        # (Tensor.numpy() is a view whatever the strides: no copy for a non-contiguous theta either)
        logp, grad = value_and_grad_np(plan, lj, theta.detach().numpy(), None if idx is None else idx.numpy(), prior)
    return torch.from_numpy(logp), torch.from_numpy(grad)


def value_and_grad_np(plan: NumpyPlan, lj: Any, theta: np.ndarray, idx: np.ndarray | None, prior: bool
                      ) -> tuple[np.ndarray, np.ndarray]:
    """The numpy computation behind :func:`value_and_grad` (arrays in, arrays out)."""
    x, y, scale = (plan.x, plan.y, 1.0) if idx is None else (plan.x[idx], plan.y[idx], lj.num_data / idx.shape[0])
    k, b = theta.shape[0], x.shape[0]
    dtype = theta.dtype
    if prior:
        grad = theta * plan.neg_prior_prec
        logp = (theta * grad).sum(1) * dtype.type(0.5) + dtype.type(lj._prior_const)
    else:
        grad = np.zeros_like(theta)
        logp = np.zeros(k, dtype)
    hs, weights, f = _forward(plan, theta, x, k)
    gf = _likelihood(plan, lj, f, y, theta, grad, logp, scale, prior, k, b)
    # backward: g = dlogp/da of layer i
    g = gf
    for i in range(len(plan.layers) - 1, -1, -1):
        wsl, wshape, bsl = plan.layers[i]
        h_in = hs[i]
        grad[:, wsl] += np.matmul(g.transpose(0, 2, 1), h_in).reshape(k, -1)
        if bsl is not None:
            grad[:, bsl] += g.sum(1)
        if i > 0:
            gh = np.matmul(g, weights[i])  # [K, B, in]
            g = gh * (dtype.type(1.0) - h_in * h_in) if plan.tanh else gh * (h_in > 0)
    return logp, grad


def log_likelihood(lj: Any, theta: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
    """The scaled log-likelihood ``[K]`` (:meth:`FlatLogJoint.log_likelihood
    <pyrobdl.flat.FlatLogJoint.log_likelihood>`'s contract), the forward pass alone, in numpy."""
    plan = plan_of(lj)
    theta_np = theta.detach().numpy()
    x, y, scale = (plan.x, plan.y, 1.0) if idx is None else (plan.x[idx.numpy()], plan.y[idx.numpy()],
                                                             lj.num_data / idx.shape[0])
    with np.errstate(all="ignore"):
        f = _forward(plan, theta_np, x, theta_np.shape[0])[2]
        ll = output_log_lik(plan, lj, f, y, theta_np, scale)[0]
    return torch.from_numpy(np.ascontiguousarray(ll))


def _forward(plan: NumpyPlan, theta: np.ndarray, x: np.ndarray, k: int
             ) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """Each layer's input (``[B, in]`` for the data, then ``[K, B, H]``), each layer's weights
    ``[K, out, in]``, and the outputs ``[K, B, O]``."""
    hs, weights = [x], []
    h = x
    last = len(plan.layers) - 1
    for i, (wsl, wshape, bsl) in enumerate(plan.layers):
        w = theta[:, wsl].reshape(k, *wshape)  # [K, out, in]
        weights.append(w)
        a = np.matmul(h, w.transpose(0, 2, 1))  # [K, B, out]
        if bsl is not None:
            a += theta[:, None, bsl]
        if i < last:
            h = np.tanh(a) if plan.tanh else np.maximum(a, theta.dtype.type(0.0))
            hs.append(h)
    return hs, weights, a


def _likelihood(plan: NumpyPlan, lj: Any, f: np.ndarray, y: np.ndarray, theta: np.ndarray, grad: np.ndarray,
                logp: np.ndarray, scale: float, prior: bool, k: int, b: int) -> np.ndarray:
    """Add the scaled log-likelihood of outputs ``f`` ``[K, B, O]`` (and a learned precision's terms) into
    ``logp`` and ``grad``; return ``dlogp/df``."""
    ll, gf, du = output_log_lik(plan, lj, f, y, theta, scale)
    logp += ll
    if du is not None:
        dt = theta.dtype.type
        grad[:, plan.u] += du
        if prior:
            value, slope = precision_log_prior(lj, theta[:, plan.u], dt)
            logp += value
            grad[:, plan.u] += slope
    return gf


def output_log_lik(plan: NumpyPlan, lj: Any, f: np.ndarray, y: np.ndarray, theta: np.ndarray, scale: float
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """:meth:`FlatLogJoint.output_log_lik_and_grad <pyrobdl.flat.FlatLogJoint.output_log_lik_and_grad>` on
    arrays: the scaled log-likelihood ``[K]`` of outputs ``f`` ``[K, B, O]`` for targets ``y``, its
    derivative in ``f``, and in a learned precision's u (else None)."""
    dt = theta.dtype.type
    k, b = f.shape[0], f.shape[1]
    if plan.classification:
        z = f - f.max(-1, keepdims=True)
        e = np.exp(z)
        tot = e.sum(-1, keepdims=True)
        rows, points = np.ogrid[:k, :b]
        ll = (z[rows, points, y] - np.log(tot[..., 0])).sum(1)
        gf = -(e / tot)
        gf[rows, points, y] += dt(1.0)
        return dt(scale) * ll, gf * dt(scale) if scale != 1.0 else gf, None
    r = y - f  # [K, B, O]
    sq = (r * r).sum((1, 2))
    if plan.learned:
        u = theta[:, plan.u]
        tau = np.exp(u)
        m = r.shape[1] * r.shape[2]
        ll = dt(0.5 * m) * (u - dt(_LOG_2PI)) - dt(0.5) * tau * sq
        du = dt(scale) * (dt(0.5 * m) - dt(0.5) * tau * sq)
        return dt(scale) * ll, r * (dt(scale) * tau)[:, None, None], du
    ll = dt(b * lj._lik_const_point) - dt(0.5 * lj._tau) * sq
    return dt(scale) * ll, r * dt(scale * lj._tau), None


_LOG_2PI = float(np.log(2.0 * np.pi))
