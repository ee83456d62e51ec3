"""How well does a fixed metric condition a BNN posterior where chees's chains are?  A probe.

Runs ``fit(method="chees")`` on one UCI split with the reference protocol's model
(``uci_references.make_model``), then takes the exact Hessian ``H`` of the negative log joint
(float64, autograd through ``FlatLogJoint.log_joint``) at the last draw of a few chains and
reports the eigenvalues of ``M^{-1/2} H M^{-1/2}`` for several fixed metrics ``M``:

* ``identity``;
* ``diagonal``: the draws' variance across all chains, what chees's warm-up windows estimate;
* ``within-chain dense``: the draws' covariance pooled within chains (deviations from each
  chain's mean), shrunk 10% towards its diagonal;
* ``local Hessian, earlier draw``: ``|H|`` (eigenvalues in absolute value, floored at 1, the
  prior precision) at the same chain's first sampling draw, ``num_samples - 1`` iterations
  earlier: a per-chain dense metric fixed at the end of warm-up;
* ``local Hessian, averaged``: the Hessian averaged over five earlier draws spread along the
  chain (the first to the last but one), then made positive-definite as above;
* ``local Hessian, other chain``: the next chain's ``|H|`` at its last draw.

For HMC with step size ε the leapfrog is stable while ε sqrt(λ_max) < 2, and a direction with
eigenvalue λ needs a trajectory of about (π/2) / sqrt(λ) to move one posterior standard
deviation, so sqrt(λ_max / λ_min) estimates the leapfrog steps per independent draw in the
flattest direction.  Negative eigenvalues (the posterior is not log-concave there) are counted.

Beside the spectra, the R-hat of a few scalar functionals over all chains: the log-likelihood,
log τ, and per hidden unit ``j`` of the first layer the position along its ReLU rescaling orbit,
``log(|a_j| / |v_j|)`` (``a_j`` the unit's incoming weights and bias, ``v_j`` its outgoing
weights; ``(c a_j, v_j / c)`` gives the same function for every c > 0, so only the prior
decides where on the orbit a chain is), and the unit's size ``log(|a_j| |v_j|)``, which the
function does see.

    python comparisons/research/posterior_geometry.py --data-dir ../shared/datasets --dataset yacht --split 0 \
        --chains 16 --warmup 300 --samples 100 --compile
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # comparisons/: uci_references
from uci_references import make_model  # noqa: E402

import pyrobdl  # noqa: E402
from pyrobdl import datasets  # noqa: E402
from pyrobdl.diagnostics import convergence  # noqa: E402
from pyrobdl.flat import FlatLogJoint  # noqa: E402


def hessian(lj: FlatLogJoint, theta: torch.Tensor) -> torch.Tensor:
    """``[P, P]``: the Hessian of the negative log joint at one flat vector."""
    return torch.autograd.functional.hessian(lambda v: -lj.log_joint(v.unsqueeze(0))[0], theta)


def abs_floor(h: torch.Tensor, floor: float = 1.0) -> torch.Tensor:
    """``h`` with its eigenvalues replaced by ``max(|λ|, floor)``: a positive-definite metric."""
    w, v = torch.linalg.eigh(0.5 * (h + h.T))
    return (v * w.abs().clamp_min(floor)) @ v.T


def spectrum(h: torch.Tensor, metric: torch.Tensor, covariance: bool = False) -> dict:
    """Eigenvalues of ``M^{-1/2} H M^{-1/2}``, summarised; ``metric`` is ``M`` (precision-like
    ``[P, P]``), or with ``covariance`` its inverse ``M^{-1}`` (``[P, P]``, or ``[P]`` a diagonal)."""
    if metric.dim() == 1:
        root = metric.sqrt()
        a = root[:, None] * h * root[None, :]
    else:
        w, v = torch.linalg.eigh(0.5 * (metric + metric.T))
        w = w.clamp_min(0).sqrt() if covariance else w.rsqrt()
        root = (v * w) @ v.T
        a = root @ h @ root
    e = torch.linalg.eigvalsh(0.5 * (a + a.T))
    pos = e[e > 0]
    return {"lambda_max": float(e.max()), "lambda_min_positive": float(pos.min()), "negative": int((e < 0).sum()),
            "lambda_min": float(e.min()), "sqrt_condition": float((e.max() / pos.min()).sqrt())}


def chees_draws(args: argparse.Namespace, num_warmup: int, num_samples: int, compile: bool | str = True):
    """Run chees on ``args.dataset``/``args.split`` with the reference model; returns the data, the
    float64 ``FlatLogJoint``, the posterior and its draws as flat vectors ``[chains, draws, P]``."""
    data = datasets.load_uci(args.dataset, args.split, data_dir=args.data_dir)
    model = make_model(data.x_train.shape[1])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning)
        post = pyrobdl.fit(model, data.x_train, data.y_train, method="chees", num_chains=args.chains,
                           num_warmup=num_warmup, num_samples=num_samples, seed=args.seed, progress=False,
                           compile=compile, chunk_size=None)
    lj = FlatLogJoint(model, data.x_train.double(), data.y_train.double())
    c, d = post.num_chains, post.num_draws
    theta = lj.layout.pack({n: v.reshape(c * d, *v.shape[2:]) for n, v in post.samples.items()}).double()
    return data, lj, post, theta.view(c, d, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--dataset", default="yacht")
    parser.add_argument("--split", type=int, default=0)
    parser.add_argument("--chains", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--probe-chains", type=int, default=4, help="chains whose Hessians are taken")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_const", const=True, default="auto")
    args = parser.parse_args()
    torch.set_num_threads(1)

    start, cpu0 = time.perf_counter(), time.process_time()
    data, lj, post, theta = chees_draws(args, args.warmup, args.samples, args.compile)
    c, d = theta.shape[:2]
    p = theta.shape[-1]
    flat = theta.reshape(c * d, p)
    diagonal = flat.var(0)
    dev = (theta - theta.mean(1, keepdim=True)).reshape(c * d, p)
    within = dev.T @ dev / (c * (d - 1))
    within = 0.9 * within + 0.1 * torch.diag(torch.diagonal(within))

    with torch.no_grad():
        ell = lj.value_and_grad(flat, prior=False)[0].view(c, d, 1).numpy()
    a = torch.cat([post.samples["layers.0.weight"], post.samples["layers.0.bias"].unsqueeze(-1)], -1).double()
    v = post.samples["layers.1.weight"].double().transpose(-1, -2)  # [c, d, hidden, out]
    orbit = (a.norm(dim=-1).log() - v.norm(dim=-1).log()).numpy()
    size = (a.norm(dim=-1).log() + v.norm(dim=-1).log()).numpy()
    functionals = {"log_likelihood": float(convergence(ell)["rhat"][0])}
    if "precision" in post.samples:
        functionals["log_tau"] = float(convergence(post.samples["precision"].reshape(c, d, 1).double().log().numpy())["rhat"][0])
    for name, values in (("orbit_position", orbit), ("unit_size", size)):
        r = np.asarray(convergence(values)["rhat"])
        functionals[name] = {"median_over_units": float(np.median(r)), "max": float(r.max())}
    print(json.dumps({"rhat": functionals}), flush=True)

    rows = []
    for ch in range(min(args.probe_chains, c)):
        h_last = hessian(lj, theta[ch, -1])
        # five earlier draws of the same chain, the last one excluded (it is where H is taken)
        along = [hessian(lj, theta[ch, i]) for i in np.linspace(0, d - 2, 5).round().astype(int)]
        metrics = {  # name: (metric, given as a covariance M^{-1})
            "identity": (torch.ones(p, dtype=theta.dtype), True),
            "diagonal (cross-chain variance)": (diagonal, True),
            "within-chain dense": (within, True),
            "local Hessian, earlier draw": (abs_floor(along[0]), False),
            "local Hessian, averaged": (abs_floor(sum(along) / len(along)), False),
            "local Hessian, other chain": (abs_floor(hessian(lj, theta[(ch + 1) % c, -1])), False),
        }
        rows.append({"chain": ch, **{name: spectrum(h_last, m, cov) for name, (m, cov) in metrics.items()}})
        print(json.dumps(rows[-1]), flush=True)
    summary = {name: {key: float(np.median([r[name][key] for r in rows])) for key in rows[0][name]}
               for name in rows[0] if name != "chain"}
    print(json.dumps({
        "dataset": args.dataset, "split": args.split, "num_train": int(data.x_train.shape[0]), "P": p,
        "chains": c, "draws": d, "step_size": post.diagnostics["step_size"],
        "trajectory_length": post.diagnostics.get("trajectory_length"),
        "rhat": functionals, "median_over_probed_chains": summary,
        "cpu_s": time.process_time() - cpu0, "wall_s": time.perf_counter() - start, "load_average": os.getloadavg(),
    }, indent=1))


if __name__ == "__main__":
    main()
