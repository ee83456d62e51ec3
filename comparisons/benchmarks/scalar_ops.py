"""What a Python number costs in a tensor operation, and how many the SVI steps still make (issue 41).

torch 2.13 copies a Python number into a fresh 0-d tensor (``aten::to`` -> ``aten::_to_copy``) at
every tensor-scalar operation; the hot paths now pass 0-d tensors made once
(``pyrobdl.flat.FlatLogJoint.const``).  This script times both forms of a few operations on a small
vector (``timeit``, inference mode, one thread), checks that they give the same bits, and counts the
``aten::to`` calls per step of the quickstart's SVI methods on the gap network (``torch.profiler``).

    taskset -c 0 python comparisons/benchmarks/scalar_ops.py
"""

from __future__ import annotations

import collections
import timeit
import warnings

import torch

import pyrobdl


def per_op() -> None:
    torch.set_num_threads(1)
    print(f"{'dtype':<8} {'operation':<22} {'number':>8} {'0-d tensor':>10}  same bits")
    for dtype in (torch.float32, torch.float64):
        g = torch.Generator().manual_seed(0)
        t = torch.randn(31, generator=g, dtype=dtype)
        for value in (0.1, 2.5, 100.0, 1.0 / 3.0):
            c = torch.tensor(value, dtype=dtype)
            cases = [("t * v", lambda: t * value, lambda: t * c), ("t + v", lambda: t + value, lambda: t + c),
                     ("torch.rsub(t, v)", lambda: torch.rsub(t, value), lambda: torch.rsub(t, c)),
                     ("t / v", lambda: t / value, lambda: t / c), ("t >= v", lambda: t >= value, lambda: t >= c)]
            with torch.inference_mode():
                for name, number, tensor in cases:
                    same = torch.equal(number(), tensor())
                    if value != 2.5 and same:
                        continue  # timings once per dtype (at 2.5); other values only if they differed
                    a, b = (min(timeit.repeat(f, number=20000, repeat=5)) / 20000 * 1e6 for f in (number, tensor))
                    print(f"{str(dtype)[6:]:<8} {name.replace('v', repr(value)):<22} {a:>6.2f} µs {b:>8.2f} µs  {same}")


def per_step(steps: int = 100) -> None:
    from torch.profiler import profile

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(80, 1, generator=g), torch.randn(80, generator=g)
    warnings.simplefilter("ignore")
    print(f"\n{'method':<22} aten::to per step")
    for method in ("mean_field", "variational_dropout", "bbvi", "map", "dropout", "gaussian_dropout"):
        prior = pyrobdl.priors.LogUniform() if method == "variational_dropout" else pyrobdl.priors.Gaussian(1.0)
        model = pyrobdl.BayesianMLP(1, (10,), 1, activation="tanh", prior=prior,
                                    likelihood=pyrobdl.likelihoods.Gaussian(100.0))
        pyrobdl.fit(model, x, y, method=method, num_steps=20, progress=False)
        with profile() as p:
            pyrobdl.fit(model, x, y, method=method, num_steps=steps, progress=False)
        n = collections.Counter(e.name for e in p.events() if e.cpu_parent is None or e.cpu_parent.name != "aten::to")
        print(f"{method:<22} {n['aten::to'] / steps:.1f}")


if __name__ == "__main__":
    per_op()
    per_step()
