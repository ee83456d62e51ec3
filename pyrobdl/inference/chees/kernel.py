"""The kernel of method "chees": K chains of jittered HMC advanced in lock-step, every leapfrog step
one batched gradient of the flat log joint."""

from __future__ import annotations

import warnings

import torch

from ...flat import FlatLogJoint
from ...flat import fused as _fused


class _Sampler:
    """The state of K lock-step chains and one jittered-HMC transition of all of them."""

    def __init__(self, lj: FlatLogJoint, theta: torch.Tensor, generator: torch.Generator, threshold: float,
                 value_and_grad: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.lj, self.gen, self.threshold = lj, generator, threshold
        self.theta = theta
        # given when they are known (a checkpoint's), so they are not evaluated again
        self.logp, self.grad = value_and_grad if value_and_grad is not None else lj.value_and_grad(theta)
        self.inv_mass = torch.ones(lj.size, dtype=theta.dtype, device=theta.device)
        self.gradients = theta.shape[0]  # chain-gradients evaluated so far

    def momentum(self) -> torch.Tensor:
        z = torch.randn(self.theta.shape, dtype=self.theta.dtype, device=self.theta.device, generator=self.gen)
        return z * self.inv_mass.rsqrt()

    def kinetic(self, p: torch.Tensor) -> torch.Tensor:
        return 0.5 * (p * p * self.inv_mass).sum(-1)

    def leapfrog(self, theta: torch.Tensor, p: torch.Tensor, grad: torch.Tensor, step: float | torch.Tensor, n: int):
        """``n`` leapfrog steps of every chain; ``step`` a number, or ``[K, 1]``: each chain's own.

        Where the log joint compiled a block of steps (:meth:`FlatLogJoint.leapfrog`, ``m`` steps a
        call), the first ``n mod m`` steps run one kernel call each and the rest in blocks."""
        # inference mode: no autograd bookkeeping (version counters, view tracking) on the ~50 small
        # ops of each step (gap: 1.08x less CPU per K = 64 call, 1.25x at K = 1, comparisons/benchmarks/
        # inference_mode.py); the tensors it returns are read, never written in place, outside it
        with torch.inference_mode():
            theta, p = theta.clone(), p + (0.5 * step) * grad
            scaled = step * self.inv_mass
            logp = grad = None
            per_row = isinstance(step, torch.Tensor)
            half = 0.5 * step
            m = self.lj.leapfrog_block
            blocks = n // m if m else 0
            single = n - blocks * m
            for i in range(single):
                theta.addcmul_(scaled, p)
                # the inner steps read only the gradient: the kernel may skip the value's sums
                last = i == single - 1 and not blocks
                logp, grad = self.lj.value_and_grad(theta, value=last)
                if per_row:
                    p.addcmul_(grad, half if last else step)
                else:
                    p.add_(grad, alpha=half if last else step)
            if blocks:
                step_rows = torch.as_tensor(step, dtype=theta.dtype, device=theta.device).expand(theta.shape[0], 1)
                scaled = scaled.expand(theta.shape).contiguous()
                step_rows = step_rows.contiguous()
                half_rows = 0.5 * step_rows
                for b in range(blocks):
                    theta, p, logp, grad = self.lj.leapfrog(theta, p, scaled, step_rows,
                                                            half_rows if b == blocks - 1 else step_rows)
        self.gradients += n * theta.shape[0]
        return theta, p, logp, grad

    def transition(self, step: float, n: int):
        """One HMC iteration for every chain; returns the statistics of the iteration."""
        p0 = self.momentum()
        energy = -self.logp + self.kinetic(p0)
        theta1, p1, logp1, grad1 = self.leapfrog(self.theta, p0, self.grad, step, n)
        energy1 = -logp1 + self.kinetic(p1)
        delta = energy1 - energy
        finite = torch.isfinite(delta) & torch.isfinite(theta1).all(-1) & torch.isfinite(grad1).all(-1)
        diverging = ~finite | (delta > self.threshold)
        accept_prob = torch.where(finite, torch.exp(torch.clamp(-delta, max=0.0)), torch.zeros_like(delta))
        u = torch.rand(accept_prob.shape, dtype=accept_prob.dtype, device=accept_prob.device, generator=self.gen)
        accept = (u < accept_prob) & finite
        theta0 = self.theta
        self.theta = torch.where(accept.unsqueeze(-1), theta1, self.theta)
        self.logp = torch.where(accept, logp1, self.logp)
        self.grad = torch.where(accept.unsqueeze(-1), grad1, self.grad)
        return theta0, theta1, p1, accept_prob, diverging, energy

    def find_step_size(self, step: float, target: float = 0.5, max_tries: int = 40, rows: int | None = None) -> float:
        """Double or halve ``step`` until one leapfrog step's harmonic-mean acceptance crosses
        ``target`` (the heuristic of Hoffman & Gelman 2014, Algorithm 4, across chains; the first
        ``rows`` chains only when given)."""
        def accept_at(eps: float) -> float:
            p0 = self.momentum()
            h0 = -self.logp + self.kinetic(p0)
            _, p1, logp1, _ = self.leapfrog(self.theta, p0, self.grad, eps, 1)
            delta = -logp1 + self.kinetic(p1) - h0
            prob = torch.where(torch.isfinite(delta), torch.exp(torch.clamp(-delta, max=0.0)), torch.zeros_like(delta))
            return _harmonic_mean(prob[:rows])

        direction = 1.0 if accept_at(step) > target else -1.0
        for _ in range(max_tries):
            nxt = step * (2.0**direction)
            a = accept_at(nxt)
            if (direction > 0 and a < target) or (direction < 0 and a > target):
                return step if direction > 0 else nxt
            step = nxt
        return step


def _compile(lj: FlatLogJoint, k: int, option: bool | str) -> float:
    """Compile ``lj`` for K rows as ``option`` asks; the seconds spent (0 when not compiled).

    ``"auto"``: on CUDA ``torch.compile`` (measured on an H100: more than 2x faster end to end at
    K = 1,024); on the CPU the fused kernel (:mod:`pyrobdl.flat.fused`: 2.9-11x less CPU per
    chain-gradient than the eager kernel at the benchmark, relu and quickstart shapes, built in
    1-3 s once per machine) where it applies, else nothing (Inductor: 1.15-1.35x per
    chain-gradient on CPU, for tens of seconds of compiling); there a failure of the compiler
    warns and the run goes on eager.  ``True`` compiles anywhere (the fused kernel where it
    applies, else Inductor) and a failure stops the run (:meth:`FlatLogJoint.compile`).
    """
    if option == "auto":
        if lj.device.type != "cuda" and _fused.unsupported(lj) is not None:
            return 0.0
        try:
            return lj.compile(k, **_block(lj))
        except RuntimeError as err:
            warnings.warn(f"chees: compile='auto' could not compile the log joint on {lj.device} ({err}); "
                          "running eager", RuntimeWarning, stacklevel=3)
            return 0.0
    return lj.compile(k, **_block(lj)) if option else 0.0


def _block(lj: FlatLogJoint) -> dict:
    """:meth:`FlatLogJoint.compile`'s leapfrog block for chees: 4 steps a call on the CPU (the compiled
    kernel's fixed cost per call shared: 0.90x the CPU per leapfrog step at K = 8 on the benchmark BNN
    with Inductor's Python wrapper, 2 and 4 alike, 8 slower; with its C++ wrapper, now the default, 4
    0.87-0.89x and 8 0.83-0.86x, at K = 32 0.80x and 0.76x: 8 is the candidate, 4 what the comparison
    with BlackJAX measured; docs/benchmarks/chees.md); on CUDA none (unmeasured there)."""
    return {"leapfrog_block": LEAPFROG_BLOCK} if lj.device.type == "cpu" else {}


#: leapfrog steps per compiled call of chees on the CPU (:func:`_block`)
LEAPFROG_BLOCK = 4



def _harmonic_mean(prob: torch.Tensor) -> float:
    """Harmonic mean of acceptance probabilities (0 if any is 0)."""
    if bool((prob <= 0).any()):
        return 0.0
    return float(1.0 / (1.0 / prob).mean())

