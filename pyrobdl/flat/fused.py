r"""The fused kernel: a one-hidden-layer network's log joint and gradient as one C++ loop per chain.

For the networks of the usual BNN benchmarks — one hidden layer (tanh or relu), one output, a
Gaussian likelihood of fixed or learned precision, a Gaussian prior, float32 on the CPU — the
flat log joint and its gradient are computed by ``_fused.cpp``, one chain at a time, 16 data
points per vector register:

* forward, per block of 16 points: each hidden unit's pre-activation
  :math:`a_h = b_h + \sum_i W_{hi} x_i` (D multiply-adds on vectors), its activation (tanh as a
  rational function :math:`a P(a^2) / Q(a^2)` of degree 9 over 8, within 5.3 float32 ulp of tanh
  everywhere: :func:`tanh`; two hidden units at a time), stored ``[H, N]`` (in cache), the output
  :math:`f`, the residual and :math:`\partial \log p / \partial f = \tau r`, stored ``[N]``;
* backward, two hidden units at a time over the data: :math:`\partial \log p / \partial a_{hn}`
  from the stored activation and :math:`\partial \log p / \partial f_n`, and at once layer 0's
  weight gradient :math:`\sum_n (\partial \log p / \partial a_{hn}) x_{ni}` (eight inputs'
  accumulators in registers), the hidden biases' and the output weights' gradients.

The activations are the one array of size ``[N, H]`` written to memory, once, and read once
(an earlier version also wrote :math:`\partial \log p / \partial a`: 1.15x the CPU); the torch
kernel does it in ~ten calls (two GEMMs over every chain, elementwise passes between them), each
writing its ``[N, K, H]`` result to memory.  The
arithmetic is that of :func:`~pyrobdl.flat.kernel.value_and_grad` summed in another order: equal
to the autograd twin within float32 rounding (``tests/test_flat_fused.py``), not bit for bit.

:meth:`FlatLogJoint.compile <pyrobdl.flat.FlatLogJoint.compile>` uses it where
:func:`unsupported` finds nothing against it; a leapfrog block (:meth:`FusedKernel.leapfrog`)
runs every step of one chain before the next chain's.  The library is compiled once per machine
with the C++ compiler (``$CXX``, else ``g++``, ``c++``, ``clang++``; ``-O3 -march=native``, no
``-ffast-math``: NaN and inf propagate as in torch) and cached under ``$PYROBDL_CACHE_DIR`` (else
``$XDG_CACHE_HOME/pyrobdl``, else ``~/.cache/pyrobdl``), keyed by the source, the compiler and
the CPU, written atomically.

Measured (AMD EPYC, one thread, the chees benchmark's 1 x 50 tanh network, N = 500, D = 8): CPU µs
per chain-gradient in ``docs/benchmarks/chees.md``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

SOURCE = Path(__file__).with_name("_fused.cpp")
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=c++17")
_LANES = 16


def unsupported(lj: Any) -> str | None:
    """Why the fused kernel cannot compute ``lj`` (a FlatLogJoint), or None when it can."""
    model = lj.model
    checks = [
        (lj.device.type == "cpu", f"it runs on the CPU (the data are on {lj.device})"),
        (lj.dtype == torch.float32, f"it is float32 (the data are {lj.dtype})"),
        (lj.has_prior, "it needs the prior (the log joint was built with prior=False)"),
        (len(model.hidden) == 1, f"it implements one hidden layer (the model has {len(model.hidden)})"),
        (model.out_features == 1, f"it implements one output (the model has {model.out_features})"),
        (lj.task != "classification", "it implements a Gaussian likelihood (the model is a classifier)"),
        (lj._act in ("tanh", "relu"), f"it implements tanh and relu (the model has {lj._act})"),
    ]
    for ok, reason in checks:
        if not ok:
            return reason
    return None


class _Net(ctypes.Structure):
    # PyrobdlNet in _fused.cpp: the same fields in the same order
    _fields_ = [(name, ctypes.c_int64) for name in ("P", "N", "NP", "D", "H", "act", "ow0", "ob0", "ow1", "ob1", "ou")] + [
        (name, ctypes.c_float) for name in ("tau", "lik_const", "a", "b", "gamma_const", "prior_const")] + [
        (name, ctypes.c_void_p) for name in ("XT", "y", "mask", "prior_prec")]


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        path = shutil.which(name) if name else None
        if path:
            return path
    raise RuntimeError("the fused kernel needs a C++ compiler ($CXX, g++, c++ or clang++): none was found on PATH")


def _cpu_signature() -> str:
    """The CPU's model and flags (a library built with -march=native runs only where they match)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            lines = [ln for ln in fh.read().splitlines() if ln.startswith(("model name", "flags"))]
        return "\n".join(dict.fromkeys(lines))
    except OSError:
        import platform

        return platform.processor() + platform.machine()


