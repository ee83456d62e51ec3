"""How noisy is one chain's E-BFMI? Per-chain E-BFMI of a chees run's sampling phase, read from its
checkpoint, with a moving-block bootstrap standard error for the chains nearest the threshold.

The certification asks E-BFMI >= 0.2 in *every* chain (docs/diagnostics.md). With 64 chains of a
few hundred draws, a chain near the line may cross it as draws accumulate (wine splits 1, 3 and 5
in docs/results.md). This script measures the sampling noise of the per-chain estimate: it
resamples blocks of ``--block`` consecutive iterations of the chain's energy (2,000 resamples,
seed 0), counts only the energy differences inside a block in the numerator (rescaled to the
chain's number of differences), and reports the bootstrap standard deviation and 90% interval.

    python comparisons/ebfmi_noise.py --checkpoint results/checkpoints/wine_split5_seed0_k64.pt --draws 700
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from pyrobdl.diagnostics.certification import ebfmi


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a chees checkpoint (fit(..., checkpoint=PATH))")
    parser.add_argument("--block", type=int, default=25, help="iterations per bootstrap block")
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--chains", type=int, default=5, help="report the chains with the lowest E-BFMI")
    parser.add_argument("--threshold", type=float, default=0.2)
    parser.add_argument("--draws", type=int, default=None, help="use the first N draws per chain (default: all)")
    args = parser.parse_args()
    state = torch.load(args.checkpoint, weights_only=True, map_location="cpu")["state"]
    warm = int(state["next_iteration"]) - int(state["samples"].shape[0])
    energy = state["rows"]["energy"].double().numpy()[warm:].T  # [chain, draw], sampling phase
    if args.draws is not None:
        energy = energy[:, : args.draws]
    values = ebfmi(energy)
    print(f"{args.checkpoint}: {energy.shape[0]} chains x {energy.shape[1]} draws (after {warm} warm-up "
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
