"""Exact moves along the hidden units' ReLU rescaling orbits: do they move yacht's chains faster?  A probe.

A ReLU unit computes the same function when its incoming weights and bias ``a_j`` (D + 1 numbers)
are multiplied by ``c > 0`` and its outgoing weights ``v_j`` (one per output) divided by ``c``:
relu(c z) = c relu(z).  The likelihood is constant along these orbits, so only the prior and the
volume decide where on its orbit a unit sits; ``comparisons/research/posterior_geometry.py`` measured the
orbit positions log(|a_j| / |v_j|) mixing as slowly as everything else on yacht (split R-hat 1.83).

The move (a generalised Gibbs step, Liu & Sabatti 2000): the rescalings form a group, positive
reals per unit, with Haar measure dc/c, and the map θ -> γ_c(θ) has Jacobian c^(D+1-O) for a unit
with O outputs; drawing c from π(γ_c θ) c^(D+1-O) dc/c and moving to γ_c(θ) leaves the posterior
π invariant.  With Gaussian priors of precisions λ, A_j = Σ λ a_j², B_j = Σ λ v_j², the draw of
w = c² is a generalised inverse Gaussian, density ∝ w^(p-1) exp(-(A_j w + B_j / w) / 2) with
p = (D + 1 - O) / 2, independent across units: exact, no rejection, one gradient per move.

Checked before anything runs: (1) along an orbit, the log joint (``FlatLogJoint``, proven equal
to Pyro's potential) plus (p - 1) log w minus the log GIG density is constant in w, to 1e-10 of
the largest term (the likelihood's invariance and the prior algebra); (2) the move keeps the
prior: prior draws moved once keep the means of v² and log|a| within 4 standard errors, and the
same check with the exponent p off by 1/2 fails it (so the check can see a wrong Jacobian).

Then the same plain HMC as ``comparisons/research/dense_metric.py`` (diagonal metric from the starting
draws' cross-chain variance, jittered ``--steps`` leapfrog steps, step size adapted for
``--adapt`` iterations, ``--samples`` kept, float64, one thread) from the same warm states —
chees's chains after 300 + 20 iterations — without and with an orbit move of every unit after
each transition.  Reported: function-space split R-hat and bulk ESS at the held-back inputs (as
``comparisons/research/collapsed_output.py``), the log-likelihood's R-hat and per-chain ESS, the orbit
positions' R-hat, step size, cost.

    python comparisons/research/orbit_moves.py --data-dir ../shared/datasets --dataset yacht --split 0 \\
        --chains 8 --steps 256 --adapt 100 --samples 200
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
from scipy.stats import geninvgauss

sys.path.insert(0, str(Path(__file__).resolve().parent))
from collapsed_output import report_runs  # noqa: E402
from dense_metric import diagonal_hmc, hmc_parser, mixing, orbit_positions  # noqa: E402
from posterior_geometry import chees_draws  # noqa: E402

from pyrobdl.flat import FlatLogJoint  # noqa: E402


class OrbitMove:
    """Exact draws along the rescaling orbits of a one-hidden-layer ReLU network's units."""

    def __init__(self, lj: FlatLogJoint, shift: float = 0.0) -> None:
        lay = lj.layout
        w0, b0, w1 = lay["layers.0.weight"], lay["layers.0.bias"], lay["layers.1.weight"]
        hidden, features = w0.shape
        outputs = w1.shape[0]
        self.incoming = torch.cat([torch.arange(w0.start, w0.stop).view(hidden, features),
                                   torch.arange(b0.start, b0.stop).view(hidden, 1)], 1)  # [H, D + 1]
        self.outgoing = torch.arange(w1.start, w1.stop).view(outputs, hidden).T  # [H, O]
        prec = lj._prior_prec  # the Gaussian prior's precision of every flat coordinate
        self.prec_in, self.prec_out = prec[self.incoming], prec[self.outgoing]
        self.p = (features + 1 - outputs) / 2 + shift  # shift != 0 only to show the checks can fail

    def gig(self, theta: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """The GIG's A and B per chain and unit, ``[K, H]``."""
        a = (self.prec_in * theta[:, self.incoming] ** 2).sum(-1)
        b = (self.prec_out * theta[:, self.outgoing] ** 2).sum(-1)
        return a.numpy(), b.numpy()

    def rescale(self, theta: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        out = theta.clone()
        out[:, self.incoming] = theta[:, self.incoming] * c.unsqueeze(-1)
        out[:, self.outgoing] = theta[:, self.outgoing] / c.unsqueeze(-1)
        return out

    def log_density(self, w: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return geninvgauss.logpdf(w, self.p, np.sqrt(a * b), scale=np.sqrt(b / a))

    def __call__(self, theta: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        a, b = self.gig(theta)
        rng = np.random.default_rng(int(torch.randint(2**62, (), generator=gen)))
        w = geninvgauss.rvs(self.p, np.sqrt(a * b), scale=np.sqrt(b / a), random_state=rng)
        return self.rescale(theta, torch.as_tensor(w, dtype=theta.dtype).sqrt())


def check_orbit_density(lj: FlatLogJoint, move: OrbitMove, theta: torch.Tensor) -> float:
    """Max over units 0-4 of the spread of log π(γ θ) + (p - 1) log w - log GIG(w) over a grid of w,
    relative to the largest log joint; 0 up to rounding when the move's density is right."""
    a, b = move.gig(theta)
    worst = 0.0
    for unit in range(5):
        w = np.geomspace(0.2, 5.0, 9) * np.sqrt(b[0, unit] / a[0, unit])  # around the conditional's mode
        c = torch.ones(len(w), move.incoming.shape[0], dtype=theta.dtype)
        c[:, unit] = torch.as_tensor(np.sqrt(w))
        joint = lj.log_joint(move.rescale(theta.expand(len(w), -1), c)).numpy()
        gap = joint + (move.p - 1) * np.log(w) - move.log_density(w, a[0, unit], b[0, unit])
        worst = max(worst, float(np.ptp(gap) / np.abs(joint).max()))
    return worst


def check_prior_kept(lj: FlatLogJoint, move: OrbitMove, n: int = 20000, seed: int = 0) -> float:
    """Largest |z| of the change in E[v²] and E[log|a|] when prior draws are moved once."""
    gen = torch.Generator().manual_seed(seed)
    before = lj.sample_prior(n, generator=gen)
    after = move(before, gen)
    zs = []
    for stat in (lambda t: t[:, move.outgoing].pow(2).sum(-1),
                 lambda t: t[:, move.incoming].norm(dim=-1).log()):
        x, y = stat(before).ravel(), stat(after).ravel()
        zs.append(float((y.mean() - x.mean()) / torch.sqrt(x.var() / x.numel() + y.var() / y.numel())))
    return max(abs(z) for z in zs)


def main() -> None:
    parser = hmc_parser(__doc__.splitlines()[0])
    parser.add_argument("--cert-points", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)

    data, lj, _, theta = chees_draws(args, num_warmup=300, num_samples=20)
    c, d = theta.shape[:2]
    start = theta[:, -1].clone()
    move = OrbitMove(lj)
    density_error = check_orbit_density(lj, move, start[:1])
    assert density_error < 1e-10, density_error
    z_right, z_wrong = check_prior_kept(lj, move), check_prior_kept(lj, OrbitMove(lj, shift=0.5))
    assert z_right < 4 and z_wrong > 4, (z_right, z_wrong)
    print(json.dumps({"orbit_density_relative_error": density_error, "prior_kept_max_z": z_right,
                      "prior_kept_max_z_with_p_off_by_half": z_wrong, "p": move.p}), flush=True)

    # how far a move can carry a unit: the spread of its orbit position given everything the function
    # depends on (the move's conditional), against the spread of orbit positions between the chains
    a, b = move.gig(start)
    rng = np.random.default_rng(args.seed)
    w = geninvgauss.rvs(move.p, np.sqrt(a * b)[..., None], scale=np.sqrt(b / a)[..., None],
                        size=(*a.shape, 2000), random_state=rng)
    position = orbit_positions(lj, start).numpy()
    print(json.dumps({"orbit_position_sd_given_the_function_median": float(np.median(0.5 * np.log(w).std(-1))),
                      "orbit_position_sd_between_chains_median_over_units": float(np.median(position.std(0))),
                      "unit_size_median": float(np.median(np.sqrt(a * b)))}), flush=True)

    variance = theta.reshape(c * d, -1).var(0)
    report_runs("sampler", {"HMC": lambda: diagonal_hmc(lj, start, variance, args),
                            "HMC + orbit moves": lambda: diagonal_hmc(lj, start, variance, args, between=move)},
                lj, data.x_test[: args.cert_points].double(),
                extra=lambda draws: {"orbit_rhat_median_over_units":
                                     mixing(lj, draws)["orbit_position"]["rhat_median_over_units"]})
    print(json.dumps({"dataset": args.dataset, "split": args.split, "chains": c, "load_average": os.getloadavg()}))


if __name__ == "__main__":
    main()