def cache_dir() -> Path:
    """Where the compiled library is kept: ``$PYROBDL_CACHE_DIR``, ``$XDG_CACHE_HOME/pyrobdl`` or ``~/.cache/pyrobdl``."""
    if os.environ.get("PYROBDL_CACHE_DIR"):
        return Path(os.environ["PYROBDL_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pyrobdl"


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL:
    """The compiled kernel, built on first use (seconds) and loaded from the cache after."""
    cxx = _compiler()
    source = SOURCE.read_bytes()
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise RuntimeError(f"the fused kernel's C++ compiler {cxx} does not run ({err})") from err
    key = hashlib.sha256(b"\0".join([source, cxx.encode(), version.encode(), " ".join(FLAGS).encode(),
                                     _cpu_signature().encode()])).hexdigest()[:24]
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        directory = Path(tempfile.gettempdir()) / f"pyrobdl-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
        directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"fused-{key}.so"
    if not path.exists():
        fd, tmp = tempfile.mkstemp(prefix=".fused-", suffix=".so", dir=directory)
        os.close(fd)
        try:
            done = subprocess.run([cxx, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                raise RuntimeError(f"building the fused kernel with {cxx} failed: {done.stderr.strip()[-600:]}")
            os.replace(tmp, path)  # atomic: a concurrent build by another process writes the same file
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(path))
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.pyrobdl_fused_vg.argtypes = [ctypes.POINTER(_Net), ptr, i64, ptr, ptr]
    lib.pyrobdl_fused_vg.restype = None
    lib.pyrobdl_fused_leapfrog.argtypes = [ctypes.POINTER(_Net), ptr, ptr, ptr, ptr, ptr, i64, i64, ptr, ptr, ptr, ptr]
    lib.pyrobdl_fused_leapfrog.restype = None
    lib.pyrobdl_fused_tanh.argtypes = [ptr, i64, ptr]
    lib.pyrobdl_fused_tanh.restype = None
    return lib


def tanh(x: torch.Tensor) -> torch.Tensor:
    r"""The fused kernel's tanh of every element of ``x`` (float32, CPU), as the kernel computes it.

    A rational minimax fit, :math:`x P(x^2) / Q(x^2)` with P and Q of degree 4, on
    :math:`|x| \le 9` (``x`` is clamped there; float32 tanh is :math:`\pm 1` beyond 8.4): at most
    5.3 ulp from tanh at every float32 input, :math:`|\tanh| \le 1 + 2^{-22}` (float32 rounding
    around 1 near the clamp), odd, NaN for NaN, the value at :math:`\pm 9` for :math:`\pm\infty`
    (``comparisons/benchmarks/tanh_rational.py`` fits it and checks every input).
    """
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"fused.tanh takes float32 on the CPU, got {x.dtype} on {x.device}")
    flat = x.detach().contiguous().reshape(-1)
    out = torch.empty_like(flat)
    _library().pyrobdl_fused_tanh(flat.data_ptr(), flat.numel(), out.data_ptr())
    return out.reshape(x.shape)


def _offset(lj: Any, name: str) -> int:
    return lj.layout[name].start if name in lj.layout else -1


class FusedKernel:
    """The fused kernel for one FlatLogJoint (full data, prior included).

    Parameters
    ----------
    lj : FlatLogJoint
        A log joint :func:`unsupported` accepts.

    Raises
    ------
    ValueError
        When :func:`unsupported` gives a reason (it is in the message).
    RuntimeError
        When no C++ compiler is found or the build fails.
    """

    def __init__(self, lj: Any) -> None:
        reason = unsupported(lj)
        if reason is not None:
            raise ValueError(f"the fused kernel does not apply: {reason}")
        self._lib = _library()
        n, d = lj.x.shape
        h = lj.model.hidden[0]
        npad = -(-n // _LANES) * _LANES
        # the arrays the structure points to: kept alive (and unmoved) as long as this object
        self._xt = torch.zeros(d, npad, dtype=torch.float32)
        self._xt[:, :n] = lj.x.t()
        self._y = torch.zeros(npad, dtype=torch.float32)
        self._y[:n] = lj.y.reshape(n)
        self._mask = torch.zeros(npad, dtype=torch.float32)
        self._mask[:n] = 1.0
        self._prec = lj._prior_prec.to(torch.float32).contiguous()
        learned = lj._learned
        self.size = lj.size
        self._net = _Net(
            P=lj.size, N=n, NP=npad, D=d, H=h, act=0 if lj._act == "tanh" else 1,
            ow0=_offset(lj, "layers.0.weight"), ob0=_offset(lj, "layers.0.bias"), ow1=_offset(lj, "layers.1.weight"),
            ob1=_offset(lj, "layers.1.bias"), ou=lj.precision_index if learned else -1,
            tau=0.0 if learned else lj._tau, lik_const=0.0 if learned else n * lj._lik_const_point,
            a=lj._a if learned else 0.0, b=lj._b if learned else 0.0, gamma_const=lj._gamma_const if learned else 0.0,
            prior_const=lj._prior_const, XT=self._xt.data_ptr(), y=self._y.data_ptr(), mask=self._mask.data_ptr(),
            prior_prec=self._prec.data_ptr())

    def _rows(self, t: torch.Tensor, cols: int, name: str) -> torch.Tensor:
        if t.dim() != 2 or t.shape[1] != cols or t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"{name} must be a float32 CPU tensor [K, {cols}], got {t.dtype} {list(t.shape)} on {t.device}")
        return t.contiguous()

    def value_and_grad(self, theta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Log joint ``[K]`` and gradient ``[K, P]`` at ``theta`` ``[K, P]`` (float32, CPU)."""
        theta = self._rows(theta, self.size, "theta")
        k = theta.shape[0]
        logp, grad = theta.new_empty(k), torch.empty_like(theta)
        self._lib.pyrobdl_fused_vg(ctypes.byref(self._net), theta.data_ptr(), k, logp.data_ptr(), grad.data_ptr())
        return logp, grad

    def leapfrog(self, theta: torch.Tensor, p: torch.Tensor, scaled: torch.Tensor, step: torch.Tensor,
                 last: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``steps`` leapfrog steps of every row, as :meth:`FlatLogJoint.leapfrog <pyrobdl.flat.FlatLogJoint.leapfrog>`
        (``theta += scaled * p``; gradient; ``p += step * grad``, ``last`` in the final step); inputs unwritten."""
        theta = self._rows(theta, self.size, "theta")
        k = theta.shape[0]
        p, scaled = self._rows(p, self.size, "p"), self._rows(scaled, self.size, "scaled")
        step, last = self._rows(step, 1, "step"), self._rows(last, 1, "last")
        if p.shape[0] != k or scaled.shape[0] != k or step.shape[0] != k or last.shape[0] != k:
            raise ValueError("theta, p, scaled, step and last must have the same number of rows")
        theta1, p1 = torch.empty_like(theta), torch.empty_like(theta)
        logp, grad = theta.new_empty(k), torch.empty_like(theta)
        self._lib.pyrobdl_fused_leapfrog(ctypes.byref(self._net), theta.data_ptr(), p.data_ptr(), scaled.data_ptr(),
                                         step.data_ptr(), last.data_ptr(), k, int(steps), theta1.data_ptr(),
                                         p1.data_ptr(), logp.data_ptr(), grad.data_ptr())
        return theta1, p1, logp, grad
