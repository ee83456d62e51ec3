r"""The whole flat SVI step in one ``torch.compile`` graph: ELBO, gradient and Adam update.

``elbo="direct_compiled"`` (issue 41).  The flat path (:mod:`pyrobdl.inference.flat_elbo`) already
computes the negative ELBO and its gradient without autograd, over one packed vector, and
:class:`~pyrobdl.inference.svi.PackedAdam` updates that vector in five tensor operations; at
batch 32 on the 1 x 50 benchmark BNN the arithmetic is tiny and the step is some 80 eager torch
operations, each paying the dispatcher.  :class:`FusedFlatAdam` compiles the same operations —
:func:`~pyrobdl.inference.flat_elbo.normal_loss_and_grad` (or
:func:`~pyrobdl.inference.flat_elbo.delta_loss_and_grad` for MAP) and the Adam update — into one
graph, called once per step.  Outside it stay only what must be equal to the eager path draw for
draw: the step's standard normals (``torch.randn``, the same call as the eager path, so both
consume the global generator identically) and the minibatch indices of the loop.

The learning rate, the KL weight :math:`\beta` and Adam's step count live in one float64 tensor
``[lr, t, beta]`` read inside the graph (a Python float would be baked into the graph and force a
recompilation whenever a schedule changes it); Adam's bias corrections are computed from ``t``
inside the graph.  ``tests/test_flat_step.py`` holds the loss and the parameters after many steps
equal, to float rounding, to :class:`~pyrobdl.inference.flat_elbo.FlatELBO` stepped by
:class:`~pyrobdl.inference.svi.PackedAdam` (itself equal to ``torch.optim.Adam``), eagerly and
compiled.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch

from ..flat.compiled import _compiled_entry
from .flat_elbo import FlatELBO, delta_loss_and_grad, normal_loss_and_grad

__all__ = ["FusedFlatAdam", "fused_support"]


def fused_support(loss_fn: Any) -> str | None:
    """Why the fused (compiled) step cannot run this loss, or None when it can.

    Parameters
    ----------
    loss_fn : object
        The SVI loop's loss module.

    Returns
    -------
    str or None
        A reason in words.
    """
    if not isinstance(loss_fn, FlatELBO):
        return f"the loss {type(loss_fn).__name__} is not pyrobdl's flat ELBO (the model or guide has no flat form)"
    if loss_fn.family not in ("normal", "delta"):
        return f"the guide's family {loss_fn.family!r} has no fused step (mean_field and map have)"
    if loss_fn.family == "normal" and getattr(loss_fn.guide, "local_reparameterization", False):
        return "mean field with local_reparameterization=True has no fused step"
    return None


def _fused_step(
    lj: Any,
    kl_terms: tuple[torch.Tensor, float, bool] | None,
    vec: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    hyper: torch.Tensor,
    idx: torch.Tensor | None,
    eps: torch.Tensor | None,
    betas: tuple[float, float, float],
) -> torch.Tensor:
    """One step: the loss and gradient at ``vec``, then Adam's update of ``vec``, ``m``, ``v``, ``hyper[1]``."""
    b1, b2, adam_eps = betas
    p = vec.shape[0] if kl_terms is None else vec.shape[0] // 2
    beta = hyper[2].to(vec.dtype)
    if kl_terms is None:  # a point mass (MAP)
        loss, grad = delta_loss_and_grad(lj, vec, idx, beta, functional=True)
    else:
        loss, grad = normal_loss_and_grad(lj, kl_terms, vec[:p], vec[p:], eps, idx, beta, functional=True)
    t = hyper[1] + 1.0
    hyper[1] = t
    step_size = (hyper[0] / (1.0 - b1**t)).to(vec.dtype)
    bc2_sqrt = torch.sqrt(1.0 - b2**t).to(vec.dtype)
    # PackedAdam.step's operations
    m.lerp_(grad, 1.0 - b1)
    v.mul_(b2).addcmul_(grad, grad, value=1.0 - b2)
    vec.sub_(step_size * m / (v.sqrt() / bc2_sqrt + adam_eps))
    return loss


