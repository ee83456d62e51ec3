"""Cost per step of pyrobdl's SVI loop against plain PyTorch training of the same MLP.

Setting (issue 12): N = 1000 points, 8 features, one hidden layer of 50 ReLU units, Gaussian
likelihood, batch 32 and full batch, one torch thread by default.  Every variant runs through
the real ``pyrobdl.fit`` loop; the baseline is a plain ``torch.nn`` MLP trained with Adam on a
Gaussian negative log-likelihood over the same shuffled epochs (default Adam, and the fused Adam
kernel).  Variants are interleaved within each repeat so that machine noise hits all of them
alike; the table gives medians over repeats of CPU time (this process, all threads) and wall time
per optimizer step (each fit runs at least ``--min-steps``, so one-off set-up is amortised), and
the ratio of each median to the plain-PyTorch median of the same run.

Usage::

    python comparisons/benchmarks/svi_step.py [--repeats 7] [--epochs 5] [--min-steps 300] [--threads 1] [--variants ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import torch

import pyrobdl

N, D, H = 1000, 8, 50

#: name -> (method, options)
VARIANTS = {
    "mean_field (flat path)": ("mean_field", {}),
    "mean_field, MC KL (flat path)": ("mean_field", {"kl": "monte_carlo"}),
    "mean_field, 4 particles (flat path)": ("mean_field", {"num_particles": 4}),
    "map (flat path)": ("map", {}),
    "dropout (flat path)": ("dropout", {}),
    "dropout, MC KL (flat path)": ("dropout", {"kl": "monte_carlo"}),
    "gaussian_dropout (flat path)": ("gaussian_dropout", {}),
    "variational_dropout (flat path, local reparam)": ("variational_dropout", {}),
    "variational_dropout, weights sampled (flat path)": ("variational_dropout", {"local_reparameterization": False}),
    "mean_field (distributions path)": ("mean_field", {"elbo": "distributions"}),
    "dropout (distributions path)": ("dropout", {"elbo": "distributions"}),
    "variational_dropout (distributions path)": ("variational_dropout", {"elbo": "distributions"}),
    "mean_field, local reparam (flat path)": ("mean_field", {"local_reparameterization": True}),
    "mean_field, local reparam (distributions path)": ("mean_field", {"local_reparameterization": True, "elbo": "distributions"}),
    "mean_field, Pyro TraceMeanField_ELBO": ("mean_field", {"elbo": "trace"}),
    # issue 38: bbvi's default estimator is elbo="direct_score_function"; Pyro's path is an option
    "bbvi (default: 4 particles, leave-one-out, direct_score_function)": ("bbvi", {}),
    "bbvi, elbo=trace_graph (Pyro's TraceGraph_ELBO)": ("bbvi", {"elbo": "trace_graph"}),
    "bbvi (16 particles, decaying average, TraceGraph_ELBO)": ("bbvi", {"num_particles": 16, "baseline": "decaying_average",
                                                                       "elbo": "trace_graph"}),
}


def plain_torch_step(x, y, batch: int, steps: int, fused: bool = False) -> tuple[float, float]:
    net = torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.ReLU(), torch.nn.Linear(H, 1))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, fused=fused)
    perm, pos = torch.randperm(N), 0
    wall, cpu = time.perf_counter(), time.process_time()
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
    return (time.process_time() - cpu) / steps, (time.perf_counter() - wall) / steps


def pyrobdl_step(x, y, batch: int, steps: int, method: str, options: dict, threads: int) -> tuple[float, float]:
    model = pyrobdl.BayesianMLP(D, (H,), 1, prior=pyrobdl.priors.Gaussian(1.0),
                                likelihood=pyrobdl.likelihoods.Gaussian(1.0))
    if method == "variational_dropout":
        model = pyrobdl.BayesianMLP(D, (H,), 1, prior=pyrobdl.priors.LogUniform(),
                                    likelihood=pyrobdl.likelihoods.Gaussian(1.0))
    post = pyrobdl.fit(model, x, y, method=method, num_steps=steps, lr=1e-3,
                       batch_size=None if batch >= N else batch, progress=False, threads=threads, **options)
    return post.cost.cpu_time_s / steps, post.cost.wall_time_s / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--min-steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", type=int, nargs="*", default=[32, N])
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS), metavar="VARIANT")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
    torch.manual_seed(0)
    x = torch.randn(N, D)
    y = torch.sin(x[:, 0]) + 0.1 * torch.randn(N)
    print(f"torch {torch.__version__}, pyrobdl {pyrobdl.__version__}, threads={args.threads}, "
          f"repeats={args.repeats}, epochs/repeat={args.epochs} (>= {args.min_steps} steps), load average at start {os.getloadavg()[0]:.1f}")
    # warm-up: the first fit and the first torch step in a process pay one-off costs
    plain_torch_step(x, y, 32, 30)
    for name in args.variants:
        pyrobdl_step(x, y, 32, 30, *VARIANTS[name], args.threads)
    for batch in args.batches:
        steps = max(args.epochs * max(N // batch, 1), args.min_steps)
        times: dict[str, list[tuple[float, float]]] = {"plain PyTorch": [], "plain PyTorch, fused Adam": []}
        for _ in range(args.repeats):
            times["plain PyTorch"].append(plain_torch_step(x, y, batch, steps))
            times["plain PyTorch, fused Adam"].append(plain_torch_step(x, y, batch, steps, fused=True))
            for name in args.variants:
                times.setdefault(name, []).append(pyrobdl_step(x, y, batch, steps, *VARIANTS[name], args.threads))
        base_cpu = statistics.median(t[0] for t in times["plain PyTorch"])
        base_wall = statistics.median(t[1] for t in times["plain PyTorch"])
        label = "full batch" if batch >= N else f"batch {batch}"
        print(f"\n{label}, {steps} steps per fit: median per step (ratio to plain PyTorch); "
              f"load average now {os.getloadavg()[0]:.1f}")
        print("| variant | CPU us/step | CPU ratio | wall us/step | wall ratio |\n|---|---|---|---|---|")
        for name, ts in times.items():
            cpu = statistics.median(t[0] for t in ts)
            wall = statistics.median(t[1] for t in ts)
            print(f"| {name} | {1e6 * cpu:.0f} | {cpu / base_cpu:.2f}x | {1e6 * wall:.0f} | {wall / base_wall:.2f}x |")


if __name__ == "__main__":
    main()
