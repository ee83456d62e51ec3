r"""chees's compiled leapfrog: one compiled kernel call per step against blocks of steps in one graph.

Issue 41 (2026-11-30, sixteenth session).  On the benchmark BNN of ``chees_vs_numpyro.py`` (500 x 8,
1 x 50 tanh, learned noise precision; float32, one torch thread, glibc's malloc retained as ``pyrobdl
compare`` does), ``K`` chains, the same 16-step trajectory run

``per step``
    as chees ran it before: ``theta += scaled * p`` and ``p += step * grad`` eagerly around one call of
    the compiled log joint (``FlatLogJoint.compile(K, kernel="inductor")``);
``block m``
    by :meth:`FlatLogJoint.leapfrog` after ``FlatLogJoint.compile(K, leapfrog_block=m)``: ``m`` steps,
    updates included, in one compiled graph (16 = a multiple of every ``m`` measured).

Both run chees's own ``_Sampler.leapfrog`` on the log joint compiled either way.

Rounds alternate the variants' order; each round times ``--calls`` trajectories of every variant in
process CPU microseconds per leapfrog step (wall beside); printed: the medians per variant and the median over rounds
of each variant's ratio to ``per step`` in the same round (the host's speed drifts between rounds).
The variants' final momenta are checked to agree first (float32 rounding of the fused updates).

    python comparisons/benchmarks/leapfrog_block.py [--chains 8] [--blocks 2 4 8] [--rounds 30] [--calls 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

import pyrobdl
from pyrobdl.flat import FlatLogJoint
from pyrobdl.inference.chees import _Sampler

STEPS = 16


def _log_joint(k: int, block: int) -> FlatLogJoint:
    from chees_vs_numpyro import make_model  # noqa: E402 (run as a script: its folder is on sys.path)
    from nuts_vs_numpyro import make_data

    x, y = make_data(0)
    lj = FlatLogJoint(make_model(), torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y, dtype=torch.float32),
                      chunk_size="auto")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lj.compile(k, leapfrog_block=block, kernel="inductor")
    return lj


def trajectory(sampler, theta, p, grad, step: float):
    """One 16-step trajectory through chees's own leapfrog (``_Sampler.leapfrog``): one compiled kernel
    call a step where the log joint has no block, blocks of ``lj.leapfrog_block`` steps where it has."""
    return sampler.leapfrog(theta, p, grad, step, STEPS)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chains", type=int, default=8)
    p.add_argument("--blocks", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--calls", type=int, default=5)
    args = p.parse_args()
    if any(STEPS % m for m in args.blocks):
        raise SystemExit(f"--blocks must divide {STEPS}")
    torch.set_num_threads(1)
    pyrobdl.retain_freed_memory()
    k = args.chains
    lj0 = _log_joint(k, 0)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        theta = lj0.sample_prior(k, generator=g) * 0.1
        mom = torch.randn(k, lj0.size, generator=g)
    variants = {"per step": _Sampler(lj0, theta, g, 1000.0)}
    for m in args.blocks:
        variants[f"block {m}"] = _Sampler(_log_joint(k, m), theta, g, 1000.0)
    grad, step = variants["per step"].grad, 0.002
    want = trajectory(variants["per step"], theta, mom, grad, step)[1]
    for name, sampler in variants.items():
        got = trajectory(sampler, theta, mom, grad, step)[1]
        print(f"{name}: final momenta within {float((got - want).abs().max() / want.abs().max()):.1e} (relative)")
    times: dict[str, list[float]] = {name: [] for name in variants}
    walls: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    for r in range(args.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            sampler = variants[name]
            start, wall = time.process_time(), time.perf_counter()
            for _ in range(args.calls):
                trajectory(sampler, theta, mom, grad, step)
            times[name].append((time.process_time() - start) / (args.calls * STEPS) * 1e6)
            walls[name].append((time.perf_counter() - wall) / (args.calls * STEPS) * 1e6)
    print(f"K = {k}, {args.rounds} rounds: | variant | CPU µs per leapfrog step (per chain-gradient) | wall µs | "
          "CPU ratio to per step |")
    for name, ts in times.items():
        ratio = statistics.median(a / b for a, b in zip(ts, times["per step"]))
        med = statistics.median(ts)
        print(f"| {name} | {med:.1f} ({med / k:.1f}) | {statistics.median(walls[name]):.1f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
