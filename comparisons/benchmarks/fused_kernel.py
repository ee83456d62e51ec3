r"""The fused kernel (``pyrobdl.flat.fused``) against the torch kernels, per chain-gradient.

For each shape and K it builds the same log joint three ways — ``FlatLogJoint.compile(K,
kernel="fused")``, ``compile(K, kernel="inductor")`` and uncompiled (the eager torch kernel, or its
numpy twin where the size rule sends small calls there) — checks each against the autograd twin, then
times ``value_and_grad`` at K rows: one process, one torch thread, ``--rounds`` rounds in alternating
order of ``--seconds`` of process CPU time each; medians of CPU µs and wall µs per chain-gradient, and
of the products' "peak mm" floor at the shape (``flat_floor.py``'s: their FLOPs at a 512 x 512
``torch.mm``'s rate, timed in every round).

Shapes: ``bnn-tanh`` (the chees benchmark's 500 x 8, 1 x 50 tanh, learned precision), ``bnn-relu``
(the same with relu: the UCI models' activation) and ``gap`` (the quickstart's 80 x 1, 1 x 10 tanh,
fixed precision 100).

    taskset -c 1 python comparisons/benchmarks/fused_kernel.py [--chains 1 8 64] [--shapes bnn-tanh gap]
        [--rounds 7] [--seconds 0.3] [--no-inductor]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from datetime import datetime, timezone

import torch

import pyrobdl
from flat_floor import gemm_flops, peak_rate
from pyrobdl.flat import FlatLogJoint

SHAPES = {
    "bnn-tanh": dict(n=500, d=8, h=50, act="tanh", learned=True),
    "bnn-relu": dict(n=500, d=8, h=50, act="relu", learned=True),
    "gap": dict(n=80, d=1, h=10, act="tanh", learned=False),
}


def build(shape: dict, k: int, inductor: bool) -> tuple[dict, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(shape["n"], shape["d"], generator=g), torch.randn(shape["n"], generator=g)
    lik = (pyrobdl.likelihoods.GaussianLearnedPrecision(6.0, 6.0) if shape["learned"]
           else pyrobdl.likelihoods.Gaussian(100.0))
    model = pyrobdl.BayesianMLP(shape["d"], (shape["h"],), 1, activation=shape["act"],
                                prior=pyrobdl.priors.Gaussian(1.0), likelihood=lik)
    ljs = {"fused": FlatLogJoint(model, x, y, chunk_size="auto"), "eager": FlatLogJoint(model, x, y, chunk_size="auto")}
    ljs["fused"].compile(k, kernel="fused")
    if inductor:
        ljs["inductor"] = FlatLogJoint(model, x, y, chunk_size="auto")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ljs["inductor"].compile(k, kernel="inductor")
    return ljs, ljs["eager"].sample_prior(k, generator=g) * 0.3


def peak_floor_us(shape: dict, seconds: float) -> float:
    """``flat_floor.py``'s "peak mm" floor at this shape, µs: the products' FLOPs of one chain-gradient at a
    512 x 512 ``torch.mm``'s rate."""
    return gemm_flops(shape["n"], shape["d"], shape["h"]) / peak_rate(512, seconds) * 1e6


def measure(name: str, k: int, args) -> None:
    ljs, theta = build(SHAPES[name], k, not args.no_inductor)
    ref_v, ref_g = ljs["eager"].log_prob_grad_autograd(theta)
    checks = []
    for label, lj in ljs.items():
        v, g = lj.value_and_grad(theta)
        checks.append(f"{label} {float((v - ref_v).abs().max() / ref_v.abs().max()):.1e} / "
                      f"{float((g - ref_g).abs().max() / ref_g.abs().max()):.1e}")
    cpu: dict = {label: [] for label in ljs}
    wall: dict = {label: [] for label in ljs}
    floors = []
    with torch.inference_mode():
        for r in range(args.rounds):
            floors.append(peak_floor_us(SHAPES[name], args.seconds / 2))
            for label in (list(ljs) if r % 2 == 0 else list(ljs)[::-1]):
                lj = ljs[label]
                lj.value_and_grad(theta)
                reps, c0, w0 = 0, time.process_time(), time.perf_counter()
                while time.process_time() - c0 < args.seconds:
                    lj.value_and_grad(theta)
                    reps += 1
                cpu[label].append((time.process_time() - c0) / reps / k * 1e6)
                wall[label].append((time.perf_counter() - w0) / reps / k * 1e6)
    med = {label: statistics.median(v) for label, v in cpu.items()}
    medw = {label: statistics.median(v) for label, v in wall.items()}
    cells = " | ".join(f"{med[label]:.2f} ({medw[label]:.2f})" for label in ljs)
    ratios = " | ".join(f"{med['fused'] / med[label]:.3f}" for label in ljs if label != "fused")
    floor = statistics.median(floors)
    print(f"| {name} | {k} | {cells} | {ratios} | {floor:.2f} ({med['fused'] / floor:.2f}x) | {'; '.join(checks)} |",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chains", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=0.3)
    parser.add_argument("--no-inductor", action="store_true", help="skip the Inductor variant (its compile takes ~20 s a shape)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()
    start_cpu, start_wall = time.process_time(), time.perf_counter()
    print(f"# {datetime.now(timezone.utc):%Y-%m-%dT%H:%M}+00:00, torch {torch.__version__}, one thread, "
          f"load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    labels = ["fused", "eager"] + ([] if args.no_inductor else ["inductor"])
    print(f"| shape | K | {' | '.join(f'{label}: CPU µs (wall)' for label in labels)} | "
          f"{' | '.join(f'fused / {label}' for label in labels[1:])} | peak-mm floor, CPU µs (fused / floor) | "
          "max rel. error vs autograd twin (value / gradient) |")
    print("|" + "---|" * (2 + len(labels) + len(labels) - 1 + 2))
    for name in args.shapes:
        for k in args.chains:
            measure(name, k, args)
    load = os.getloadavg()
    print(f"# load after {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {time.process_time() - start_cpu:.0f} CPU s, "
          f"{time.perf_counter() - start_wall:.0f} wall s")


if __name__ == "__main__":
    main()
