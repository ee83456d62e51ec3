r"""The flat log joint's kernel under ``torch.no_grad`` against ``torch.inference_mode``, per call.

The samplers' and the SVI steps' hot paths (chees's leapfrog loop, the flat NUTS/HMC potential, the
flat ELBO steps, the ensemble's members) run the kernel in inference mode: no autograd bookkeeping
(version counters, view tracking) on its ~50 small ops.  This measures what that is worth at the
quickstart's shapes (gap: 80 x 1, 1 x 10 tanh; blr: 100 x 3, linear) and wine's reference shape
(1,439 x 11, 1 x 50 tanh), K = 1 and 64: the same call alternately under each mode, ``--rounds``
rounds, medians of process CPU microseconds per call, one torch thread.  The two give the same
numbers (checked first).

    python comparisons/benchmarks/inference_mode.py [--rounds 7] [--calls 400]
"""

from __future__ import annotations

import argparse
import statistics

import torch


from _percall import SHAPES, cpu_us_per_call, log_joint  # noqa: E402 (run as a script: its folder is on sys.path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=400)
    a = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    print(f"{'shape':6} {'K':>4} {'no_grad us':>11} {'inference us':>13} {'ratio':>6}")
    for name in ("gap", "blr", "wine"):
        lj, _ = log_joint(*SHAPES[name])
        for k in (1, 64):
            theta = torch.randn(k, lj.size, generator=g) * 0.5
            modes = {"no_grad": torch.no_grad, "inference": torch.inference_mode}
            outs = {}
            for mode, cm in modes.items():
                with cm():
                    outs[mode] = lj.value_and_grad(theta)
            assert torch.equal(outs["no_grad"][0], outs["inference"][0])
            assert torch.equal(outs["no_grad"][1], outs["inference"][1])
            calls = max(a.calls // (20 if name == "wine" and k == 64 else 1), 10)
            res: dict[str, list[float]] = {m: [] for m in modes}
            for r in range(a.rounds):
                order = list(modes) if r % 2 == 0 else list(reversed(modes))
                for mode in order:
                    with modes[mode]():
                        res[mode].append(cpu_us_per_call(lambda: lj.value_and_grad(theta), calls, 5))
            old, new = statistics.median(res["no_grad"]), statistics.median(res["inference"])
            print(f"{name:6} {k:4d} {old:11.1f} {new:13.1f} {old / new:6.2f}")


if __name__ == "__main__":
    main()
