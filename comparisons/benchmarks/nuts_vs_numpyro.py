"""pyrobdl's NUTS (Pyro kernels) against NumPyro's NUTS on the identical Bayesian MLP.

Setting (issue 6): 500 points with 8 features, one hidden layer of 50 tanh units, N(0, 1) priors
on every weight and bias, a Gamma(6, 6) prior on the noise precision (pyrobdl's
``GaussianLearnedPrecision`` default).  Every sampler gets the same warm-up, samples, chains,
target acceptance (0.8), maximum tree depth, diagonal mass matrix, initialisation (a draw from
the prior) and seed, and runs its chains one after another on one CPU thread (torch and XLA).

Reported per variant: wall time, gradient evaluations (leapfrog steps, warm-up included), time
per gradient, and the minimum and median bulk ESS of the function values at the first 50
training inputs (ArviZ, through ``pyrobdl.diagnostics.arviz_adapter``) with ESS per second, and
R-hat when there are two or more chains.  pyrobdl's wall time is the fit's own clock
(initialisation, any JIT compilation, warm-up and sampling; not the ArviZ diagnostics).  NumPyro
runs twice with the same settings: first including JAX's compilation, then (new key) with the
compiled programs loaded from JAX's persistent compilation cache in a temporary directory —
NumPyro recompiles its sampling loop at every call, so without the cache a second run would
pay ~5 s of compilation again.  ``--profile`` adds a cProfile of a
short pyrobdl run for the Pyro and the direct potential (the flat potential, the default since
2026-11-28, was added to the variants after the table in docs/methods/mcmc.md was measured).

NumPyro and JAX are benchmark-only dependencies: ``pip install -e '.[bench]'``.

Usage::

    nice -n 10 python comparisons/benchmarks/nuts_vs_numpyro.py [--warmup 100] [--samples 100]
        [--chains 2] [--max-tree-depth 7] [--seed 0] [--skip NAME ...] [--profile] [--out FILE]
        [--cpu-core N]

The defaults keep one run within ~15 minutes on a shared 2-core machine: a 1x50 network hits
the maximum tree depth at nearly every iteration, so each iteration costs 2^depth - 1 gradients.
"""

from __future__ import annotations

import os

# one CPU thread for XLA as for torch; must be set before JAX is imported
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import cProfile  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import pstats  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import pyrobdl  # noqa: E402
from pyrobdl.diagnostics import convergence  # noqa: E402

N, D, H = 500, 8, 50
CONCENTRATION, RATE = 6.0, 6.0
NUM_EVAL = 50

PYRO_VARIANTS = {
    "pyrobdl NUTS, Pyro potential": dict(potential="trace", jit_compile=False),
    "pyrobdl NUTS, Pyro potential, jit_compile": dict(potential="trace", jit_compile=True),
    "pyrobdl NUTS, direct potential": dict(potential="direct", jit_compile=False),
    "pyrobdl NUTS, flat potential": dict(potential="flat", jit_compile=False),
}


def pin_to_core(core: int | None) -> None:
    """Run every thread of this process (and the threads it starts later) on CPU core ``core`` only.

    CPU seconds are then one core's: without it a helper thread of JAX's runs on any idle core,
    and JAX's CPU time exceeded its wall time by 1.6-1.7x on the 2-core machine at load 1.5-2
    (docs/benchmarks/chees.md, "One core each").  None: no change."""
    if core is None:
        return
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), {core})


def make_data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A smooth nonlinear target with noise sd 0.3, standardised."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, D)).astype(np.float32)
    f = np.sin(2 * x[:, 0]) + 0.5 * x[:, 1] * x[:, 2] + 0.3 * np.tanh(x[:, 3:].sum(1))
    y = f + 0.3 * rng.standard_normal(N)
    return x, ((y - y.mean()) / y.std()).astype(np.float32)


def make_test_inputs(seed: int = 0, num: int = NUM_EVAL) -> np.ndarray:
    """``num`` held-out inputs ``[num, D]`` from the training inputs' distribution (their own random
    stream: none of them is a training input), where function-space ESS is measured."""
    return np.random.default_rng([seed, 1]).standard_normal((num, D)).astype(np.float32)


