"""pyrobdl's many-chain HMC (``method="chees"``) against NumPyro's NUTS on the identical Bayesian MLP.

Same model and data as ``nuts_vs_numpyro.py`` (imported from it): 500 points with 8 features,
one hidden layer of 50 tanh units, N(0, 1) priors on every weight and bias, a Gamma(6, 6) prior
on the noise precision; float32; one torch thread and one XLA thread, everything in this one
process.  Because the machine is shared (2 cores, other jobs running), every figure is reported
as **process CPU time** beside wall time, and ratios are taken between measurements of the same
run.

Part 1, cost per chain-gradient (microbenchmark).  For K chains at once: pyrobdl's
``FlatLogJoint.value_and_grad`` with ``chunk_size=None`` and ``"auto"``, its autograd twin
``log_prob_grad_autograd``, and NumPyro's own potential (``numpyro.infer.util.initialize_model``
on the NumPyro model of ``nuts_vs_numpyro.py``) through ``jax.jit(jax.value_and_grad(.))`` for
one chain and ``jax.jit(jax.vmap(jax.value_and_grad(.)))`` for K.  The states are posterior-like:
draws of a short chees run (``--theta-chains`` chains after ``--theta-warmup`` iterations;
``--theta-source chees``, default), or prior draws with the weights scaled by 0.3
(``--theta-source prior``).  The two
implementations are first checked to agree (log joint = -potential, gradients equal after
reordering).  Every variant is timed once per round, in a rotating order, for ``--micro-rounds``
rounds; each timing is a loop of calls lasting about ``--micro-seconds``.  A further NumPyro
variant runs ``--loop-length`` gradients inside one jitted ``lax.fori_loop`` (what NumPyro's
compiled sampler does), which removes JAX's per-call dispatch from its figure.  Reported: medians of
CPU and wall microseconds per chain-gradient, and the CPU ratio to NumPyro's one-chain figure.

Part 2, end to end: function-space ESS per CPU second.  NumPyro NUTS (``run_numpyro`` of
``nuts_vs_numpyro.py``: max tree depth, diagonal mass, target 0.8, init from the prior, chains
sequential) runs twice per seed, first including compilation, then (new key) with the compiled
programs loaded from JAX's persistent compilation cache; the second run is the reference.
pyrobdl runs ``fit(..., method="chees", num_chains=K)`` (all other options at their defaults:
target acceptance 0.651, ``chunk_size="auto"``, init from the prior).  For each run: wall and CPU
seconds of the sampler (NumPyro: warm-up + sampling; chees: the fit's own clocks, ``Cost``),
chain-gradients (warm-up, step-size searches and sampling included), CPU microseconds per
gradient, minimum and median bulk ESS of the function values at 50 held-out inputs
(``nuts_vs_numpyro.make_test_inputs``: drawn like the training inputs from their own random
stream, none of them a training input; ``pyrobdl.diagnostics.convergence``, equal to ArviZ's),
those per CPU second and their ratio to the same seed's NumPyro run, the maximum split R-hat, and
(chees) the certification.  With two or more seeds, NumPyro and the chees runs are interleaved
(the order is reversed every other seed).

Two protocols (``--protocols``; both by default, every chees row says which):

- ``equal-per-chain`` (the default comparison): every sampler the same warm-up and the same
  draws per chain — chees ``--chees-warmup`` (default ``--numpyro-warmup``) + ``--numpyro-samples``
  per chain, like NumPyro's chains;
- ``equal-total``: chees keeps as many draws in all as NumPyro's chains x draws
  (``max(--chees-min-samples, ceil(--chees-draws / K))`` per chain, ``--chees-draws`` default
  ``--numpyro-chains`` x ``--numpyro-samples``) after the same warm-up per chain — the protocol this
  script used alone before issue 41; with many chains most of chees's gradients are then warm-up.

NumPyro and JAX are benchmark-only dependencies: ``pip install -e '.[bench]'``.

Usage::

    nice -n 10 python comparisons/benchmarks/chees_vs_numpyro.py [--seeds 0 1]
        [--numpyro-warmup 300] [--numpyro-samples 300] [--numpyro-chains 2] [--max-tree-depth 10]
        [--chees-chains 8 32 128] [--chees-warmup 300] [--chees-draws 600] [--chees-min-samples 20]
        [--protocols equal-per-chain equal-total]
        [--micro-chains 1 8 32 128] [--micro-rounds 7] [--micro-seconds 0.2] [--loop-length 50]
        [--theta-source chees|prior] [--skip-micro] [--skip-end-to-end] [--out FILE]

Before issue 41 (``equal-total`` alone, training inputs) one seed took 34 minutes on the project's
shared 2-core machine (load average 2-3.6), 15 of them chees with K = 128; ``equal-per-chain``
runs 300 draws per chain, so K = 128 costs about twice that again.  ``--seeds 1 --skip-micro``
runs one more seed alone.
"""

