"""Time per epoch of pyrobdl's SVI loop against plain PyTorch training of the same MLP.

Setting (issue 2): N = 1000 points, 8 features, one hidden layer of 50 ReLU units, batch 32 and
full batch.  Every variant runs through the real ``pyrobdl.fit`` loop; the baseline is a plain
``torch.nn`` MLP trained with Adam on a Gaussian negative log-likelihood over the same shuffled
epochs (default Adam, and the fused Adam kernel pyrobdl's loop uses, so the ratio separates
the optimizer from the ELBO).  Each (variant, batch) is repeated and the median epoch time is reported, with its ratio
to the plain-PyTorch median measured in the same run.

Usage::

    python comparisons/benchmarks/svi_step.py [--repeats 7] [--epochs 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import warnings

import torch

import pyrobdl

N, D, H = 1000, 8, 50

VARIANTS = {
    "direct, analytic KL": dict(elbo="direct", kl="analytic"),
    "direct, MC KL": dict(elbo="direct", kl="monte_carlo"),
    "direct, local reparam": dict(elbo="direct", kl="analytic", local_reparameterization=True),
    "Pyro Trace_ELBO": dict(elbo="trace", kl="monte_carlo"),
    "Pyro TraceMeanField_ELBO": dict(elbo="trace", kl="analytic"),
    "Pyro Trace_ELBO + local reparam": dict(elbo="trace", kl="monte_carlo", local_reparameterization=True),
    "Pyro JitTrace_ELBO": dict(elbo="jit_trace", kl="monte_carlo"),
}


def plain_torch_epoch_time(x, y, batch: int, epochs: int, fused: bool = False) -> float:
    net = torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.ReLU(), torch.nn.Linear(H, 1))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, fused=fused)
    steps = epochs * max(N // batch, 1)
    perm, pos = torch.randperm(N), 0
    start = time.perf_counter()
    for _ in range(steps):
        if batch < N:
            if pos + batch > N:
                perm, pos = torch.randperm(N), 0
            idx = perm[pos : pos + batch]
            pos += batch
            xb, yb = x[idx], y[idx]
        else:
            xb, yb = x, y
        loss = 0.5 * (net(xb).squeeze(-1) - yb).pow(2).sum() * (N / xb.shape[0])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return (time.perf_counter() - start) / epochs


def pyrobdl_epoch_time(x, y, batch: int, epochs: int, options: dict) -> float:
    options = dict(options)
    guide_opts = {"local_reparameterization": options.pop("local_reparameterization", False)}
    model = pyrobdl.BayesianMLP(D, (H,), 1, prior=pyrobdl.priors.Gaussian(1.0),
                                likelihood=pyrobdl.likelihoods.Gaussian(1.0))
    steps = epochs * max(N // batch, 1)
    post = pyrobdl.fit(model, x, y, method="mean_field", num_steps=steps, lr=1e-3,
                       batch_size=None if batch >= N else batch, progress=False, **guide_opts, **options)
    return post.cost.wall_time_s / epochs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # Pyro's JIT path warns about Python-level shape checks it bakes into the trace.
    warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
    torch.manual_seed(0)
    x = torch.randn(N, D)
    y = torch.sin(x[:, 0]) + 0.1 * torch.randn(N)
    print(f"torch {torch.__version__}, pyrobdl {pyrobdl.__version__}, threads={args.threads}, "
          f"repeats={args.repeats}, epochs/repeat={args.epochs}")
    # warm-up: the first fit and the first torch step in a process pay one-off costs
    plain_torch_epoch_time(x, y, 32, 1)
    for options in VARIANTS.values():
        pyrobdl_epoch_time(x, y, 32, 1, options)
    for batch in (32, N):
        # interleave variants within each repeat so machine noise hits all of them alike
        times: dict[str, list[float]] = {"plain PyTorch": [], "plain PyTorch, fused Adam": []}
        for _ in range(args.repeats):
            times["plain PyTorch"].append(plain_torch_epoch_time(x, y, batch, args.epochs))
            times["plain PyTorch, fused Adam"].append(plain_torch_epoch_time(x, y, batch, args.epochs, fused=True))
            for name in args.variants:
                times.setdefault(name, []).append(pyrobdl_epoch_time(x, y, batch, args.epochs, VARIANTS[name]))
        base = statistics.median(times["plain PyTorch"])
        label = "full batch" if batch >= N else f"batch {batch}"
        print(f"\n{label}: median ms per epoch (ratio to plain PyTorch)")
        print("| variant | ms/epoch | ratio |\n|---|---|---|")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"| {name} | {1e3 * med:.2f} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
