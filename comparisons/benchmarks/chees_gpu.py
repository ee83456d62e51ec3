"""Many-chain HMC (``method="chees"``) on a GPU against NumPyro's NUTS on the CPU of the same machine.

The model and data of ``chees_vs_numpyro.py`` (the 1x50 tanh BNN, 500 x 8, Gamma(6, 6) noise
precision prior, float32).  Three parts, each optional:

``--part numpyro``
    NumPyro NUTS on the CPU (one XLA thread; 2 chains x (300 + 300), max tree depth 10, run twice
    per seed: with compilation, then cached), exactly ``chees_vs_numpyro.run_numpyro_seed``; one
    JSON line per run to ``--out``.  Run it as its own process beside the GPU parts: it uses one
    CPU core and no GPU, so it does not disturb the GPU's timings.
``--part micro``
    GPU cost per chain-gradient: ``FlatLogJoint.value_and_grad`` on ``[K, P]`` states (prior draws,
    weights scaled by 0.3) and one whole leapfrog step of the sampler (``_Sampler.leapfrog``, 20
    steps per call), for each K of ``--micro-chains``, eager and (K in ``--compile-chains``)
    through ``torch.compile``.  Timed with a device synchronisation around loops of calls lasting about
    ``--micro-seconds``; ``--micro-rounds`` rounds in rotating order; medians.
``--part e2e``
    ``pyrobdl.fit(method="chees", device=--device, num_chains=K)`` for each K of ``--chees-chains``
    (``--chees-warmup`` warm-up iterations, ``max(20, ceil(--chees-draws / K))`` draws per chain;
    ``compile=True`` for K in ``--compile-chains``, timed after a short fit has compiled it),
    then the bulk ESS of the function values at the first 50 training inputs, per wall second
    and per CPU second of the host process, and their ratio to the NumPyro runs found in
    ``--numpyro-results`` (the cached runs: NumPyro's CPU seconds).

Usage (on a machine with CUDA; NumPyro and JAX from ``pip install -e '.[bench]'``)::

    python comparisons/benchmarks/chees_gpu.py --part numpyro --out numpyro.jsonl &
    python comparisons/benchmarks/chees_gpu.py --part micro e2e --numpyro-results numpyro.jsonl --out gpu.jsonl

The figures of the issue-11 session that had an H100 are in ``docs/benchmarks/chees_gpu.md``.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chees_vs_numpyro import load, make_model, per_cpu, run_numpyro_seed  # noqa: E402
from nuts_vs_numpyro import NUM_EVAL, make_data, summarise  # noqa: E402

import pyrobdl  # noqa: E402
from pyrobdl.flat import FlatLogJoint  # noqa: E402
from pyrobdl.inference.chees import _Sampler  # noqa: E402


def emit(row: dict, out: Path) -> None:
    row = {**row, "load_after": load()}
    with out.open("a") as fh:
        fh.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, calls: int, device: torch.device) -> tuple[float, float]:
    sync(device)
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(calls):
        fn()
    sync(device)
    return time.process_time() - cpu, time.perf_counter() - wall


def micro(x, y, device: torch.device, args, out: Path) -> None:
    xt, yt = torch.as_tensor(x, device=device), torch.as_tensor(y, device=device)
    model = make_model().to(device)
    gen = torch.Generator(device=device).manual_seed(12345)
    variants = []  # (name, K, chain-gradients per call, compile seconds, fn)
    leapfrog_steps = 20
    for compiled in (False, True):
        for k in (args.micro_chains if not compiled else [k for k in args.micro_chains if k in args.compile_chains]):
            lj = FlatLogJoint(model, xt, yt, chunk_size=None)
            compile_s = lj.compile(k) if compiled else 0.0
            theta = lj.sample_prior(k, generator=gen)
            theta[:, : lj.size - 1] *= 0.3  # weights and biases; the last coordinate is log precision
            sampler = _Sampler(lj, theta, gen, 1000.0)
            p = sampler.momentum()
            tag = "compiled" if compiled else "eager"
            variants.append((f"value_and_grad ({tag})", k, k, compile_s,
                             lambda lj=lj, theta=theta: lj.value_and_grad(theta)))
            variants.append((f"leapfrog step ({tag})", k, k * leapfrog_steps, compile_s,
                             lambda s=sampler, p=p: s.leapfrog(s.theta, p, s.grad, 1e-3, leapfrog_steps)))
    calls = []
    for _, _, _, _, fn in variants:  # warm-up and calibration
        fn()
        _, wall = timed(fn, 2, device)
        calls.append(max(2, int(args.micro_seconds / max(wall / 2, 1e-7))))
    cpu_us = [[] for _ in variants]
    wall_us = [[] for _ in variants]
    for r in range(args.micro_rounds):
        shift = r % len(variants)
        order = list(range(len(variants)))
        for i in order[shift:] + order[:shift]:
            c, w = timed(variants[i][4], calls[i], device)
            cpu_us[i].append(1e6 * c / (calls[i] * variants[i][2]))
            wall_us[i].append(1e6 * w / (calls[i] * variants[i][2]))
    for i, (name, k, _, compile_s, _) in enumerate(variants):
        emit({"part": "micro", "variant": name, "chains": k, "device": device_name(device),
              "calls_per_timing": calls[i], "compile_s": compile_s,
              "wall_us_per_chain_gradient": statistics.median(wall_us[i]),
              "cpu_us_per_chain_gradient": statistics.median(cpu_us[i]),
              "wall_us_all": wall_us[i], "cpu_us_all": cpu_us[i],
              "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None},
             out)


def e2e(x, y, device: torch.device, args, out: Path) -> None:
    for k in args.chees_chains:
        samples = max(args.chees_min_samples, math.ceil(args.chees_draws / k))
        for compiled in ((True,) if k in args.compile_chains else (False,)):
            print(f"e2e K={k}: {args.chees_warmup} + {samples}, compile={compiled}", file=sys.stderr, flush=True)
            if compiled:  # timed with the compiled program cached, as NumPyro's reference run is
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    pyrobdl.fit(make_model(), x, y, method="chees", num_chains=k, num_warmup=2, num_samples=2,
                                seed=args.seed, progress=False, compile=True, device=str(device))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                call_start = time.perf_counter()
                post = pyrobdl.fit(make_model(), x, y, method="chees", num_chains=k, num_warmup=args.chees_warmup,
                                   num_samples=samples, seed=args.seed, progress=args.progress,
                                   diagnostic_points=NUM_EVAL,
                                   compile=compiled, device=str(device))
                call_wall = time.perf_counter() - call_start
            d = post.diagnostics
            f = post.function_draws(torch.as_tensor(x[:NUM_EVAL]))[..., 0].double().cpu().numpy()
            cert = d["certification"]
            extra = {
                "part": "e2e", "method": "chees", "chains": k, "warmup": args.chees_warmup, "samples": samples,
                "compile": compiled, "compile_s": d["compile_s"], "device": post.cost.device,
                "device_name": device_name(device), "step_size": d["step_size"],
                "trajectory_length": d["trajectory_length"], "mean_num_steps_sampling": d["mean_num_steps_sampling"],
                "divergences": int(sum(d["divergences"])), "ebfmi_min": float(np.min(d["ebfmi"])),
                "certified": bool(cert["passed"]), "certification_failures": list(cert["failures"]),
                "peak_memory_bytes": post.cost.peak_memory_bytes,
                # the whole fit call: sampling (the cost above) plus the certification and the
                # convergence summary computed after it
                "fit_call_wall_s": call_wall,
                "warnings": sorted({str(w.message)[:200] for w in caught}),
            }
            row = per_cpu(summarise(f"pyrobdl chees K={k} on {device}", post.cost.wall_time_s, post.cost.cpu_time_s,
                                    d["chain_gradients"], f, extra))
            row["wall_us_per_chain_gradient"] = 1e6 * row["wall_s"] / row["gradients"]
            ref = numpyro_reference(args.numpyro_results)
            if ref is not None:
                # GPU wall seconds (the GPU is the chees run's whole cost) against NumPyro's CPU seconds
                row["ess_min_per_wall_s_vs_numpyro_cpu_s"] = row["ess_min_per_s"] / ref["ess_min_per_cpu_s"]
                row["ess_median_per_wall_s_vs_numpyro_cpu_s"] = row["ess_median_per_s"] / ref["ess_median_per_cpu_s"]
                row["numpyro_reference_seeds"] = ref["seeds"]
            emit(row, out)
            del post
            if device.type == "cuda":
                torch.cuda.empty_cache()


def numpyro_reference(path: str | None) -> dict | None:
    """Medians over the cached NumPyro runs in ``path`` (None when there are none yet)."""
    if not path or not Path(path).exists():
        return None
    rows = [json.loads(s) for s in Path(path).read_text().splitlines() if s.strip()]
    rows = [r for r in rows if r.get("method") == "numpyro" and r.get("reference")]
    if not rows:
        return None
    ref = {key: statistics.median(r[key] for r in rows) for key in ("ess_min_per_cpu_s", "ess_median_per_cpu_s")}
    # which runs the ratio used: with --part numpyro still running beside, perhaps not every seed yet
    return {**ref, "seeds": sorted(r.get("seed") for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", nargs="+", choices=["numpyro", "micro", "e2e"], required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, nargs="*", default=[0], help="NumPyro seeds (--part numpyro)")
    parser.add_argument("--numpyro-warmup", type=int, default=300)
    parser.add_argument("--numpyro-samples", type=int, default=300)
    parser.add_argument("--numpyro-chains", type=int, default=2)
    parser.add_argument("--max-tree-depth", type=int, default=10)
    parser.add_argument("--micro-chains", type=int, nargs="*", default=[1, 64, 1024, 4096, 16384, 65536])
    parser.add_argument("--micro-rounds", type=int, default=5)
    parser.add_argument("--micro-seconds", type=float, default=0.3)
    parser.add_argument("--chees-chains", type=int, nargs="*", default=[1024, 4096, 16384])
    parser.add_argument("--chees-warmup", type=int, default=300)
    parser.add_argument("--chees-draws", type=int, default=600)
    parser.add_argument("--chees-min-samples", type=int, default=20)
    parser.add_argument("--compile-chains", type=int, nargs="*", default=[],
                        help="for these K also time the torch.compile'd log joint (micro), and run fit(compile=True) "
                             "instead of the eager fit (e2e)")
    parser.add_argument("--numpyro-results", default=None)
    parser.add_argument("--progress", action="store_true",
                        help="e2e: show chees's progress bar on stderr (in a log file set TQDM_MININTERVAL)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    x, y = make_data(0)
    if "numpyro" in args.part:
        for seed in args.seeds:
            for row in run_numpyro_seed(x, y, seed, args):
                emit({**row, "part": "numpyro"}, out)
    device = torch.device(args.device)
    if {"micro", "e2e"} & set(args.part) and device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: CUDA is not available on this machine")
    if "micro" in args.part:
        micro(x, y, device, args, out)
    if "e2e" in args.part:
        e2e(x, y, device, args, out)


if __name__ == "__main__":
    main()
