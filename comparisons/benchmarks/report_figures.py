"""CPU seconds of each of the report's figure functions over a results folder (issue 41, req. 4).

Each function of ``pyrobdl.report.figures.FIGURES`` (or those named) is called for every dataset of
the folder, once per round, in the same order each round; the first round pays the imports.

    python comparisons/benchmarks/report_figures.py RESULTS [--figures rank_plots,elbo_curves] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", help="a folder written by pyrobdl compare")
    p.add_argument("--figures", default=None, help="comma-separated names in pyrobdl.report.figures (default: FIGURES)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    from pyrobdl.compare.store import scan_results
    from pyrobdl.report import figures

    records, _ = scan_results(args.results)
    by_dataset: dict[str, list] = {}
    for r in records:
        if not r.get("is_replicate"):
            by_dataset.setdefault(r["dataset"], []).append(r)
    fns = ([getattr(figures, n) for n in args.figures.split(",")] if args.figures else list(figures.FIGURES))
    for rnd in range(args.rounds):
        cells = []
        for fn in fns:
            start = time.process_time()
            for dataset, recs in by_dataset.items():
                fn(recs, dataset)
            cells.append(f"{fn.__name__} {time.process_time() - start:.2f}")
        print(f"round {rnd}: " + " | ".join(cells) + " CPU s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
