"""The :class:`FlatLogJoint` object: the batched log joint of a BayesianMLP, its gradient, its
autograd twin and prior draws (the package docstring, :mod:`pyrobdl.flat`, has the maths)."""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from typing import Any

import torch

from .. import likelihoods as _lik
from .._grad import no_grad
from . import fused as _fused
from . import kernel as _kernel
from . import numpy_kernel as _numpy_kernel
from .compiled import _compiled_entry
from .layout import FlatLayout
from .support import _check_supported, auto_chunk_size

_LOG_2PI = math.log(2.0 * math.pi)
# torch.compiler.is_compiling from torch 2.3 (the requirement allows 2.2, where nothing here is compiled by default)
_is_compiling = getattr(torch.compiler, "is_compiling", lambda: False)


def _inductor_options(device: torch.device) -> Any:
    """Inductor's options for :meth:`FlatLogJoint.compile`'s graphs: on the CPU a C++ wrapper around the
    generated kernels instead of a Python one (``cpp_wrapper``): the same floats, 0.93x the CPU per leapfrog
    step at K = 8 in blocks of 4 and 0.98x at K = 32 (AMD EPYC, 2026-11-30; on the Intel Xeon ~20 µs less
    per kernel call, 2026-11-30); no longer to compile there.  Elsewhere Inductor's defaults."""
    if device.type != "cpu":
        return contextlib.nullcontext()
    import torch._inductor.config as inductor_config

    return inductor_config.patch(cpp_wrapper=True)


