"""Nested R-hat as Margossian et al. (2024) define it: chains started in superchains from common
points (``fit(..., method="chees", superchain_size=M)``), against the same number of chains
started independently.

For each ``superchain_size`` M in the grid and each seed, one chees run of ``--chains`` chains;
reported: split R-hat (ArviZ, all chains), nested R-hat over superchains of M (for M = 1 the
chains are grouped in superchains of ``--group`` afterwards, which is what earlier references
reported and what ``certify`` now refuses: over independent starts nested R-hat cannot see chains
that never leave their starting mode), bulk/tail ESS, the fit's own certification (nested R-hat
for M > 1, split R-hat for M = 1), the adapted step size and trajectory length, chain-gradients
and process CPU seconds.

``--dataset gap`` (default): the quickstart's gap cell (``chees_ensemble_init.py``'s model and
data), certified at 50 inputs of the test grid over [-1.5, 1.5], gap included (every fourth of
its 200 points), which the sampler never saw.  ``--dataset NAME --split S``: a UCI split with
``comparisons/uci_references.py``'s model, certified at the split's first 50 test inputs.

    nice -n 10 python comparisons/benchmarks/chees_superchains.py --chains 32 --superchains 1 4 \
        --warmup 400 --samples 200 --seeds 0

One torch thread.  The table goes to stdout as Markdown.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import torch
from chees_ensemble_init import gap_problem, uci_problem

import pyrobdl
from pyrobdl.datasets import gap_regression
from pyrobdl.diagnostics import CertificationCriteria, certify


def run(m: int, seed: int, problem, args) -> dict:
    make_model, x, y, x_cert = problem
    cpu, wall = time.process_time(), time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        post = pyrobdl.fit(make_model(), x, y, "chees", num_chains=args.chains, num_warmup=args.warmup,
                           num_samples=args.samples, max_num_steps=args.max_num_steps, superchain_size=m,
                           seed=seed, progress=False)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    group = m if m > 1 else args.group
    split = certify(post, x_cert, CertificationCriteria())
    # for m = 1 this certificate fails by construction, but certify still reports the value
    nested = certify(post, x_cert, CertificationCriteria(rhat="nested", superchain_size=group))
    own = nested if m > 1 else split  # the fit's own criteria
    d = post.diagnostics
    return {"m": m, "seed": seed, "group": group, "split_rhat": split.rhat_max, "nested_rhat": nested.rhat_max,
            "ess_bulk": split.ess_bulk_min, "ess_tail": split.ess_tail_min, "own_method": own.rhat_method,
            "certified": own.passed, "failures": "; ".join(own.failures), "step": d["step_size"],
            "T": d["trajectory_length"], "gradients": post.cost.gradient_evaluations, "cpu_s": cpu, "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--superchains", type=int, nargs="+", default=[1, 4], help="superchain sizes M to run")
    ap.add_argument("--group", type=int, default=4, help="superchain size for nested R-hat of M = 1 runs")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--chains", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=400)
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--max-num-steps", type=int, default=1024)
    ap.add_argument("--dataset", default="gap", help="'gap' or a UCI dataset name")
    ap.add_argument("--split", type=int, default=0)
    ap.add_argument("--data-dir", default=None, help="UCI data directory (default: PYROBDL_DATA_DIR)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.dataset == "gap":
        make_model, x, y, _ = gap_problem()
        grid = gap_regression(80, 200, noise_sd=0.1, seed=0).x_test
        problem = (make_model, x, y, grid[::4])
    else:
        problem = uci_problem(args.dataset, args.split, args.data_dir)
    print(f"# {args.dataset}: {args.chains} chains x ({args.warmup} + {args.samples}), load {os.getloadavg()}")
    print("| M | seed | split R-hat | nested R-hat (superchains of) | min bulk / tail ESS | fit's certificate "
          "| step size | T | chain-gradients | CPU s | wall s | failures |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for seed in args.seeds:
        for m in args.superchains:
            r = run(m, seed, problem, args)
            cert = f"{'passed' if r['certified'] else 'failed'} ({r['own_method']})"
            print(f"| {r['m']} | {r['seed']} | {r['split_rhat']:.3f} | {r['nested_rhat']:.4f} ({r['group']}"
                  f"{'' if r['m'] > 1 else ', independent starts'}) | {r['ess_bulk']:.0f} / {r['ess_tail']:.0f} "
                  f"| {cert} | {r['step']:.2g} | {r['T']:.3g} | {r['gradients']:,} | {r['cpu_s']:.1f} "
                  f"| {r['wall_s']:.1f} | {r['failures']} |", flush=True)
    print(f"# load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