from __future__ import annotations

import os

# one CPU thread for XLA as for torch; must be set before JAX is imported (as nuts_vs_numpyro.py)
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from datetime import datetime, timezone  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nuts_vs_numpyro import (  # noqa: E402
    CONCENTRATION, NUM_EVAL, RATE, D, H, make_data, make_test_inputs, pin_to_core, run_numpyro, summarise,
)

import pyrobdl  # noqa: E402
from pyrobdl.flat import FlatLogJoint  # noqa: E402


def make_model() -> pyrobdl.BayesianMLP:
    return pyrobdl.BayesianMLP(
        D, (H,), 1, activation="tanh", prior=pyrobdl.priors.Gaussian(1.0),
        likelihood=pyrobdl.likelihoods.GaussianLearnedPrecision(CONCENTRATION, RATE),
    )


def numpyro_model(x, y=None):
    """The NumPyro model of ``nuts_vs_numpyro.run_numpyro`` (defined there inside the function,
    so it cannot be imported; kept identical)."""
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as ndist

    w0 = numpyro.sample("w0", ndist.Normal(0.0, 1.0).expand([D, H]).to_event(2))
    b0 = numpyro.sample("b0", ndist.Normal(0.0, 1.0).expand([H]).to_event(1))
    w1 = numpyro.sample("w1", ndist.Normal(0.0, 1.0).expand([H, 1]).to_event(2))
    b1 = numpyro.sample("b1", ndist.Normal(0.0, 1.0).expand([1]).to_event(1))
    tau = numpyro.sample("precision", ndist.Gamma(CONCENTRATION, RATE))
    f = (jnp.tanh(x @ w0 + b0) @ w1 + b1)[..., 0]
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("obs", ndist.Normal(f, 1.0 / jnp.sqrt(tau)), obs=y)


#: the two protocols of part 2 (``--protocols``); the first is the default comparison
PROTOCOLS = ("equal-per-chain", "equal-total")


def chees_samples(k: int, args, protocol: str = "equal-per-chain") -> int:
    """Draws per chain of chees with K chains: NumPyro's draws per chain (``equal-per-chain``), or
    ``max(--chees-min-samples, ceil(--chees-draws / K))`` (``equal-total``: as many draws in all
    as NumPyro's chains x draws, by default)."""
    if protocol == "equal-per-chain":
        return args.numpyro_samples
    return max(args.chees_min_samples, math.ceil(args.chees_draws / k))


def load() -> str:
    return "%.2f %.2f %.2f" % os.getloadavg()


