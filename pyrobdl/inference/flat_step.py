r"""The whole flat SVI step in one ``torch.compile`` graph: ELBO, gradient and Adam update.

``elbo="direct_compiled"`` (issue 41).  The flat path (:mod:`pyrobdl.inference.flat_elbo`) already
computes the negative ELBO and its gradient without autograd, over one packed vector, and
:class:`~pyrobdl.inference.svi.PackedAdam` updates that vector (in torch's fused Adam kernel, or
five tensor operations where that kernel is missing); at
batch 32 on the 1 x 50 benchmark BNN the arithmetic is tiny and the step is some 80 eager torch
operations, each paying the dispatcher.  :class:`FusedFlatAdam` compiles the same operations —
:func:`~pyrobdl.inference.flat_elbo.normal_loss_and_grad` (or
:func:`~pyrobdl.inference.flat_elbo.delta_loss_and_grad` for MAP,
:func:`~pyrobdl.inference.flat_vd.vd_loss_and_grads` for variational dropout) and the Adam
update — into one graph, called once per step.  Outside it stay only what must be equal to the
eager path draw for draw: the step's normal draws (the same calls as the eager path —
``torch.randn``, :func:`~pyrobdl.inference.flat_vd.normal_lrt_noise`,
:func:`~pyrobdl.inference.flat_vd.vd_noise` — so both consume the global generator
identically) and the minibatch indices of the loop.

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
from types import SimpleNamespace
from typing import Any

import torch

from ..flat.compiled import _compiled_entry
from .flat_dropout import dropout_loss_and_grads, dropout_noise
from .flat_vd import normal_lrt_noise, vd_loss_and_grads, vd_noise
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
    return None


def _fused_step(
    lj: Any,
    terms: Any,
    vecs: list[torch.Tensor],
    ms: list[torch.Tensor],
    vs: list[torch.Tensor],
    hyper: torch.Tensor,
    idx: torch.Tensor | None,
    noise: dict,
    plan: Any,
    betas: tuple[float, float, float],
) -> torch.Tensor:
    """One step: the loss and gradients at ``vecs``, then Adam's update of ``vecs``, ``ms``, ``vs``, ``hyper[1]``.

    ``terms``: the family and what its objective reads besides the data (a plain namespace, not
    the guide module, so that Dynamo guards on values); ``noise``: the step's draws, as the eager
    path draws them; ``plan``: the family's index plan (:mod:`pyrobdl.inference.flat_dropout`,
    :mod:`pyrobdl.inference.flat_vd`) or None.
    """
    b1, b2, adam_eps = betas
    vec = vecs[0]
    beta = hyper[2].to(vec.dtype)
    if terms.family == "normal":
        p = vec.shape[0] // 2
        loss, grad = normal_loss_and_grad(lj, terms.kl_terms, vec[:p], vec[p:], noise["eps"], idx, beta, plan,
                                          noise.get("preactivations"), functional=True)
        grads = [grad]
    elif terms.family == "delta":  # a point mass (MAP)
        loss, grad = delta_loss_and_grad(lj, vec, idx, beta, functional=True)
        grads = [grad]
    elif terms.family == "variational_dropout":
        loss, grads = vd_loss_and_grads(terms, plan, lj, vec[: lj.size], vec[lj.size :], noise, idx,
                                        terms.analytic_kl, beta, functional=True)
    else:  # MC dropout: the means, and the learned precision's [loc, rho] when there is one
        fallback = vecs[1] if len(vecs) > 1 else None
        loss, grads = dropout_loss_and_grads(terms, plan, lj, vec, fallback, noise, idx,
                                             terms.analytic_kl, beta, functional=True)
    t = hyper[1] + 1.0
    hyper[1] = t
    step_size = (hyper[0] / (1.0 - b1**t)).to(vec.dtype)
    bc2_sqrt = torch.sqrt(1.0 - b2**t).to(vec.dtype)
    for p_, g, m, v in zip(vecs, grads, ms, vs):  # PackedAdam.step's operations
        m.lerp_(g, 1.0 - b1)
        v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
        p_.sub_(step_size * m / (v.sqrt() / bc2_sqrt + adam_eps))
    return loss


class FusedFlatAdam:
    r"""Adam over a flat guide's packed vectors, fused with the flat ELBO's step (optionally compiled).

    The SVI loop's optimizer for ``elbo="direct_compiled"``: :meth:`loss_and_step` computes the
    negative ELBO and its gradient and applies Adam's update (:math:`\beta = (0.9, 0.999)`,
    :math:`\epsilon = 10^{-8}`, as :class:`~pyrobdl.inference.svi.PackedAdam`) in one call, so the
    loop does not call a separate ``step()`` (:attr:`updates_in_step`).

    Parameters
    ----------
    loss_fn : FlatELBO
        A flat ELBO (every family: mean field with or without local reparameterization, MAP,
        MC dropout, variational dropout).
    lr : float
        Learning rate; ``param_groups[0]["lr"]`` may be changed between steps, as with torch.
    compile : bool, default True
        Compile the step with ``torch.compile`` at the first call (False runs the same
        operations eagerly: for tests, and where no C++ compiler is available).

    Attributes
    ----------
    params : list of torch.Tensor
        The packed vectors it updates (views of the guide's parameters).
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
        self.params = list(loss_fn.parameters_to_optimize())
        self.vector = self.params[0]
        self.param_groups = [{"lr": float(lr)}]
        self.exp_avg = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in self.params]
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

    def _terms(self) -> SimpleNamespace:
        """The family and what its objective reads of the guide and the ELBO, as plain values."""
        elbo, g = self.loss_fn, self.loss_fn.guide
        terms = SimpleNamespace(family=elbo.family, analytic_kl=elbo.analytic_kl)
        if elbo.family == "normal":
            terms.kl_terms = elbo._kl_terms()
        elif elbo.family == "variational_dropout":
            terms.sparse, terms.approximation = bool(g.sparse), g.approximation
            terms.local_reparameterization = bool(g.local_reparameterization)
        elif elbo.family == "dropout":
            terms.sigma, terms.kind = float(g.sigma), g.kind
        return terms

    def _noise(self, batch: int) -> dict:
        """The step's draws, by the eager path's own functions (the same generator calls in the same order)."""
        elbo = self.loss_fn
        s, lj, plan = elbo.num_particles, elbo._lj, elbo._plan
        if elbo.family == "variational_dropout":
            return vd_noise(elbo.guide, plan, s, batch, lj)
        if elbo.family == "dropout":
            return dropout_noise(elbo.guide, plan, s, lj)
        if elbo.family == "normal" and plan is not None:  # local reparameterization
            return normal_lrt_noise(plan, s, batch, lj)
        if elbo.family == "normal":
            v = self.vector
            return {"eps": torch.randn(s, v.shape[0] // 2, dtype=v.dtype, device=v.device)}
        return {}

    def _build(self, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor | None) -> Any:
        elbo = self.loss_fn
        lj = elbo._log_joint(x, y)
        terms, plan = self._terms(), elbo._plan  # plan: NormalLRTPlan, DropoutPlan, VDPlan or None
        betas = (0.9, 0.999, 1e-8)

        def step(vecs, ms, vs, hyper, idx, noise):
            return _fused_step(lj, terms, vecs, ms, vs, hyper, idx, noise, plan, betas)

        if not self.compile:
            return step
        # one code object per kind of step (Dynamo's limit of 8 recompilations is per code
        # object); the data and the packed vectors are graph inputs, so fits of the same shapes
        # (another seed, another split) reuse the compiled graph; the Python numbers the graph
        # bakes in (prior, likelihood and guide constants) are part of the key
        consts = (lj._prior_const, getattr(lj, "_tau", None), getattr(lj, "_a", None), getattr(lj, "_b", None),
                  repr(sorted((k, v) for k, v in vars(terms).items() if k != "kl_terms")),
                  terms.kl_terms[1:] if elbo.family == "normal" else None)
        key = ("svi_step", consts, elbo.num_particles, tuple(lj._x1.shape), tuple(lj.y.shape), lj.y.dtype, lj.dtype,
               str(lj.device), tuple(elbo.model.hidden), elbo.model.out_features, lj._act,
               type(elbo.model.likelihood).__name__, lj.layout.size, tuple(p.numel() for p in self.params),
               None if idx is None else tuple(idx.shape), type(plan).__name__)
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
        if self._fn is None or x is not self._data[0] or y is not self._data[1]:
            # the step is built for these data (the loop passes the same tensors every step)
            self._fn, self._data = None, (x, y)
            self.loss_fn._log_joint(x, y)
        args = (self.params, self.exp_avg, self.exp_avg_sq, self._hyper, idx,
                self._noise(x.shape[0] if idx is None else idx.shape[-1]))
        if self._fn is not None:
            return self._fn(*args)
        if not self.compile:
            self._fn = self._build(x, y, idx)
            return self._fn(*args)
        start = time.perf_counter()
        try:
            with warnings.catch_warnings():
                # torch's compiler imports its own deprecated helpers; see FlatLogJoint.compile
                warnings.simplefilter("ignore", DeprecationWarning)
                warnings.filterwarnings("ignore", message=".*TensorFloat32 tensor cores", category=UserWarning)
                self._fn = self._build(x, y, idx)
                loss = self._fn(*args)
        except Exception as err:  # torch's compiler raises many types (BackendCompilerFailed, ...)
            self._fn = None
            raise RuntimeError(f"torch.compile of the SVI step failed on this machine ({type(err).__name__}: "
                               f"{str(err)[:300]}); use elbo='direct'") from err
        self.compile_seconds = time.perf_counter() - start
        return loss
