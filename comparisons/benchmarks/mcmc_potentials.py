"""CPU (and wall) microseconds per gradient of NUTS/HMC's potentials, as Pyro's integrator asks for them.

``pyro.ops.integrator.potential_grad`` on the 1x50 tanh benchmark network of ``nuts_vs_numpyro.py``
(500 x 8 points, Gamma(6, 6) noise precision, one torch thread) for each ``potential`` of
``fit(method="nuts" | "hmc")``: Pyro's traced potential, the same under ``torch.jit.trace``, the direct
one and the flat one (docs/methods/mcmc.md, "The potential").  Interleaved rounds, medians.

    python comparisons/benchmarks/mcmc_potentials.py [--rounds 5] [--calls 300] [--cpu-core N]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nuts_vs_numpyro import CONCENTRATION, RATE, D, H, make_data, pin_to_core  # noqa: E402

import pyrobdl  # noqa: E402
from pyrobdl.inference.mcmc_kernels import _direct_potential, _flat_potential  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--cpu-core", type=int, default=None, metavar="N")
    a = p.parse_args()
    pin_to_core(a.cpu_core)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    from pyro.infer.autoguide.initialization import init_to_sample
    from pyro.infer.mcmc.util import initialize_model
    from pyro.ops.integrator import potential_grad

    x, y = (torch.from_numpy(v) for v in make_data(0))
    model = pyrobdl.BayesianMLP(D, (H,), 1, activation="tanh",
                                likelihood=pyrobdl.likelihoods.GaussianLearnedPrecision(CONCENTRATION, RATE))
    _, jit, transforms, _ = initialize_model(model, (x, y), jit_compile=True, skip_jit_warnings=True,
                                             init_strategy=init_to_sample)
    z, traced, _, _ = initialize_model(model, (x, y), init_strategy=init_to_sample)
    fns = {"trace": traced, "trace, jit_compile": jit, "direct": _direct_potential(model, x, y, transforms),
           "flat": _flat_potential(model, x, y)}
    z = {k: v.detach().clone() for k, v in z.items()}
    for fn in fns.values():
        potential_grad(fn, z)
    cpu, wall = {k: [] for k in fns}, {k: [] for k in fns}
    for _ in range(a.rounds):
        for name, fn in fns.items():
            c, w = time.process_time(), time.perf_counter()
            for _ in range(a.calls):
                potential_grad(fn, z)
            cpu[name].append((time.process_time() - c) / a.calls * 1e6)
            wall[name].append((time.perf_counter() - w) / a.calls * 1e6)
    base = np.median(cpu["trace"])
    print(f"load average {os.getloadavg()}; medians of {a.rounds} interleaved rounds of {a.calls} calls")
    print("| potential | CPU µs per gradient | wall µs | vs trace (CPU) |\n|---|---|---|---|")
    for name in fns:
        c = np.median(cpu[name])
        print(f"| {name} | {c:,.0f} | {np.median(wall[name]):,.0f} | {base / c:.1f}× faster |")


if __name__ == "__main__":
    main()
