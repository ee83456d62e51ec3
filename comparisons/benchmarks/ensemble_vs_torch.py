"""Deep ensemble: pyrobdl's batched members against independent plain-PyTorch members.

The protocol of issue 38: a UCI dataset's standard splits, K = 5 members, 1x50 ReLU, an N(0, 1)
prior on every weight and bias (weight decay), a learned homoscedastic noise precision under
pyrobdl's default Gamma(6, 6) prior, Adam at lr 1e-2, 3,000 steps of batch 128, the members'
equal-weight mixture scored on the original scale (test log-likelihood per point, RMSE).

Every variant is scored by the same function from the members' weights and noise precisions,
so differences come from training alone.  Variants (``--variants``, comma separated):

``pyrobdl``         ``fit(..., "ensemble")`` with the given options (``--ens-options`` JSON)
                    on top of the protocol's num_members/num_steps/lr/batch_size
``pyrobdl_noavg``   as ``pyrobdl``, with ``average_last=0`` (the last iterate)
``torch``           K independent ``torch.nn`` members, ``torch.optim.Adam``, a fresh shuffle
                    per epoch with a last partial batch (``DataLoader(shuffle=True)``), the
                    summed log joint with the likelihood scaled by N/|batch|, the last iterate
``torch_avg``       as ``torch``, with the iterates of the last 10% of steps averaged (Polyak)
``torch_droplast``  as ``torch``, dropping the last partial batch of every epoch

    nice -n 10 python comparisons/benchmarks/ensemble_vs_torch.py --dataset boston --splits 0-4 \
        --repeats 1 --variants pyrobdl,torch

Needs ``PYROBDL_DATA_DIR`` (or ``--data-dir``).  Prints one row per (variant, split) and a mean.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

import pyrobdl
from pyrobdl.datasets import load_uci

K, HIDDEN, STEPS, LR, BATCH = 5, 50, 3000, 1e-2, 128
GAMMA_A, GAMMA_B, PRIOR_SD = 6.0, 6.0, 1.0


def score(f: torch.Tensor, tau: torch.Tensor, data) -> tuple[float, float]:
    """Mixture test LL per point and RMSE on the original scale from member outputs ``f [K, M]``
    (standardised units) and precisions ``tau [K]`` (standardised units)."""
    f, tau = f.double(), tau.double().reshape(-1, 1)
    y = data.y_test.double() * data.y_std + data.y_mean
    loc = f * data.y_std + data.y_mean
    sd = data.y_std / tau.sqrt()
    lp = torch.distributions.Normal(loc, sd).log_prob(y)  # [K, M]
    ll = torch.logsumexp(lp, 0) - math.log(f.shape[0])
    rmse = ((loc.mean(0) - y) ** 2).mean().sqrt()
    return float(ll.mean()), float(rmse)


def model_for(data) -> pyrobdl.BayesianMLP:
    return pyrobdl.BayesianMLP(data.x_train.shape[1], (HIDDEN,), 1, prior=pyrobdl.priors.Gaussian(PRIOR_SD),
                               likelihood=pyrobdl.likelihoods.GaussianLearnedPrecision(GAMMA_A, GAMMA_B))


def run_pyrobdl(data, seed: int, options: dict) -> tuple[torch.Tensor, torch.Tensor]:
    model = model_for(data)
    settings = {"num_members": K, "num_steps": STEPS, "lr": LR, "batch_size": BATCH, **options}
    post = pyrobdl.fit(model, data.x_train, data.y_train, "ensemble", seed=seed, progress=False, **settings)
    members = post.members
    with torch.no_grad():
        f = model.network(members, data.x_test)[..., 0]
    return f, members[model.likelihood.site].reshape(-1)


class Member(torch.nn.Module):
    """One plain network with its log noise precision."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(d, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 1))
        self.log_tau = torch.nn.Parameter(torch.zeros(()))  # tau = 1, the Gamma(6, 6) prior mean

    def log_joint(self, x: torch.Tensor, y: torch.Tensor, n: int) -> torch.Tensor:
        tau = self.log_tau.exp()
        f = self.net(x)[:, 0]
        loglik = 0.5 * (self.log_tau - math.log(2 * math.pi)) - 0.5 * tau * (y - f) ** 2
        prior = sum(-0.5 * (p**2).sum() / PRIOR_SD**2 for p in self.net.parameters())
        gamma = (GAMMA_A - 1) * self.log_tau - GAMMA_B * tau + self.log_tau  # log Gamma(tau) + log|d tau/d u|
        return n / x.shape[0] * loglik.sum() + prior + gamma