def summarise(name: str, wall: float, cpu: float, grads: int, f: np.ndarray, extra: dict) -> dict:
    """``f`` is ``[chain, draw, NUM_EVAL]``."""
    conv = convergence(f)
    ess = conv["ess_bulk"]
    return {
        "variant": name,
        "wall_s": wall,
        "cpu_s": cpu,
        "gradients": int(grads),
        "ms_per_gradient": 1e3 * wall / grads,
        "cpu_ms_per_gradient": 1e3 * cpu / grads,
        "ess_min": float(ess.min()),
        "ess_median": float(np.median(ess)),
        "ess_min_per_s": float(ess.min()) / wall,
        "ess_median_per_s": float(np.median(ess)) / wall,
        "rhat_max": float(np.max(conv["rhat"])) if f.shape[0] > 1 else float("nan"),  # needs 2+ chains
        **extra,
    }


def run_pyrobdl(x, y, args, options: dict) -> tuple[dict, object]:
    model = pyrobdl.BayesianMLP(
        D, (H,), 1, activation="tanh", prior=pyrobdl.priors.Gaussian(1.0),
        likelihood=pyrobdl.likelihoods.GaussianLearnedPrecision(CONCENTRATION, RATE),
    )
    cpu = time.process_time()
    post = pyrobdl.fit(
        model, x, y, method="nuts", num_warmup=args.warmup, num_samples=args.samples,
        num_chains=args.chains, max_tree_depth=args.max_tree_depth, init_strategy="sample",
        seed=args.seed, progress=False, diagnostic_points=NUM_EVAL, **options,
    )
    # CPU time includes the fit's ArviZ diagnostics (< 1 s); the fit's own wall clock does not
    cpu = time.process_time() - cpu
    wall = post.cost.wall_time_s
    d = post.diagnostics
    f = post.function_draws(torch.as_tensor(x[:NUM_EVAL]))[..., 0].double().numpy()
    extra = {
        "leapfrog_warmup": sum(d["leapfrog_steps_warmup"]),
        "mean_tree_depth": float(np.mean(d["mean_tree_depth"])),
        "max_depth_fraction": float(np.mean(d["max_tree_depth_fraction"])),
        "step_size": float(np.mean(d["step_size"])),
        "accept_prob": float(np.mean(d["accept_prob"])),
        "divergences": int(sum(d["divergences"])),
    }
    return summarise(f"{next(k for k, v in PYRO_VARIANTS.items() if v == options)}", wall, cpu,
                     post.cost.gradient_evaluations, f, extra), post


def run_numpyro(x, y, args, x_eval: np.ndarray | None = None) -> list[dict]:
    """NumPyro NUTS twice (with, then without compilation); the function values are taken at
    ``x_eval`` (default the first ``NUM_EVAL`` training inputs)."""
    import jax

    jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="nuts_bench_jax_"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as ndist
    from numpyro.infer import MCMC, NUTS, init_to_sample

    def model(x, y=None):
        w0 = numpyro.sample("w0", ndist.Normal(0.0, 1.0).expand([D, H]).to_event(2))
        b0 = numpyro.sample("b0", ndist.Normal(0.0, 1.0).expand([H]).to_event(1))
        w1 = numpyro.sample("w1", ndist.Normal(0.0, 1.0).expand([H, 1]).to_event(2))
        b1 = numpyro.sample("b1", ndist.Normal(0.0, 1.0).expand([1]).to_event(1))
        tau = numpyro.sample("precision", ndist.Gamma(CONCENTRATION, RATE))
        f = (jnp.tanh(x @ w0 + b0) @ w1 + b1)[..., 0]
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("obs", ndist.Normal(f, 1.0 / jnp.sqrt(tau)), obs=y)

    kernel = NUTS(model, target_accept_prob=0.8, max_tree_depth=args.max_tree_depth,
                  init_strategy=init_to_sample, dense_mass=False)
    mcmc = MCMC(kernel, num_warmup=args.warmup, num_samples=args.samples, num_chains=args.chains,
                chain_method="sequential", progress_bar=False)
    xj, yj = jnp.asarray(x), jnp.asarray(y)
    rows = []
    # NumPyro compiles its sampling loop again at every warmup()/run() call (~5 s here each
    # time).  With JAX's persistent compilation cache (a temporary directory) the second pass
    # loads those programs instead: pass 1 is the cost including compilation, pass 2 (new key,
    # same settings) NumPyro's compiled speed.
    for label, key in (("incl. compile", args.seed), ("compiled (cached)", args.seed + 1)):
        start, cpu = time.perf_counter(), time.process_time()
        mcmc.warmup(jax.random.PRNGKey(key), xj, yj, extra_fields=("num_steps",), collect_warmup=True)
        warm_steps = int(np.asarray(mcmc.get_extra_fields()["num_steps"]).sum())
        mcmc.run(mcmc.post_warmup_state.rng_key, xj, yj,
                 extra_fields=("num_steps", "diverging", "accept_prob", "adapt_state.step_size"))
        samples = mcmc.get_samples(group_by_chain=True)
        jax.block_until_ready(samples)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        ex = mcmc.get_extra_fields(group_by_chain=True)
        steps = np.asarray(ex["num_steps"])
        s = {k: np.asarray(v, dtype=np.float64) for k, v in samples.items()}
        xe = (x[:NUM_EVAL] if x_eval is None else x_eval).astype(np.float64)
        f = (np.tanh(np.einsum("nd,cadh->canh", xe, s["w0"]) + s["b0"][:, :, None]) @ s["w1"])[..., 0] + s["b1"]
        extra = {
            "leapfrog_warmup": warm_steps,
            "mean_tree_depth": float(np.mean([int(n).bit_length() for n in steps.ravel()])),
            "max_depth_fraction": float(np.mean(steps >= 2**args.max_tree_depth - 1)),
            "step_size": float(np.asarray(ex["adapt_state.step_size"]).mean()),
            "accept_prob": float(np.asarray(ex["accept_prob"]).mean()),
            "divergences": int(np.asarray(ex["diverging"]).sum()),
        }
        rows.append(summarise(f"NumPyro {numpyro.__version__} NUTS, {label}", wall, cpu,
                              warm_steps + int(steps.sum()), f, extra))
    return rows


