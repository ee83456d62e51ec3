r"""The one SVI loop behind every variational method.

Guides differ; the loop does not.  It takes a model, a guide, a loss module from
:func:`~pyrobdl.inference.elbo.make_elbo` and the loop settings, and returns an
:class:`~pyrobdl.posterior.SVIPosterior`.  Following Pyro's ``examples/svi_torch.py``, the loss is
an ``nn.Module`` stepped by one plain torch optimizer over the guide's own parameters, with
Pyro's global parameter store isolated in a private scope for the duration of the run.
"""

from __future__ import annotations

import math
import resource
import time
from dataclasses import dataclass
from typing import Any, Callable

import pyro
import torch
from tqdm.auto import tqdm

from .._grad import no_grad
from ..posterior import Cost, SVIPosterior
from .elbo import make_elbo
from .flat_step import FusedFlatAdam

__all__ = ["CHECK_EVERY", "LR_SCHEDULES", "LoopResult", "LoopSettings", "PackedAdam", "optimize", "run_svi"]

#: Steps between two finiteness checks of the loss (each one synchronises with the device).
CHECK_EVERY = 50


def _constant(t: float) -> float:
    return 1.0


def _linear(t: float) -> float:
    return 1.0 - 0.9 * t


def _cosine(t: float) -> float:
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * t))


#: Learning-rate multipliers as functions of training progress t in [0, 1].
#: ``linear`` and ``cosine`` decay to 10% of ``lr`` at the last step.
LR_SCHEDULES: dict[str, Callable[[float], float]] = {
    "constant": _constant,
    "linear": _linear,
    "cosine": _cosine,
}


