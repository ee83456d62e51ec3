r"""CPU cost of the flat log joint's value and gradient at the UCI reference shapes: eager against
compiled, each with the relu output weight's gradient folded into layer 0's GEMM (the default)
and computed by its own product (``FlatLogJoint._fold_output_grad = False``, the kernel before).

For a relu layer into one output unit, :math:`\sum_b g_{kb}\,\mathrm{relu}(a_{bkh}) =
\sum_i w^{aug}_{khi} S_{khi}` with :math:`S = x_1^\top (g \odot 1[a > 0])`, the product layer 0's
gradient computes anyway (``pyrobdl/flat.py``), so one pass over the ``[N, K, 50]`` activations
— tens of megabytes at the reference shapes, read from memory — is saved.

One process, one torch thread, the variants interleaved in alternating order over ``--rounds``
rounds of ``--seconds`` of process CPU time each; medians and minima of CPU µs per
chain-gradient (one row of ``theta`` evaluated once).  The model and shapes are those of
``comparisons/uci_references.py`` (1 × 50 relu, learned precision), random data of the split's size.

Usage (from the repository root)::

    python comparisons/benchmarks/flat_relu_fold.py --chains 64 --rounds 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import warnings

import torch
from flat_chunk_size import interleaved_cpu_us  # this folder is on the path when run as a script

import pyrobdl
from pyrobdl.flat import FlatLogJoint

#: (label, N, D): the training split sizes of yacht, concrete and wine
SHAPES = [("yacht", 277, 6), ("concrete", 927, 8), ("wine", 1439, 11)]


def variants(n: int, d: int, k: int) -> tuple[dict[str, FlatLogJoint], torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, d, generator=g), torch.randn(n, generator=g)
    model = pyrobdl.BayesianMLP(d, (50,), 1, activation="relu",
                                likelihood=pyrobdl.likelihoods.GaussianLearnedPrecision(1.0, 0.01))
    out = {}
    for compiled in (False, True):
        for fold in (False, True):
            lj = FlatLogJoint(model, x, y)
            lj._fold_output_grad = fold
            if compiled:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    lj.compile(k, kernel="inductor")
            out[("compiled" if compiled else "eager") + (", folded" if fold else ", own product")] = lj
    theta = next(iter(out.values())).sample_prior(k, generator=g) * 0.3
    return out, theta


def probe(n: int, d: int, k: int, rounds: int, seconds: float) -> dict:
    ljs, theta = variants(n, d, k)
    ref = ljs["eager, own product"].value_and_grad(theta)[1]
    diff = {name: float((lj.value_and_grad(theta)[1] - ref).abs().max() / ref.abs().max()) for name, lj in ljs.items()}
    times = interleaved_cpu_us(ljs, theta, rounds, seconds)
    return {name: {"median_us": statistics.median(v), "min_us": min(v), "rounds_us": v,
                   "max_rel_grad_diff": diff[name]} for name, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chains", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--shapes", nargs="*", default=[s[0] for s in SHAPES])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {"chains": args.chains, "rounds": args.rounds, "load_before": os.getloadavg(), "shapes": {}}
    for label, n, d in SHAPES:
        if label not in args.shapes:
            continue
        res = probe(n, d, args.chains, args.rounds, args.seconds)
        results["shapes"][label] = res
        base = res["eager, own product"]["median_us"]
        for name, r in res.items():
            print(f"{label:9s} N={n:5d} {name:22s} median {r['median_us']:7.1f}  min {r['min_us']:7.1f} CPU us/chain-grad "
                  f"({r['median_us'] / base:4.2f}x eager own product; grad rel diff {r['max_rel_grad_diff']:.1e})", flush=True)
    results["load_after"] = os.getloadavg()
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
