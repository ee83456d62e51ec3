r"""Per-cell overhead of running a suite on a local Ray cluster against the local executor.

For a suite (and an ``--only`` cut of it), the same cells are run into fresh results folders,
alternating executors over ``--repeats`` rounds: ``local`` (in this process, one cell after the
other), ``ray-1`` (a local Ray with one CPU: also one cell at a time, so the difference is the
overhead) and ``ray-N`` (a local Ray with ``--cpus`` CPUs: cells in parallel).  One torch thread
per cell everywhere.  Reported per executor (medians over rounds):

* the run's wall seconds, excluding Ray's start-up (measured separately, ``ray.init``);
* the summed cell time the workers measured (``wall_time_s`` of the records);
* **overhead per cell** = (run wall − summed cell time) / cells for sequential executors — the
  time a cell costs beyond its own work (task submission, shipping the reference draws and the
  results back, the driver's writes); for ``ray-N`` the speed-up against ``local`` instead;
* the driver's CPU seconds (this process) and the workers' CPU seconds (records' ``cpu_time_s``).

    nice -n 10 python comparisons/benchmarks/ray_overhead.py comparisons/quickstart.toml \
        --only dataset=gap --repeats 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def one_run(suite_path: str, only: str | None, executor: str, cpus: int, data_dir: str | None) -> dict:
    import ray

    from pyrobdl.compare import load_suite, run_suite
    from pyrobdl.compare.grid import parse_only
    from pyrobdl.compare.ray_executor import RayExecutor
    from pyrobdl.compare.store import scan_results

    init_s = 0.0
    ex = None
    if executor != "local":
        t = time.perf_counter()
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
        init_s = time.perf_counter() - t
        ex = RayExecutor()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cpu0, t0 = time.process_time(), time.perf_counter()
            summary = run_suite(load_suite(suite_path), Path(tmp) / "out", only=parse_only(only), progress=False,
                                executor=ex, threads=1, data_dir=data_dir)
            wall, driver_cpu = time.perf_counter() - t0, time.process_time() - cpu0
            records, _ = scan_results(Path(tmp) / "out")
    finally:
        if executor != "local":
            ray.shutdown()
    cells = len(summary.ok) + len(summary.failed)
    cell_wall = sum(float(r.get("wall_time_s") or 0) for r in records)
    cell_cpu = sum(float(r.get("cpu_time_s") or 0) for r in records)
    return {"executor": executor, "cells": cells, "failed": len(summary.failed), "wall_s": wall,
            "init_s": init_s, "cell_wall_s": cell_wall, "cell_cpu_s": cell_cpu, "driver_cpu_s": driver_cpu,
            "overhead_per_cell_s": (wall - cell_wall) / max(cells, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("suite")
    ap.add_argument("--only", default=None)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    executors = ["local", "ray-1", f"ray-{args.cpus}"]
    rows = []
    for r in range(args.repeats):
        order = executors if r % 2 == 0 else executors[::-1]  # interleaved, alternating order
        for name in order:
            row = one_run(args.suite, args.only, name, 1 if name == "ray-1" else args.cpus, args.data_dir)
            row["round"] = r
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    local_wall = statistics.median(x["wall_s"] for x in rows if x["executor"] == "local")
    print("\n| executor | cells | run wall s (median) | Ray start s | summed cell wall s | overhead per cell s "
          "| driver CPU s | cells' CPU s | speed-up vs local |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in executors:
        xs = [x for x in rows if x["executor"] == name]
        med = {k: statistics.median(x[k] for x in xs) for k in
               ("wall_s", "init_s", "cell_wall_s", "overhead_per_cell_s", "driver_cpu_s", "cell_cpu_s")}
        overhead = f"{med['overhead_per_cell_s']:.3f}" if name != f"ray-{args.cpus}" or args.cpus == 1 else "(parallel)"
        print(f"| {name} | {xs[0]['cells']} | {med['wall_s']:.1f} | {med['init_s']:.1f} | {med['cell_wall_s']:.1f} | "
              f"{overhead} | {med['driver_cpu_s']:.1f} | {med['cell_cpu_s']:.1f} | {local_wall / med['wall_s']:.2f}x |")


if __name__ == "__main__":
    main()