def pyrobdl_version() -> str:
    """The commit of the checkout, with '+dirty' when pyrobdl/ has uncommitted changes."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "pyrobdl"], cwd=root, capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


# --------------------------------------------------------------------------- part 1: per gradient
def posterior_like_states(x, y, args) -> tuple[torch.Tensor, str]:
    """``[max K, P]`` flat unconstrained states for the microbenchmark."""
    kmax = max(args.micro_chains)
    lj = FlatLogJoint(make_model(), torch.as_tensor(x), torch.as_tensor(y))
    if args.theta_source == "prior":
        gen = torch.Generator().manual_seed(12345)
        theta = lj.sample_prior(kmax, generator=gen)
        theta[:, : lj.size - 1] *= 0.3  # weights and biases; the last coordinate is log precision
        return theta, "prior draws, weights and biases scaled by 0.3"
    chains = args.theta_chains
    draws = math.ceil(kmax / chains)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        post = pyrobdl.fit(make_model(), x, y, method="chees", num_chains=chains, num_warmup=args.theta_warmup,
                           num_samples=draws, seed=12345, progress=False)
    # site -> [chain, draw, *shape]; interleave chains so that the first K states span every chain
    flat = {name: v.transpose(0, 1).reshape(-1, *v.shape[2:]) for name, v in post.samples.items()}
    theta = lj.layout.pack(flat)[:kmax]
    desc = (f"posterior-like states: {draws} draws from each of {chains} chees chains after "
            f"{args.theta_warmup} warm-up iterations (seed 12345)")
    return theta.contiguous(), desc


def to_numpyro_flat(lj: FlatLogJoint, theta: np.ndarray, ravel_order: list[str]) -> np.ndarray:
    """pyrobdl's flat layout ``[K, P]`` -> NumPyro's raveled unconstrained vector ``[K, P]``
    (a permutation: NumPyro stores w0 as [in, hidden], pyrobdl layers.0.weight as [hidden, in])."""
    k = theta.shape[0]
    s = lj.layout
    part = {
        "w0": theta[:, s["layers.0.weight"].start : s["layers.0.weight"].stop].reshape(k, H, D).transpose(0, 2, 1),
        "b0": theta[:, s["layers.0.bias"].start : s["layers.0.bias"].stop],
        "w1": theta[:, s["layers.1.weight"].start : s["layers.1.weight"].stop].reshape(k, 1, H).transpose(0, 2, 1),
        "b1": theta[:, s["layers.1.bias"].start : s["layers.1.bias"].stop],
        "precision": theta[:, s["precision"].start : s["precision"].stop],  # log tau in both
    }
    return np.concatenate([part[n].reshape(k, -1) for n in ravel_order], 1)


def timed_loop(fn, calls: int) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(calls):
        fn()
    return time.process_time() - cpu, time.perf_counter() - wall


def micro_benchmark(x, y, args) -> tuple[list[dict], str, dict]:
    import jax
    import jax.numpy as jnp
    from jax.flatten_util import ravel_pytree
    from numpyro.infer.util import initialize_model

    theta, desc = posterior_like_states(x, y, args)
    xt, yt = torch.as_tensor(x), torch.as_tensor(y)
    model = make_model()
    lj = {"None": FlatLogJoint(model, xt, yt, chunk_size=None), "auto": FlatLogJoint(model, xt, yt, chunk_size="auto")}
    xj, yj = jnp.asarray(x), jnp.asarray(y)
    info, potential_fn, _, _ = initialize_model(jax.random.PRNGKey(0), numpyro_model, model_args=(xj, yj))
    z0, unravel = ravel_pytree(info.z)
    order = sorted(info.z)  # ravel_pytree flattens a dict in sorted-key order
    assert z0.shape[0] == lj["None"].size, (z0.shape, lj["None"].size)

    def potential(z):
        return potential_fn(unravel(z))

    vg1 = jax.jit(jax.value_and_grad(potential))
    vgk = jax.jit(jax.vmap(jax.value_and_grad(potential)))
    theta_np = theta.numpy()
    z_all = jnp.asarray(to_numpyro_flat(lj["None"], theta_np, order))

    # the two implementations compute the same function: log joint = -potential, same gradient
    v_t, g_t = lj["None"].value_and_grad(theta)
    v_j, g_j = vgk(z_all)
    dv = float(np.max(np.abs(v_t.numpy() + np.asarray(v_j)) / np.maximum(1.0, np.abs(v_t.numpy()))))
    g_tj = to_numpyro_flat(lj["None"], g_t.numpy(), order)
    dg = float(np.max(np.abs(g_tj + np.asarray(g_j))) / max(1.0, float(np.max(np.abs(g_tj)))))
    check = {"max_rel_diff_value": dv, "max_rel_diff_grad": dg, "mean_log_joint": float(v_t.mean())}
    print(f"[micro] states: {desc}; mean log joint {float(v_t.mean()):.1f}; pyrobdl vs NumPyro: "
          f"max rel. diff value {dv:.2e}, gradient {dg:.2e} (float32)", flush=True)
    if dv > 1e-3 or dg > 1e-3:
        print("[micro] WARNING: pyrobdl's and NumPyro's log joints disagree", flush=True)

    vg = jax.value_and_grad(potential)

    def in_loop(value_and_grad, z):
        """``--loop-length`` gradients inside one compiled program (as in NumPyro's sampler:
        no Python dispatch per gradient); each step moves z a little so nothing is hoisted."""
        def body(_, carry):
            zz, acc = carry
            v, g = value_and_grad(zz)
            return zz - 1e-7 * g, acc + v
        return jax.lax.fori_loop(0, args.loop_length, body, (z, jnp.zeros(z.shape[:-1], z.dtype)))

    loop1 = jax.jit(lambda z: in_loop(vg, z))
    loopk = jax.jit(lambda z: in_loop(jax.vmap(vg), z))
    L = args.loop_length

    variants = []  # (name, implementation, K, chain-gradients per call, fn)
    for k in args.micro_chains:
        th = theta[:k].contiguous()
        zk = z_all[:k]
        if k == 1:
            z1 = z_all[0]
            variants.append(("NumPyro jit(value_and_grad)", "numpyro", 1, 1,
                             lambda z1=z1: jax.block_until_ready(vg1(z1))))
            variants.append((f"NumPyro value_and_grad, {L} in a jitted fori_loop", "numpyro-loop", 1, L,
                             lambda z1=z1: jax.block_until_ready(loop1(z1))))
        else:
            variants.append(("NumPyro jit(vmap(value_and_grad))", "numpyro", k, k,
                             lambda zk=zk: jax.block_until_ready(vgk(zk))))
            variants.append((f"NumPyro vmap(value_and_grad), {L} in a jitted fori_loop", "numpyro-loop", k, k * L,
                             lambda zk=zk: jax.block_until_ready(loopk(zk))))
        variants.append(("pyrobdl value_and_grad, chunk_size=None", "pyrobdl", k, k,
                         lambda th=th: lj["None"].value_and_grad(th)))
        chunk = lj["auto"].chunk_size
        if k > chunk:  # otherwise identical to chunk_size=None
            variants.append((f"pyrobdl value_and_grad, chunk_size='auto' ({chunk})", "pyrobdl", k, k,
                             lambda th=th: lj["auto"].value_and_grad(th)))
        variants.append(("pyrobdl log_prob_grad_autograd", "pyrobdl-autograd", k, k,
                         lambda th=th: lj["None"].log_prob_grad_autograd(th)))

    calls = []
    for _, _, _, _, fn in variants:  # warm up (JIT compile) and calibrate the loop length
        fn()
        fn()
        _, wall = timed_loop(fn, 3)
        calls.append(max(3, int(args.micro_seconds / max(wall / 3, 1e-7))))
    cpu_us = [[] for _ in variants]
    wall_us = [[] for _ in variants]
    for r in range(args.micro_rounds):
        order_r = list(range(len(variants)))
        shift = r % len(variants)
        for i in order_r[shift:] + order_r[:shift]:
            grads = variants[i][3]
            c, w = timed_loop(variants[i][4], calls[i])
            cpu_us[i].append(1e6 * c / (calls[i] * grads))
            wall_us[i].append(1e6 * w / (calls[i] * grads))
        print(f"[micro] round {r + 1}/{args.micro_rounds} done; load average {load()}", flush=True)
    rows = []
    for i, (name, impl, k, _, _) in enumerate(variants):
        rows.append({
            "variant": name, "implementation": impl, "chains": k, "calls_per_timing": calls[i],
            "cpu_us_per_gradient": statistics.median(cpu_us[i]), "wall_us_per_gradient": statistics.median(wall_us[i]),
            "cpu_us_all": cpu_us[i], "wall_us_all": wall_us[i],
        })
    ref = next(r["cpu_us_per_gradient"] for r in rows if r["implementation"] == "numpyro" and r["chains"] == 1) \
        if any(r["implementation"] == "numpyro" and r["chains"] == 1 for r in rows) else float("nan")
    for r in rows:
        r["cpu_vs_numpyro_1chain"] = r["cpu_us_per_gradient"] / ref
    return rows, desc, check


def micro_table(rows: list[dict]) -> str:
    lines = ["| K | variant | CPU µs/grad | wall µs/grad | CPU vs NumPyro 1 chain |", "|---|---|---|---|---|"]
    rank = {"numpyro": 0, "numpyro-loop": 1, "pyrobdl": 2, "pyrobdl-autograd": 3}
    for r in sorted(rows, key=lambda r: (r["chains"], rank[r["implementation"]])):
        lines.append(f"| {r['chains']} | {r['variant']} | {r['cpu_us_per_gradient']:.1f} | "
                     f"{r['wall_us_per_gradient']:.1f} | {r['cpu_vs_numpyro_1chain']:.2f}x |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ part 2: end to end
def per_cpu(row: dict) -> dict:
    row["ess_min_per_cpu_s"] = row["ess_min"] / row["cpu_s"]
    row["ess_median_per_cpu_s"] = row["ess_median"] / row["cpu_s"]
    row["cpu_us_per_gradient"] = 1e6 * row["cpu_s"] / row["gradients"]
    return row


def run_numpyro_seed(x, y, x_test, seed: int, args) -> list[dict]:
    """Both passes of ``nuts_vs_numpyro.run_numpyro``; keys 2*seed (with compilation) and 2*seed+1 (timed)."""
    ns = argparse.Namespace(warmup=args.numpyro_warmup, samples=args.numpyro_samples, chains=args.numpyro_chains,
                            max_tree_depth=args.max_tree_depth, seed=2 * seed)
    rows = []
    for row in run_numpyro(x, y, ns, x_eval=x_test):
        row = per_cpu(row)
        row.update(seed=seed, method="numpyro", chains=args.numpyro_chains, warmup=args.numpyro_warmup,
                   samples=args.numpyro_samples, reference=row["variant"].endswith("(cached)"), load_after=load())
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def run_chees(x, y, x_test, k: int, seed: int, args, protocol: str = "equal-per-chain") -> dict:
    """One chees fit; function-space ESS at the held-out inputs ``x_test``."""
    samples = chees_samples(k, args, protocol)
    if args.compile:  # like NumPyro, timed with the compiled program cached (a short fit fills the cache)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pyrobdl.fit(make_model(), x, y, method="chees", num_chains=k, num_warmup=2, num_samples=2, seed=seed,
                        progress=False, compile=True)
    cpu_outer = time.process_time()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        post = pyrobdl.fit(make_model(), x, y, method="chees", num_chains=k, num_warmup=args.chees_warmup,
                           num_samples=samples, seed=seed, progress=False, diagnostic_points=NUM_EVAL,
                           compile=args.compile)
    cpu_outer = time.process_time() - cpu_outer
    d = post.diagnostics
    f = post.function_draws(torch.as_tensor(x_test))[..., 0].double().numpy()
    cert = d["certification"]
    extra = {
        "seed": seed, "method": "chees", "protocol": protocol, "chains": k, "warmup": args.chees_warmup, "samples": samples,
        "compile": args.compile, "compile_s": d["compile_s"],
        "cpu_s_incl_fit_diagnostics": cpu_outer,
        "step_size": d["step_size"], "trajectory_length": d["trajectory_length"],
        "mean_num_steps_sampling": d["mean_num_steps_sampling"],
        "leapfrog_warmup": d["leapfrog_steps_warmup"], "leapfrog_sampling": d["leapfrog_steps_sampling"],
        "step_size_search_chain_gradients": d["step_size_search_chain_gradients"],
        "accept_prob": float(np.mean(d["accept_prob"])),
        "divergences": int(sum(d["divergences"])), "divergences_warmup": d["divergences_warmup"],
        "num_steps_cap_hits": d["num_steps_cap_hits_warmup"] + d["num_steps_cap_hits_sampling"],
        "ebfmi_min": float(np.min(d["ebfmi"])),
        "inverse_mass_matrix": d["inverse_mass_matrix"],
        "certified": bool(cert["passed"]), "certification_failures": list(cert["failures"]),
        "warnings": sorted({str(w.message)[:200] for w in caught}),
        "load_after": load(),
    }
    row = per_cpu(summarise(f"pyrobdl chees, K={k}", post.cost.wall_time_s, post.cost.cpu_time_s,
                            d["chain_gradients"], f, extra))
    print(json.dumps(row), flush=True)
    return row


def add_ratios(rows: list[dict]) -> None:
    refs = {r["seed"]: r for r in rows if r["method"] == "numpyro" and r["reference"]}
    for r in rows:
        ref = refs.get(r["seed"])
        r["ess_min_per_cpu_s_vs_numpyro"] = r["ess_min_per_cpu_s"] / ref["ess_min_per_cpu_s"] if ref else float("nan")
        r["ess_median_per_cpu_s_vs_numpyro"] = (r["ess_median_per_cpu_s"] / ref["ess_median_per_cpu_s"]
                                                if ref else float("nan"))


def e2e_table(rows: list[dict]) -> str:
    head = ("| run | seed | chains x (warm-up + samples) | wall s | CPU s | gradients | CPU µs/grad | fESS min "
            "| fESS median | fESS min / CPU s | fESS median / CPU s | vs NumPyro (min / median) | max R-hat "
            "| divergences | certification |")
    lines = [head, "|" + "---|" * 15]
    for r in rows:
        if r["method"] == "chees":
            div = f"{r['divergences']} (warm-up {r['divergences_warmup']})"
            cert = "pass" if r["certified"] else "fail: " + "; ".join(r["certification_failures"])
            name = f"chees K={r['chains']}" + (" compiled" if r.get("compile") else "") + f", {r['protocol']}"
        else:
            div = str(r["divergences"])
            cert = "—"
            name = "NumPyro NUTS" + ("" if r["reference"] else ", incl. compile")
        lines.append(
            f"| {name} | {r['seed']} | {r['chains']} x ({r['warmup']} + {r['samples']}) | {r['wall_s']:.1f} "
            f"| {r['cpu_s']:.1f} | {r['gradients']} | {r['cpu_us_per_gradient']:.1f} | {r['ess_min']:.0f} "
            f"| {r['ess_median']:.0f} | {r['ess_min_per_cpu_s']:.2f} | {r['ess_median_per_cpu_s']:.2f} "
            f"| {r['ess_min_per_cpu_s_vs_numpyro']:.2f}x / {r['ess_median_per_cpu_s_vs_numpyro']:.2f}x "
            f"| {r['rhat_max']:.3f} | {div} | {cert} |"
        )
    return "\n".join(lines)


def sampler_table(rows: list[dict]) -> str:
    lines = ["| run | seed | step size | leapfrog steps / iteration (sampling) | accept prob | "
             "gradients in warm-up | fESS min / CPU s of sampling alone (est.) | E-BFMI min |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["method"] == "chees":
            sampling = r["chains"] * r["leapfrog_sampling"] / r["gradients"]
            lines.append(f"| chees K={r['chains']}, {r['protocol']} | {r['seed']} | {r['step_size']:.4f} | "
                         f"{r['mean_num_steps_sampling']:.0f} (T = {r['trajectory_length']:.2f}) | "
                         f"{r['accept_prob']:.2f} | {100 * (1 - sampling):.0f}% | "
                         f"{r['ess_min'] / (sampling * r['cpu_s']):.1f} | {r['ebfmi_min']:.2f} |")
        elif r["reference"]:
            chains, samples = r["chains"], r["samples"]
            sampling = 1 - r["leapfrog_warmup"] / r["gradients"]
            mean_steps = (r["gradients"] - r["leapfrog_warmup"]) / (chains * samples)
            lines.append(f"| NumPyro NUTS | {r['seed']} | {r['step_size']:.4f} | {mean_steps:.0f} "
                         f"(mean tree depth {r['mean_tree_depth']:.1f}, {100 * r['max_depth_fraction']:.0f}% at max) | "
                         f"{r['accept_prob']:.2f} | {100 * (1 - sampling):.0f}% | "
                         f"{r['ess_min'] / (sampling * r['cpu_s']):.1f} | — |")
    return "\n".join(lines)


def summary_table(rows: list[dict]) -> str:
    """Medians over seeds of the per-seed figures (NumPyro: the timed, cached runs)."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        if r["method"] == "numpyro" and not r["reference"]:
            continue
        name = "NumPyro NUTS" if r["method"] == "numpyro" else f"chees K={r['chains']}, {r['protocol']}"
        groups.setdefault(name, []).append(r)
    lines = ["| run | seeds | CPU s | CPU µs/grad | fESS min / CPU s | fESS median / CPU s "
             "| vs NumPyro: min | vs NumPyro: median |", "|---|---|---|---|---|---|---|---|"]
    for name, rs in groups.items():
        def med(key):
            return statistics.median(r[key] for r in rs)
        lines.append(f"| {name} | {len(rs)} | {med('cpu_s'):.1f} | {med('cpu_us_per_gradient'):.1f} "
                     f"| {med('ess_min_per_cpu_s'):.2f} | {med('ess_median_per_cpu_s'):.2f} "
                     f"| {med('ess_min_per_cpu_s_vs_numpyro'):.2f}x | {med('ess_median_per_cpu_s_vs_numpyro'):.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-seed", type=int, default=0, help="make_data's seed (one data set for all runs)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--numpyro-warmup", type=int, default=300)
    parser.add_argument("--numpyro-samples", type=int, default=300)
    parser.add_argument("--numpyro-chains", type=int, default=2)
    parser.add_argument("--max-tree-depth", type=int, default=10)
    parser.add_argument("--chees-chains", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--chees-warmup", type=int, default=None, help="default: --numpyro-warmup")
    parser.add_argument("--chees-draws", type=int, default=None, help="equal-total: total draws over all "
                        "chains (at least); default --numpyro-chains x --numpyro-samples")
    parser.add_argument("--protocols", nargs="+", choices=PROTOCOLS, default=list(PROTOCOLS),
                        help="equal-per-chain: every sampler the same warm-up and draws per chain (the "
                        "default comparison); equal-total: chees as many draws in all as NumPyro")
    parser.add_argument("--chees-min-samples", type=int, default=20, help="fewest samples per chain")
    parser.add_argument("--micro-chains", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--micro-rounds", type=int, default=7)
    parser.add_argument("--micro-seconds", type=float, default=0.2, help="length of one timing loop")
    parser.add_argument("--loop-length", type=int, default=50, help="gradients per jitted fori_loop call")
    parser.add_argument("--theta-source", choices=("chees", "prior"), default="chees")
    parser.add_argument("--theta-chains", type=int, default=8, help="chains of the chees run giving the states")
    parser.add_argument("--theta-warmup", type=int, default=100, help="its warm-up iterations")
    parser.add_argument("--compile", action="store_true", help="chees with compile=True (timed with the "
                        "compiled kernels cached by a short fit first, as NumPyro is timed on its second run)")
    parser.add_argument("--skip-micro", action="store_true")
    parser.add_argument("--skip-end-to-end", action="store_true")
    parser.add_argument("--out", help="write the settings and rows as JSON here")
    parser.add_argument("--cpu-core", type=int, default=None, metavar="N",
                        help="run on CPU core N only (nuts_vs_numpyro.pin_to_core)")
    args = parser.parse_args()
    pin_to_core(args.cpu_core)
    if args.chees_warmup is None:
        args.chees_warmup = args.numpyro_warmup
    if args.chees_draws is None:
        args.chees_draws = args.numpyro_chains * args.numpyro_samples
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*torch.jit.trace.*")

    import jax
    import numpyro

    # The persistent compilation cache must be configured before JAX compiles anything in this
    # process: JAX decides once per process whether the cache is used.  run_numpyro sets its own
    # directory again, which is then ignored; its second run still loads the compiled programs.
    jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="chees_bench_jax_"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

    x, y = make_data(args.data_seed)
    x_test = make_test_inputs(args.data_seed)
    settings = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__, "jax": jax.__version__, "numpyro": numpyro.__version__,
        "pyro": __import__("pyro").__version__, "pyrobdl_commit": pyrobdl_version(),
        "torch_threads": torch.get_num_threads(),
        "xla_flags": os.environ.get("XLA_FLAGS"), "cpu_count": os.cpu_count(),
        "load_average_before": load(), **vars(args),
        "chees_samples_per_chain": {p: {k: chees_samples(k, args, p) for k in args.chees_chains}
                                    for p in args.protocols},
        "function_space_inputs": f"{NUM_EVAL} held-out inputs (make_test_inputs({args.data_seed}))",
    }
    print("settings: " + json.dumps(settings), flush=True)
    print(f"load average before: {settings['load_average_before']}", flush=True)
    out: dict = {"settings": settings}

    if not args.skip_micro:
        micro_rows, desc, check = micro_benchmark(x, y, args)
        out.update(micro=micro_rows, micro_states=desc, micro_check=check)
        print("\n## Cost per chain-gradient\n\n" + micro_table(micro_rows) + "\n", flush=True)

    rows: list[dict] = []
    if not args.skip_end_to_end:
        for i, seed in enumerate(args.seeds):
            jobs = [("numpyro", None, None)] + [("chees", k, p) for p in args.protocols for k in args.chees_chains]
            if i % 2:
                jobs.reverse()
            for kind, k, protocol in jobs:
                print(f"[e2e] seed {seed}: {kind}{'' if k is None else f' K={k}, {protocol}'}; "
                      f"load average {load()}", flush=True)
                if kind == "numpyro":
                    rows.extend(run_numpyro_seed(x, y, x_test, seed, args))
                else:
                    rows.append(run_chees(x, y, x_test, k, seed, args, protocol))
        rows.sort(key=lambda r: (r["seed"], r["method"] != "numpyro", r["method"] == "numpyro" and r["reference"],
                                 r.get("protocol", ""), r["chains"]))
        add_ratios(rows)
        out["end_to_end"] = rows

    settings["load_average_after"] = load()
    if pyrobdl_version() != settings["pyrobdl_commit"]:
        print(f"WARNING: the checkout changed during the run ({settings['pyrobdl_commit']} -> {pyrobdl_version()})")
    print(f"\nload average after: {settings['load_average_after']}")
    if not args.skip_micro:
        print(f"\n## Cost per chain-gradient ({out['micro_states']}; medians of {args.micro_rounds} rounds)\n")
        print(micro_table(out["micro"]))
    if rows:
        print("\n## End to end: function-space ESS per CPU second\n")
        print(e2e_table(rows))
        print("\n## Samplers\n")
        print(sampler_table(rows))
        print(f"\n## Medians over seeds {args.seeds}\n")
        print(summary_table(rows))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1, default=float)


if __name__ == "__main__":
    main()
