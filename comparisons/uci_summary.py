r"""One Markdown table across datasets from a UCI suite's results folder (docs/results/uci.md).

For every (dataset, method) of the stored cells that finished: the number of splits, RMSE, test
log-likelihood and 90% interval coverage as mean ± standard error over splits (the report's own
:func:`~pyrobdl.report.tables.mean_se`), and the median fit CPU seconds per cell; then, for the
published rows each method's suite entry names, the report's verdict (beats / matches / misses by
two combined standard errors, :func:`~pyrobdl.report.tables.published_table`).  Only the suite's
own cells are read, checksums verified (:func:`pyrobdl.compare.store.scan_results`).

    python comparisons/uci_summary.py results/uci_fast --methods ensemble laplace
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

from pyrobdl.compare.store import scan_results
from pyrobdl.report.formatting import fmt_mean_se, mean_se
from pyrobdl.report.tables import metric_values, ok_records, published_table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="a results folder written by `pyrobdl compare`")
    ap.add_argument("--methods", nargs="*", default=None, help="method labels to include (default: all)")
    args = ap.parse_args()
    records, skipped = scan_results(args.results)
    if skipped:
        print(f"(skipped {len(skipped)} cell folder(s))\n")
    oks = [r for r in ok_records(records) if args.methods is None or r["method"] in args.methods]
    groups: dict[tuple[str, str], list] = defaultdict(list)
    for r in oks:
        groups[(r["dataset"], r["method"])].append(r)
    print("| dataset | method | splits | RMSE | test LL | 90% coverage | fit CPU s (median) |")
    print("|---|---|---|---|---|---|---|")
    for (ds, method), recs in sorted(groups.items()):
        cells = [fmt_mean_se(*mean_se(metric_values(recs, k))[:2]) for k in ("rmse", "test_ll", "coverage_90")]
        cpu = statistics.median(float(r["fit_cpu_time_s"]) for r in recs)
        print(f"| {ds} | {method} | {len(recs)} | {' | '.join(cells)} | {cpu:.1f} |")
    print()
    print("| dataset | method | published | metric | ours | published value | verdict |")
    print("|---|---|---|---|---|---|---|")
    by_dataset: dict[str, list] = defaultdict(list)
    for r in oks:
        by_dataset[r["dataset"]].append(r)
    for ds, recs in sorted(by_dataset.items()):
        table = published_table(recs)
        for row in table.rows if table is not None else ():
            print(f"| {ds} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
