r"""Certified HMC reference posteriors on the standard UCI splits (method ``"chees"``).

For every requested (dataset, split): the UCI protocol of ``../shared/REFERENCES.md`` §1 —
one hidden layer of 50 ReLU units, X and y standardised with the training split's statistics,
N(0, 1) priors on every weight and bias, a learned noise precision with the weak
Gamma(1, 0.01) prior of ``comparisons/uci.toml`` — sampled by ``pyrobdl.fit(method="chees")``;
then test RMSE and test log-likelihood on the original target scale
(``pyrobdl.diagnostics.evaluate``, every stored draw), the certification computed on **held-back
inputs** (the split's first ``--cert-points`` test inputs, never seen by the sampler) with both
split and nested R-hat (nested R-hat certifies only chains started in superchains:
``--superchain-starts``), and the cost (chain-gradients, process CPU seconds, wall seconds).  One
JSON line per split goes to ``--out`` as soon as the split is done; a rerun skips the splits
already there, so an interrupted run loses nothing.  ``--table`` prints the Markdown table of
``docs/results/references.md``.

Usage (from the repository root)::

    nice -n 10 python comparisons/uci_references.py --data-dir ../shared/datasets \
        --datasets yacht boston energy concrete wine --splits 0 1 2 --out results/uci_references.jsonl
    python comparisons/uci_references.py --out results/uci_references.jsonl --table

With ``--checkpoint-dir DIR`` each split's chees run writes its state to ``DIR`` (every
``--checkpoint-every`` seconds): the same command resumes a killed run where it stopped, with the
same draws; ``--extend-to N`` (with ``--extend-by M``) extends a run that is not certified (by
``--extend-until``: split, nested or both R-hats, at the held-back inputs) by M draws per chain
at a time, up to N, without redoing any draw — chees's own ``max_num_samples``, so a run cut
inside an extension resumes there from its checkpoint::

    nice -n 19 python comparisons/uci_references.py --data-dir ../shared/datasets --datasets wine --splits 5 \
        --warmup 300 --samples 300 --extend-to 900 --extend-by 100 --superchain-starts --compile \
        --chunk-size none --checkpoint-dir results/checkpoints --out results/wine.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

import dataclasses

import numpy as np
import torch

import pyrobdl
from pyrobdl import datasets, likelihoods, priors
from pyrobdl.diagnostics import CertificationCriteria, certify, evaluate
from pyrobdl.inference.chees import MASS_MATRICES
from pyrobdl.inference.mcmc import MCMCPosterior

#: The suite's model for the UCI benchmark (comparisons/uci.toml).
HIDDEN, CONCENTRATION, RATE = 50, 1.0, 0.01


def first_draws(post: MCMCPosterior, n: int) -> MCMCPosterior:
    """The same run cut after its first ``n`` sampling iterations (warm-up kept whole)."""
    t = post.trace
    keep = t.num_warmup + n
    cut = {f.name: (v[:, :keep] if isinstance(v, np.ndarray) else v)
           for f in dataclasses.fields(t) for v in [getattr(t, f.name)]}
    return MCMCPosterior(post.model, {k: v[:, :n] for k, v in post.samples.items()},
                         dataclasses.replace(t, **cut), method=post.method,
                         settings=post.settings, cost=post.cost)


def prefix_certifications(post: MCMCPosterior, held_back: torch.Tensor, prefixes: list[int],
                          superchain: int) -> list[dict]:
    """Certification (split and nested R-hat) of the first ``n`` draws per chain, each ``n``."""
    rows = []
    for n in sorted(p for p in prefixes if p < post.num_draws):
        sub = first_draws(post, n)
        s = certify(sub, held_back)
        nst = certify(sub, held_back, CertificationCriteria(rhat="nested", superchain_size=superchain))
        rows.append({"num_samples": n, "certified_split": s.passed, "certified_nested": nst.passed,
                     "rhat_split_max": s.rhat_max, "rhat_nested_max": nst.rhat_max,
                     "ess_bulk_min": s.ess_bulk_min, "ess_tail_min": s.ess_tail_min,
                     "divergences": s.divergences, "ebfmi_min": s.ebfmi_min, "ebfmi_pooled": s.ebfmi_pooled,
                     "failures_nested": list(nst.failures)})
    return rows


def make_model(num_features: int) -> pyrobdl.BayesianMLP:
    """The reference protocol's network: 1 x 50 ReLU, N(0, 1) weights, learned noise precision."""
    return pyrobdl.BayesianMLP(
        num_features, (HIDDEN,), 1, activation="relu", prior=priors.Gaussian(1.0),
        likelihood=likelihoods.GaussianLearnedPrecision(CONCENTRATION, RATE),
    )


