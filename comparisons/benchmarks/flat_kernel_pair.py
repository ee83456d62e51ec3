r"""The flat log joint's kernel of an earlier commit against this checkout's, per call, interleaved.

``pyrobdl/flat/kernel.py`` at ``OLD_REV`` (read with ``git show``, loaded as a module beside the
package) and the checkout's own run on the same :class:`~pyrobdl.flat.FlatLogJoint` objects —
the quickstart's shapes (gap: 80 x 1, 1 x 10 tanh; blr: 100 x 3, no hidden layer), wine's
reference shape (1,439 x 11, 1 x 50 tanh) and a two-layer net (200 x 4, 2 x 20 tanh) — at K = 1
(the shape of Pyro's NUTS/HMC and of an SVI step with one particle) and K = 64 (chees); the torch
kernel at both (``FlatLogJoint.numpy_kernel`` off: on the CPU those K = 1 calls otherwise go to
the numpy twin, which neither revision's kernel.py touches).  Each pair is first checked
to agree (value within float32 rounding of a log joint of its size, gradient relative to its
largest entry), then timed in ``--rounds`` rounds of alternating order, medians of process CPU
microseconds per call, one torch thread.  The old kernel must read the same ``FlatLogJoint``
attributes as the new one (true from 64603af on, except f0ca7b0 and 6726406, which lacked ``_zero``).

    python comparisons/benchmarks/flat_kernel_pair.py OLD_REV [--rounds 7] [--shapes gap,blr,wine,2x20] [--work 200000]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import tempfile

import torch

import pyrobdl.flat.logjoint as _logjoint

from _percall import SHAPES, cpu_us_per_call, log_joint  # noqa: E402 (run as a script: its folder is on sys.path)


def old_kernel(rev: str):
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True,
                          cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    src = subprocess.run(["git", "show", f"{rev}:pyrobdl/flat/kernel.py"], capture_output=True, text=True, check=True,
                         cwd=root).stdout
    path = os.path.join(tempfile.mkdtemp(), "kernel_old.py")
    with open(path, "w") as fh:
        fh.write(src)
    spec = importlib.util.spec_from_file_location("kernel_old", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("old_rev")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--work", type=int, default=200_000, help="calls per timing: max(50, WORK // (K * N))")
    args = p.parse_args()
    torch.set_num_threads(1)
    kernels = {"old": old_kernel(args.old_rev), "new": _logjoint._kernel}
    print(f"{'shape':6s} {'K':>3s} {'old us':>9s} {'new us':>9s} {'old/new':>7s}  agreement (value abs, gradient rel)")
    for name in args.shapes.split(","):
        n, d, hidden = SHAPES[name]
        for k in (1, 64):
            lj, g = log_joint(n, d, hidden)
            lj.numpy_kernel = False  # the torch kernel at K = 1 too (not the numpy twin's small calls)
            theta = lj.sample_prior(k, generator=g) * 0.3
            out = {}
            for lab, mod in kernels.items():
                _logjoint._kernel = mod
                out[lab] = lj.value_and_grad(theta)
            dv = (out["new"][0] - out["old"][0]).abs().max().item()
            dg = ((out["new"][1] - out["old"][1]).abs().max() / out["old"][1].abs().max()).item()
            assert dv <= 1e-6 * out["old"][0].abs().max().item() + 1e-3 and dg <= 1e-5, (name, k, dv, dg)
            calls = max(50, args.work // (k * n))
            times = {lab: [] for lab in kernels}
            for r in range(args.rounds):
                for lab in (("old", "new") if r % 2 == 0 else ("new", "old")):
                    _logjoint._kernel = kernels[lab]
                    times[lab].append(cpu_us_per_call(lambda: lj.value_and_grad(theta), calls, 20))
            o, nw = statistics.median(times["old"]), statistics.median(times["new"])
            print(f"{name:6s} {k:3d} {o:9.1f} {nw:9.1f} {o / nw:7.2f}  {dv:.1e}, {dg:.1e}", flush=True)
    _logjoint._kernel = kernels["new"]


if __name__ == "__main__":
    main()
