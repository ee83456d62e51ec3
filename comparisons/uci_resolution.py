r"""Every method's distance to a UCI reference in units of the reference's resolution.

For each (dataset, split) whose two independent reference runs exist (``comparisons/uci_references.py
--seed 0`` and ``--seed 1`` with ``--save-draws DIR``: ``DIR/<dataset>_split<k>_seed<s>.npz``, the
network output at every test input for every draw and the noise precision):

1. the reference's **resolution**: ``pyrobdl.diagnostics.reference_resolution`` between the two
   runs, each thinned to ``--num-samples`` draws evenly over its chains (what a suite cell's
   evaluation uses: ``comparisons/uci.toml``'s ``num_eval_samples``), run 1 in a method's place
   and run 0 as the reference, on the original target scale;
2. every ``--methods`` fitted as ``comparisons/uci.toml`` fits it on that split (the suite's own
   grid gives the model and every option, seed 0), then ``evaluate(..., reference=run 0,
   resolution=...)``: its distance to the reference, that distance in resolutions, and whether it
   is distinguishable from the reference (``reference_resolved``).

One JSON line per (dataset, split, method) goes to ``--out`` as soon as it is done; a rerun skips
what is there.  ``--table`` prints the Markdown table of ``docs/results.md``.

Usage (from the repository root)::

    nice -n 19 python comparisons/uci_resolution.py --data-dir ../shared/datasets --draws-dir results/replicates \
        --datasets yacht wine --splits 0 --out results/uci_resolution.jsonl
    python comparisons/uci_resolution.py --out results/uci_resolution.jsonl --table
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

import pyrobdl
from pyrobdl.compare import expand, load_suite
from pyrobdl.compare.grid import build_model
from pyrobdl.compare.sources import load_dataset
from pyrobdl.diagnostics import Certification, evaluate, reference_resolution
from pyrobdl.posterior import predictive_from_draws

SUITE = Path(__file__).with_name("uci.toml")
METHODS = ["map", "mean_field", "dropout", "variational_dropout", "ensemble", "laplace"]


def stored_run(path: Path, model: Any, num_samples: int) -> tuple[Any, Certification, dict]:
    """``(x_test, Prediction)`` of a saved reference run, thinned to ``num_samples`` draws at evenly
    spaced positions of its chain-major draws (as ``MCMCPosterior.sample`` does), its
    certification and its arrays."""
    data = np.load(path)
    f = torch.as_tensor(data["f"], dtype=torch.float32)  # [C, D, N]
    c, d, n = f.shape
    idx = (torch.arange(num_samples) * (c * d) // num_samples).long()
    f_flat = f.reshape(c * d, n)[idx].unsqueeze(-1)
    precision = torch.as_tensor(data["precision"], dtype=torch.float32).reshape(c * d)[idx]
    x = torch.as_tensor(data["x_test"], dtype=torch.float32)
    site = model.likelihood.site
    pred = predictive_from_draws(model, {site: precision}, x, f=f_flat)  # the stored outputs stand for the network's
    cert = Certification.from_dict(json.loads(str(data["certification"])))
    return (x, pred), cert, {"num_chains": c, "num_draws": d}


def cells_of(dataset: str, split: int, data_dir: str) -> dict[str, Any]:
    """The suite's cells of (dataset, split, seed 0), by method label."""
    suite = load_suite(SUITE)
    return {c.method: c for c in expand(suite, data_dir) if c.dataset == dataset and c.split == split and c.seed == 0}


