"""Bring your own network (issue 44), measured: a torch MLP trained by the user, then pyrobdl.

On one UCI split (default yacht split 0, standardised), a 1x50 ReLU ``nn.Sequential`` is trained
in plain PyTorch (Adam, full batch) on pyrobdl's own MAP objective (Gaussian likelihood with a
fixed precision, N(0, 1) prior), so that its weights are what ``laplace``'s MAP fit looks for.
Then, each ``--repeats`` times, interleaved:

* ``post_hoc``: ``fit(method="laplace", init=net, fit_map=False)``: no fit, Laplace at the net;
* ``own_map``: ``fit(method="laplace")``: pyrobdl's MAP fit (defaults: 1000 Adam steps) + Laplace;
* ``from_net``: ``fit(method="laplace", init=net)``: the MAP fit started at the net.

Printed: wall and CPU seconds, gradient evaluations, the log-joint gradient norm at the
Laplace mean (post-hoc: is the net at a mode of this log joint?), the distance of the mean to the
net's weights, test RMSE and test log-likelihood (original units).

    python comparisons/bring_your_own_network.py --dataset yacht --split 0 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import pyrobdl
import pyrobdl.flat


def train_torch(x: torch.Tensor, y: torch.Tensor, precision: float, steps: int, seed: int) -> torch.nn.Sequential:
    """The user's own training: full-batch Adam on -log joint / N of pyrobdl's model."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(x.shape[1], 50), torch.nn.ReLU(), torch.nn.Linear(50, 1))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    n = x.shape[0]
    for _ in range(steps):
        opt.zero_grad()
        sq = ((net(x).squeeze(-1) - y) ** 2).sum()
        decay = sum((p**2).sum() for p in net.parameters())
        ((0.5 * precision * sq + 0.5 * decay) / n).backward()
        opt.step()
    return net


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="yacht")
    parser.add_argument("--split", type=int, default=0)
    parser.add_argument("--precision", type=float, default=25.0, help="likelihood precision (standardised y)")
    parser.add_argument("--torch-steps", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--predictive", default="linearized", choices=["sample", "linearized"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = pyrobdl.datasets.load_uci(args.dataset, args.split, data_dir=os.environ.get("PYROBDL_DATA_DIR"))
    x, y = data.x_train, data.y_train
    t0, c0 = time.perf_counter(), time.process_time()
    net = train_torch(x, y, args.precision, args.torch_steps, seed=0)
    print(f"{args.dataset} split {args.split}: N={x.shape[0]}, torch training {args.torch_steps} Adam steps "
          f"{time.perf_counter() - t0:.1f} s wall / {time.process_time() - c0:.1f} s CPU")
    model = pyrobdl.BayesianMLP.from_torch(net, prior=pyrobdl.priors.Gaussian(1.0),
                                           likelihood=pyrobdl.likelihoods.Gaussian(args.precision))
    flat_net = torch.cat([p.detach().reshape(-1) for layer in (net[0], net[2]) for p in (layer.weight, layer.bias)])
    with torch.no_grad():
        f = net(data.x_test).squeeze(-1) * data.y_std + data.y_mean
        rmse = float(((f - (data.y_test * data.y_std + data.y_mean)) ** 2).mean().sqrt())
    print(f"the torch net itself: test RMSE {rmse:.3f}")
    runs = {"post_hoc": dict(init=net, fit_map=False), "own_map": {}, "from_net": dict(init=net)}
    rows: dict[str, list[dict]] = {k: [] for k in runs}
    for rep in range(args.repeats):
        for name, kw in runs.items():
            post = pyrobdl.fit(model, x, y, "laplace", seed=rep, progress=False, predictive=args.predictive, **kw)
            scores = pyrobdl.diagnostics.evaluate(post, data.x_test, data.y_test, num_samples=500,
                                                  y_mean=data.y_mean, y_std=data.y_std, seed=0)
            lj = pyrobdl.flat.FlatLogJoint(model, x, y)
            grad = lj.value_and_grad(post.mean.unsqueeze(0))[1].norm()
            rows[name].append(dict(wall=post.cost.wall_time_s, cpu=post.cost.cpu_time_s,
                                   grads=post.cost.gradient_evaluations, grad_norm=float(grad),
                                   dist=float((post.mean - flat_net).norm()), rmse=scores["rmse"],
                                   ll=scores["test_ll"]))
    print(f"{'run':9s} {'wall s':>7s} {'CPU s':>7s} {'grads':>6s} {'|grad lj|':>10s} {'|mean-net|':>10s} "
          f"{'RMSE':>7s} {'test LL':>8s}")
    for name, rs in rows.items():
        for r in rs:
            print(f"{name:9s} {r['wall']:7.2f} {r['cpu']:7.2f} {r['grads']:6d} {r['grad_norm']:10.3g} "
                  f"{r['dist']:10.3g} {r['rmse']:7.3f} {r['ll']:8.3f}")


if __name__ == "__main__":
    main()
