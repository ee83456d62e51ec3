"""``chees`` with and without ``compile=True`` on the benchmark's 1x50 tanh BNN (500 x 8).

For each K and repeat, the same fit (``num_warmup``, ``num_samples = max(20, 600 / K)``, seed 0)
eager and compiled, interleaved; reported: process CPU seconds beside wall seconds (compilation included), the
compile seconds (wall; the C++ compiler's subprocesses are not in the process CPU clock),
chain-gradients, CPU microseconds per chain-gradient, and the minimum function-space bulk ESS at the first 50 training inputs.  One
torch thread.

    nice -n 10 python comparisons/benchmarks/chees_compile.py --chains 8 16 64 --warmup 300
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
import pyrobdl  # noqa: E402
from chees_vs_numpyro import make_model  # noqa: E402
from nuts_vs_numpyro import make_data  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chains", type=int, nargs="*", default=[8, 16, 64])
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    x, y = (torch.as_tensor(a) for a in make_data(0))
    print(f"load average at start {os.getloadavg()[0]:.1f}")
    print("| K | compile | CPU s | wall s | compile s (wall) | chain-gradients | CPU µs/grad | min fESS | max R-hat |")
    print("|---|---|---|---|---|---|---|---|---|")
    for _ in range(args.repeats):
        for k in args.chains:
            for compiled in (False, True):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    post = pyrobdl.fit(make_model(), x, y, "chees", num_chains=k, num_warmup=args.warmup,
                                       num_samples=max(20, 600 // k), seed=0, progress=False, compile=compiled)
                conv = post.function_space_convergence(x[:50])
                cpu, cs, g = post.cost.cpu_time_s, post.diagnostics["compile_s"], post.cost.gradient_evaluations
                # the compiler's subprocesses are not in the process CPU clock: CPU s understates compiling
                print(f"| {k} | {compiled} | {cpu:.1f} | {post.cost.wall_time_s:.1f} | {cs:.1f} | {g:,} | {cpu / g * 1e6:.1f} "
                      f"| {np.min(conv['ess_bulk']):.0f} | {np.max(conv['rhat']):.3f} |", flush=True)
    print(f"load average at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
