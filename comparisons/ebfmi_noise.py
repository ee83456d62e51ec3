"""How noisy is one chain's E-BFMI? Per-chain E-BFMI of a chees run's sampling phase, read from its
checkpoint, with a moving-block bootstrap standard error for the chains nearest the threshold.

The certification asks E-BFMI >= 0.2 in *every* chain (docs/diagnostics.md). With 64 chains of a
few hundred draws, a chain near the line may cross it as draws accumulate (wine splits 1, 3 and 5
in docs/results.md). This script measures the sampling noise of the per-chain estimate: it
resamples blocks of ``--block`` consecutive iterations of the chain's energy (2,000 resamples,
seed 0), counts only the energy differences inside a block in the numerator (rescaled to the
chain's number of differences), and reports the bootstrap standard deviation and 90% interval.

    python comparisons/ebfmi_noise.py --checkpoint results/checkpoints/wine_split5_seed0_k64.pt --draws 700

With ``--window N`` it asks instead whether a chain's E-BFMI is a property of the chain or noise:
for every checkpoint given, each chain's E-BFMI over two disjoint windows of N draws (the first
and the second N), their correlation across chains, the noise sd that their differences imply
(sd of the difference / sqrt 2) beside the spread between chains, and the E-BFMI pooled over the
chains (:func:`~pyrobdl.diagnostics.certification.ebfmi_pooled`, what certification checks by
default); then the same pooled over every checkpoint's chains.  If the chains differed, the
windows would correlate and the spread between chains would exceed the noise:

    python comparisons/ebfmi_noise.py --window 300 --checkpoint results/checkpoints/wine_split1{0,1,2,3,4,5,6,7}_seed0_k64.pt
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
    print(f"| checkpoint | chains | median, window 1 / 2 | smallest, window 1 / 2 (chain) | correlation | noise sd | "
          f"sd between chains | pooled, window 1 / 2 | below 0.2, window 1 / 2 |")
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, nargs="+",
                        help="a chees checkpoint (fit(..., checkpoint=PATH)); several with --window")
    parser.add_argument("--block", type=int, default=25, help="iterations per bootstrap block")
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--chains", type=int, default=5, help="report the chains with the lowest E-BFMI")
    parser.add_argument("--threshold", type=float, default=0.2)
    parser.add_argument("--draws", type=int, default=None, help="use the first N draws per chain (default: all)")
    parser.add_argument("--window", type=int, default=None,
                        help="compare each chain's E-BFMI over two disjoint windows of this many draws")
    args = parser.parse_args()
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