class FusedFlatAdam:
    r"""Adam over a flat guide's packed vector, fused with the flat ELBO's step (optionally compiled).

    The SVI loop's optimizer for ``elbo="direct_compiled"``: :meth:`loss_and_step` computes the
    negative ELBO and its gradient and applies Adam's update (:math:`\beta = (0.9, 0.999)`,
    :math:`\epsilon = 10^{-8}`, as :class:`~pyrobdl.inference.svi.PackedAdam`) in one call, so the
    loop does not call a separate ``step()`` (:attr:`updates_in_step`).

    Parameters
    ----------
    loss_fn : FlatELBO
        A flat ELBO of a mean-field (without local reparameterization) or MAP guide.
    lr : float
        Learning rate; ``param_groups[0]["lr"]`` may be changed between steps, as with torch.
    compile : bool, default True
        Compile the step with ``torch.compile`` at the first call (False runs the same
        operations eagerly: for tests, and where no C++ compiler is available).

    Attributes
    ----------
    compile_seconds : float
        Wall seconds the first (compiling) call took; 0 before it.

    Raises
    ------
    ValueError
        If :func:`fused_support` gives a reason.
    """

    #: The loop must not call ``step()``: :meth:`loss_and_step` updated the parameters.
    updates_in_step = True

    def __init__(self, loss_fn: FlatELBO, lr: float, compile: bool = True) -> None:
        reason = fused_support(loss_fn)
        if reason is not None:
            raise ValueError(f"elbo='direct_compiled' cannot run: {reason}; use elbo='direct'")
        self.loss_fn = loss_fn
        (self.vector,) = loss_fn.parameters_to_optimize()
        self.params = [self.vector]
        self.param_groups = [{"lr": float(lr)}]
        self.exp_avg = torch.zeros_like(self.vector)
        self.exp_avg_sq = torch.zeros_like(self.vector)
        self._hyper = torch.tensor([float(lr), 0.0, float(loss_fn.kl_weight)], dtype=torch.float64,
                                   device=self.vector.device)
        self._lr, self._beta = float(lr), float(loss_fn.kl_weight)
        self.compile = bool(compile)
        self.compile_seconds = 0.0
        self._fn: Any = None
        self._data: tuple[Any, Any] = (None, None)

    @property
    def t(self) -> int:
        """Adam's step count."""
        return int(self._hyper[1])

    def _build(self, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor | None) -> Any:
        elbo = self.loss_fn
        lj = elbo._log_joint(x, y)
        kl_terms = elbo._kl_terms() if elbo.family == "normal" else None
        betas = (0.9, 0.999, 1e-8)

        def step(vec, m, v, hyper, idx, eps):
            return _fused_step(lj, kl_terms, vec, m, v, hyper, idx, eps, betas)

        if not self.compile:
            return step
        # one code object per kind of step (Dynamo's limit of 8 recompilations is per code
        # object); the data and the packed vectors are graph inputs, so fits of the same shapes
        # (another seed, another split) reuse the compiled graph; the Python numbers the graph
        # bakes in (prior and likelihood constants) are part of the key
        consts = (lj._prior_const, getattr(lj, "_tau", None), getattr(lj, "_a", None), getattr(lj, "_b", None),
                  None if kl_terms is None else kl_terms[1:])
        key = ("svi_step", elbo.family, consts, elbo.num_particles, tuple(lj._x1.shape),
               tuple(lj.y.shape), lj.y.dtype, lj.dtype, str(lj.device), tuple(elbo.model.hidden),
               elbo.model.out_features, lj._act, type(elbo.model.likelihood).__name__, lj.layout.size,
               None if idx is None else tuple(idx.shape))
        return torch.compile(_compiled_entry(step, key), dynamic=False)

    @torch.no_grad()
    def loss_and_step(self, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
        """The negative ELBO at the current parameters (a detached scalar), after which they take one Adam step.

        Raises
        ------
        RuntimeError
            When ``torch.compile`` fails on this machine (e.g. no C++ compiler); the message
            says to use ``elbo="direct"``.
        """
        lr, beta = float(self.param_groups[0]["lr"]), float(self.loss_fn.kl_weight)
        if lr != self._lr or beta != self._beta:
            self._hyper[0], self._hyper[2] = lr, beta
            self._lr, self._beta = lr, beta
        vec = self.vector
        eps = None
        if self.loss_fn.family == "normal":  # the eager path's draw, from the same generator
            eps = torch.randn(self.loss_fn.num_particles, vec.shape[0] // 2, dtype=vec.dtype, device=vec.device)
        if self._fn is not None and x is self._data[0] and y is self._data[1]:
            return self._fn(vec, self.exp_avg, self.exp_avg_sq, self._hyper, idx, eps)
        self._data = (x, y)  # the step is built for these data (the loop passes the same tensors every step)
        if not self.compile:
            self._fn = self._build(x, y, idx)
            return self._fn(vec, self.exp_avg, self.exp_avg_sq, self._hyper, idx, eps)
        start = time.perf_counter()
        try:
            with warnings.catch_warnings():
                # torch's compiler imports its own deprecated helpers; see FlatLogJoint.compile
                warnings.simplefilter("ignore", DeprecationWarning)
                warnings.filterwarnings("ignore", message=".*TensorFloat32 tensor cores", category=UserWarning)
                self._fn = self._build(x, y, idx)
                loss = self._fn(vec, self.exp_avg, self.exp_avg_sq, self._hyper, idx, eps)
        except Exception as err:  # torch's compiler raises many types (BackendCompilerFailed, ...)
            self._fn = None
            raise RuntimeError(f"torch.compile of the SVI step failed on this machine ({type(err).__name__}: "
                               f"{str(err)[:300]}); use elbo='direct'") from err
        self.compile_seconds = time.perf_counter() - start
        return loss