@dataclass(frozen=True)
class LoopSettings:
    """Settings of the SVI loop (the options every SVI method takes).

    Attributes
    ----------
    num_steps : int
        Optimizer steps.
    lr : float
        Adam learning rate.
    batch_size : int or None
        Minibatch size; None for full batch.  Minibatches are drawn without replacement in
        shuffled epochs (the last batch of each holds the ``N mod B`` points left), and the
        likelihood of each batch is scaled by ``N`` over its own size.
    num_particles : int
        Vectorized Monte Carlo samples per step.
    lr_schedule : {"constant", "linear", "cosine"}
        Learning-rate decay over the run (see :data:`LR_SCHEDULES`).
    kl_warmup : int
        Steps over which the KL weight rises linearly from 0 to 1 (0 = no annealing).
    average_last : float
        Fraction of final steps over which guide parameters are averaged (Polyak averaging);
        the averaged parameters are the result.  0 disables it.
    elbo : str
        Estimator, see :func:`~pyrobdl.inference.elbo.make_elbo`.
    kl : str
        KL treatment, ``"analytic"`` or ``"monte_carlo"``.
    """

    num_steps: int = 1000
    lr: float = 1e-2
    batch_size: int | None = None
    num_particles: int = 1
    lr_schedule: str = "constant"
    kl_warmup: int = 0
    average_last: float = 0.1
    elbo: str = "direct"
    kl: str = "analytic"

    def validate(self, num_data: int) -> None:
        """Raise ValueError naming the first invalid setting."""
        for name in ("num_steps", "num_particles"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if not isinstance(self.lr, (int, float)) or not math.isfinite(self.lr) or self.lr <= 0:
            raise ValueError(f"lr must be a finite number > 0, got {self.lr!r}")
        if self.batch_size is not None and (
            isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1
        ):
            raise ValueError(f"batch_size must be None or an integer >= 1, got {self.batch_size!r}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"unknown lr_schedule {self.lr_schedule!r}; valid: {sorted(LR_SCHEDULES)}")
        if isinstance(self.kl_warmup, bool) or not isinstance(self.kl_warmup, int) or self.kl_warmup < 0:
            raise ValueError(f"kl_warmup must be an integer >= 0, got {self.kl_warmup!r}")
        if not isinstance(self.average_last, (int, float)) or not 0 <= self.average_last < 1:
            raise ValueError(f"average_last must be in [0, 1), got {self.average_last!r}")

    def effective_batch(self, num_data: int) -> int:
        return num_data if self.batch_size is None else min(self.batch_size, num_data)


class _Batches:
    """Shuffled epochs of minibatch indices, drawn on the data's device.

    Every epoch visits every point once: its last batch holds the ``N mod B`` points left, as
    ``torch.utils.data.DataLoader`` does by default and as the ensemble's trainer does.  The losses
    scale the likelihood by ``N / len(idx)``, the batch's own size, so every batch -- the short
    last one included -- is an unbiased estimate of the full-data objective (issue 38; before,
    the remainder was dropped and ``N mod B`` points sat out each epoch).
    """

    def __init__(self, num_data: int, batch_size: int, device: torch.device) -> None:
        self.num_data, self.batch_size, self.device = num_data, batch_size, device
        self._perm = torch.empty(0, dtype=torch.long, device=device)
        self._pos = 0

    def next(self) -> torch.Tensor | None:
        if self.batch_size >= self.num_data:
            return None
        if self._pos >= self._perm.shape[0]:
            self._perm = torch.randperm(self.num_data, device=self.device)
            self._pos = 0
        idx = self._perm[self._pos : self._pos + self.batch_size]
        self._pos += self.batch_size
        return idx


def _epochs_covered(steps: int, num_data: int, batch_size: int) -> float:
    """Passes over the data made by ``steps`` minibatches of :class:`_Batches`: each epoch is
    ``ceil(N / B)`` steps (the last one the ``N mod B`` points left) and visits ``N`` points."""
    per_epoch = -(-num_data // batch_size)
    full, rest = divmod(steps, per_epoch)
    return full + rest * batch_size / num_data


def _adam(params: list[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    # The fused kernel measured 3x faster than the default per-tensor loop for the 8 small
    # tensors of a 1x50 guide; older torch or exotic dtypes fall back to the default.
    try:
        return torch.optim.Adam(params, lr=lr, fused=True)
    except (RuntimeError, ValueError, TypeError):
        return torch.optim.Adam(params, lr=lr)


class PackedAdam:
    r"""Adam (Kingma & Ba, 2015) on a few packed tensors, without ``torch.optim``'s per-step wrapper.

    The same update as ``torch.optim.Adam`` with its defaults (:math:`\beta = (0.9, 0.999)`,
    :math:`\epsilon = 10^{-8}`, no weight decay):
    :math:`m \leftarrow \beta_1 m + (1-\beta_1) g`, :math:`v \leftarrow \beta_2 v + (1-\beta_2) g^2`,
    :math:`\theta \leftarrow \theta - \frac{\eta}{1-\beta_1^t}\,
    m / (\sqrt{v / (1-\beta_2^t)} + \epsilon)` — in one call of torch's fused Adam kernel
    (``torch._fused_adam_``, what ``torch.optim.Adam(fused=True)`` runs) where it exists for the
    tensors' device and dtype, else five tensor operations per tensor.  The wrapper of
    ``torch.optim.Optimizer.step`` (hooks, grad-mode and profiler bookkeeping) measured ~100 us per
    step on this project's CPU, as much as the rest of a flat mean-field step for a 1x50 network;
    ``tests/test_flat_elbo.py`` holds both kernels equal to ``torch.optim.Adam`` over many steps.

    Parameters
    ----------
    params : list of torch.Tensor
        Tensors updated in place from their ``.grad``.
    lr : float
        Learning rate; ``param_groups[0]["lr"]`` may be changed between steps, as with torch.
    """

    def __init__(self, params: list[torch.Tensor], lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        self.params = list(params)
        self.param_groups = [{"lr": float(lr)}]
        self.b1, self.b2, self.eps = float(betas[0]), float(betas[1]), float(eps)
        self.exp_avg = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in self.params]
        self.t = 0
        # torch's fused Adam kernel (the one behind ``torch.optim.Adam(fused=True)``): the same
        # update in one call instead of five operations per tensor, 19-24 CPU us less per step in
        # whole fits (comparisons/benchmarks/packed_adam.py); one step tensor shared by every
        # tensor, always equal to ``t``
        self._step = _fused_adam_step(self.params)
        self._one = None if self._step is None else torch.ones((), dtype=self._step.dtype)  # add_(1.0) copies the 1

    @no_grad
    def step(self) -> None:
        """One Adam update of every tensor that has a gradient."""
        self.t += 1
        lr = self.param_groups[0]["lr"]
        if self._step is not None:
            self._step.add_(self._one)
            grads = [p.grad for p in self.params]
            if all(g is not None for g in grads):  # not `None in grads`: a tensor's == costs ~12 us
                torch._fused_adam_(self.params, grads, self.exp_avg, self.exp_avg_sq, [], [self._step] * len(grads),
                                   lr=lr, beta1=self.b1, beta2=self.b2, weight_decay=0.0, eps=self.eps,
                                   amsgrad=False, maximize=False)
                return
        step_size = lr / (1.0 - self.b1**self.t)
        bc2_sqrt = math.sqrt(1.0 - self.b2**self.t)
        for p, m, v in zip(self.params, self.exp_avg, self.exp_avg_sq):
            g = p.grad
            if g is None:
                continue
            m.lerp_(g, 1.0 - self.b1)
            v.mul_(self.b2).addcmul_(g, g, value=1.0 - self.b2)
            p.addcdiv_(m, v.sqrt().div_(bc2_sqrt).add_(self.eps), value=-step_size)


def _fused_adam_step(params: list[torch.Tensor]) -> torch.Tensor | None:
    """A zero step tensor for ``torch._fused_adam_`` when it runs on ``params``' device and dtype
    (tried once on a one-element copy), else None: the five-operation update is used instead
    (torch < 2.4 has no CPU kernel; a private operator may also change between releases)."""
    if not params or not hasattr(torch, "_fused_adam_"):
        return None
    first = params[0]
    if any(p.device != first.device or p.dtype != first.dtype or not p.is_floating_point() for p in params):
        return None
    try:
        probe = [torch.ones(1, dtype=first.dtype, device=first.device) for _ in range(4)]
        step = torch.ones((), dtype=torch.float32, device=first.device)
        torch._fused_adam_([probe[0]], [probe[1]], [probe[2]], [probe[3]], [], [step], lr=0.1, beta1=0.9,
                           beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return None
    return torch.zeros((), dtype=torch.float32, device=first.device)


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@dataclass
class LoopResult:
    """What :func:`optimize` returns.

    Attributes
    ----------
    losses : torch.Tensor
        The minimised objective at every step, ``[num_steps]`` (minibatch estimates).
    records : torch.Tensor or None
        What ``step_fn`` returned beside each loss, stacked ``[num_steps, *record_shape]``
        (None when ``record_shape`` is None).
    """

    losses: torch.Tensor
    records: torch.Tensor | None


def optimize(
    step_fn: Callable[[torch.Tensor | None], Any],
    params: list[torch.Tensor],
    optimizer: Any,
    settings: LoopSettings,
    batches: Any,
    *,
    desc: str,
    progress: bool = False,
    label: str = "ELBO",
    record_shape: tuple[int, ...] | None = None,
    before_step: Callable[[int], None] | None = None,
) -> LoopResult:
    """The one optimisation loop: every SVI method, the ensemble's members and Laplace's MAP fit.

    Each step: ``before_step(step)``; the learning rate of the schedule; ``step_fn(idx)`` with
    the next minibatch from ``batches`` (which computes the loss and leaves its gradient in every
    parameter's ``.grad``); the loss recorded; every :data:`CHECK_EVERY` steps a finiteness
    check; ``optimizer.step()``; Polyak averaging over the last ``average_last`` fraction of
    steps.  An optimizer with ``updates_in_step = True``
    (:class:`~pyrobdl.inference.flat_step.FusedFlatAdam`) is not stepped: ``step_fn`` applied its
    update with the loss (a finiteness check then sees parameters one update further on).  At
    the end the averaged parameters (when averaging is on) are copied into ``params``.

    Parameters
    ----------
    step_fn : callable
        ``step_fn(idx) -> loss`` (a 0-d tensor) or ``(loss, record)`` when ``record_shape`` is
        given; ``idx`` is the minibatch (None for full batch).
    params : list of torch.Tensor
        The tensors ``optimizer`` updates (averaged and restored in place).
    optimizer : torch.optim.Optimizer, PackedAdam or FusedFlatAdam
        Built by the caller over ``params`` with ``lr = settings.lr``.
    settings : LoopSettings
        ``num_steps``, ``lr``, ``lr_schedule`` and ``average_last`` are used here.
    batches : object
        ``batches.next()`` gives each step's minibatch indices (or None).
    desc : str
        Progress-bar label.
    progress : bool, default False
        Show a tqdm progress bar.
    label : str, default "ELBO"
        Name of minus the loss in error messages and the progress bar.
    record_shape : tuple of int, optional
        Shape of the per-step record ``step_fn`` returns beside the loss.
    before_step : callable, optional
        Called with the step number before ``step_fn`` (e.g. the KL warm-up weight).

    Returns
    -------
    LoopResult

    Raises
    ------
    FloatingPointError
        When the loss becomes NaN or infinite; the message names the step and the last finite
        value of ``label``.  The check runs every :data:`CHECK_EVERY` steps (one device
        synchronisation each, not one per step); when it fails, ``params`` are restored to those
        of the last passed check, so they are left finite.
    """
    steps = settings.num_steps
    device, dtype = params[0].device, params[0].dtype
    group = optimizer.param_groups[0]
    schedule = None if settings.lr_schedule == "constant" else LR_SCHEDULES[settings.lr_schedule]
    average_from = steps - int(round(settings.average_last * steps)) if settings.average_last > 0 else steps
    averaged = [p.detach().clone() for p in params] if average_from < steps else []
    losses = torch.empty(steps, dtype=dtype, device=device)
    # on the CPU each loss is written through a numpy view of the same memory: ~0.3 CPU µs a step
    # against ~1.5 for a tensor's __setitem__ (the value is the same: the loss's float converted)
    cpu = device.type == "cpu"
    record = losses.numpy() if cpu else losses
    records = None if record_shape is None else torch.empty(steps, *record_shape, dtype=dtype, device=device)
    records_view = records.numpy() if cpu and records is not None else records
    snapshot = [p.detach().clone() for p in params]
    checked = 0
    bar = tqdm(range(steps), desc=desc, disable=not progress, mininterval=0.5, leave=False)
    fused = getattr(optimizer, "updates_in_step", False)  # step_fn updates the parameters itself
    for step in bar:
        if before_step is not None:
            before_step(step)
        if schedule is not None:  # read by optimizer.step() only, or by a fused step_fn
            group["lr"] = settings.lr * schedule(min(step / max(steps - 1, 1), 1.0))
        out = step_fn(batches.next())
        if records is None:
            record[step] = out.item() if cpu else out  # item(): no Tensor.__array__ (Python) on the CPU
        elif cpu:
            record[step], records_view[step] = out[0].item(), out[1].numpy()
        else:
            record[step], records[step] = out
        if step + 1 - checked >= CHECK_EVERY:
            _check_finite(losses, checked, step + 1, params, snapshot, label=label)
            checked = step + 1
        if not fused:
            optimizer.step()
        if step >= average_from:
            with torch.no_grad():
                torch._foreach_lerp_(averaged, params, 1.0 / (step - average_from + 1))
        if progress and step % 200 == 0:
            bar.set_postfix({label: f"{-float(losses[step]):.4g}"}, refresh=False)
    _check_finite(losses, checked, steps, params, snapshot, label=label)
    if averaged:
        with torch.no_grad():
            torch._foreach_copy_(params, averaged)
    return LoopResult(losses, records)


def run_svi(
    model: Any,
    guide: Any,
    x: torch.Tensor,
    y: torch.Tensor,
    settings: LoopSettings,
    *,
    method: str,
    all_settings: dict[str, Any],
    progress: bool = True,
) -> SVIPosterior:
    """Train ``guide`` on ``model`` and return the posterior.

    Parameters
    ----------
    model : pyrobdl.BayesianMLP
        The model, already on the data's device.
    guide : pyrobdl.guides.BNNGuide
        The guide, already on the data's device.
    x, y : torch.Tensor
        Validated training data (``y`` in the likelihood's shape).
    settings : LoopSettings
        Loop settings.
    method : str
        Registry name, recorded in the posterior.
    all_settings : dict
        Every option of the method, recorded in the posterior.
    progress : bool
        Show a tqdm progress bar.

    Returns
    -------
    SVIPosterior

    Raises
    ------
    FloatingPointError
        When the loss becomes NaN or infinite; the message names the step and the last finite
        ELBO.  The check runs every :data:`CHECK_EVERY` steps (one device synchronisation each,
        not one per step); when it fails, the guide's parameters are restored to those of the
        last passed check, so the guide is left finite.
    """
    device = x.device
    num_data = x.shape[0]
    settings.validate(num_data)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start, cpu_start = time.perf_counter(), time.process_time()

    loss_fn = make_elbo(model, guide, elbo=settings.elbo, kl=settings.kl, num_particles=settings.num_particles)
    # The flat path (FlatELBO) computes its own gradient and optimizes the guide's packed
    # vectors; other losses go through autograd over the guide's parameters.
    flat = hasattr(loss_fn, "loss_and_grad")
    params = loss_fn.parameters_to_optimize() if flat else [p for p in guide.parameters() if p.requires_grad]
    if settings.elbo == "direct_compiled":  # ELBO, gradient and Adam in one compiled graph
        optimizer: Any = FusedFlatAdam(loss_fn, settings.lr)
        params = optimizer.params
    else:
        optimizer = PackedAdam(params, settings.lr) if flat else _adam(params, settings.lr)
    batch = settings.effective_batch(num_data)

    def step_fn(idx: torch.Tensor | None) -> torch.Tensor:
        if settings.elbo == "direct_compiled":
            return optimizer.loss_and_step(x, y, idx)
        if flat:
            return loss_fn.loss_and_grad(x, y, idx)
        loss = loss_fn(x, y, idx)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        return loss.detach()

    def warmup(step: int) -> None:
        loss_fn.kl_weight = min(1.0, (step + 1) / settings.kl_warmup)

    # A private parameter-store scope: Pyro-traced ELBOs register the guide's PyroParams in the
    # global store, where two guides with the same parameter names would overwrite each other.
    with pyro.get_param_store().scope():
        history = optimize(step_fn, params, optimizer, settings, _Batches(num_data, batch, device), desc=method,
                           progress=progress, before_step=warmup if settings.kl_warmup else None).losses
    steps = settings.num_steps
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    cost = Cost(
        wall_time_s=wall,
        gradient_evaluations=steps * settings.num_particles,
        epochs=_epochs_covered(steps, num_data, batch),
        peak_memory_bytes=_peak_memory(device),
        device=str(device),
        cpu_time_s=cpu,
    )
    elbo_history = -history.double().cpu().numpy()
    return SVIPosterior(model, guide, method=method, settings=all_settings, cost=cost, history=elbo_history)


def _check_finite(
    history: torch.Tensor,
    start: int,
    stop: int,
    params: list[torch.Tensor] | None = None,
    snapshot: list[torch.Tensor] | None = None,
    label: str = "ELBO",
) -> None:
    """Raise FloatingPointError naming the first non-finite step of ``history`` (minus the
    objective, per step) in ``[start, stop)`` and the last finite value of the objective
    ``label``, after restoring ``params`` from ``snapshot``; otherwise refresh the snapshot."""
    chunk = history[start:stop]
    finite = torch.isfinite(chunk)
    if bool(finite.all()):
        if snapshot is not None:
            with torch.no_grad():
                torch._foreach_copy_(snapshot, params)
        return
    if snapshot is not None:
        with torch.no_grad():
            torch._foreach_copy_(params, snapshot)
    bad = start + int((~finite).nonzero()[0])
    good = torch.isfinite(history[:bad]).nonzero()
    if good.numel():
        last = int(good[-1])
        detail = f"last finite {label} {-float(history[last]):.6g} at step {last}"
    else:
        detail = f"no finite {label} before it"
    raise FloatingPointError(f"{label} became {-float(history[bad])} at step {bad}; {detail}")
