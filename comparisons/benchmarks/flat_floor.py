r"""How far the flat log joint's value and gradient is from its compute floor, and where the time goes.

The model is the chees benchmark's (``chees_vs_numpyro.py``): 500 points with 8 features, one
hidden layer of 50 tanh units, Gaussian N(0, 1) priors, a learned noise precision; float32, one
torch thread.  For K chains at once (``--chains``, default 8, 64, 256) it times
``FlatLogJoint.value_and_grad`` per chain-gradient (one row of ``theta`` evaluated once), in
process CPU µs, for the variants

- ``eager auto``: ``chunk_size="auto"`` (what ``fit(method="chees")`` uses on CPU);
- ``eager none``: all K rows in one call;
- ``compiled auto``: ``chunk_size="auto"`` after ``FlatLogJoint.compile(K, kernel="inductor")``;
- ``fused``: after ``FlatLogJoint.compile(K, kernel="fused")`` (``pyrobdl.flat.fused``: one C++
  loop per chain; since 2026-11-30, the seventeenth session);
- ``autograd``: ``log_prob_grad_autograd``, the differentiable twin (the reference);
- ``leapfrog (eager auto)``: ten leapfrog steps of chees's kernel (``chees.kernel._Sampler``),
  per chain-gradient: the log joint plus the position and momentum updates around it (what
  compiling the whole leapfrog step could remove at most);

against two floors measured in the same run, between the same rounds:

- ``floor (peak mm)``: the arithmetic of one chain-gradient (the GEMM FLOPs of the forward and
  backward pass, counted below) at the rate of a square ``torch.mm`` (``--peak-size``);
- ``floor (its GEMMs)``: the same FLOPs at the rate the kernel's own GEMM shapes reach (layer 0's
  forward ``[N, in+1] @ [in+1, c*H]`` and backward ``[in+1, N] @ [N, c*H]``, c = the chunk size,
  and the batched products of the output layer), i.e. what the arithmetic costs with every
  elementwise pass, allocation and dispatch removed;
- ``floor (GEMMs + tanh)``: the latter plus the activation's two unavoidable elementwise passes
  at the chunk's shape (``tanh_`` forward, ``tanh_backward``; before 2026-11-30 the kernel
  computed tanh(a) = 2 sigmoid(2a) - 1 and this floor timed ``sigmoid_`` and
  ``sigmoid_backward``), on fresh inputs each time (repeated in-place calls would reach
  denormals and time those).

Every variant and floor is timed once per round, in alternating order, for ``--rounds`` rounds
of ``--seconds`` of process CPU time each; medians are reported.  Last, ``torch.profiler``
records ``--profile-calls`` eager calls at each K and prints each op's share of self CPU time.

Usage (from the repository root)::

    nice -n 10 python comparisons/benchmarks/flat_floor.py [--chains 8 64 256] [--rounds 5]
        [--seconds 0.5] [--no-compile] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings
from datetime import datetime, timezone

import torch

import pyrobdl
from pyrobdl.flat import FlatLogJoint, auto_chunk_size

N, D, H = 500, 8, 50


def make(k: int, compile_: bool) -> tuple[dict, torch.Tensor]:
    """The variants' log joints and posterior-like states ``[K, P]`` (prior draws x 0.3)."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, D, generator=g), torch.randn(N, generator=g)
    model = pyrobdl.BayesianMLP(D, (H,), 1, activation="tanh", prior=pyrobdl.priors.Gaussian(1.0),
                                likelihood=pyrobdl.likelihoods.GaussianLearnedPrecision(6.0, 6.0))
    ljs = {"eager auto": FlatLogJoint(model, x, y, chunk_size="auto"),
           "eager none": FlatLogJoint(model, x, y)}
    if compile_:
        lj = FlatLogJoint(model, x, y, chunk_size="auto")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lj.compile(k, kernel="inductor")
        ljs["compiled auto"] = lj
        ljs["fused"] = FlatLogJoint(model, x, y)
        ljs["fused"].compile(k, kernel="fused")
    theta = ljs["eager auto"].sample_prior(k, generator=g) * 0.3
    return ljs, theta


