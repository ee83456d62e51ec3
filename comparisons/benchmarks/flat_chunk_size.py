"""CPU µs per chain-gradient of ``FlatLogJoint.value_and_grad`` for each ``chunk_size``, at the
UCI reference shapes (1 x 50 ReLU, learned noise precision; yacht, concrete, wine, kin8nm and power
training sizes) and the 1 x 50 tanh benchmark shape, K chains at once (eager kernel, one torch thread).

Only shapes matter for the timing, so the data are Gaussian noise and the states prior draws
scaled by 0.3.  Each chunk size is timed in loops of ``--seconds`` of process CPU time for
``--rounds`` rounds; medians are printed, with the size ``chunk_size="auto"`` picks (and the
size the rule before issue 41 picked: about 400,000 numbers per layer's activations).

By default the sizes of one shape are timed in one process, interleaved (alternating order per
round).  ``--fresh`` times each (shape, K, size) in a process of its own, as a fit starts: glibc's
``malloc`` adapts its thresholds to what the process has freed so far, so sizes timed in one
process share that state, and a block above glibc's 32 MB ceiling (``pyrobdl.retain_freed_memory``)
is mapped afresh on every call whatever came before.  ``--retain-freed-memory`` applies that setting
(in every process), as the suite runner does.  Use it to choose ``chunk_size`` for long runs on a
new machine.

``--fit DATASET`` times whole chees fits instead (``pyrobdl.fit(method="chees")``, the UCI reference
model of ``comparisons/uci_references.py`` on split 0 of DATASET, superchains of 8, ``--warmup`` +
``--samples`` iterations, seed 0): one fresh process per (chunk size, round), the sizes alternating;
``auto`` is the default.

    python comparisons/benchmarks/flat_chunk_size.py --chains 64
    python comparisons/benchmarks/flat_chunk_size.py --chains 8 64 256 --fresh --sizes 4 16 64
    python comparisons/benchmarks/flat_chunk_size.py --fit wine --chains 64 --sizes 4 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch

import pyrobdl
from pyrobdl.flat import FlatLogJoint, auto_chunk_size

#: (label, N, D, activation): yacht, concrete, wine, kin8nm and power training splits (90% of each
#: dataset); the chees benchmark
SHAPES = [("yacht", 277, 6, "relu"), ("concrete", 927, 8, "relu"), ("wine", 1439, 11, "relu"),
          ("kin8nm", 7373, 8, "relu"), ("power", 8611, 4, "relu"), ("benchmark", 500, 8, "tanh")]


def old_auto(n: int, width: int) -> int:
    """The rule before issue 41: rows near 400,000 numbers per layer's activations (a power of two)."""
    return 2 ** round(math.log2(max(1.0, 400_000 / max(1, n * width))))


def make(n: int, d: int, act: str, k: int, sizes: list) -> tuple[dict, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, d, generator=g), torch.randn(n, generator=g)
    model = pyrobdl.BayesianMLP(d, (50,), 1, activation=act,
                                likelihood=pyrobdl.likelihoods.GaussianLearnedPrecision(1.0, 0.01))
    ljs = {c: FlatLogJoint(model, x, y, chunk_size=c) for c in sizes}
    theta = ljs[sizes[0]].sample_prior(k, generator=g) * 0.3
    return ljs, theta


def interleaved_cpu_us(ljs: dict, theta: torch.Tensor, rounds: int, seconds: float) -> dict:
    """CPU µs per chain-gradient of each log joint's ``value_and_grad(theta)``, one list per variant:
    ``rounds`` rounds, variants in alternating order, each for ``seconds`` of process CPU time."""
    names = list(ljs)
    times: dict = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            lj = ljs[name]
            lj.value_and_grad(theta)
            reps, start = 0, time.process_time()
            while time.process_time() - start < seconds:
                lj.value_and_grad(theta)
                reps += 1
            times[name].append((time.process_time() - start) / reps / theta.shape[0] * 1e6)
    return times


def one(args: argparse.Namespace) -> None:
    """``--one SHAPE K SIZE``: this process times one variant and prints its median as JSON."""
    label, k, size = args.one[0], int(args.one[1]), None if args.one[2] == "None" else int(args.one[2])
    _, n, d, act = next(s for s in SHAPES if s[0] == label)
    ljs, theta = make(n, d, act, k, [size])
    times = interleaved_cpu_us(ljs, theta, args.rounds, args.seconds)[size]
    print(json.dumps({"median": statistics.median(times)}))