def profile_pyrobdl(x, y, args, options: dict, top: int = 25) -> str:
    small = argparse.Namespace(**{**vars(args), "warmup": 20, "samples": 20, "chains": 1})
    prof = cProfile.Profile()
    prof.enable()
    run_pyrobdl(x, y, small, options)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def table(rows: list[dict]) -> str:
    head = ("| variant | wall s | CPU s | gradients | wall ms/grad | CPU ms/grad | CPU ms/grad vs NumPyro "
            "| ESS min | ESS median | ESS min/CPU s | ESS median/CPU s | max R-hat |")
    lines = [head, "|" + "---|" * 12]
    ref = next((r["cpu_ms_per_gradient"] for r in rows if r["variant"].endswith("(cached)")), float("nan"))
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {r['gradients']} | {r['ms_per_gradient']:.2f} "
            f"| {r['cpu_ms_per_gradient']:.2f} | {r['cpu_ms_per_gradient'] / ref:.1f}x | {r['ess_min']:.1f} "
            f"| {r['ess_median']:.1f} | {r['ess_min'] / r['cpu_s']:.3f} | {r['ess_median'] / r['cpu_s']:.3f} "
            f"| {r['rhat_max']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--chains", type=int, default=2)
    parser.add_argument("--max-tree-depth", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip", nargs="*", default=[], help="substrings of variant names to skip")
    parser.add_argument("--profile", action="store_true", help="cProfile a short pyrobdl run")
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--cpu-core", type=int, default=None, metavar="N", help="run on CPU core N only")
    args = parser.parse_args()
    pin_to_core(args.cpu_core)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*torch.jit.trace.*")
    x, y = make_data(args.seed)
    print(f"N={N} D={D} H={H} tanh, warmup={args.warmup} samples={args.samples} chains={args.chains} "
          f"max_tree_depth={args.max_tree_depth} seed={args.seed}; load average {os.getloadavg()}", flush=True)
    rows = []
    if not any(s in "NumPyro" for s in args.skip):
        for row in run_numpyro(x, y, args):
            rows.append(row)
            print(json.dumps(row), flush=True)
    for name, options in PYRO_VARIANTS.items():
        if any(s in name for s in args.skip):
            continue
        rows.append(run_pyrobdl(x, y, args, options)[0])
        print(json.dumps(rows[-1]), flush=True)
    print(f"load average after: {os.getloadavg()}")
    print(table(rows))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"args": vars(args), "rows": rows}, fh, indent=1)
    if args.profile:
        for name in ("pyrobdl NUTS, Pyro potential", "pyrobdl NUTS, direct potential"):
            print(f"\n## cProfile, {name}, 20 warm-up + 20 samples, top entries by own time\n")
            print(profile_pyrobdl(x, y, args, PYRO_VARIANTS[name]))


if __name__ == "__main__":
    main()