class FlatLogJoint:
    r"""Log joint density of a BayesianMLP and its gradient for a batch of flat parameter vectors.

    Parameters
    ----------
    model : pyrobdl.BayesianMLP
        The model (Gaussian prior; Gaussian, learned-precision Gaussian or categorical
        likelihood; relu or tanh).
    x : torch.Tensor
        Training inputs ``[N, in_features]``; their dtype and device are those of every
        computation.
    y : torch.Tensor
        Targets as the model takes them (``[N]``/``[N, out]``, or class labels ``[N]``).
    chunk_size : int or "auto", optional
        Evaluate at most this many rows of ``theta`` at once (bounds memory, e.g. thousands
        of chains on a GPU); None: all at once.  ``"auto"``: on CPU, the most rows (a power of
        two) whose layer activations (N x rows x widest layer) take about 16 MB
        (:func:`auto_chunk_size`): a larger block is mapped afresh by every call, so rows at once
        win until that size and lose above it — at wine's shape (N = 1,439, 1 x 50) 64 rows
        cost 96 CPU us per chain-gradient at once, 134 in chunks of 4 (the rule before: ~1.6 MB),
        320 for 256 rows at once (docs/benchmarks/chees.md); on CUDA all at once.
    prior : bool, default True
        False: the scaled log-likelihood alone (``value_and_grad(..., prior=False)`` and
        :meth:`output_log_lik_and_grad`), for a model whose prior the flat path does not
        implement (the improper log-uniform prior of variational dropout, whose guide brings its
        own KL); the weight prior is then neither checked nor available.

    Attributes
    ----------
    layout : FlatLayout
        The packing of the sites.
    num_data : int
        N.
    numpy_kernel : bool
        Class attribute, default True: calls of at most
        :data:`~pyrobdl.flat.numpy_kernel.MAX_NUMPY_ELEMENTS` activations on the CPU (rows x data
        points x the widest layer) run the kernel's numpy twin (:mod:`pyrobdl.flat.numpy_kernel`,
        2-3x less CPU time at one row of a small network); False: always the torch kernel.

    Raises
    ------
    ValueError
        For an improper prior.
    TypeError
        For a prior, likelihood or activation the fast path does not implement.

    Notes
    -----
    With minibatch indices ``idx`` (``B`` of them) the likelihood term is scaled by
    :math:`N/B`, exactly as the model's ``pyro.plate("data", subsample=...)`` does, so the
    value is an unbiased estimate of the full log joint.

    Examples
    --------
    >>> lj = FlatLogJoint(model, x, y)
    >>> theta = lj.sample_prior(64)                 # [64, P]
    >>> logp, grad = lj.value_and_grad(theta)       # [64], [64, P]
    """

    #: Small calls on the CPU go to the kernel's numpy twin (:mod:`pyrobdl.flat.numpy_kernel`, 0.4-0.8x
    #: the torch kernel's CPU time at up to 16 rows of gap's network); False: always the torch kernel.
    numpy_kernel: bool = True

    def __init__(
        self, model: Any, x: torch.Tensor, y: torch.Tensor, *, chunk_size: int | None = None, prior: bool = True
    ) -> None:
        _check_supported(model, prior=prior)
        self.has_prior = bool(prior)
        if chunk_size == "auto":
            width = max((*model.hidden, model.out_features))
            chunk_size = None if x.device.type == "cuda" else auto_chunk_size(x.shape[0], width, x.element_size())
        elif chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
            raise ValueError(f"chunk_size must be an integer >= 1, 'auto' or None, got {chunk_size!r}")
        self.model = model
        self.layout = FlatLayout(model)
        self.chunk_size = chunk_size
        self.x = x
        self.dtype, self.device = x.dtype, x.device
        self.num_data = x.shape[0]
        lik = model.likelihood
        self.task = lik.task
        y = lik.prepare_targets(y, model.out_features)
        self.y = y.to(device=x.device) if self.task == "classification" else y.to(device=x.device, dtype=x.dtype)
        self._act = model.activation
        self._num_layers = len(model.hidden) + 1
        # per-site prior precision 1/s^2 and normaliser, from the prior's own hook
        self._prior = []
        for site in model.sites if prior else ():
            s = float(model.prior.layer_scale(site))
            self._prior.append((self.layout[site.name], 1.0 / (s * s), -math.prod(site.shape) * (math.log(s) + 0.5 * _LOG_2PI)))
        self._learned = isinstance(lik, _lik.GaussianLearnedPrecision)
        if self._learned:
            self._a, self._b = float(lik.concentration), float(lik.rate)
            self._gamma_const = self._a * math.log(self._b) - math.lgamma(self._a)
            self._prec_slice = self.layout[lik.site]
        elif isinstance(lik, _lik.Gaussian):
            self._tau = float(lik.precision)
        self._x1 = torch.cat([x, x.new_ones(x.shape[0], 1)], 1)
        # the Gaussian prior as one vector of precisions (0 for the likelihood's latents, whose
        # prior is added separately): two tensor ops instead of a handful per site
        self._prior_prec = torch.zeros(self.layout.size, dtype=x.dtype, device=x.device)
        for sl, prec, _ in self._prior:
            self._prior_prec[sl.start : sl.stop] = prec
        self._prior_const = sum(const for _, _, const in self._prior)
        self._neg_prior_prec = -self._prior_prec
        self._half_neg_prior_prec = 0.5 * self._neg_prior_prec  # the prior's quadratic form as one mv
        self._zero = x.new_zeros(())  # the ignored input of a product with beta = 0
        self._consts: dict[float, torch.Tensor] = {}  # const(): numbers as 0-d tensors
        # the sites the kernel's backward pass gives gradients to (the layers'), in layout order; when
        # they are the layout's first columns, their gradients are added as one concatenated block
        self._layer_sites = [s.name for s in self.layout.sites if s.name.startswith("layers.")]
        stop = sum(self.layout[n].size for n in self._layer_sites)
        prefix = all(self.layout[n].stop <= stop for n in self._layer_sites)
        self._layer_stop = stop if prefix else None
        self._split_sizes = [s.size for s in self.layout.sites]
        # per layer: (the weight's index among the split's parts, its shape, the bias's index or None)
        index = {site.name: i for i, site in enumerate(self.layout.sites)}
        self._weight_plan = [(index[f"layers.{i}.weight"], tuple(self.layout[f"layers.{i}.weight"].shape),
                              index.get(f"layers.{i}.bias")) for i in range(self._num_layers)]
        #: a Gaussian likelihood of fixed precision: its normaliser per data point (kernel.py adds B of them)
        self._lik_const_point = (0.5 * model.out_features * (math.log(self._tau) - _LOG_2PI)
                                 if self.task != "classification" and not self._learned else 0.0)
        self._compiled: Any = None
        self._leapfrog_compiled: Any = None
        self._fused: _fused.FusedKernel | None = None
        #: leapfrog steps per :meth:`leapfrog` call, once compiled (:meth:`compile`); 0: none
        self.leapfrog_block = 0
        #: relu into one output unit: the output weight's gradient from layer 0's GEMM (below);
        #: False computes it by its own product (same numbers up to rounding; for tests and timing)
        self._fold_output_grad = True
        #: the eager kernel's tanh layers as sigmoid(2a), the fold (kernel.py); fixed per machine
        self._sigmoid_tanh = _kernel.tanh_through_sigmoid(self.device)
        self._numpy_plan: Any = None
        self._widest = max((model.out_features, *model.hidden))

    def compile(self, batch_size: int, leapfrog_block: int = 0, kernel: str = "auto") -> float:
        """Compile the full-data log joint and gradient for ``[K, P]`` batches.

        Afterwards :meth:`value_and_grad` with ``idx=None`` and ``prior=True`` (what a sampler
        calls) runs the compiled kernel; other calls stay eager.  Two compiled kernels:
        :mod:`~pyrobdl.flat.fused` (one C++ loop per chain, for a one-hidden-layer regression
        network in float32 on the CPU; built once per machine) and ``torch.compile`` of the torch
        kernel (any model; the batch shapes that ``batch_size`` rows produce under
        :attr:`chunk_size` are compiled now).  Either way compilation cost and failures happen
        here, not inside a run.

        Parameters
        ----------
        batch_size : int
            K, the number of rows the caller will pass.
        leapfrog_block : int, default 0
            At least 2: also compile :meth:`leapfrog` (that many leapfrog steps in one graph, for a
            sampler; one call's fixed cost shared by the steps); 0: not.
        kernel : {"auto", "fused", "inductor"}, default "auto"
            ``"fused"``: the fused kernel (:func:`pyrobdl.flat.fused.unsupported` says where it
            does not apply; 2.6-4.5x less CPU per chain-gradient than the Inductor graph on the
            chees benchmark's network at K = 1-256, ``docs/benchmarks/chees.md``); ``"inductor"``:
            ``torch.compile``; ``"auto"``: the fused kernel where it applies, else Inductor.

        Returns
        -------
        float
            Seconds spent compiling.

        Raises
        ------
        ValueError
            For a ``leapfrog_block`` other than 0 or an integer >= 2, an unknown ``kernel``, or
            ``kernel="fused"`` where it does not apply (the reason is in the message).
        RuntimeError
            When compiling fails on this machine (e.g. no C++ compiler); the message says to run
            uncompiled.
        """
        if not isinstance(leapfrog_block, int) or isinstance(leapfrog_block, bool) or leapfrog_block == 1 or leapfrog_block < 0:
            raise ValueError(f"leapfrog_block must be 0 (none) or an integer >= 2, got {leapfrog_block!r}")
        if kernel not in ("auto", "fused", "inductor"):
            raise ValueError(f"kernel must be 'auto', 'fused' or 'inductor', got {kernel!r}")
        start, reason = time.perf_counter(), _fused.unsupported(self)
        if kernel == "fused" and reason is not None:
            raise ValueError(f"kernel='fused' does not apply to this log joint: {reason}")
        if kernel == "fused" or (kernel == "auto" and reason is None):
            try:
                fused = _fused.FusedKernel(self)
            except RuntimeError as err:
                raise RuntimeError(f"{err}; run without compiling (compile=False)") from err
            self._fused, self._compiled, self._leapfrog_compiled, self.leapfrog_block = fused, None, None, leapfrog_block
            return time.perf_counter() - start
        c = self.chunk_size
        sizes = {batch_size} if c is None or batch_size <= c else {c} | ({batch_size % c} - {0})
        try:
            with warnings.catch_warnings():
                # torch 2.13's compiler imports its own deprecated torch.jit.script_method helpers
                warnings.simplefilter("ignore", DeprecationWarning)
                # Inductor's advice to enable TF32 matmuls on CUDA (a UserWarning): taking it would change
                # float32 results, and a caller's warnings-as-errors filter must not turn it into a
                # compilation failure (seen on an H200 under pytest's filterwarnings = error)
                warnings.filterwarnings("ignore", message=".*TensorFloat32 tensor cores", category=UserWarning)
                key = (tuple(self._x1.shape), tuple(self.y.shape), self.y.dtype, self.dtype, str(self.device),
                       tuple(self.model.hidden), self.model.out_features, self._act, type(self.model.likelihood).__name__,
                       self.layout.size, self._fold_output_grad)
                entry = _compiled_entry(lambda theta: self._value_and_grad(theta, None, True, functional=True), key)
                fn = torch.compile(entry, dynamic=False)
                block = None
                if leapfrog_block:
                    block = torch.compile(_compiled_entry(self._leapfrog_steps(leapfrog_block), key + ("leapfrog", leapfrog_block)),
                                          dynamic=False)
                with torch.inference_mode(), _inductor_options(self.device):  # inference: the mode every call runs it in
                    for k in sorted(sizes):  # (_vg): one graph, no recompiling; the first calls compile
                        zeros = torch.zeros(k, self.size, dtype=self.dtype, device=self.device)  # shapes matter, not values
                        fn(zeros)
                        if block is not None:  # distinct tensors (aliasing is guarded), [K, 1] contiguous (strides too)
                            block(*(torch.zeros_like(zeros) for _ in range(3)),
                                  *(torch.zeros(k, 1, dtype=self.dtype, device=self.device) for _ in range(2)))
        except Exception as err:  # torch's compiler raises many types (BackendCompilerFailed, ...)
            raise RuntimeError(f"torch.compile of the flat log joint failed on this machine ({type(err).__name__}: "
                               f"{str(err)[:300]}); run without compiling (compile=False)") from err
        self._compiled, self._leapfrog_compiled, self._fused = fn, block, None
        self.leapfrog_block = leapfrog_block if block is not None else 0
        return time.perf_counter() - start

    def _leapfrog_steps(self, m: int):
        """The function :meth:`leapfrog` compiles: ``m`` leapfrog steps, written out (Dynamo unrolls them)."""
        def steps(theta, p, scaled, step, last):
            for i in range(m):
                theta = theta + scaled * p
                logp, grad = self._value_and_grad(theta, None, True, functional=True)
                p = p + (step if i < m - 1 else last) * grad
            return theta, p, logp, grad
        return steps

    def leapfrog(self, theta: torch.Tensor, p: torch.Tensor, scaled: torch.Tensor, step: torch.Tensor,
                 last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        r""":attr:`leapfrog_block` leapfrog steps of every row in one compiled call (after :meth:`compile`).

        The fused kernel runs every step of one row before the next row's.  Each step is
        ``theta += scaled * p``, the log joint's gradient ``g`` at ``theta``, then
        ``p += step * g`` — by ``last`` instead of ``step`` in the block's final step (a trajectory's
        closing half step, or ``step`` when more follow).  Rows are independent; chunked as
        :meth:`value_and_grad` is.  Inputs are not written.

        Parameters
        ----------
        theta, p, scaled : torch.Tensor
            ``[K, P]``: positions, momenta, and the step times the inverse mass of each row.
        step, last : torch.Tensor
            ``[K, 1]``: each row's step size, and its coefficient of the block's final gradient.

        Returns
        -------
        (torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor)
            Positions and momenta after the block, and the log joint ``[K]`` and gradient ``[K, P]``
            at the final positions.
        """
        if self._fused is not None and self.leapfrog_block:
            return self._fused.leapfrog(theta, p, scaled, step, last, self.leapfrog_block)
        if self._leapfrog_compiled is None:
            raise RuntimeError("FlatLogJoint.leapfrog needs compile(batch_size, leapfrog_block=m) first")
        args, seen = [], set()
        with torch.inference_mode():  # as compiled (see _vg)
            for a in (theta, p, scaled, step, last):
                # Dynamo guards on aliasing (``last is step`` would compile a second graph): distinct tensors
                args.append(a if a.is_inference() and id(a) not in seen else a.clone())
                seen.add(id(a))
            c = self.chunk_size
            if c is None or theta.shape[0] <= c:
                return self._leapfrog_compiled(*args)
            parts = [self._leapfrog_compiled(*(a[i : i + c] for a in args)) for i in range(0, theta.shape[0], c)]
            return tuple(torch.cat([part[j] for part in parts]) for j in range(4))

    # ------------------------------------------------------------------------------- helpers
    @property
    def kernel(self) -> str:
        """What full-data calls run: ``"fused"`` or ``"inductor"`` (after :meth:`compile`), else ``"eager"``."""
        return "fused" if self._fused is not None else "inductor" if self._compiled is not None else "eager"

    @property
    def size(self) -> int:
        """P, the length of a flat parameter vector."""
        return self.layout.size

    def _weights(self, theta: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (weight ``[K, out, in]``, bias ``[K, out]``); zeros for a model without biases."""
        k = theta.shape[0]
        # one split (one dispatch) instead of a slice per site; the sites' order and shapes planned once
        # (looking them up by name per call cost ~10 CPU us of a 64-chain call at gap's shape)
        parts = theta.split_with_sizes(self._split_sizes, 1)
        return [(parts[w].view(k, *shape), theta.new_zeros(k, shape[0]) if b is None else parts[b])
                for w, shape, b in self._weight_plan]

    def _data(self, idx: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, float]:
        # idx [B]: one minibatch for every row of theta; idx [K, B]: row k's own minibatch
        # (x[idx] is then [K, B, in], y[idx] [K, B, ...])
        if idx is None:
            return self.x, self.y, 1.0
        return self.x[idx], self.y[idx], self.num_data / idx.shape[-1]

    def _check_idx(self, idx: torch.Tensor | None, k: int) -> None:
        if idx is None:
            return
        if idx.dim() not in (1, 2) or (idx.dim() == 2 and idx.shape[0] != k):
            raise ValueError(f"idx must have shape [B] or [K={k}, B] (one minibatch per row of theta), "
                             f"got {list(idx.shape)}")

    def sample_prior(self, num: int, *, generator: torch.Generator | None = None) -> torch.Tensor:
        """``num`` independent draws from the prior, flat and unconstrained, ``[num, P]``."""
        theta = torch.empty(num, self.size, dtype=self.dtype, device=self.device)
        for sl, prec, _ in self._prior:
            theta[:, sl.start : sl.stop] = torch.randn(num, sl.size, dtype=self.dtype, device=self.device,
                                                       generator=generator) * prec ** -0.5
        if self._learned:
            conc = torch.full((num,), self._a, dtype=self.dtype, device=self.device)
            g = torch._standard_gamma(conc, generator=generator)  # Gamma(a, 1); divide by the rate
            theta[:, self._prec_slice.start] = (g / self._b).log()
        return theta

    # ------------------------------------------------------------------------ the reference
    def log_joint(self, theta: torch.Tensor, idx: torch.Tensor | None = None, *, prior: bool = True) -> torch.Tensor:
        """Log joint ``[K]`` written with differentiable torch ops (autograd gives its gradient).

        The slow, obviously-correct twin of :meth:`value_and_grad` (``prior=False``: the
        scaled log-likelihood alone); use it for testing or when a second derivative is needed.
        """
        self._check_idx(idx, theta.shape[0])
        x, y, scale = self._data(idx)
        params = self.layout.unpack(theta, constrained=False)
        logp = theta.new_zeros(theta.shape[0])
        for sl, prec, const in self._prior if prior else ():
            v = theta[:, sl.start : sl.stop]
            logp = logp + const - 0.5 * prec * (v * v).sum(-1)
        if self._learned and prior:  # Gamma prior of tau = exp(u) plus the log-Jacobian u
            u = theta[:, self._prec_slice.start]
            logp = logp + self._gamma_const + self._a * u - self._b * u.exp()
        h = x
        for i in range(self._num_layers):
            h = torch.matmul(h, params[f"layers.{i}.weight"].transpose(-1, -2))
            if f"layers.{i}.bias" in params:
                h = h + params[f"layers.{i}.bias"].unsqueeze(-2)
            if i < self._num_layers - 1:
                h = torch.relu(h) if self._act == "relu" else torch.tanh(h)
        return logp + scale * self._log_lik(h, y, theta)[0]

    def _log_lik(self, f: torch.Tensor, y: torch.Tensor, theta: torch.Tensor):
        """Log-likelihood ``[K]`` (unscaled) and, for the learned precision, the Gamma+Jacobian
        term; also returns what the backward pass needs."""
        if self.task == "classification":
            logz = torch.logsumexp(f, -1)  # [K, B]
            picked = f.gather(-1, y.view(-1 if y.dim() == 2 else 1, y.shape[-1], 1).expand(f.shape[0], -1, 1)).squeeze(-1)
            return (picked - logz).sum(-1), logz
        r = y - f  # [K, B, O]
        sq = (r * r).sum((-1, -2))  # [K]
        m = r.shape[-1] * r.shape[-2]
        if self._learned:
            u = theta[:, self._prec_slice.start]
            tau = u.exp()
            return 0.5 * m * (u - _LOG_2PI) - 0.5 * tau * sq, (r, tau, u, m)
        # one normaliser, as kernel.py's; float - tensor as torch.rsub (Tensor.__rsub__ is a Python wrapper)
        c = self.const
        return torch.rsub(c(0.5 * self._tau) * sq, c(r.shape[-2] * self._lik_const_point)), (r, None, None, m)

    def const(self, value: float) -> torch.Tensor | float:
        """A number as a 0-d CPU tensor of the log joint's dtype, made once per value (the hot paths' scalars).

        torch 2.13 copies a Python number into a fresh 0-d tensor (``aten::to``) at every
        tensor-scalar operation, 2.3 against 0.9 µs for a multiplication of a small float32 vector
        (``timeit``, inference mode, the project's 2-core Xeon); with a 0-d tensor of the same dtype
        the operation reads it as it would the number, cast to that dtype once: the same result, bit
        for bit (the kernel's outputs and 15 SVI configurations' fits hashed before and after).

        Parameters
        ----------
        value : float
            The number (a key of the cache: use it for the few constants of a hot path, not for
            values that change every step).

        Returns
        -------
        torch.Tensor or float
            The 0-d tensor; ``value`` itself in half precision (its scalars are computed in float,
            not in half) and inside ``torch.compile``'s tracing (a graph keeps its numbers).
        """
        if self.dtype not in (torch.float32, torch.float64) or _is_compiling():
            return value
        t = self._consts.get(value)
        if t is None:
            if value == 0.0 or value != value:  # +0.0 and -0.0 are one key, NaN none: not cached
                return value
            t = self._consts[value] = torch.tensor(value, dtype=self.dtype)
        return t

    # ----------------------------------------------------------------------------- fast path
    def value_and_grad(
        self, theta: torch.Tensor, idx: torch.Tensor | None = None, *, prior: bool = True, value: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Log joint ``[K]`` and its gradient ``[K, P]`` for flat unconstrained ``theta`` ``[K, P]``.

        Parameters
        ----------
        theta : torch.Tensor
            ``[K, P]`` (or ``[P]``, then the outputs have no leading dim).
        idx : torch.Tensor, optional
            Minibatch indices into the training data; the likelihood is scaled by N/B.
            ``[B]``: the same minibatch for every row of ``theta``; ``[K, B]``: row k's own
            minibatch (ensemble members each with their own data order).
        prior : bool, default True
            Include the log prior (:meth:`log_prior`); False gives the (scaled) log-likelihood
            alone, which variational objectives combine with their own KL terms.
        value : bool, default True
            False: the caller reads only the gradient (a leapfrog's inner steps), and the eager
            torch kernel skips the value's own sums where it can (a Gaussian likelihood of fixed
            precision; ~8% of a 64-chain call at the quickstart's gap shape), returning None for it;
            the other paths still return it.  The gradient is the same either way, bit for bit.

        Returns
        -------
        (torch.Tensor, torch.Tensor)
            The log joint (or None, see ``value``) and its gradient, without autograd history.
        """
        if theta.dim() == 1:
            v, g = self.value_and_grad(theta.unsqueeze(0), idx, prior=prior, value=value)
            return (None if v is None else v[0]), g[0]
        if theta.dim() != 2 or theta.shape[1] != self.size:
            raise ValueError(f"theta must have shape [K, {self.size}], got {list(theta.shape)}")
        k = theta.shape[0]
        self._check_idx(idx, k)
        if prior and not self.has_prior:
            raise ValueError("this FlatLogJoint was built with prior=False: it has no log prior")
        if self._fused is not None and idx is None and prior:  # compile(): one loop per chain, no chunks
            with torch.inference_mode():
                return self._fused.value_and_grad(theta)
        if self.chunk_size is not None and k > self.chunk_size:
            c = self.chunk_size
            rows = (lambda i: idx[i : i + c]) if idx is not None and idx.dim() == 2 else (lambda i: idx)
            parts = [self._vg(theta[i : i + c], rows(i), prior, value) for i in range(0, k, c)]
            values = None if any(p[0] is None for p in parts) else torch.cat([p[0] for p in parts])
            return values, torch.cat([p[1] for p in parts])
        return self._vg(theta, idx, prior, value)

    def _vg(self, theta: torch.Tensor, idx: torch.Tensor | None, prior: bool, value: bool = True
            ) -> tuple[torch.Tensor | None, torch.Tensor]:
        if self._compiled is not None and idx is None and prior:
            # always in inference mode and on an inference tensor, as compiled: torch.compile guards on
            # the grad mode and on theta's dispatch keys, and the samplers call the kernel both inside
            # inference mode (the leapfrog loop) and outside it (a chain's start: one copy)
            with torch.inference_mode():
                return self._compiled(theta if theta.is_inference() else theta.clone())
        if self.numpy_kernel and _numpy_kernel.usable(self, theta, idx):
            return _numpy_kernel.value_and_grad(self, theta, idx, prior)
        return self._value_and_grad(theta, idx, prior, value=value)

    @no_grad
    def log_likelihood(self, theta: torch.Tensor, idx: torch.Tensor | None = None) -> torch.Tensor:
        """The scaled log-likelihood ``[K]`` at ``theta`` ``[K, P]``: the forward pass alone, no gradient.

        What a score-function estimator needs (``pyrobdl.inference.flat_score_function``): the
        likelihood part of :meth:`value_and_grad` (``prior=False``) without its backward pass.
        ``idx`` as in :meth:`value_and_grad` (``[B]`` or ``[K, B]``; the likelihood scaled by N/B).
        """
        self._check_idx(idx, theta.shape[0])
        if self.numpy_kernel and _numpy_kernel.usable(self, theta, idx):
            return _numpy_kernel.log_likelihood(self, theta, idx)
        x1, y, scale = _kernel.batch(self, idx)
        k = theta.shape[0]
        tanh = self._act == "tanh"
        _, _, f = _kernel._forward(x1, self._weights(theta), self._num_layers - 1, tanh, tanh and self._sigmoid_tanh,
                                   x1.dim() == 3, k, x1.shape[-2], self._zero)
        ll, _ = self._log_lik(f, y, theta)
        return ll if scale == 1.0 else ll.mul_(scale)

    @no_grad
    def log_prior(self, theta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r"""The prior part of :meth:`value_and_grad`: ``log p`` ``[K]`` and its gradient ``[K, P]``.

        In unconstrained space: for a learned precision :math:`\tau = e^u` it includes the
        log-Jacobian :math:`u`, like the log joint.

        Raises
        ------
        ValueError
            If the object was built with ``prior=False``.
        """
        if not self.has_prior:
            raise ValueError("this FlatLogJoint was built with prior=False: it has no log prior")
        grad = theta * self._neg_prior_prec  # d/dtheta of the Gaussian prior
        logp = (theta * grad).sum(-1).mul_(0.5).add_(self._prior_const)
        if self._learned:
            value, grad[:, self._prec_slice.start] = self.precision_log_prior(theta)
            logp += value
        return logp, grad

    @property
    def precision_index(self) -> int | None:
        r"""Column of :math:`u = \log\tau` in ``theta`` for a learned noise precision, else None."""
        return self._prec_slice.start if self._learned else None

    def precision_log_prior(self, theta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r"""The learned precision's part of :meth:`log_prior`: :math:`\log\mathrm{Gamma}(e^u; a, b) + u`
        ``[K]`` and its derivative in :math:`u` ``[K]``.

        Raises
        ------
        ValueError
            If the likelihood has no learned precision.
        """
        if not self._learned:
            raise ValueError("the likelihood has no learned precision")
        u = theta[:, self._prec_slice.start]
        tau = u.exp()
        return self._gamma_const + self._a * u - self._b * tau, self._a - self._b * tau

    @no_grad
    def output_log_lik_and_grad(
        self, f: torch.Tensor, idx: torch.Tensor | None, theta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        r"""The scaled log-likelihood of network outputs and its derivatives.

        For a variational path that computes the network's outputs itself (local
        reparameterization samples pre-activations, not weights).

        Parameters
        ----------
        f : torch.Tensor
            Outputs ``[K, B, out]`` for the ``B`` data points ``idx`` (all ``N`` when None).
        idx : torch.Tensor, optional
            Minibatch indices ``[B]``; the log-likelihood is scaled by N/B.
        theta : torch.Tensor
            ``[K, P]``; only the learned precision's column is read.

        Returns
        -------
        (torch.Tensor, torch.Tensor, torch.Tensor or None)
            The scaled log-likelihood ``[K]``, its derivative in ``f`` ``[K, B, out]``, and its
            derivative in :math:`u = \log\tau` ``[K]`` for a learned precision (else None).
        """
        y = self.y if idx is None else self.y[idx]
        scale = 1.0 if idx is None else self.num_data / idx.shape[-1]
        ll, aux = self._log_lik(f, y, theta)
        if self.task == "classification":
            gf = -torch.softmax(f, -1)
            gf.scatter_add_(-1, y.view(1, -1, 1).expand(f.shape[0], -1, 1), torch.ones_like(gf[..., :1]))
            return scale * ll, gf.mul_(scale), None
        r, tau, _, m = aux
        if self._learned:
            du = scale * (0.5 * m - 0.5 * tau * (r * r).sum((-1, -2)))
            return scale * ll, r * (scale * tau).view(-1, 1, 1), du
        return self.const(scale) * ll, r * self.const(scale * self._tau), None

    @no_grad
    def _value_and_grad(
        self, theta: torch.Tensor, idx: torch.Tensor | None, prior: bool = True, functional: bool = False,
        value: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        # the hand-written kernel (pyrobdl/flat/kernel.py); functional: no out= writes (torch.compile)
        return _kernel.value_and_grad(self, theta, idx, prior, functional, value)

    def log_prob_grad_autograd(self, theta: torch.Tensor, idx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`log_joint` and its autograd gradient (testing and timing reference)."""
        with torch.enable_grad():
            t = theta.detach().requires_grad_(True)
            v = self.log_joint(t, idx)
            (g,) = torch.autograd.grad(v.sum(), t)
        return v.detach(), g
