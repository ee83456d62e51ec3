r"""How often does a short chees run on Bayesian linear regression pass the reference certification?

``tests/test_chees.py::test_blr_exact_posterior`` fits the exact-posterior BLR problem with 32
chains x (300 warm-up + S draws) at seed 0 and asserts the certification passed.  A fixed seed
is one draw from the run-to-run distribution: this probe measures that distribution — seeds 0-9
for each way of estimating the mass matrix, per ``S`` — so the test's ``S`` can be chosen where a
failure means a fault, not bad luck.  One line per (S, mass matrix): ``.`` certified, else
``F<seed>(<function-space R-hat max>)``, and the failures' reasons.

    python comparisons/benchmarks/blr_certification_rate.py --num-samples 200 300 400 [--seeds 10]
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))

import pyrobdl  # noqa: E402
from test_chees import PRECISION, PRIOR_SCALE, bayesian_linear_regression, blr_model  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-samples", type=int, nargs="+", default=[200, 300])
    p.add_argument("--seeds", type=int, default=10)
    args = p.parse_args()
    torch.set_num_threads(1)
    blr = bayesian_linear_regression(100, 20, 3, prior_scale=PRIOR_SCALE, precision=PRECISION, seed=0)
    for num_samples in args.num_samples:
        for mass_matrix in ("cross-chain", "within-chain", "per-chain"):
            marks, reasons = [], []
            for seed in range(args.seeds):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # an uncertified fit warns; counted here instead
                    post = pyrobdl.fit(blr_model(), blr.x_train, blr.y_train, method="chees", num_chains=32,
                                       num_warmup=300, num_samples=num_samples, seed=seed, progress=False,
                                       mass_matrix=mass_matrix)
                if post.certification.passed:
                    marks.append(".")
                else:
                    marks.append(f"F{seed}({post.diagnostics['function_space']['rhat_max']:.4f})")
                    reasons.append(f"seed {seed}: {'; '.join(post.certification.failures)}")
            passed = marks.count(".")
            print(f"S = {num_samples} {mass_matrix:13s} {''.join(marks)}  {passed} of {args.seeds} certified", flush=True)
            for r in reasons:
                print("    " + r)


if __name__ == "__main__":
    main()