def checkpoint_path(args: argparse.Namespace, name: str, split: int) -> str | None:
    """The split's chees checkpoint under ``--checkpoint-dir`` (None without it): a killed run
    rerun with the same command resumes there, and a larger ``--samples`` extends a finished one."""
    if args.checkpoint_dir is None:
        return None
    return str(Path(args.checkpoint_dir) / f"{name}_split{split}_seed{args.seed}_k{args.chains}.pt")


def run_split(name: str, split: int, args: argparse.Namespace) -> dict:
    data = datasets.load_uci(name, split, data_dir=args.data_dir)
    held_back = data.x_test[: args.cert_points]
    model = make_model(data.x_train.shape[1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # with --extend-to the fit samples until certified at the held-back inputs (chees's
        # max_num_samples: extend_by more draws per chain per round, none redrawn)
        post = pyrobdl.fit(
            model, data.x_train, data.y_train, method="chees", num_chains=args.chains,
            num_warmup=args.warmup, num_samples=args.samples, seed=args.seed, progress=args.progress,
            init_strategy=args.init_strategy, compile=args.compile,
            superchain_size=args.superchain if args.superchain_starts else 1, chunk_size=args.chunk_size,
            mass_matrix=args.mass_matrix, device=args.device, max_num_steps=args.max_num_steps,
            temperatures=args.temperatures, adapt_temperatures=args.adapt_temperatures,
            checkpoint=checkpoint_path(args, name, split), checkpoint_every_s=args.checkpoint_every,
            certify_inputs=held_back, max_num_samples=args.extend_to, extend_by=args.extend_by,
            certify_rhat=args.extend_until if args.extend_to is not None else "auto",
            **dict(chees_option(o) for o in args.chees_option),
        )
    samples = post.num_draws
    if args.save_draws is not None:
        save_draws(post, data, Path(args.save_draws) / f"{name}_split{split}_seed{args.seed}.npz")
    split_cert = certify(post, held_back)
    nested_cert = certify(post, held_back, CertificationCriteria(rhat="nested", superchain_size=args.superchain))
    total = post.num_chains * post.num_draws
    scores = evaluate(post, data.x_test, data.y_test, num_samples=total, seed=0,
                      y_mean=data.y_mean, y_std=data.y_std)
    d = post.diagnostics
    prefixes = prefix_certifications(post, held_back, args.cert_prefixes or [], args.superchain)
    return {
        "dataset": name, "split": split, "seed": args.seed,
        "num_train": int(data.x_train.shape[0]), "num_test": int(data.x_test.shape[0]),
        "settings": {"num_chains": args.chains, "num_warmup": args.warmup, "num_samples": samples,
                     "init_strategy": args.init_strategy, "compile": args.compile,
                     "superchain_size": post.trace.superchain_size, "chunk_size": args.chunk_size,
                     "mass_matrix": args.mass_matrix, "device": args.device,
                     "max_num_steps": args.max_num_steps, "temperatures": args.temperatures,
                     "adapt_temperatures": args.adapt_temperatures,
                     **dict(chees_option(o) for o in args.chees_option)},
        "rmse": scores["rmse"], "test_ll": scores["test_ll"], "coverage_90": scores.get("coverage_90"),
        "certified_split": split_cert.passed, "failures_split": list(split_cert.failures),
        "certified_nested": nested_cert.passed, "failures_nested": list(nested_cert.failures),
        "rhat_split_max": split_cert.rhat_max, "rhat_nested_max": nested_cert.rhat_max,
        "ess_bulk_min": split_cert.ess_bulk_min, "ess_tail_min": split_cert.ess_tail_min,
        "divergences": split_cert.divergences, "ebfmi_min": split_cert.ebfmi_min,
        "ebfmi_pooled": split_cert.ebfmi_pooled,
        "prefixes": prefixes,
        "resumed_at": d["resumed_at"],
        "extensions": post.diagnostics.get("extensions", []),
        "step_size": d["step_size"], "trajectory_length": d["trajectory_length"],
        "swap_accept_prob": d["swap_accept_prob"], "num_chains_all_rungs": d["num_chains_all_rungs"],
        "step_size_rungs": d["step_size_rungs"], "temperatures_final": d["temperatures"],
        "swap_accept_prob_sampling": d["swap_accept_prob_sampling"],
        "round_trips": d["round_trips"], "hot_arrivals": d["hot_arrivals"],
        "round_trips_warmup": d["round_trips_warmup"], "hot_arrivals_warmup": d["hot_arrivals_warmup"],
        "ladder_span": d["ladder_span"],
        "mean_num_steps_sampling": d["mean_num_steps_sampling"],
        "chain_gradients": post.cost.gradient_evaluations, "cpu_s": post.cost.cpu_time_s,
        "wall_s": post.cost.wall_time_s, "device": post.cost.device,
        "device_name": torch.cuda.get_device_name(post.cost.device) if post.cost.device.startswith("cuda") else "cpu",
        "peak_memory_bytes": post.cost.peak_memory_bytes,
        "load_average": os.getloadavg(), "torch_threads": torch.get_num_threads(),
        "warnings": [str(w.message)[:300] for w in caught],
        "versions": {"pyrobdl": pyrobdl.__version__, "torch": torch.__version__},
    }


def save_draws(post: MCMCPosterior, data: Any, path: Path) -> None:
    """Every draw's network output at every test input (``f`` ``[chain, draw, N]``, model scale) and
    the noise precision ``[chain, draw]``, with the target scale and the certification record: what
    two independent runs' resolution (``pyrobdl.diagnostics.reference_resolution``) is computed from."""
    f = post.function_draws(data.x_test)[..., 0].detach().cpu().numpy().astype(np.float32)
    site = post.model.likelihood.site
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez_compressed(tmp, f=f, precision=post.samples[site].detach().cpu().numpy().astype(np.float64),
                        x_test=data.x_test.cpu().numpy(), y_test=data.y_test.cpu().numpy(),
                        y_mean=np.asarray(data.y_mean, dtype=float), y_std=np.asarray(data.y_std, dtype=float),
                        certification=json.dumps(post.certification.to_dict()))
    os.replace(tmp, path)


def table(rows: list[dict]) -> str:
    head = ("| dataset | split | N | test RMSE | test LL | certified (split R-hat) | certified (nested R-hat) "
            "| max R-hat split / nested | min bulk / tail ESS | div. | chain-gradients | CPU s | wall s |")
    lines = [head, "|" + "---|" * 13]
    for r in sorted(rows, key=lambda r: (r["dataset"], r["split"])):
        # nested R-hat certifies only chains started in superchains (rows before that option: independent)
        independent = r["settings"].get("superchain_size", 1) == 1
        nested = "n/a (independent starts)" if independent else ("yes" if r["certified_nested"] else "no")
        lines.append(
            f"| {r['dataset']} | {r['split']} | {r['num_train']} | {r['rmse']:.3f} | {r['test_ll']:.3f} "
            f"| {'yes' if r['certified_split'] else 'no'} | {nested} "
            f"| {r['rhat_split_max']:.3f} / {r['rhat_nested_max']:.3f} | {r['ess_bulk_min']:.0f} / {r['ess_tail_min']:.0f} "
            f"| {r['divergences']} | {r['chain_gradients']:,} | {r['cpu_s']:.0f} | {r['wall_s']:.0f} |"
        )
    return "\n".join(lines)


def chees_option(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` of ``--chees-option``; the value read as JSON where it parses (numbers, true)."""
    key, _, value = text.partition("=")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=os.environ.get("PYROBDL_DATA_DIR"))
    parser.add_argument("--datasets", nargs="*", default=["yacht", "boston", "energy", "concrete", "wine"])
    parser.add_argument("--splits", nargs="*", type=int, default=[0, 1, 2])
    parser.add_argument("--chains", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cert-points", type=int, default=50, help="held-back test inputs for certification")
    parser.add_argument("--superchain", type=int, default=8, help="chains per superchain for nested R-hat")
    parser.add_argument("--superchain-starts", action="store_true",
                        help="start the chains in superchains of --superchain (chees superchain_size): what nested "
                             "R-hat needs; without it the chains start independently and the nested certificate "
                             "fails by construction (its R-hat value is still recorded)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--init-strategy", default="prior", choices=["prior", "map", "ensemble"],
                        help="chees's init_strategy (map/ensemble: map_num_steps=500 Adam steps per chain)")
    parser.add_argument("--compile", action="store_const", const=True, default="auto",
                        help="chees compile=True (13-26%% less CPU per chain-gradient measured at K = 8-64; needs a C++ "
                             "compiler); without it chees's default compile='auto' (compiled on CUDA, eager on CPU)")
    parser.add_argument("--chunk-size", type=lambda v: None if v == "none" else (v if v == "auto" else int(v)),
                        default="auto", help="chees chunk_size: 'auto' (default), 'none' (all chains in one call) "
                        "or an integer; comparisons/benchmarks/flat_chunk_size.py measures which is fastest here")
    parser.add_argument("--mass-matrix", choices=MASS_MATRICES, default="cross-chain",
                        help="chees mass_matrix: how each warm-up window estimates the diagonal mass matrix "
                        "(docs/methods/chees.md)")
    parser.add_argument("--max-num-steps", type=int, default=1024,
                        help="chees max_num_steps: the cap on leapfrog steps per iteration (its default 1024)")
    parser.add_argument("--temperatures", type=float, nargs="*", default=None,
                        help="chees temperatures: inverse temperatures 1 > ... > 0 for replica exchange; --chains is "
                             "then the number of chains of all rungs together, and only the first rung's are kept")
    parser.add_argument("--adapt-temperatures", action="store_true",
                        help="chees adapt_temperatures: move the inner rungs of --temperatures during warm-up so "
                             "that neighbouring exchanges are rejected equally often")
    parser.add_argument("--device", default="cpu", help="where to sample: 'cpu' or 'cuda' (fit's device)")
    parser.add_argument("--cert-prefixes", nargs="*", type=int, default=[],
                        help="also certify the first N sampling iterations of each chain, for each N")
    parser.add_argument("--progress", action="store_true",
                        help="show chees's progress bar (iteration, step size, T, steps) on stderr; in a log "
                             "file set TQDM_MININTERVAL (seconds) to keep it short")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="write each split's chees state there (every --checkpoint-every seconds): the same "
                             "command resumes a killed run, and with a larger --samples extends a finished one "
                             "(drop its row from --out first)")
    parser.add_argument("--checkpoint-every", type=float, default=300.0, help="seconds between checkpoint writes")
    parser.add_argument("--extend-to", type=int, default=None,
                        help="while the run is not certified at the held-back inputs (--extend-until), sample "
                             "--extend-by more draws per chain, up to this many (chees's max_num_samples; with "
                             "--checkpoint-dir a run cut inside an extension resumes there)")
    parser.add_argument("--extend-by", type=int, default=100)
    parser.add_argument("--extend-until", choices=["split", "nested", "both"], default="both",
                        help="which R-hat's certification ends the extension (chees's certify_rhat; nested and "
                             "both need --superchain-starts)")
    parser.add_argument("--save-draws", default=None,
                        help="folder for each run's draws of f at every test input (NAME_splitS_seedK.npz)")
    parser.add_argument("--chees-option", action="append", default=[], metavar="KEY=VALUE",
                        help="any other option of fit(method='chees'), e.g. step_size_adaptation=continuous "
                             "(repeatable; VALUE read as JSON where it parses)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--table", action="store_true", help="print the table of --out and exit")
    args = parser.parse_args()
    if args.extend_to is not None and args.extend_until != "split" and not args.superchain_starts:
        parser.error(f"--extend-until {args.extend_until} certifies with nested R-hat, which needs chains started in "
                     "superchains: give --superchain-starts (or --extend-until split)")
    if args.extend_to is not None and args.extend_to < args.samples:
        parser.error(f"--extend-to {args.extend_to} must be >= --samples {args.samples}")
    if args.extend_by < 1:
        parser.error(f"--extend-by must be >= 1, got {args.extend_by}")
    out = Path(args.out)
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()] if out.exists() else []
    if args.table:
        print(table(rows))
        return
    torch.set_num_threads(args.threads)
    # the compiled kernel's 18 MB buffers re-faulted on every call under glibc's defaults: 1.34x
    # more CPU per chain-gradient at wine's shape (pyrobdl/_allocator.py); the draws are unchanged
    pyrobdl.retain_freed_memory()
    done = {(r["dataset"], r["split"]) for r in rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.datasets:
        for split in args.splits:
            if (name, split) in done:
                continue
            start = time.perf_counter()
            row = run_split(name, split, args)
            with out.open("a") as fh:
                fh.write(json.dumps(row) + "\n")
            print(f"{name} split {split}: RMSE {row['rmse']:.3f} LL {row['test_ll']:.3f} certified "
                  f"split={row['certified_split']} nested={row['certified_nested']} "
                  f"{time.perf_counter() - start:.0f} s; {row['failures_split']}", flush=True)


if __name__ == "__main__":
    main()
