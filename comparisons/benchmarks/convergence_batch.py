"""R-hat and bulk/tail ESS of many quantities: ArviZ's per-quantity path against pyrobdl's batch.

``pyrobdl.diagnostics.convergence`` (batched tensor operations) and
``pyrobdl.diagnostics.arviz_adapter.arviz_convergence`` (``az.rhat`` and ``az.ess``) on the same
AR(1) draws, for each ``--shapes`` entry ``chains x draws x quantities``: CPU and wall seconds per
quantity, medians of ``--rounds`` rounds in alternating order, one torch thread by default, and
the largest relative difference between the two results.  With ``--device cuda`` pyrobdl's side
also runs on the GPU (the draws already there, as a CUDA posterior's are).

Usage::

    python comparisons/benchmarks/convergence_batch.py --shapes 64x1000x40 4096x100x10
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from pyrobdl.diagnostics import convergence
from pyrobdl.diagnostics.arviz_adapter import arviz_convergence


def ar1(c: int, d: int, v: int, phi: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = np.empty((c, d, v))
    x[:, 0] = rng.normal(size=(c, v))
    for t in range(1, d):
        x[:, t] = phi * x[:, t - 1] + rng.normal(size=(c, v))
    return x


def clock(fn) -> tuple[float, float, dict]:
    cpu, wall = time.process_time(), time.perf_counter()
    out = fn()
    return time.process_time() - cpu, time.perf_counter() - wall, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["64x1000x40", "1024x100x20", "4096x100x10"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    for shape in args.shapes:
        c, d, v = (int(s) for s in shape.split("x"))
        draws = ar1(c, d, v, 0.5, seed=c + d + v)
        on_device = torch.as_tensor(draws, device=device)

        def ours():
            out = convergence(on_device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return out

        runs = {"arviz": (lambda: arviz_convergence(draws)), "pyrobdl": ours}
        ours()  # warm-up (CUDA context, first kernels)
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
        results = {}
        for r in range(args.rounds):
            for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                cpu, wall, results[name] = clock(runs[name])
                times[name].append((cpu, wall))
        diff = max(float(np.nanmax(np.abs(results["pyrobdl"][k] - results["arviz"][k]) / np.abs(results["arviz"][k])))
                   for k in results["arviz"])
        row = {"shape": shape, "device": str(device), "threads": args.threads, "max_rel_diff": diff}
        for name, ts in times.items():
            row[f"{name}_cpu_s_per_quantity"] = statistics.median(t[0] for t in ts) / v
            row[f"{name}_wall_s_per_quantity"] = statistics.median(t[1] for t in ts) / v
        row["speed-up (CPU s)"] = row["arviz_cpu_s_per_quantity"] / row["pyrobdl_cpu_s_per_quantity"]
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
