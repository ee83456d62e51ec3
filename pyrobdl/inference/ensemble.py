r"""Deep ensembles: K MAP (or maximum-likelihood) networks trained together as one batched model.

``fit(model, x, y, method="ensemble", num_members=5, ...)`` packs the K members' weights in one
``[K, P]`` tensor of the flat layout (:mod:`pyrobdl.flat`) and maximises, for every member at
once,

.. math::

    \log p(\theta_k) + \frac{N}{B} \sum_{n \in \mathcal B_k} \log p(y_n \mid x_n, \theta_k)
    \qquad (\text{or only the likelihood term with } ``prior=False``),

with one call of :meth:`~pyrobdl.flat.FlatLogJoint.value_and_grad` per step.  Each member has
its own initialisation (``init_loc``, ``nn.Linear``-style by default) and its own minibatch
order :math:`\mathcal B_k` (``idx [K, B]``); Adam is elementwise, so one Adam over the ``[K, P]``
tensor is K independent Adams.  The posterior is the equal-weight mixture of the members
(Lakshminarayanan, Pritzel & Blundell 2017, without their adversarial training and with the
model's own homoscedastic likelihood).

The optimisation runs in the SVI loop itself (:func:`pyrobdl.inference.svi.optimize`, the one
loop of every SVI method): ``num_steps``, ``lr``, ``batch_size``, ``lr_schedule``,
``average_last`` mean the same, and a non-finite objective stops the run with the same error,
naming the step and the last finite value.  :func:`train_members` is also the MAP fit of
``"laplace"`` and the ensemble initialisation of ``"chees"``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

from ..flat import FlatLogJoint, _check_supported
from ..flat import numpy_kernel
from ..posterior import Cost, Posterior
from .registry import Method, register_method, require_proper_prior
from .starts import check_spread, init_members, spread_starts
from .svi import LoopSettings, PackedAdam, _peak_memory, optimize

__all__ = ["ENSEMBLE_OPTIONS", "EnsemblePosterior", "MemberTraining", "init_members", "run_ensemble", "train_members"]

#: The SVI loop's options that mean something for a point estimate (no particles, KL or ELBO).
LOOP_OPTIONS = ("num_steps", "lr", "batch_size", "lr_schedule", "average_last")

ENSEMBLE_OPTIONS: dict[str, Any] = {
    "num_members": 5,
    "prior": True,
    "init_loc": "linear",
    **{k: getattr(LoopSettings(), k) for k in LOOP_OPTIONS},
    "chunk_size": None,
}
#: Options that exist only beside ``fit(..., init=network)``: member 0 starts at the network, the
#: others at fresh ``nn.Linear``-style draws (``init_spread=None``) or at the network plus
#: ``init_spread`` times N(0, 1) noise in every coordinate.
ENSEMBLE_INIT_OPTIONS: dict[str, Any] = {"init_spread": None}


def loop_settings(options: Mapping[str, Any], num_data: int) -> LoopSettings:
    """The :class:`LoopSettings` of ``options`` (validated): the loop options named in
    :data:`LOOP_OPTIONS`, the others at their defaults."""
    settings = LoopSettings(**{k: options[k] for k in LOOP_OPTIONS})
    settings.validate(num_data)
    return settings


@dataclass(frozen=True)
class MemberTraining:
    """What :func:`train_members` returns.

    Attributes
    ----------
    theta : torch.Tensor
        The trained members, flat and unconstrained, ``[K, P]`` (averaged over the last
        ``average_last`` fraction of steps when that is > 0).
    history : numpy.ndarray
        The objective (log joint, or log-likelihood with ``prior=False``; minibatch estimates)
        of every member at every step, ``[num_steps, K]``.
    gradient_evaluations : int
        Member-gradients evaluated: ``num_steps * K``.
    epochs : float
        Full-data-equivalent passes over all members: ``num_steps * K * B / N``.
    """

    theta: torch.Tensor
    history: np.ndarray
    gradient_evaluations: int
    epochs: float


class _MemberBatches:
    """Shuffled epochs of minibatch indices, one independent order per member, ``[K, B]``.

    Every epoch visits every point once: its last batch holds the ``N mod B`` points left
    (``[K, N mod B]``, the likelihood scaled by ``N / (N mod B)``), as ``torch.utils.data.DataLoader``
    does by default.  Dropping that remainder instead cost 0.05 nats of test LL per point on boston
    against independent torch members (issue 38, docs/methods/ensemble.md)."""

    def __init__(self, num_members: int, num_data: int, batch_size: int, device: torch.device) -> None:
        self.k, self.n, self.b, self.device = num_members, num_data, batch_size, device
        self._perm = torch.empty(num_members, 0, dtype=torch.long, device=device)
        self._pos = 0

    def next(self) -> torch.Tensor | None:
        if self.b >= self.n:
            return None
        if self._pos >= self._perm.shape[1]:
            # K independent permutations (global torch RNG, like the SVI loop's batches)
            self._perm = torch.rand(self.k, self.n, device=self.device).argsort(1)
            self._pos = 0
        idx = self._perm[:, self._pos : self._pos + self.b]
        self._pos += self.b
        return idx


def _member_step(lj: FlatLogJoint, param: torch.Tensor, prior: bool) -> Any:
    """:func:`train_members`'s step: the loss minimised (all members at once) and each member's objective;
    the gradient of the loss left in ``param.grad``."""

    def step_fn(idx: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.inference_mode():  # no autograd bookkeeping; the gradient is only read outside it
            value, grad = lj.value_and_grad(param.detach(), idx, prior=prior)
            grad = grad.neg_()
        param.grad = grad
        return -value.sum(), value

    return step_fn


def _numpy_member_step(lj: FlatLogJoint, param: torch.Tensor, prior: bool) -> Any:
    """:func:`train_members`'s full-batch step at few activations: the log joint's numpy twin called on the
    members' memory directly (what ``lj.value_and_grad`` calls there, without its checks and tensor
    conversions; the same gradient, bit for bit)."""
    plan, members = numpy_kernel.plan_of(lj), param.detach().numpy()

    def step_fn(idx: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        with np.errstate(all="ignore"):
            value, grad = numpy_kernel.value_and_grad_np(plan, lj, members, None, prior)
        param.grad = torch.from_numpy(np.negative(grad, out=grad))
        return torch.from_numpy(np.asarray(-value.sum())), torch.from_numpy(value)

    return step_fn


def train_members(
    lj: FlatLogJoint,
    theta: torch.Tensor,
    settings: LoopSettings,
    *,
    prior: bool = True,
    progress: bool = False,
    desc: str = "ensemble",
) -> MemberTraining:
    """Maximise the log joint (``prior=True``) or the log-likelihood of K members at once.

    Parameters
    ----------
    lj : FlatLogJoint
        The model's flat log joint on the training data.
    theta : torch.Tensor
        Starting points ``[K, P]`` (not modified).
    settings : LoopSettings
        ``num_steps``, ``lr``, ``batch_size``, ``lr_schedule`` and ``average_last`` are used,
        with the SVI loop's meaning; the others are ignored.
    prior : bool, default True
        MAP (log joint) or maximum likelihood.
    progress : bool, default False
        Show a progress bar.
    desc : str
        Its label.

    Returns
    -------
    MemberTraining

    Raises
    ------
    FloatingPointError
        When a member's objective becomes NaN or infinite; the message names the step and the
        last finite value of the members' summed objective (checked every
        :data:`~pyrobdl.inference.svi.CHECK_EVERY` steps, as in the SVI loop, which restores the
        members to their values at the last passed check first).
    """
    k, device = theta.shape[0], theta.device
    steps = settings.num_steps
    param = torch.nn.Parameter(theta.detach().clone())
    batch = settings.effective_batch(lj.num_data)

    if batch >= lj.num_data and lj.numpy_kernel and numpy_kernel.usable_rows(lj, k, None):
        step_fn = _numpy_member_step(lj, param, prior)
    else:
        step_fn = _member_step(lj, param, prior)
    result = optimize(step_fn, [param], PackedAdam([param], settings.lr), settings,
                      _MemberBatches(k, lj.num_data, batch, device), desc=desc, progress=progress,
                      label="log joint" if prior else "log-likelihood", record_shape=(k,))
    return MemberTraining(param.detach().clone(), result.records.double().cpu().numpy(), steps * k,
                          steps * k * batch / lj.num_data)


class EnsemblePosterior(Posterior):
    """The equal-weight mixture of K point estimates.

    :meth:`sample` cycles through the members in order: draw ``i`` is member ``i mod K``, so
    ``num_samples = K`` returns every member once, in order.

    Attributes
    ----------
    theta : torch.Tensor
        The members, flat and unconstrained, ``[K, P]``.
    layout : pyrobdl.flat.FlatLayout
        Their packing.
    """

    def __init__(self, model: Any, theta: torch.Tensor, layout: Any, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.theta = theta
        self.layout = layout

    @property
    def num_members(self) -> int:
        """K."""
        return self.theta.shape[0]

    @property
    def members(self) -> dict[str, torch.Tensor]:
        """Every member's sites, ``{site: [K, *shape]}`` (constrained)."""
        return self.layout.unpack(self.theta)

    def _state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return {"theta": self.theta}, {}

    @classmethod
    def _from_state(cls, model: Any, tensors: Mapping[str, torch.Tensor], extra: Mapping[str, Any],
                    common: Mapping[str, Any]) -> EnsemblePosterior:
        from ..flat import FlatLayout

        layout = FlatLayout(model)
        theta = tensors["theta"]
        if theta.dim() != 2 or theta.shape[1] != layout.size:
            raise ValueError(f"saved ensemble members have shape {list(theta.shape)}, expected [K, {layout.size}]")
        return cls(model, theta, layout, **common)

    def _draw(self, num_samples: int) -> dict[str, torch.Tensor]:
        order = torch.arange(num_samples, device=self.theta.device) % self.num_members
        return self.layout.unpack(self.theta[order])