def run_split(dataset: str, split: int, args: argparse.Namespace, done: set) -> list[dict]:
    cells = cells_of(dataset, split, args.data_dir)
    ref_cell = cells["chees"]
    data = load_dataset(ref_cell.spec["dataset"]["source"], ref_cell.spec["dataset"]["options"], split,
                        args.data_dir, SUITE.parent)
    ref_model = build_model(ref_cell.spec["model"], data)
    draws = Path(args.draws_dir)
    runs = [stored_run(draws / f"{dataset}_split{split}_seed{s}.npz", ref_model, args.num_samples) for s in (0, 1)]
    (ref, cert0, shape0), (rep, cert1, _) = runs
    if not torch.equal(ref[0], data.x_test):
        raise ValueError(f"{dataset} split {split}: the saved runs' test inputs differ from the data's")
    scale = {"y_mean": float(data.y_mean), "y_std": float(data.y_std)}
    res = reference_resolution(rep, ref, data.x_test, num_samples=args.num_samples, model=ref_model, **scale)
    rows = []
    for label in args.methods:
        if (dataset, split, label) in done:
            continue
        cell = cells[label]
        model = build_model(cell.spec["model"], data)
        start, cpu = time.perf_counter(), time.process_time()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            post = pyrobdl.fit(model, data.x_train, data.y_train, cell.spec["method"]["name"], seed=0,
                               progress=False, **cell.spec["method"]["options"])
            scores = evaluate(post, data.x_test, data.y_test, reference=ref, resolution=res,
                              num_samples=args.num_samples, seed=0, **scale)
        rows.append({
            "dataset": dataset, "split": split, "method": label, "num_test": int(data.x_test.shape[0]),
            "reference_certified": [cert0.passed, cert1.passed], "reference_failures": list(cert0.failures),
            "reference_shape": shape0, "resolution": res.to_dict(), "scores": scores,
            "fit_cpu_s": time.process_time() - cpu, "fit_wall_s": time.perf_counter() - start,
            "load_average": os.getloadavg(), "warnings": [str(w.message)[:200] for w in caught],
            "versions": {"pyrobdl": pyrobdl.__version__, "torch": torch.__version__},
        })
        with Path(args.out).open("a") as fh:
            fh.write(json.dumps(rows[-1]) + "\n")
        print(f"{dataset} {split} {label}: W2_f {scores['w2_function_to_reference']:.4f} = "
              f"{scores['w2_function_to_reference_in_resolutions']:.2f} resolutions; resolved "
              f"{bool(scores['reference_resolved'])}; {rows[-1]['fit_cpu_s']:.0f} CPU s", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    """Per (dataset, split): the resolution, then every method's distance and its multiple."""
    head = ("| dataset | split | reference certified | resolution W2_f | method | W2_f to reference | in resolutions "
            "| distinguishable | KL in resolutions | test RMSE | test LL |")
    lines = [head, "|" + "---|" * 11]
    for r in sorted(rows, key=lambda r: (r["dataset"], r["split"], r["scores"]["w2_function_to_reference"])):
        s, res = r["scores"], r["resolution"]["metrics"]["w2_function_to_reference"]
        cert = "yes" if all(r["reference_certified"]) else "no"
        lines.append(
            f"| {r['dataset']} | {r['split']} | {cert} | {res:.4f} | {r['method']} | "
            f"{s['w2_function_to_reference']:.4f} | {s['w2_function_to_reference_in_resolutions']:.1f} | "
            f"{'yes' if s['reference_resolved'] else 'no'} | {s['kl_gaussian_to_reference_in_resolutions']:.1f} | "
            f"{s['rmse']:.3f} | {s['test_ll']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=os.environ.get("PYROBDL_DATA_DIR"))
    parser.add_argument("--draws-dir", default="results/replicates")
    parser.add_argument("--datasets", nargs="*", default=["yacht", "boston", "energy", "concrete", "wine"])
    parser.add_argument("--splits", nargs="*", type=int, default=[0])
    parser.add_argument("--methods", nargs="*", default=METHODS)
    parser.add_argument("--num-samples", type=int, default=1000, help="draws per run and per method (uci.toml's)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--table", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()] if out.exists() else []
    if args.table:
        print(table(rows))
        return
    torch.set_num_threads(args.threads)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {(r["dataset"], r["split"], r["method"]) for r in rows}
    for name in args.datasets:
        for split in args.splits:
            if all((Path(args.draws_dir) / f"{name}_split{split}_seed{s}.npz").exists() for s in (0, 1)):
                run_split(name, split, args, done)
            else:
                print(f"{name} split {split}: the two reference runs are not both in {args.draws_dir}; skipped")


if __name__ == "__main__":
    main()