def fresh(label: str, k: int, sizes: list, args: argparse.Namespace) -> dict:
    out = {}
    for c in sizes:
        cmd = [sys.executable, __file__, "--one", label, str(k), str(c), "--rounds", str(args.rounds),
               "--seconds", str(args.seconds)] + (["--retain-freed-memory"] if args.retain_freed_memory else [])
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        out[c] = json.loads(res.stdout.strip().splitlines()[-1])["median"]
    return out


def fit_once(args: argparse.Namespace) -> None:
    """``--fit-one DATASET K SIZE``: one chees fit in this process; prints its cost as JSON."""
    import warnings
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from uci_references import make_model

    dataset, k, size = args.fit_one[0], int(args.fit_one[1]), args.fit_one[2]
    data = pyrobdl.datasets.load_uci(dataset, 0, data_dir=os.environ.get("PYROBDL_DATA_DIR"))
    warnings.simplefilter("ignore")
    post = pyrobdl.fit(make_model(data.x_train.shape[1]), data.x_train, data.y_train, method="chees", num_chains=k,
                       num_warmup=args.warmup, num_samples=args.samples, seed=0, progress=False, superchain_size=8,
                       chunk_size=size if size == "auto" else None if size == "None" else int(size))
    print(json.dumps({"chain_gradients": post.cost.gradient_evaluations, "cpu_s": post.cost.cpu_time_s,
                      "wall_s": post.cost.wall_time_s}))


def fits(args: argparse.Namespace) -> None:
    """Whole chees fits per chunk size, fresh processes, alternating (``--fit``)."""
    sizes = [*(str(c) for c in args.sizes), "auto"]
    for k in args.chains:
        for r in range(args.rounds):
            for size in sizes if r % 2 == 0 else sizes[::-1]:
                cmd = [sys.executable, __file__, "--fit-one", args.fit, str(k), size, "--warmup", str(args.warmup),
                       "--samples", str(args.samples)] + (["--retain-freed-memory"] if args.retain_freed_memory else [])
                res = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
                print(f"{args.fit} K = {k} chunk_size = {size}: {res['chain_gradients']:,} chain-gradients, "
                      f"{res['cpu_s']:.1f} CPU s ({res['wall_s']:.1f} s wall), "
                      f"{res['cpu_s'] / res['chain_gradients'] * 1e6:.1f} CPU µs per chain-gradient; "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chains", type=int, nargs="+", default=[64])
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    ap.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=0.3)
    ap.add_argument("--fresh", action="store_true", help="each variant in a fresh process")
    ap.add_argument("--retain-freed-memory", action="store_true", help="pyrobdl.retain_freed_memory() first")
    ap.add_argument("--fit", metavar="DATASET", help="time whole chees fits on this UCI dataset (split 0)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--one", nargs=3, metavar=("SHAPE", "K", "SIZE"), help=argparse.SUPPRESS)
    ap.add_argument("--fit-one", nargs=3, metavar=("DATASET", "K", "SIZE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.retain_freed_memory:
        pyrobdl.retain_freed_memory()
    if args.one:
        return one(args)
    if args.fit_one:
        return fit_once(args)
    if args.fit:
        return fits(args)
    sizes = [*args.sizes, None]
    print(f"# {'fresh processes' if args.fresh else 'one process per shape'}, malloc "
          f"{'retained' if args.retain_freed_memory else 'glibc default'}; load average {os.getloadavg()}")
    print("| shape | N x D | K | auto (before) | " + " | ".join(str(c) for c in sizes) + " |")
    print("|---|---|---|---|" + "---|" * len(sizes))
    for label, n, d, act in (s for s in SHAPES if s[0] in args.shapes):
        for k in args.chains:
            if args.fresh:
                med = fresh(label, k, sizes, args)
            else:
                ljs, theta = make(n, d, act, k, sizes)
                med = {c: statistics.median(v) for c, v in interleaved_cpu_us(ljs, theta, args.rounds, args.seconds).items()}
            print(f"| {label} ({act}) | {n} x {d} | {k} | {auto_chunk_size(n, 50)} ({old_auto(n, 50)}) | "
                  + " | ".join(f"{med[c]:.1f}" for c in sizes) + " |", flush=True)
    print(f"# load average after {os.getloadavg()}")


if __name__ == "__main__":
    main()
