"""Stuck chains against the certification's three readings: split R-hat, nested R-hat and the
chain-mean outlier test (:func:`~pyrobdl.diagnostics.chain_outliers.chain_outliers`), on synthetic
chains (docs/diagnostics.md, "One set of criteria for every reference, and stuck chains").

Chains of ``--draws`` draws of 50 quantities, iid N(0, 1) or a stationary AR(1) of unit marginal
variance, Gaussian or Student-t with 5 degrees of freedom (scaled to unit variance); superchains of
8.  Two tables:

* **detection**: ``m`` of K chains shifted by ``delta`` posterior sd in every quantity, or in one
  (one per superchain, "spread", or all in superchain 0, "together"); over ``--seeds`` seeds the range of
  the largest split and nested R-hat, and of the largest chain score ``max_q |z_kq|``, and in how
  many seeds each reading fails (R-hat > 1.01; score above the Bonferroni threshold);
* **false alarms**: well-mixed chains, in how many of ``--runs`` runs some chain is flagged, and
  the range of the largest score against the threshold.

    python comparisons/research/stuck_chains.py            # both tables
    python comparisons/research/stuck_chains.py --quick    # fewer seeds and runs (a smoke test)
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
from scipy.signal import lfilter

from pyrobdl.diagnostics.certification import nested_rhat
from pyrobdl.diagnostics.chain_outliers import chain_outliers
from pyrobdl.diagnostics.rank_diagnostics import convergence

QUANTITIES = 50
SUPERCHAIN = 8


def chains(k: int, d: int, *, rho: float = 0.0, dist: str = "normal", seed: int = 0, q: int = QUANTITIES) -> np.ndarray:
    """``[k, d, q]`` stationary draws of unit marginal variance: iid (``rho = 0``) or AR(1),
    Gaussian or Student-t 5 (``dist="t5"``) innovations."""
    rng = np.random.default_rng(seed)
    if dist == "t5":
        e = rng.standard_t(5, size=(k, d, q)) / np.sqrt(5 / 3)
    else:
        e = rng.normal(size=(k, d, q))
    if rho:
        e *= np.sqrt(1.0 - rho * rho)
        e[:, 0] /= np.sqrt(1.0 - rho * rho)  # start in the stationary distribution
        e = lfilter([1.0], [1.0, -rho], e, axis=1)
    return e


def stuck(x: np.ndarray, m: int, delta: float, place: str, shifted: int | None = None) -> np.ndarray:
    """``x`` with ``m`` chains shifted by ``delta``, in every quantity or the first ``shifted``: one
    per superchain (``"spread"``) or the first ``m`` (``"together"``, superchain 0)."""
    idx = np.arange(m) * (SUPERCHAIN if place == "spread" else 1)
    x[idx, :, :shifted] += delta
    return x


def readings(x: np.ndarray) -> tuple[float, float, float, float]:
    """Largest split R-hat, nested R-hat (superchains of 8), chain score, and the score threshold."""
    o = chain_outliers(x)
    split = float(np.max(convergence(torch.as_tensor(x))["rhat"]))
    return split, float(np.max(nested_rhat(x, SUPERCHAIN))), o.largest, o.z


def cell(values: list[float], fails: int, decimals: int) -> str:
    """A table cell: the range of ``values``, bold when some failed, and how many did."""
    lo, hi = (f"{v:.{decimals}f}" for v in (min(values), max(values)))
    text = lo if lo == hi else f"{lo}–{hi}"
    return f"**{text}** ({fails})" if fails else f"{text} (0)"


def detection(seeds: int, draws: int) -> None:
    print(f"\nDetection: largest split R-hat / nested R-hat / chain score (threshold), range over {seeds} seeds; "
          f"(n): seeds in which the reading fails\n")
    print("| K | draws | stuck chains | δ | split R-hat | nested R-hat | chain score | threshold |")
    print("|---|---|---|---|---|---|---|---|")
    rows = [(64, 0.0, m, p, None) for m, p in ((1, "spread"), (2, "spread"), (4, "spread"), (4, "together"))]
    rows += [(64, 0.0, 4, "spread", 1), (64, 0.5, 4, "spread", None), (64, 0.8, 4, "spread", None)]
    rows += [(512, 0.0, 4, "spread", None), (512, 0.0, 8, "spread", None)]
    for k, rho, m, place, shifted in rows:
        for delta in (0.25, 0.5, 1.0):
            got = [readings(stuck(chains(k, draws, rho=rho, seed=s), m, delta, place, shifted)) for s in range(seeds)]
            split, nested, score, z = (list(v) for v in zip(*got))
            how = "iid" if not rho else f"AR(1) ρ={rho:g}"
            where = "" if shifted is None else f", in {shifted} of {QUANTITIES} quantities"
            print(f"| {k} | {how} | {m} {place}{where} | {delta:g} | {cell(split, sum(v > 1.01 for v in split), 3)} | "
                  f"{cell(nested, sum(v > 1.01 for v in nested), 3)} | "
                  f"{cell(score, sum(s > t for s, t in zip(score, z)), 1)} | {z[0]:.2f} |", flush=True)


def false_alarms(runs64: int, runs512: int, draws: int) -> None:
    print(f"\nFalse alarms: well-mixed chains of {draws} draws x {QUANTITIES} quantities\n")
    print("| K | draws | marginal | runs | runs with a chain flagged | largest score | threshold |")
    print("|---|---|---|---|---|---|---|")
    for k, runs in ((64, runs64), (512, runs512)):
        for rho in (0.0, 0.8):
            for dist in ("normal", "t5"):
                found = [chain_outliers(chains(k, draws, rho=rho, dist=dist, seed=1000 + s)) for s in range(runs)]
                top = [o.largest for o in found]
                how = "iid" if not rho else f"AR(1) ρ={rho:g}"
                print(f"| {k} | {how} | {dist} | {runs} | {sum(bool(o.chains) for o in found)} | "
                      f"{min(top):.2f}–{max(top):.2f} | {found[0].z:.2f} |", flush=True)


def mad_alone(runs: int) -> None:
    """Why the floor: the MAD of K chain means alone as the noise sd, on exact Gaussian chain means
    (K x 50 of them, unit sd): how often some |z| exceeds the Bonferroni threshold."""
    from statistics import NormalDist

    rng = np.random.default_rng(0)
    print(f"\nMAD alone as the noise sd, {runs} runs of exact N(0, 1) chain means x {QUANTITIES} quantities:")
    for k in (8, 16, 64, 512):
        z = NormalDist().inv_cdf(1 - 0.01 / (2 * k * QUANTITIES))
        hits = 0
        for _ in range(runs):
            m = rng.normal(size=(k, QUANTITIES))
            dev = np.abs(m - np.median(m, 0))
            hits += bool((dev / (1.4826 * np.median(dev, 0)) > z).any())
        print(f"K = {k}: a chain flagged in {hits} of {runs} runs (threshold {z:.2f}; alpha 0.01)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5, help="seeds per detection cell")
    parser.add_argument("--runs64", type=int, default=200, help="false-alarm runs with 64 chains")
    parser.add_argument("--runs512", type=int, default=40, help="false-alarm runs with 512 chains")
    parser.add_argument("--draws", type=int, default=300)
    parser.add_argument("--quick", action="store_true", help="2 seeds, 10 and 4 runs")
    parser.add_argument("--only", choices=("detection", "false-alarms"), default=None)
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.runs64, args.runs512 = 2, 10, 4
    start, cpu = time.time(), time.process_time()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}")
    if args.only != "false-alarms":
        detection(args.seeds, args.draws)
    if args.only != "detection":
        mad_alone(400 if args.quick else 2000)
        false_alarms(args.runs64, args.runs512, args.draws)
    print(f"\n{time.process_time() - cpu:.0f} s CPU, {time.time() - start:.0f} s wall, "
          f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
