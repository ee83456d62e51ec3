"""chees against BlackJAX's ChEES and NumPyro's NUTS on one device, the same model, K, warm-up and draws.

The model and data of ``chees_vs_numpyro.py`` (500 x 8 inputs, one hidden layer of 50 tanh units,
N(0, 1) priors, a Gamma(6, 6) prior on the noise precision; float32).  One sampler at one K per
call (``--sampler``, ``--chains``), so that a shell script can give each its own time limit; one
JSON line per run is appended to ``--out``.

``chees``
    ``pyrobdl.fit(method="chees", num_chains=K, num_warmup=W, num_samples=S, compile=...,
    device=...)`` with every other option at its default (target acceptance 0.651, cross-chain
    diagonal mass matrix, trajectory Adam lr 0.05, init from the prior).  With ``--compile`` a
    2 + 2 fit first fills the compile cache, and the timed fit reuses it.
``blackjax``
    ``blackjax.chees_adaptation`` (diagonal mass matrix estimated over the ensemble,
    ``mass_matrix_estimation="diagonal"``; target acceptance 0.651; ``optax.adam(0.05)``; at most
    1,024 leapfrog steps; initial step size ``--blackjax-step-size``) for W steps, then S steps of
    ``blackjax.dynamic_hmc`` with the adapted parameters, ``jax.vmap`` over the chains inside one
    ``jax.jit`` + ``lax.scan``.  Log density: NumPyro's potential of the same model
    (``numpyro.infer.util.initialize_model``), so the target is NumPyro's to the last bit.  Init
    from the prior (the noise precision's log).
``numpyro``
    ``numpyro.infer.NUTS`` (max tree depth ``--max-tree-depth``, diagonal mass matrix, target 0.8,
    init from the prior) with ``chain_method="vectorized"``: the K chains in one program.

Every run is timed on the device (synchronised), with the host process's CPU seconds beside; for the
JAX samplers the seconds JAX spent tracing and compiling (``jax.monitoring``'s compile events) are
recorded and subtracted (``sampling_wall_s``), for chees the fit's own clocks exclude the compiled
program's build (its ``compile_s`` is recorded).  Chain-gradients: every leapfrog step of every
chain, warm-up included (NumPyro: its trees' ``num_steps``).  Function-space ESS (bulk, ArviZ's
definition via ``pyrobdl.diagnostics.convergence``) at 50 held-out inputs, min and median, per
second and per chain-gradient; and **one certification for all three**: ``pyrobdl.diagnostics.certify``
with split R-hat (the chains start independently), divergences and pooled E-BFMI from each sampler's
own energies (BlackJAX: the energy of the state each transition kept).

Usage (the benchmark extra, ``pip install -e '.[bench]'``: JAX, NumPyro, BlackJAX)::

    python comparisons/benchmarks/chees_vs_blackjax.py --sampler blackjax --chains 512 --device cuda \\
        --warmup 150 --samples 100 --out samplers.jsonl
    python comparisons/benchmarks/chees_vs_blackjax.py --table samplers.jsonl

``comparisons/benchmarks/gpu_session.sh`` runs the three at K = 512 and 4,096 on a lent GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path
from types import SimpleNamespace


def _jax_env(device: str) -> None:
    """JAX's platform and threads, set before JAX (or ``nuts_vs_numpyro``, which defaults JAX to the
    CPU on import) is imported."""
    if device == "cpu":
        os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    else:
        os.environ.setdefault("JAX_PLATFORMS", "cuda")
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


class _CompileClock:
    """Seconds JAX spent tracing, lowering and compiling since it was made (``jax.monitoring``)."""

    EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
              "/jax/core/compile/backend_compile_duration")

    def __init__(self) -> None:
        import jax.monitoring

        self.seconds = 0.0
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, name: str, duration: float, **_: object) -> None:
        if name in self.EVENTS:
            self.seconds += duration


# --------------------------------------------------------------------------- the JAX side
def _prior_positions(key, k: int):
    """K draws from the prior, unconstrained (the precision's log), as NumPyro's potential wants them."""
    import jax
    import jax.numpy as jnp
    from nuts_vs_numpyro import CONCENTRATION, RATE, D, H

    ks = jax.random.split(key, 5)
    return {
        "w0": jax.random.normal(ks[0], (k, D, H)), "b0": jax.random.normal(ks[1], (k, H)),
        "w1": jax.random.normal(ks[2], (k, H, 1)), "b1": jax.random.normal(ks[3], (k, 1)),
        "precision": jnp.log(jax.random.gamma(ks[4], CONCENTRATION, (k,)) / RATE),
    }


def _function_values(w0, b0, w1, b1, x_test):
    """``[K, S, M]`` network outputs at ``x_test`` for draws ``w0 [K, S, D, H]`` ..."""
    import jax.numpy as jnp

    h = jnp.tanh(jnp.einsum("md,ksdh->ksmh", x_test, w0) + b0[:, :, None, :])
    return jnp.einsum("ksmh,ksho->ksmo", h, w1)[..., 0] + b1[:, :, None, :][..., 0]


def blackjax_problem(x, y, seed: int, k: int) -> tuple:
    """The keys, K prior starting points ``[K, P]`` and log density BlackJAX runs on: NumPyro's
    potential of the model of ``chees_vs_numpyro`` on ``x, y`` (``seed`` splits into the init,
    model, warm-up and sampling keys). Returns ``(k_warm, k_samp, positions, unravel, logdensity)``.

    The positions are flat ``[K, P]``: blackjax 1.7.1's ChEES averages proposals with a weight
    broadcast that only fits leaves of shape ``[K, dim]`` (``weighted_empirical_mean``), so the
    pytree is raveled and ``unravel`` maps one row back."""
    import jax
    import jax.flatten_util
    import jax.numpy as jnp
    from chees_vs_numpyro import numpyro_model
    from numpyro.infer.util import initialize_model

    k_init, k_model, k_warm, k_samp = jax.random.split(jax.random.PRNGKey(seed), 4)
    potential = initialize_model(k_model, numpyro_model, model_args=(jnp.asarray(x), jnp.asarray(y)),
                                 dynamic_args=False)[1]
    tree = _prior_positions(k_init, k)
    unravel = jax.flatten_util.ravel_pytree(jax.tree.map(lambda v: v[0], tree))[1]
    positions = jax.vmap(lambda t: jax.flatten_util.ravel_pytree(t)[0])(tree)

    def logdensity(z):
        return -potential(unravel(z))

    return k_warm, k_samp, positions, unravel, logdensity


def run_blackjax(x, y, x_test, args) -> tuple[dict, object, object]:
    import blackjax
    import jax
    import jax.flatten_util
    import jax.numpy as jnp
    import numpy as np
    import optax
    from blackjax.adaptation.base import get_filter_adapt_info_fn

    k = args.chains
    k_warm, k_samp, positions, unravel, logdensity = blackjax_problem(x, y, args.seed, k)
    warmup = blackjax.chees_adaptation(
        logdensity, k, target_acceptance_rate=0.651, max_leapfrog_steps=1024, mass_matrix_estimation="diagonal",
        adaptation_info_fn=get_filter_adapt_info_fn(info_keys={"num_integration_steps", "is_divergent"}))

    def run(k_warm, k_samp, positions):
        (states, params), winfo = warmup.run(k_warm, positions, args.blackjax_step_size, optax.adam(0.05),
                                             args.warmup)
        kernel = blackjax.dynamic_hmc(logdensity, **params)
        imm = params["inverse_mass_matrix"]

        def one(states, key):
            new, info = jax.vmap(kernel.step)(jax.random.split(key, k), states)
            start = -states.logdensity + 0.5 * jnp.sum(info.momentum**2 * imm, axis=-1)  # the transition's start
            energy = jnp.where(info.is_accepted, info.energy, start)  # the energy of the state kept
            keep = (new.position, energy, info.is_divergent, info.num_integration_steps)
            return new, keep

        _, (draws, energy, divergent, steps) = jax.lax.scan(one, states, jax.random.split(k_samp, args.samples))
        return (draws, energy, divergent, steps, winfo.info.num_integration_steps, params["step_size"],
                params["integration_steps_params"][0])

    clock = _CompileClock()
    wall, cpu = time.perf_counter(), time.process_time()
    out = jax.block_until_ready(jax.jit(run)(k_warm, k_samp, positions))
    wall, cpu, compile_s = time.perf_counter() - wall, time.process_time() - cpu, clock.seconds
    draws, energy, divergent, steps, warm_steps, eps, n_leap = out
    # scan stacks the draws first: [S, K, P] -> [K, S, P] -> each site [K, S, ...]
    d = jax.vmap(jax.vmap(unravel))(jnp.swapaxes(draws, 0, 1))
    f = np.asarray(_function_values(d["w0"], d["b0"], d["w1"], d["b1"], jnp.asarray(x_test)), dtype=np.float64)
    grads = int(np.sum(np.asarray(warm_steps))) + int(np.sum(np.asarray(steps)))  # both [iteration, chain]
    trace = SimpleNamespace(num_warmup=0, diverging=np.asarray(divergent).T, energy=np.asarray(energy).T,
                            superchain_size=1)
    extra = {"step_size": float(eps), "mean_num_steps_sampling": float(np.mean(np.asarray(steps))),
             "nominal_num_steps": float(n_leap), "jax_platform": jax.devices()[0].platform}
    return _timing(wall, cpu, compile_s, grads, extra), f, trace


def run_numpyro(x, y, x_test, args) -> tuple[dict, object, object]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from chees_vs_numpyro import numpyro_model
    from numpyro.infer import MCMC, NUTS, init_to_sample

    kernel = NUTS(numpyro_model, max_tree_depth=args.max_tree_depth, target_accept_prob=0.8,
                  init_strategy=init_to_sample)
    mcmc = MCMC(kernel, num_warmup=args.warmup, num_samples=args.samples, num_chains=args.chains,
                chain_method="vectorized", progress_bar=False)
    xj, yj = jnp.asarray(x), jnp.asarray(y)
    clock = _CompileClock()
    wall, cpu = time.perf_counter(), time.process_time()
    mcmc.warmup(jax.random.PRNGKey(args.seed), xj, yj, collect_warmup=True, extra_fields=("num_steps",))
    warm_steps = int(np.sum(np.asarray(mcmc.get_extra_fields()["num_steps"])))
    mcmc.run(mcmc.post_warmup_state.rng_key, xj, yj, extra_fields=("num_steps", "diverging", "energy"))
    jax.block_until_ready(mcmc.get_samples())
    wall, cpu, compile_s = time.perf_counter() - wall, time.process_time() - cpu, clock.seconds
    s = mcmc.get_samples(group_by_chain=True)
    e = mcmc.get_extra_fields(group_by_chain=True)
    f = np.asarray(_function_values(s["w0"], s["b0"], s["w1"], s["b1"], jnp.asarray(x_test)), dtype=np.float64)
    grads = warm_steps + int(np.sum(np.asarray(e["num_steps"])))
    trace = SimpleNamespace(num_warmup=0, diverging=np.asarray(e["diverging"]), energy=np.asarray(e["energy"]),
                            superchain_size=1)
    extra = {"step_size": float(np.mean(np.asarray(mcmc.last_state.adapt_state.step_size))),
             "mean_num_steps_sampling": float(np.mean(np.asarray(e["num_steps"]))),
             "jax_platform": jax.devices()[0].platform}
    return _timing(wall, cpu, compile_s, grads, extra), f, trace


def _timing(wall: float, cpu: float, compile_s: float, grads: int, extra: dict) -> dict:
    # compiling is host work: its seconds are taken off the CPU clock as off the wall clock
    return {"wall_s": wall, "cpu_s": cpu, "compile_s": compile_s, "sampling_wall_s": max(wall - compile_s, 1e-9),
            "sampling_cpu_s": max(cpu - compile_s, 1e-9), "chain_gradients": grads, **extra}


# --------------------------------------------------------------------------- pyrobdl
def run_chees(x, y, x_test, args) -> tuple[dict, object, object]:
    import warnings

    import numpy as np
    import pyrobdl
    import torch
    from chees_vs_numpyro import make_model

    common = dict(method="chees", num_chains=args.chains, seed=args.seed, progress=False, compile=args.compile,
                  device=args.device, **dict(_option(o) for o in args.chees_option))
    if args.compile:  # the timed fit reuses the program a short fit compiled, as JAX's runs subtract theirs
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pyrobdl.fit(make_model(), x, y, num_warmup=2, num_samples=2, **common)
    _sync(args.device)
    wall, cpu = time.perf_counter(), time.process_time()
    post = pyrobdl.fit(make_model(), x, y, num_warmup=args.warmup, num_samples=args.samples, **common)
    _sync(args.device)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    d = post.diagnostics
    warm = {k: d[k] for k in ("leapfrog_steps_warmup", "step_size_search_chain_gradients", "warmup_restarts") if k in d}
    f = post.function_draws(torch.as_tensor(x_test).to(post.model.device))[..., 0].double().cpu().numpy()
    trace = post.trace
    extra = {"step_size": float(d["step_size"]), "mean_num_steps_sampling": float(d["mean_num_steps_sampling"]),
             "trajectory_length": float(d["trajectory_length"]), "fit_call_wall_s": wall, "fit_call_cpu_s": cpu,
             "own_certification_passed": bool(d["certification"]["passed"]),
             "peak_memory_bytes": post.cost.peak_memory_bytes, "kernel": d.get("kernel", "eager"), **warm}
    row = {"wall_s": post.cost.wall_time_s, "cpu_s": post.cost.cpu_time_s, "compile_s": d.get("compile_s") or 0.0,
           "sampling_wall_s": post.cost.wall_time_s, "sampling_cpu_s": post.cost.cpu_time_s, "chain_gradients": int(d["chain_gradients"]), **extra}
    return row, np.asarray(f), trace


def _option(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` of ``--chees-option``, parsed as ``comparisons/uci_references.py`` parses its own."""
    parent = str(Path(__file__).resolve().parents[1])
    if parent not in sys.path:
        sys.path.insert(0, parent)
    from uci_references import chees_option

    return chees_option(text)


# --------------------------------------------------------------------------- one certification
def certify_draws(f, trace) -> dict:
    """``pyrobdl.diagnostics.certify`` (split R-hat; divergences; pooled E-BFMI) of ``f [K, S, M]``."""
    import numpy as np
    import torch
    from chees_vs_numpyro import make_model
    from pyrobdl.diagnostics import CertificationCriteria, certify

    values = torch.as_tensor(np.asarray(f, dtype=np.float64))[..., None]
    shim = SimpleNamespace(model=make_model(), trace=trace, function_draws=lambda _x: values)
    x_dummy = torch.zeros(values.shape[2], 8)
    cert = certify(shim, x_dummy, CertificationCriteria(rhat="split"))
    return {"certified": bool(cert.passed), "certification_failures": list(cert.failures),
            "rhat_max": cert.rhat_max, "ess_bulk_min": cert.ess_bulk_min, "ess_tail_min": cert.ess_tail_min,
            "divergences": cert.divergences, "ebfmi_pooled": cert.ebfmi_pooled}


def summarise(row: dict, f, trace, args) -> dict:
    import numpy as np
    from pyrobdl.diagnostics import convergence

    ess = np.asarray(convergence(f)["ess_bulk"])
    row.update(certify_draws(f, trace))
    g = row["chain_gradients"]
    row.update({
        "ess_min": float(ess.min()), "ess_median": float(np.median(ess)),
        "ess_min_per_s": float(ess.min()) / row["sampling_wall_s"],
        "ess_median_per_s": float(np.median(ess)) / row["sampling_wall_s"],
        "ess_min_per_cpu_s": float(ess.min()) / row["sampling_cpu_s"],
        "ess_median_per_cpu_s": float(np.median(ess)) / row["sampling_cpu_s"],
        "ess_min_per_mgrad": 1e6 * float(ess.min()) / g, "ess_median_per_mgrad": 1e6 * float(np.median(ess)) / g,
        "us_per_chain_gradient": 1e6 * row["sampling_wall_s"] / g,
    })
    return row


def device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"


# --------------------------------------------------------------------------- table
def _clock(r: dict) -> tuple[float, str]:
    """Seconds a run is charged: host CPU seconds on the CPU (the machine is shared), wall on a GPU."""
    return (r["sampling_cpu_s"], "CPU") if r["device"] == "cpu" else (r["sampling_wall_s"], "wall")


def table(path: str) -> str:
    """Markdown: one row per run, its ratio to the BlackJAX run of the same K, W + S, device and seed;
    then the median ratio per sampler and K."""
    import statistics

    rows = [json.loads(s) for s in Path(path).read_text().splitlines() if s.strip()]
    for r in rows:  # runs with --chees-option are their own sampler in the table
        if r.get("chees_options"):
            r["sampler"] += " (" + ", ".join(f"{k}={v}" for k, v in sorted(r["chees_options"].items())) + ")"
    key = lambda r: (r["chains"], r["warmup"], r["samples"], r["device"], r["seed"])  # noqa: E731
    bjx = {key(r): r["ess_min"] / _clock(r)[0] for r in rows if r["sampler"] == "blackjax"}
    head = ("| sampler | K | W + S | seed | device | s (clock; compile s) | chain-grads | µs / chain-grad | "
            "fESS min / median | fESS min / s | fESS min / M grads | certified | vs BlackJAX, fESS min / s |")
    out, ratios = [head, "|" + "---|" * (head.count("|") - 1)], {}
    for r in sorted(rows, key=lambda r: (r["device"], r["chains"], r["warmup"], r["samples"], r["seed"], r["sampler"])):
        sec, clock = _clock(r)
        ratio = (r["ess_min"] / sec) / bjx[key(r)] if key(r) in bjx else None
        if ratio is not None:
            ratios.setdefault((r["sampler"], r["chains"], r["warmup"], r["samples"], r["device"]), []).append(ratio)
        cert = "yes" if r["certified"] else "no: " + "; ".join(r["certification_failures"])[:100]
        out.append(
            f"| {r['sampler']} | {r['chains']} | {r['warmup']} + {r['samples']} | {r['seed']} | {r['device_name']} "
            f"| {sec:.1f} ({clock}; {r['compile_s']:.1f}) | {r['chain_gradients']:,} | {1e6 * sec / r['chain_gradients']:.3f} "
            f"| {r['ess_min']:,.0f} / {r['ess_median']:,.0f} | {r['ess_min'] / sec:,.2f} | {r['ess_min_per_mgrad']:,.0f} "
            f"| {cert} | {'' if ratio is None else f'{ratio:.2f}x'} |")
    out += ["", "| sampler | K | W + S | device | runs | median vs BlackJAX (min, max) |", "|---|---|---|---|---|---|"]
    for (name, k, w, s_, dev), v in sorted(ratios.items(), key=lambda kv: (kv[0][4], kv[0][1], kv[0][0])):
        out.append(f"| {name} | {k} | {w} + {s_} | {dev} | {len(v)} | {statistics.median(v):.2f}x ({min(v):.2f}, {max(v):.2f}) |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sampler", choices=("chees", "blackjax", "numpyro"))
    p.add_argument("--chains", type=int, default=512)
    p.add_argument("--device", default="cuda", help="cpu or cuda (JAX runs on the same kind of device)")
    p.add_argument("--warmup", type=int, default=150)
    p.add_argument("--samples", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true", help="chees: fit(compile=True), timed after a 2 + 2 fit")
    p.add_argument("--max-tree-depth", type=int, default=10)
    p.add_argument("--chees-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a fit option of chees (repeatable), e.g. init_trajectory_length=0.1; recorded in the row")
    p.add_argument("--blackjax-step-size", type=float, default=0.05, help="BlackJAX's initial step size")
    p.add_argument("--cpu-core", type=int, default=None, metavar="N",
                   help="run on CPU core N only (set before torch or JAX starts a thread): CPU seconds are then "
                   "one core's; without it a helper thread of JAX's can add a second core's time where one is idle")
    p.add_argument("--retain-freed-memory", action="store_true",
                   help="pyrobdl.retain_freed_memory() before either sampler starts (glibc's malloc keeps freed "
                   "buffers mapped; what pyrobdl compare does; docs/benchmarks/chees.md, glibc's malloc)")
    p.add_argument("--out", help="append the run's JSON line here")
    p.add_argument("--table", metavar="JSONL", help="print the Markdown table of these runs and stop")
    args = p.parse_args(argv)
    if args.cpu_core is not None:  # every thread, before torch or JAX starts more (nuts_vs_numpyro.pin_to_core)
        for tid in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(tid), {args.cpu_core})
    if args.table:
        print(table(args.table))
        return 0
    if not args.sampler or not args.out:
        p.error("--sampler and --out are needed (or --table)")
    if args.chains < 2 or args.warmup < 1 or args.samples < 4:
        p.error("--chains must be >= 2, --warmup >= 1, --samples >= 4")
    _jax_env(args.device)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch
    from chees_vs_numpyro import load
    from nuts_vs_numpyro import make_data, make_test_inputs

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: CUDA is not available")
    torch.set_num_threads(1)
    if args.retain_freed_memory:
        import pyrobdl

        pyrobdl.retain_freed_memory()
    if args.sampler != "chees":
        try:
            import blackjax  # noqa: F401
            import jax
            import numpyro  # noqa: F401
        except ImportError as e:
            print(f"{args.sampler} not run: {e} (the benchmark extra: pip install -e '.[bench]')", flush=True)
            return 6

        platform = jax.devices()[0].platform
        if args.device.startswith("cuda") and platform != "gpu":
            print(f"JAX does not see the GPU (jax.devices(): {jax.devices()}); {args.sampler} not run", flush=True)
            return 5
    x, y = make_data(0)
    x_test = make_test_inputs(0)
    run = {"chees": run_chees, "blackjax": run_blackjax, "numpyro": run_numpyro}[args.sampler]
    row, f, trace = run(x, y, x_test, args)
    row = summarise(row, f, trace, args)
    row.update(sampler=args.sampler, chains=args.chains, warmup=args.warmup, samples=args.samples, seed=args.seed,
               device=args.device, device_name=device_name(args.device), compile=args.compile,
               chees_options=dict(_option(o) for o in args.chees_option),
               load=load(), cpu_core=args.cpu_core, retain_freed_memory=args.retain_freed_memory,
               process_minor_faults=resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
    line = json.dumps(row)
    print(line, flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as fh:
        fh.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
