r"""Paper check: sparse variational dropout on LeNet-300-100 / MNIST (Molchanov et al. 2017).

Published (REFERENCES.md section 2): 1.92% test error, 68x compression, 98.9 / 97.2 / 62.0 %
of the weights removed per layer, with 200 epochs, batch 100, Adam 1e-3 with linear decay,
linear KL warm-up, log sigma^2 initialised at -10, weights with log alpha >= 3 pruned.

Everything goes through ``pyrobdl.fit(method="variational_dropout")``; the script only adds
the evaluation.  Results are appended, one JSON object per run, to ``--out`` (a JSON-lines
file), and the trained guide's ``state_dict`` is saved next to it as soon as training ends,
so a crash in the evaluation loses nothing.

Paper-scale run (a GPU is advisable; about 120,000 steps)::

    python comparisons/mnist_sparse_vd.py --epochs 200 --warmup-epochs 50 --device cuda \
        --out results/mnist_sparse_vd.jsonl

What ran on the shared 2-core CPU is recorded in docs/methods/variational_dropout.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

import pyrobdl
from pyrobdl import likelihoods, priors
from pyrobdl.datasets import load_mnist
from pyrobdl.guides import pruned_posterior
from pyrobdl.posterior import predictive_from_draws

PAPER = {"test_error": 0.0192, "compression_ratio": 68.0, "removed_per_layer": [0.989, 0.972, 0.620]}


def error_rate(probs: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of test points whose most probable class is wrong."""
    return float((probs.argmax(-1) != y).double().mean())


def evaluate(posterior, x_test: torch.Tensor, y_test: torch.Tensor, threshold: float, num_samples: int) -> dict:
    """Test error of the mean and MC-averaged networks, before and after pruning, and sparsity."""
    model, guide = posterior.model, posterior.guide
    pruned = pruned_posterior(posterior, threshold)
    out = {}
    with torch.no_grad():
        for label, post in (("full", posterior), ("pruned", pruned)):
            # Molchanov et al. test with the posterior-mean weights (masked after pruning).
            mean_pred = predictive_from_draws(model, post.guide.point_params(), x_test)
            out[f"test_error_mean_net_{label}"] = error_rate(mean_pred.mean, y_test)
            # The shared predictive: num_samples weight draws, probabilities averaged.
            mc = torch.zeros(x_test.shape[0], model.out_features, device=x_test.device)
            for chunk in torch.split(torch.arange(x_test.shape[0], device=x_test.device), 2000):
                pred = post.predict(x_test[chunk], num_samples=num_samples, seed=0)
                mc[chunk] = pred.mean
            out[f"test_error_mc_{label}"] = error_rate(mc, y_test)
            out[f"test_nll_mc_{label}"] = float(
                -torch.log(mc.gather(-1, y_test[:, None]).clamp_min(1e-12)).mean()
            )
    sp = guide.sparsity(threshold)
    out["removed_per_layer"] = {k: round(v, 5) for k, v in sp.removed.items()}
    out["kept_per_layer"] = dict(sp.kept)
    out["removed_total"] = sp.removed_total
    out["compression_ratio"] = sp.compression_ratio
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=os.environ.get("PYROBDL_DATA_DIR", "../shared/datasets"))
    parser.add_argument("--epochs", type=float, default=200.0)
    parser.add_argument("--warmup-epochs", type=float, default=None, help="default: a quarter of --epochs")
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threshold", type=float, default=3.0)
    parser.add_argument("--num-samples", type=int, default=20, help="weight draws of the MC predictive")
    parser.add_argument("--max-train", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="results/mnist_sparse_vd.jsonl")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.epochs <= 0:
        parser.error("--epochs must be > 0")
    torch.set_num_threads(args.threads)

    data = load_mnist(data_dir=args.data_dir, max_train=args.max_train)
    device = torch.device(args.device)
    x, y = data.x_train.to(device), data.y_train.to(device)
    x_test, y_test = data.x_test.to(device), data.y_test.to(device)
    n = x.shape[0]
    steps_per_epoch = math.ceil(n / args.batch_size)
    num_steps = max(1, round(args.epochs * steps_per_epoch))
    warmup_epochs = args.epochs / 4 if args.warmup_epochs is None else args.warmup_epochs
    kl_warmup = round(warmup_epochs * steps_per_epoch)

    model = pyrobdl.BayesianMLP(
        784, (300, 100), 10, activation="relu", prior=priors.LogUniform(), likelihood=likelihoods.Categorical()
    )
    options = dict(
        num_steps=num_steps,
        batch_size=args.batch_size,
        lr=args.lr,
        lr_schedule="linear",
        kl_warmup=kl_warmup,
        average_last=0.0,
        init_log_sigma2=-10.0,
        sparse=True,
        local_reparameterization=True,
    )
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "script": "comparisons/mnist_sparse_vd.py",
        "argv": sys.argv[1:] if argv is None else argv,
        "torch": torch.__version__,
        "threads": args.threads,
        "num_train": n,
        "epochs": args.epochs,
        "warmup_epochs": warmup_epochs,
        "options": options,
        "seed": args.seed,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    print(json.dumps(record), flush=True)

    posterior = pyrobdl.fit(
        model, x, y, method="variational_dropout", seed=args.seed, device=device,
        progress=not args.no_progress, **options,
    )
    state_path = out_path.with_suffix(f".seed{args.seed}.guide.pt")
    torch.save(posterior.guide.state_dict(), state_path)
    record.update(
        guide_state=str(state_path),
        wall_time_s=posterior.cost.wall_time_s,
        gradient_evaluations=posterior.cost.gradient_evaluations,
        device=posterior.cost.device,
        final_elbo_mean_last_epoch=float(posterior.history[-steps_per_epoch:].mean()),
    )
    print(json.dumps({"trained": True, "wall_time_s": record["wall_time_s"]}), flush=True)
    record.update(evaluate(posterior, x_test, y_test, args.threshold, args.num_samples))
    record["paper"] = PAPER
    record["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    with open(out_path, "a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
