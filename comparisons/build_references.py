r"""Build the compact reference stores of ``pyrobdl.references`` (``docs/references.md``).

Two modes:

``quickstart``
    For the synthetic sets of ``comparisons/quickstart.toml`` (``blr``, ``gap``): build the suite's
    dataset and model exactly as ``pyrobdl compare`` does (the suite's own config parser, grid and
    model builder), run its reference method ``chees`` with the suite's settings, certified at
    **every** test input (``certify_inputs = x_test``), write a draws file (the format of
    ``comparisons/uci_references.py --save-draws``) and convert it.  A run that does not certify is
    not stored (the script says so and exits with status 1).  The synthetic data themselves are
    stored beside the summary (``include_data``).

``convert``
    Convert a draws file made elsewhere, e.g. ``results/replicates/wine_split0_seed0.npz`` from
    ``comparisons/uci_references.py --save-draws``.  The protocol is the UCI reference protocol of
    that script (1 x 50 ReLU, N(0, 1) priors, Gamma(1, 0.01) noise precision) with the run's
    settings from its ``--out`` JSON-lines record (``--record``), or whatever ``--protocol`` adds.
    The UCI data are never stored, only their hashes.

Usage (from the repository root)::

    OMP_NUM_THREADS=1 python comparisons/build_references.py quickstart --datasets gap blr \
        --draws-dir results/reference_draws
    python comparisons/build_references.py convert results/replicates/wine_split0_seed0.npz \
        --name wine --split 0 --record results/uci_references.jsonl
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

import pyrobdl
from pyrobdl import references
from pyrobdl.compare import build_model, expand, load_suite
from pyrobdl.compare.sources import load_dataset

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "comparisons" / "quickstart.toml"


def _versions() -> dict[str, str]:
    import pyro

    return {"pyrobdl": pyrobdl.__version__, "torch": torch.__version__, "pyro": pyro.__version__,
            "numpy": np.__version__}


def _jsonable(value: Any) -> Any:
    """``value`` if JSON can hold it, else its ``repr`` (tensors and objects in settings)."""
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


def save_draws(post: Any, data: Any, path: Path) -> None:
    """The draws file of ``comparisons/uci_references.py`` (same keys, shapes and scale); a fixed
    noise precision is written as a constant ``[chain, draw]`` array."""
    f = post.function_draws(data.x_test)[..., 0].detach().cpu().numpy().astype(np.float32)
    lik = post.model.likelihood
    site = getattr(lik, "site", None)
    if site is not None and site in post.samples:
        precision = post.samples[site].detach().cpu().numpy().astype(np.float64).reshape(f.shape[:2])
    else:
        precision = np.full(f.shape[:2], float(lik.precision))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez_compressed(tmp, f=f, precision=precision, x_test=data.x_test.cpu().numpy(),
                        y_test=data.y_test.cpu().numpy(), y_mean=np.asarray(data.y_mean, dtype=float),
                        y_std=np.asarray(data.y_std, dtype=float),
                        certification=json.dumps(post.certification.to_dict()))
    os.replace(tmp, path)


def _quickstart_cell(label: str, split: int) -> Any:
    suite = load_suite(QUICKSTART)
    seed = suite.seeds[0]
    cells = [c for c in expand(suite) if c.dataset == label and c.method == "chees"
             and c.split == split and c.seed == seed]
    if not cells:
        raise SystemExit(f"quickstart.toml has no chees cell for dataset {label!r} split {split}")
    return cells[0]


def build_quickstart(label: str, split: int, draws_dir: Path, root: Path | None) -> dict:
    """Run, save the draws, and (when certified) convert one quickstart reference."""
    cell = _quickstart_cell(label, split)
    spec = cell.spec
    ds = spec["dataset"]
    data = load_dataset(ds["source"], ds["options"], split, None, QUICKSTART.parent)
    model = build_model(spec["model"], data)
    options = dict(spec["method"]["options"])
    options["certify_inputs"] = data.x_test
    cpu0, wall0 = time.process_time(), time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        post = pyrobdl.fit(model, data.x_train, data.y_train, "chees", seed=cell.seed, device="cpu",
                           progress=False, **options)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    draws_path = draws_dir / f"{label}_split{split}_seed{cell.seed}.npz"
    save_draws(post, data, draws_path)
    cert = post.certification
    row = {"name": label, "split": split, "certified": cert.passed, "certification": cert.summary(),
           "fit_cpu_s": round(cpu, 1), "fit_wall_s": round(wall, 1), "draws_file": str(draws_path),
           "chain_gradients": post.cost.gradient_evaluations}
    if not cert.passed:
        row["stored"] = None
        return row
    settings = {k: _jsonable(v) for k, v in options.items() if k != "certify_inputs"}
    recipe = {"blr": "pyrobdl.datasets.bayesian_linear_regression(num_train, num_test, in_features, "
                     "prior_scale=prior_scale, precision=precision, seed=split)",
              "gap": "pyrobdl.datasets.gap_regression(num_train, num_test, noise_sd=noise_sd, seed=split)"}
    protocol = {
        "suite": "comparisons/quickstart.toml", "cell": cell.id, "config_hash": cell.config_hash,
        "data": {"source": ds["source"], "options": ds["options"], "recipe": recipe.get(ds["source"]),
                 "split": split, "num_train": int(data.x_train.shape[0])},
        "model": spec["model"], "method": "chees", "settings": settings,
        "settings_resolved": {k: _jsonable(v) for k, v in post.settings.items()},
        "seed": cell.seed, "certified_at": f"all {data.x_test.shape[0]} test inputs (certify_inputs = x_test)",
        "cost": {"fit_cpu_s": cpu, "fit_wall_s": wall, "chain_gradients": post.cost.gradient_evaluations,
                 "device": "cpu", "torch_threads": torch.get_num_threads()},
        "warnings": [str(w.message)[:400] for w in caught],
        "versions": _versions(),
    }
    path = references.convert(draws_path, label, split, protocol=protocol, root=root, include_data=True)
    row["stored"] = str(path)
    row["kB"] = round(path.stat().st_size / 1000, 1)
    return row


def _uci_protocol_constants() -> dict[str, Any]:
    """The UCI reference protocol as ``comparisons/uci_references.py`` defines it (its constants)."""
    spec = importlib.util.spec_from_file_location("uci_references", ROOT / "comparisons" / "uci_references.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return {
        "script": "comparisons/uci_references.py",
        "model": f"BayesianMLP(D, ({mod.HIDDEN},), 1, activation='relu')",
        "prior": "pyrobdl.priors.Gaussian(1.0) on every weight and bias",
        "likelihood": f"pyrobdl.likelihoods.GaussianLearnedPrecision({mod.CONCENTRATION}, {mod.RATE})",
        "data": "UCI standard split (shared/datasets/uci), X and y standardised with the training split's statistics",
        "method": "chees",
    }


def _record(path: Path, name: str, split: int, seed: int) -> dict | None:
    """The last JSON line of ``--out`` of uci_references.py for (name, split, seed), if any."""
    found = None
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            if r.get("dataset") == name and r.get("split") == split and r.get("seed", 0) == seed:
                found = r
    return found


def convert_file(args: argparse.Namespace) -> dict:
    protocol: dict[str, Any] = _uci_protocol_constants() if not args.no_uci_protocol else {}
    if args.record is not None:
        rec = _record(Path(args.record), args.name, args.split, args.seed)
        if rec is None:
            raise SystemExit(f"{args.record} has no record for {args.name} split {args.split} seed {args.seed}")
        protocol.update({k: rec[k] for k in ("settings", "seed", "versions", "chain_gradients", "cpu_s", "wall_s",
                                             "device", "num_train") if k in rec})
    else:
        protocol["seed"] = args.seed
    if args.protocol:
        protocol.update(json.loads(args.protocol))
    protocol["source_file"] = Path(args.draws).name
    path = references.convert(args.draws, args.name, args.split, protocol=protocol, root=args.root, force=args.force)
    ref = references.load(args.name, args.split, root=args.root)
    return {"name": args.name, "split": args.split, "stored": str(path), "kB": round(path.stat().st_size / 1000, 1),
            "certified": ref.certified, "num_inputs": ref.num_inputs,
            "draws": f"{ref.meta['num_chains']} x {ref.meta['num_draws']}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    q = sub.add_parser("quickstart", help="run and store the quickstart's chees references")
    q.add_argument("--datasets", nargs="+", default=["gap", "blr"])
    q.add_argument("--split", type=int, default=0)
    q.add_argument("--draws-dir", default="results/reference_draws")
    q.add_argument("--root", default=None, help="store folder (default: the package's pyrobdl/references/data)")
    c = sub.add_parser("convert", help="convert a draws file")
    c.add_argument("draws")
    c.add_argument("--name", required=True)
    c.add_argument("--split", type=int, required=True)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--record", default=None, help="uci_references.py --out JSON lines holding this run's settings")
    c.add_argument("--protocol", default=None, help="JSON object added to the protocol")
    c.add_argument("--no-uci-protocol", action="store_true", help="not a uci_references.py run")
    c.add_argument("--force", action="store_true", help="store even if not certified (marked uncertified)")
    c.add_argument("--root", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.mode == "convert":
        print(json.dumps(convert_file(args)))
        return
    failed = False
    for label in args.datasets:
        row = build_quickstart(label, args.split, Path(args.draws_dir), args.root)
        print(json.dumps(row), flush=True)
        if not row["certified"]:
            failed = True
            print(f"{label} split {args.split}: NOT certified, not stored ({row['certification']})", file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