def gemm_flops(n: int = N, d: int = D, h: int = H) -> int:
    """Multiply-add FLOPs (2 per MAC) of one chain-gradient's products at ``n`` points, ``d`` inputs and
    ``h`` hidden units: layer 0 forward and its weight gradient (``n (d+1) h`` MACs each), the output
    layer forward, its weight gradient and the back-propagated ``g w`` (``n h`` MACs each)."""
    return 2 * (2 * n * (d + 1) * h + 3 * n * h)


def peak_rate(size: int, seconds: float) -> float:
    """FLOP/s of a square float32 ``torch.mm`` (one thread)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    out = torch.empty(size, size)
    torch.mm(a, b, out=out)
    reps, start = 0, time.process_time()
    while time.process_time() - start < seconds:
        torch.mm(a, b, out=out)
        reps += 1
    return 2 * size**3 * reps / (time.process_time() - start)


def gemm_shapes_us(chunk: int, seconds: float) -> float:
    """CPU µs per chain of the kernel's GEMMs alone at chunk size ``chunk`` (preallocated outputs)."""
    x1 = torch.randn(N, D + 1)
    w = torch.randn(D + 1, chunk * H)
    a = torch.empty(N, chunk * H)
    g = torch.randn(N, chunk * H)
    r0 = torch.empty(D + 1, chunk * H)
    z = torch.randn(chunk, N, H)
    w1 = torch.randn(chunk, H, 1)
    f = torch.empty(chunk, N, 1)
    gf = torch.randn(chunk, N, 1)
    mz = torch.empty(chunk, 1, H)
    gb = torch.empty(chunk, N, H)
    w1t = torch.randn(chunk, 1, H)

    def once():
        torch.mm(x1, w, out=a)
        torch.bmm(z, w1, out=f)
        torch.bmm(gf.transpose(1, 2), z, out=mz)
        torch.bmm(gf, w1t, out=gb)
        torch.mm(x1.t(), g, out=r0)

    once()
    reps, start = 0, time.process_time()
    while time.process_time() - start < seconds:
        once()
        reps += 1
    return (time.process_time() - start) / reps / chunk * 1e6


def activation_us(chunk: int, seconds: float) -> float:
    """CPU µs per chain of the tanh layer's forward and backward elementwise passes at ``[N, chunk, H]``."""
    a0 = torch.randn(N, chunk, H)
    a, g, out = torch.empty_like(a0), torch.randn(N, chunk, H), torch.empty_like(a0)
    spent, reps = 0.0, 0
    while spent < seconds:
        a.copy_(a0)
        start = time.process_time()
        a.tanh_()
        torch.ops.aten.tanh_backward.grad_input(g, a, grad_input=out)
        spent += time.process_time() - start
        reps += 1
    return spent / reps / chunk * 1e6


def leapfrog_call(lj: FlatLogJoint, theta: torch.Tensor, steps: int = 10):
    """Ten leapfrog steps of chees's kernel from ``theta``: returns a function timing one call
    and the chain-gradients it evaluates."""
    from pyrobdl.inference.chees.kernel import _Sampler

    sampler = _Sampler(lj, theta.clone(), torch.Generator().manual_seed(1), threshold=1000.0)
    p = sampler.momentum()
    return (lambda: sampler.leapfrog(sampler.theta, p, sampler.grad, 1e-3, steps)), steps