def _check_options(model: Any, options: Mapping[str, Any]) -> None:
    if options["prior"] not in (True, False):
        raise TypeError(f"prior must be True or False, got {options['prior']!r}")
    require_proper_prior(model, options)
    _check_supported(model)
    k = options["num_members"]
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"num_members must be an integer >= 1, got {k!r}")
    c = options["chunk_size"]
    if c is not None and c != "auto" and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
        raise ValueError(f"chunk_size must be an integer >= 1, 'auto' or None, got {c!r}")
    check_spread(options.get("init_spread"), allow_none=True)
    loop_settings(options, 1)


def run_ensemble(model: Any, x: torch.Tensor, y: torch.Tensor, options: Mapping[str, Any], progress: bool) -> Posterior:
    """Train ``num_members`` networks as one batched model (``fit``'s ``run`` for ``"ensemble"``).

    Parameters
    ----------
    model : pyrobdl.BayesianMLP
        The model, on the data's device.
    x, y : torch.Tensor
        Validated training data.
    options : Mapping
        Every option of :data:`ENSEMBLE_OPTIONS`, plus ``seed`` and ``device``.
    progress : bool
        Show a progress bar.

    Returns
    -------
    EnsemblePosterior
        ``history`` is the members' mean objective per step; ``diagnostics`` holds each
        member's final objective (minibatch estimate) and ``num_members``.
    """
    device = x.device
    settings = loop_settings(options, x.shape[0])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start, cpu_start = time.perf_counter(), time.process_time()
    lj = FlatLogJoint(model, x, y, chunk_size=options["chunk_size"])
    if options.get("init") is None:
        theta0 = init_members(model, lj, options["num_members"], options["init_loc"])
    else:
        theta0 = spread_starts(model, lj, options["init"], options["num_members"], options["init_spread"],
                               keep_first=True)
    trained = train_members(lj, theta0, settings, prior=options["prior"], progress=progress)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    cost = Cost(wall_time_s=wall, gradient_evaluations=trained.gradient_evaluations, epochs=trained.epochs,
                peak_memory_bytes=_peak_memory(device), device=str(device), cpu_time_s=cpu)
    diagnostics = {
        "num_members": options["num_members"],
        "final_objective": [float(v) for v in trained.history[-1]],
        "objective": "log joint" if options["prior"] else "log-likelihood",
    }
    return EnsemblePosterior(model, trained.theta, lj.layout, method="ensemble", settings=dict(options), cost=cost,
                             history=trained.history.mean(1), diagnostics=diagnostics)


register_method(Method(
    "ensemble", ENSEMBLE_OPTIONS, run_ensemble,
    "Deep ensemble: K MAP (or maximum-likelihood) networks trained as one batched model (Lakshminarayanan et al. 2017)",
    check_model=_check_options, init_options=ENSEMBLE_INIT_OPTIONS,
))
