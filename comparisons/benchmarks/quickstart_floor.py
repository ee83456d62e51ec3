r"""Is the quickstart's gap reference at its eager floor, and would compiling pay in one run?

The quickstart's gap network (80 points, 1 input, 10 tanh units, fixed noise precision 100) is
tiny: its log joint at K = 64 chains is a few hundred microseconds of some 70 small tensor ops.
This probe measures, in process CPU µs per call of ``FlatLogJoint.value_and_grad``:

- ``eager``: the package's kernel (what ``fit(method="chees")`` and NUTS/HMC's flat potential run);
- ``compiled``: the same after ``FlatLogJoint.compile(K, kernel="inductor")``;
- ``minimal``: a hand-written kernel for exactly this model (one tanh layer, one output, a fixed
  Gaussian likelihood) in [K, N, H] layout with as few ops as the maths needs — a floor for any
  eager rewrite (not in the package; checked equal to the package's kernel first);

at K = 1 (Pyro's NUTS/HMC) and K = 64 (the reference), each variant timed once per round in
alternating order, medians over ``--rounds``.  Then what compiling costs: a fresh process
compiles gap's log joint and then blr's (100 points, 3 inputs, no hidden layer) with an empty
Inductor cache (``cold``: what a new user's first quickstart pays) and again with the cache those
runs filled (``warm``), CPU seconds of the process and its compiler subprocesses.

    python comparisons/benchmarks/quickstart_floor.py [--rounds 5] [--calls 2000]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time


def _cpu() -> float:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def gap_log_joint(n: int = 80, d: int = 1, hidden: tuple = (10,), seed: int = 0):
    import torch

    import pyrobdl
    from pyrobdl.flat import FlatLogJoint

    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, d, generator=g), torch.randn(n, 1, generator=g)
    model = pyrobdl.BayesianMLP(d, list(hidden), 1, activation="tanh", prior=pyrobdl.priors.Gaussian(1.0),
                                likelihood=pyrobdl.likelihoods.Gaussian(precision=100.0))
    return FlatLogJoint(model, x, y), x, y, g


def minimal_kernel(lj, x, y, tau: float = 100.0):
    """The value and gradient of gap's log joint in the fewest ops (one tanh layer, one output)."""
    import torch

    lay = lj.layout
    w0, b0, w1, b1 = (lay[f"layers.{i}.{k}"] for i in (0, 1) for k in ("weight", "bias"))
    n, d = x.shape
    h_units = w0.shape[0]
    neg_prec = -lj._prior_prec
    const = lj._prior_const + 0.5 * n * (math.log(tau) - math.log(2 * math.pi))

    @torch.no_grad()
    def vg(theta):
        k = theta.shape[0]
        grad = theta * neg_prec
        logp = torch.linalg.vecdot(theta, grad).mul_(0.5)
        xk = x.expand(k, n, d)
        h = torch.baddbmm(theta[:, b0.start:b0.stop].unsqueeze(1), xk,
                          theta[:, w0.start:w0.stop].view(k, h_units, d).transpose(1, 2)).tanh_()  # [K, N, H]
        w = theta[:, w1.start:w1.stop]
        r = torch.sub(y, torch.baddbmm(theta[:, b1.start:b1.stop].unsqueeze(1), h, w.unsqueeze(2)))  # [K, N, 1]
        logp.add_(torch.linalg.vecdot(r.view(k, n), r.view(k, n)), alpha=-0.5 * tau).add_(const)
        gf = r.mul_(tau)
        grad[:, w1.start:w1.stop].add_(torch.bmm(h.transpose(1, 2), gf).view(k, h_units))
        grad[:, b1.start:b1.stop].add_(gf.sum(1))
        ga = torch.ops.aten.tanh_backward(gf * w.unsqueeze(1), h)  # [K, N, H]
        grad[:, w0.start:w0.stop].view(k, h_units, d).add_(torch.bmm(ga.transpose(1, 2), xk))
        grad[:, b0.start:b0.stop].add_(ga.sum(1))
        return logp, grad

    return vg


def per_call(rounds: int, calls: int) -> dict:
    import torch

    torch.set_num_threads(1)
    out = {}
    for k in (1, 64):
        lj, x, y, g = gap_log_joint()
        ljc, *_ = gap_log_joint()
        ljc.compile(k, kernel="inductor")
        theta = lj.sample_prior(k, generator=g) * 0.3
        fns = {"eager": lj.value_and_grad, "compiled": ljc.value_and_grad, "minimal": minimal_kernel(lj, x, y)}
        v0, g0 = fns["eager"](theta)
        for name in ("compiled", "minimal"):
            v, gr = fns[name](theta)
            assert torch.allclose(v, v0, rtol=1e-5, atol=1e-3) and torch.allclose(gr, g0, rtol=1e-4, atol=1e-4 * float(g0.abs().max())), name
        times = {name: [] for name in fns}
        for r in range(rounds):
            for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                f = fns[name]
                for _ in range(50):
                    f(theta)
                c = time.process_time()
                for _ in range(calls):
                    f(theta)
                times[name].append((time.process_time() - c) / calls * 1e6)
        out[k] = {name: round(statistics.median(v), 1) for name, v in times.items()}
    return out


def child_compile() -> None:
    """In a fresh process: compile gap's then blr's log joint at K = 64; print CPU seconds of each."""
    import torch

    torch.set_num_threads(1)
    res = {}
    for label, shape in (("gap", dict(n=80, d=1, hidden=(10,))), ("blr", dict(n=100, d=3, hidden=()))):
        lj, *_ = gap_log_joint(**shape)
        c = _cpu()
        lj.compile(64, kernel="inductor")
        res[label] = round(_cpu() - c, 1)
    print(json.dumps(res))


def compile_costs() -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        for label in ("cold", "warm"):
            c = _cpu()
            done = subprocess.run([sys.executable, __file__, "--child-compile"], env=env, capture_output=True, text=True, check=True)
            out[label] = {**json.loads(done.stdout.strip().splitlines()[-1]), "process": round(_cpu() - c, 1)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--child-compile", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child_compile:
        child_compile()
        return
    print(f"load average before: {os.getloadavg()}")
    print("CPU us per call (medians):", json.dumps(per_call(a.rounds, a.calls)))
    print("compiling, CPU s (gap K=64, then blr K=64; 'process' = the whole child incl. imports):",
          json.dumps(compile_costs()))
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