def measure(k: int, args) -> dict:
    ljs, theta = make(k, not args.no_compile)
    ref_v, ref_g = ljs["eager none"].log_prob_grad_autograd(theta)
    check = {}
    for name, lj in ljs.items():
        v, g = lj.value_and_grad(theta)
        check[name] = {"value_max_abs_diff": float((v - ref_v).abs().max()),
                       "grad_max_rel_diff": float((g - ref_g).abs().max() / ref_g.abs().max())}
    chunk = auto_chunk_size(N, H) if k > auto_chunk_size(N, H) else k
    calls = {name: (lambda lj=lj: lj.value_and_grad(theta)) for name, lj in ljs.items()}
    calls["autograd"] = lambda: ljs["eager none"].log_prob_grad_autograd(theta)
    leap, per_call = leapfrog_call(ljs["eager auto"], theta)
    calls["leapfrog (eager auto)"] = leap
    floors = ["floor (peak mm)", "floor (its GEMMs)", "floor (GEMMs + tanh)"]
    times: dict = {name: [] for name in [*calls, *floors]}
    for r in range(args.rounds):
        names = list(times) if r % 2 == 0 else list(times)[::-1]
        for name in names:
            if name == "floor (peak mm)":
                times[name].append(gemm_flops() / peak_rate(args.peak_size, args.seconds) * 1e6)
                continue
            if name == "floor (its GEMMs)":
                times[name].append(gemm_shapes_us(chunk, args.seconds))
                continue
            if name == "floor (GEMMs + tanh)":
                times[name].append(gemm_shapes_us(chunk, args.seconds / 2) + activation_us(chunk, args.seconds / 2))
                continue
            fn = calls[name]
            fn()
            reps, start = 0, time.process_time()
            while time.process_time() - start < args.seconds:
                fn()
                reps += 1
            grads = k * (per_call if name == "leapfrog (eager auto)" else 1)
            times[name].append((time.process_time() - start) / reps / grads * 1e6)
    med = {name: statistics.median(v) for name, v in times.items()}
    return {"K": k, "chunk": chunk, "median_us": med, "rounds_us": times, "check": check,
            "profile": profile(ljs["eager auto"], theta, args.profile_calls)}


def profile(lj: FlatLogJoint, theta: torch.Tensor, calls: int) -> list[tuple[str, float, int]]:
    """(op, share of self CPU time, calls) of ``calls`` eager ``value_and_grad`` calls."""
    from torch.profiler import ProfilerActivity, profile as tprofile

    lj.value_and_grad(theta)
    with tprofile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            lj.value_and_grad(theta)
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: -e.self_cpu_time_total)
    return [(e.key, e.self_cpu_time_total / total, e.count // calls) for e in events]


def report(res: dict) -> None:
    med = res["median_us"]
    peak, own, act = med["floor (peak mm)"], med["floor (its GEMMs)"], med["floor (GEMMs + tanh)"]
    print(f"\n## K = {res['K']} (chunk {res['chunk']})")
    print("| variant | CPU µs / chain-gradient (median) | x floor (peak mm) | x floor (its GEMMs) "
          "| x floor (GEMMs + tanh) |")
    print("|---|---|---|---|---|")
    for name, us in med.items():
        print(f"| {name} | {us:.1f} | {us / peak:.2f} | {us / own:.2f} | {us / act:.2f} |")
    print("checks against autograd:", json.dumps(res["check"]))
    print("profile (eager auto), self CPU share:")
    for name, share, count in res["profile"][:12]:
        print(f"  {share * 100:5.1f}%  {count:3d}/call  {name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chains", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=0.5)
    ap.add_argument("--peak-size", type=int, default=512)
    ap.add_argument("--profile-calls", type=int, default=20)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    out = {"date": datetime.now(timezone.utc).isoformat(timespec="minutes"), "torch": torch.__version__,
           "load_before": os.getloadavg(), "gemm_flops_per_chain": gemm_flops(), "results": []}
    print(f"# {out['date']}, torch {torch.__version__}, one thread, load {out['load_before']}, "
          f"{gemm_flops() / 1e6:.2f} MFLOP per chain-gradient")
    for k in args.chains:
        res = measure(k, args)
        report(res)
        out["results"].append(res)
    out["load_after"] = os.getloadavg()
    out["cpu_s"], out["wall_s"] = time.process_time() - cpu0, time.perf_counter() - wall0
    print(f"\n# load after {out['load_after']}; {out['cpu_s']:.0f} CPU s, {out['wall_s']:.0f} wall s")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
