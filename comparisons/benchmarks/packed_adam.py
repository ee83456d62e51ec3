"""PackedAdam with torch's fused Adam kernel against its five-operation update, inside whole fits.

    python comparisons/benchmarks/packed_adam.py [--rounds 5] [--steps 5000] [METHOD ...]

The quickstart's gap network (1 input, 10 tanh units, Gaussian likelihood of precision 100, 80 random
points), fitted by ``pyrobdl.fit`` for ``--steps`` steps with a cosine schedule, the two kernels
alternating ``--rounds`` times in one process; process CPU seconds, medians (issue 41, tenth session).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import pyrobdl
import pyrobdl.inference.svi as svi


def fit_cpu_s(method: str, steps: int, fused: bool, x: torch.Tensor, y: torch.Tensor) -> float:
    """CPU seconds of one fit with the fused kernel on or off (``_fused_adam_step`` -> None)."""
    probe = svi._fused_adam_step
    if not fused:
        svi._fused_adam_step = lambda params: None
    try:
        model = pyrobdl.BayesianMLP(1, (10,), 1, activation="tanh", likelihood=pyrobdl.likelihoods.Gaussian(100.0))
        start = time.process_time()
        pyrobdl.fit(model, x, y, method=method, num_steps=steps, progress=False, lr_schedule="cosine")
        return time.process_time() - start
    finally:
        svi._fused_adam_step = probe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("methods", nargs="*", default=["mean_field", "map"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(80, 1, generator=g), torch.randn(80, generator=g)
    for method in args.methods:
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for fused in (False, True):
                times[fused].append(fit_cpu_s(method, args.steps, fused, x, y))
        five, fused = statistics.median(times[False]), statistics.median(times[True])
        print(f"{method}: five operations {five:.3f}, fused {fused:.3f} CPU s per {args.steps} steps; "
              f"{five / fused:.3f}x, {(five - fused) / args.steps * 1e6:.1f} us less per step")


if __name__ == "__main__":
    main()
