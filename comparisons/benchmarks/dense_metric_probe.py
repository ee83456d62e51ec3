"""Would a dense mass matrix shorten chees's trajectories on the quickstart's gap data?  (issue 41)

Reads the gap reference's stored draws from a quickstart results folder, whitens the potential's
Hessian at 20 of them by the draws' covariance (dense) or by its diagonal, and prints the largest
eigenvalue of each (the leapfrog step is stable below 2 / sqrt of it) and the correlation matrix's
condition number.

    python comparisons/benchmarks/dense_metric_probe.py results/quickstart
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

import pyrobdl
from pyrobdl.datasets import gap_regression
from pyrobdl.flat import FlatLogJoint


def main(results: Path) -> None:
    torch.set_num_threads(1)
    draws = torch.load(results / "cells" / "gap__chees__split-0__seed-0" / "reference_draws.pt", weights_only=False)
    data = gap_regression(80, 200, noise_sd=0.1, seed=0)
    model = pyrobdl.BayesianMLP(1, (10,), 1, activation="tanh", likelihood=pyrobdl.likelihoods.Gaussian(100.0))
    lj = FlatLogJoint(model, data.x_train.double(), data.y_train.double())
    theta = lj.layout.pack({k: v.double() for k, v in draws.items()})  # [draws, P]
    cov = torch.cov(theta.T)
    sd = cov.diagonal().sqrt()
    ev = torch.linalg.eigvalsh(cov / sd[:, None] / sd[None, :])
    print(f"{theta.shape[0]} draws, P = {theta.shape[1]}; correlation eigenvalues {ev.min():.3g}-{ev.max():.3g}, "
          f"condition number {ev.max() / ev.min():.3g}")
    rng = np.random.default_rng(0)
    points = rng.choice(theta.shape[0], 20, replace=False)
    for name, m_inv in [("diagonal", torch.diag(cov.diagonal())), ("dense", cov)]:
        chol = torch.linalg.cholesky(m_inv)
        top = []
        for i in points:
            hess = torch.autograd.functional.hessian(lambda u: -lj.log_joint(u.unsqueeze(0))[0], theta[i].clone())
            top.append(torch.linalg.eigvalsh(chol.T @ hess @ chol).max().item())
        lam = float(np.median(top))
        print(f"{name:>8} metric: largest whitened curvature {lam:.3g} (median of 20 draws), stable step < "
              f"{2 / np.sqrt(lam):.3g}, ~{np.pi / 2 * np.sqrt(lam):.0f} steps per quarter period of the global scale")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "results/quickstart"))