def run_torch(data, seed: int, average: float = 0.0, drop_last: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    x, y = data.x_train, data.y_train
    n = x.shape[0]
    fs, taus = [], []
    for _ in range(K):
        m = Member(x.shape[1])
        opt = torch.optim.Adam(m.parameters(), lr=LR)
        avg_from = STEPS - int(round(average * STEPS))
        avg = [torch.zeros_like(p) for p in m.parameters()]
        perm, pos = torch.randperm(n), 0
        for step in range(STEPS):
            if pos >= n or (drop_last and pos + BATCH > n):
                perm, pos = torch.randperm(n), 0
            idx = perm[pos : pos + BATCH]
            pos += BATCH
            opt.zero_grad(set_to_none=True)
            (-m.log_joint(x[idx], y[idx], n)).backward()
            opt.step()
            if step >= avg_from:
                with torch.no_grad():
                    for a, p in zip(avg, m.parameters()):
                        a.add_(p, alpha=1.0 / (STEPS - avg_from))
        if avg_from < STEPS:
            with torch.no_grad():
                for a, p in zip(avg, m.parameters()):
                    p.copy_(a)
        with torch.no_grad():
            fs.append(m.net(data.x_test)[:, 0])
            taus.append(m.log_tau.exp())
    return torch.stack(fs), torch.stack(taus)


VARIANTS = {
    "torch": lambda data, seed, _: run_torch(data, seed),
    "torch_avg": lambda data, seed, _: run_torch(data, seed, average=0.1),
    "torch_droplast": lambda data, seed, _: run_torch(data, seed, drop_last=True),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="boston")
    p.add_argument("--splits", default="0-4", help="a range a-b or a comma list")
    p.add_argument("--variants", default="pyrobdl,torch")
    p.add_argument("--ens-options", default="{}", help="JSON options for the pyrobdl variant(s)")
    p.add_argument("--repeats", type=int, default=1, help="seeds per split (first-seed, first-seed + 1, ...)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--data-dir", default=os.environ.get("PYROBDL_DATA_DIR"))
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    splits = (list(range(int(a.splits.split("-")[0]), int(a.splits.split("-")[1]) + 1)) if "-" in a.splits
              else [int(s) for s in a.splits.split(",")])
    ens_options = json.loads(a.ens_options)
    names = a.variants.split(",")
    results: dict[str, list[tuple[float, float, float, float]]] = {v: [] for v in names}
    print(f"{'variant':<16} {'split':>5} {'seed':>4} {'test LL':>9} {'RMSE':>7} {'wall s':>7} {'CPU s':>7}")
    for split in splits:
        data = load_uci(a.dataset, split, data_dir=a.data_dir)
        for seed in range(a.first_seed, a.first_seed + a.repeats):
            for v in names:  # interleaved: every variant on the same split and seed back to back
                t0, c0 = time.perf_counter(), time.process_time()
                if v.startswith("pyrobdl"):
                    extra = {"average_last": 0.0} if v == "pyrobdl_noavg" else {}
                    f, tau = run_pyrobdl(data, seed, {**ens_options, **extra})
                else:
                    f, tau = VARIANTS[v](data, seed, None)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                ll, rmse = score(f, tau, data)
                results[v].append((ll, rmse, wall, cpu))
                print(f"{v:<16} {split:>5} {seed:>4} {ll:>9.3f} {rmse:>7.3f} {wall:>7.1f} {cpu:>7.1f}", flush=True)
    print("\nmean over splits and seeds")
    for v, rows in results.items():
        n = len(rows)
        mean = [sum(r[i] for r in rows) / n for i in range(4)]
        se = (sum((r[0] - mean[0]) ** 2 for r in rows) / max(n - 1, 1) / n) ** 0.5
        print(f"{v:<16} test LL {mean[0]:.3f} (se {se:.3f})  RMSE {mean[1]:.3f}  wall {mean[2]:.1f} s  CPU {mean[3]:.1f} s")


if __name__ == "__main__":
    main()
