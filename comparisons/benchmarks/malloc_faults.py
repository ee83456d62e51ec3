r"""What glibc's malloc defaults cost the samplers: page faults per log-joint call, with and without
``pyrobdl.retain_freed_memory()``.

Each run is a fresh process (the setting is process-wide and cannot be undone): a short chees fit at
a UCI reference shape (the reference protocol's 1 x 50 ReLU network with a learned noise precision,
``comparisons/uci_references.py``'s model and superchains of 8, on split 0 of the dataset), timed after a 2 + 2 fit that
compiled the program when ``--compile`` is given (so the compiler's own work is not in the figure).
Printed per run: CPU µs per chain-gradient, user and system seconds, minor page faults per call of
the K-chain log joint.  The two variants alternate, ``--rounds`` times each; medians at the end.

    python comparisons/benchmarks/malloc_faults.py --dataset wine --compile --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import warnings
from pathlib import Path


def one_run(args: argparse.Namespace) -> dict:
    """The timed fit of one variant, in this process."""
    import torch

    torch.set_num_threads(1)
    import pyrobdl
    from pyrobdl import datasets

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from uci_references import make_model

    applied = pyrobdl.retain_freed_memory() if args.variant == "retained" else None
    data = datasets.load_uci(args.dataset, 0, data_dir=args.data_dir)
    model = make_model(data.x_train.shape[1])
    kw = dict(method="chees", num_chains=args.chains, num_warmup=args.warmup, num_samples=args.samples, seed=0,
              progress=False, compile=args.compile, chunk_size=None, superchain_size=args.superchain)
    warnings.simplefilter("ignore")
    if args.compile:
        pyrobdl.fit(model, data.x_train, data.y_train, **dict(kw, num_warmup=2, num_samples=2))
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    post = pyrobdl.fit(model, data.x_train, data.y_train, **kw)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    grads = post.cost.gradient_evaluations
    return {"variant": args.variant, "applied": applied, "chain_gradients": grads,
            "cpu_us_per_chain_gradient": post.cost.cpu_time_s / grads * 1e6,
            "user_s": r1.ru_utime - r0.ru_utime, "sys_s": r1.ru_stime - r0.ru_stime,
            "faults_per_call": (r1.ru_minflt - r0.ru_minflt) / (grads / args.chains),
            "load_average": os.getloadavg()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="wine")
    p.add_argument("--data-dir", default=os.environ.get("PYROBDL_DATA_DIR"))
    p.add_argument("--chains", type=int, default=64)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--superchain", type=int, default=8, help="chees superchain_size (the reference runs' 8)")
    p.add_argument("--compile", action="store_true", help="chees compile=True, as the reference runs")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variant", choices=("default", "retained"), help=argparse.SUPPRESS)  # the child's
    args = p.parse_args(argv)
    if args.variant is not None:
        print(json.dumps(one_run(args)))
        return 0
    env = {**os.environ, "GLIBC_TUNABLES": "", "OMP_NUM_THREADS": "1"}  # glibc's defaults in the children
    child = [sys.executable, __file__, "--dataset", args.dataset, "--chains", str(args.chains),
             "--warmup", str(args.warmup), "--samples", str(args.samples), "--superchain", str(args.superchain)] + (["--compile"] if args.compile else [])
    if args.data_dir:
        child += ["--data-dir", args.data_dir]
    rows: dict[str, list[dict]] = {"default": [], "retained": []}
    for r in range(args.rounds):
        for variant in (("default", "retained") if r % 2 == 0 else ("retained", "default")):
            out = subprocess.run(child + ["--variant", variant], env=env, capture_output=True, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows[variant].append(row)
            print(f"round {r} {variant:9s} {row['cpu_us_per_chain_gradient']:7.1f} CPU µs/chain-gradient, user "
                  f"{row['user_s']:.2f} s, sys {row['sys_s']:.2f} s, {row['faults_per_call']:.0f} faults per call "
                  f"({row['chain_gradients']} chain-gradients; load {row['load_average'][0]:.1f})", flush=True)
    med = {v: statistics.median(x["cpu_us_per_chain_gradient"] for x in rs) for v, rs in rows.items()}
    print(f"medians: default {med['default']:.1f}, retained {med['retained']:.1f} CPU µs per chain-gradient "
          f"({med['default'] / med['retained']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
