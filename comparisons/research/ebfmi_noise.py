"""How noisy is one chain's E-BFMI? Per-chain E-BFMI of a chees run's sampling phase, read from its
checkpoint, with a moving-block bootstrap standard error for the chains nearest the threshold.

The certification asks E-BFMI >= 0.2 in *every* chain (docs/diagnostics.md). With 64 chains of a
few hundred draws, a chain near the line may cross it as draws accumulate (wine splits 1, 3 and 5
in docs/results/wine.md). This script measures the sampling noise of the per-chain estimate: it
resamples blocks of ``--block`` consecutive iterations of the chain's energy (2,000 resamples,
seed 0), counts only the energy differences inside a block in the numerator (rescaled to the
chain's number of differences), and reports the bootstrap standard deviation and 90% interval.

    python comparisons/research/ebfmi_noise.py --checkpoint results/checkpoints/wine_split5_seed0_k64.pt --draws 700

With ``--window N`` it asks instead whether a chain's E-BFMI is a property of the chain or noise:
for every checkpoint given, each chain's E-BFMI over two disjoint windows of N draws (the first
and the second N), their correlation across chains, the noise sd that their differences imply
(sd of the difference / sqrt 2) beside the spread between chains, and the E-BFMI pooled over the
chains (:func:`~pyrobdl.diagnostics.certification.ebfmi_pooled`, what certification checks by
default); then the same pooled over every checkpoint's chains.  If the chains differed, the
windows would correlate and the spread between chains would exceed the noise:

    python comparisons/research/ebfmi_noise.py --window 300 --checkpoint results/checkpoints/wine_split1{0,1,2,3,4,5,6,7}_seed0_k64.pt

With ``--synthetic`` (no checkpoint) it measures the certification's outlying-chain E-BFMI test
(:func:`~pyrobdl.diagnostics.energy.ebfmi_outliers`) and the R-hat readings on synthetic chains
(docs/diagnostics.md, "An outlying chain's E-BFMI" and "One set of criteria for every
reference, and stuck chains"): the AR(1) noise model against the wine measurement, outlying
chains among 63 at 0.5, false alarms among well-mixed chains, and split / nested R-hat of a few
chains stuck in a shifted mode:

    python comparisons/research/ebfmi_noise.py --synthetic
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from pyrobdl.diagnostics.certification import ebfmi, ebfmi_pooled


def block_bootstrap(energy: np.ndarray, block: int, reps: int, rng: np.random.Generator) -> np.ndarray:
    """E-BFMI of ``reps`` moving-block resamples of one chain's energy sequence."""
    n = energy.size
    out = np.empty(reps)
    for r in range(reps):
        starts = rng.integers(0, n - block + 1, size=-(-n // block))
        pieces = [energy[s:s + block] for s in starts]
        series = np.concatenate(pieces)[:n]
        diffs = np.concatenate([np.diff(p) for p in pieces])
        numerator = np.sum(diffs ** 2) * (n - 1) / diffs.size
        out[r] = numerator / np.sum((series - series.mean()) ** 2)
    return out


def sampling_energy(path: str) -> tuple[np.ndarray, int]:
    """``[chain, draw]``: the energies of a checkpoint's sampling phase, and its warm-up iterations."""
    state = torch.load(path, weights_only=True, map_location="cpu")["state"]
    warm = int(state["next_iteration"]) - int(state["samples"].shape[0])
    return state["rows"]["energy"].double().numpy()[warm:int(state["next_iteration"])].T, warm


def window_stats(a: np.ndarray, b: np.ndarray) -> str:
    """Correlation of each chain's E-BFMI in two windows, the noise sd their differences imply, and
    the spread between chains, as table cells."""
    return f"{np.corrcoef(a, b)[0, 1]:.3f} | {np.std(a - b) / np.sqrt(2):.3f} | {np.std(a):.3f}"


def windows(paths: list[str], n: int) -> None:
    """Per-chain E-BFMI over draws 1..n and n+1..2n of each checkpoint: do the two agree?"""
    print("| checkpoint | chains | median, window 1 / 2 | smallest, window 1 / 2 (chain) | correlation | noise sd | "
          "sd between chains | pooled, window 1 / 2 | below 0.2, window 1 / 2 |")
    print("|---|---|---|---|---|---|---|---|---|")
    first, second = [], []
    for path in paths:
        e, _ = sampling_energy(path)
        if e.shape[1] < 2 * n:
            print(f"| {path} | {e.shape[1]} draws per chain: fewer than 2 x {n}, skipped |")
            continue
        a, b = ebfmi(e[:, :n]), ebfmi(e[:, n:2 * n])
        first.append(a)
        second.append(b)
        print(f"| {path} | {e.shape[0]} | {np.median(a):.3f} / {np.median(b):.3f} | {a.min():.3f} ({a.argmin()}) / "
              f"{b.min():.3f} ({b.argmin()}) | {window_stats(a, b)} | "
              f"{ebfmi_pooled(e[:, :n]):.3f} / {ebfmi_pooled(e[:, n:2 * n]):.3f} | "
              f"{int((a < 0.2).sum())} / {int((b < 0.2).sum())} |")
    if first:
        a, b = np.concatenate(first), np.concatenate(second)
        print(f"| all | {a.size} | | | {window_stats(a, b)} | | {int((a < 0.2).sum())} / {int((b < 0.2).sum())} |")


def unit_ar1(chains: int, draws: int, value: float, seed: int) -> np.ndarray:
    """Stationary Gaussian AR(1) energies of unit variance whose E-BFMI is ``value``."""
    from scipy.signal import lfilter

    rho = 1.0 - value / 2.0
    z = np.random.default_rng(seed).normal(size=(chains, draws)) * np.sqrt(1.0 - rho * rho)
    z[:, 0] /= np.sqrt(1.0 - rho * rho)
    return lfilter([1.0], [1.0, -rho], z, axis=1)


def synthetic() -> None:
    """The numbers of docs/diagnostics.md's outlier and stuck-chain paragraphs."""
    from pyrobdl.diagnostics.certification import nested_rhat
    from pyrobdl.diagnostics.energy import ebfmi_noise_sd, ebfmi_outliers
    from pyrobdl.diagnostics.rank_diagnostics import convergence

    print(f"AR(1) noise sd: N=300 b=0.4 {ebfmi_noise_sd(300, 0.4):.3f} (wine: 0.102); N=500 b=0.5 {ebfmi_noise_sd(500, 0.5):.3f}")
    for seed in range(3):
        for label, bad, value in (("one at 0.05", 1, 0.05), ("one at 0.08", 1, 0.08), ("four at 0.05", 4, 0.05),
                                  ("four at 0.08", 4, 0.08), ("random walk", 1, None)):
            e = unit_ar1(64, 500, 0.5, seed)
            if value is None:
                e[0] = 0.5 * np.cumsum(np.random.default_rng(3 + seed).normal(size=500))
            else:
                e[:bad] = unit_ar1(bad, 500, value, 100 + seed)
            o = ebfmi_outliers(e)
            sds = [f"{(o.centre - v) / o.noise_sd:.1f}" for v in o.values]
            print(f"seed {seed} {label}: pooled {ebfmi_pooled(e):.3f}, flagged {list(o.chains)} at {sds} sd (z {o.z:.2f})")
    for k, n, b, runs in ((512, 300, 0.3, 20), (512, 300, 0.35, 20), (512, 300, 0.4, 20), (64, 500, 0.5, 40)):
        flagged = sum(bool(ebfmi_outliers(unit_ar1(k, n, b, 1000 + i)).chains) for i in range(runs))
        print(f"well mixed, {k} chains x {n} draws at {b}: a chain flagged in {flagged} of {runs} runs")
    rng = np.random.default_rng(0)
    for k in (64, 512):
        for m, place in ((1, "spread"), (2, "spread"), (4, "spread"), (4, "together"), (8, "spread")):
            cells = []
            for delta in (0.5, 0.75, 1.0):
                split, nested = [], []
                for _ in range(5):
                    x = rng.normal(size=(k, 300, 50))
                    x[np.arange(m) * (8 if place == "spread" else 1)] += delta
                    split.append(float(np.max(convergence(torch.as_tensor(x))["rhat"])))
                    nested.append(float(np.max(nested_rhat(x, 8))))
                cells.append(f"{min(split):.3f}-{max(split):.3f} / {min(nested):.3f}-{max(nested):.3f}")
            print(f"| {k} | {m} {place} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--synthetic", action="store_true", help="the synthetic measurements (no checkpoint)")
    parser.add_argument("--checkpoint", nargs="+",
                        help="a chees checkpoint (fit(..., checkpoint=PATH)); several with --window")
    parser.add_argument("--block", type=int, default=25, help="iterations per bootstrap block")
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--chains", type=int, default=5, help="report the chains with the lowest E-BFMI")
    parser.add_argument("--threshold", type=float, default=0.2)
    parser.add_argument("--draws", type=int, default=None, help="use the first N draws per chain (default: all)")
    parser.add_argument("--window", type=int, default=None,
                        help="compare each chain's E-BFMI over two disjoint windows of this many draws")
    args = parser.parse_args()
    if args.synthetic:
        synthetic()
        return
    if not args.checkpoint:
        parser.error("--checkpoint is required without --synthetic")
    if args.window is not None:
        windows(args.checkpoint, args.window)
        return
    if len(args.checkpoint) != 1:
        parser.error("one --checkpoint without --window")
    energy, warm = sampling_energy(args.checkpoint[0])
    if args.draws is not None:
        energy = energy[:, : args.draws]
    values = ebfmi(energy)
    print(f"{args.checkpoint[0]}: {energy.shape[0]} chains x {energy.shape[1]} draws (after {warm} warm-up "
          f"iterations); E-BFMI median {np.median(values):.3f}, min {values.min():.4f}; below {args.threshold:g}: "
          f"{[int(c) for c in np.flatnonzero(values < args.threshold)]}")
    rng = np.random.default_rng(0)
    print(f"| chain | E-BFMI | block-bootstrap sd (blocks of {args.block}) | 90% interval |")
    print("|---|---|---|---|")
    for c in np.argsort(values)[: args.chains]:
        reps = block_bootstrap(energy[c], args.block, args.reps, rng)
        print(f"| {c} | {values[c]:.4f} | {np.std(reps):.4f} | {np.quantile(reps, 0.05):.3f}–{np.quantile(reps, 0.95):.3f} |")


if __name__ == "__main__":
    main()
