"""Per-iteration step size, harmonic-mean acceptance and trajectory length of chees and of BlackJAX's ChEES.

The model, data, K, warm-up and draws of ``chees_vs_blackjax.py`` (eager chees, every option at its
default unless given as ``KEY=VALUE``).  Prints one JSON line (and appends it to OUT): per phase of
the run (iterations 0-75, 75-150, 150-250, 250-300 of a 300-iteration warm-up, then sampling) the
geometric-mean step size, the mean harmonic mean of the chains' acceptance probabilities (the
statistic both samplers' dual averaging targets at 0.651), the mean acceptance, T and leapfrog
steps; the final step and T; quantiles of the log of the final diagonal inverse mass matrix; the
function-space ESS at the held-out inputs.  Docs: ``docs/benchmarks/chees.md``, "Step size and
trajectory length against BlackJAX".

Usage::

    python comparisons/benchmarks/chees_step_diagnosis.py chees 0 diag.jsonl [step_size_adaptation=continuous ...]
    python comparisons/benchmarks/chees_step_diagnosis.py blackjax 0 diag.jsonl
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import chees_vs_blackjax as cb  # noqa: E402

K, W, S = 8, 300, 300
PHASES = [(0, 75), (75, 150), (150, 250), (250, 300), (300, 600)]


def harmonic_means(acc):
    """``[T, K]`` acceptance probabilities -> ``[T]`` harmonic means (0 where a chain has 0)."""
    import numpy as np

    a = np.asarray(acc, dtype=np.float64)
    return np.where((a <= 0).any(1), 0.0, 1.0 / np.mean(1.0 / np.maximum(a, 1e-300), 1))


def summary(step, acc, length, nsteps, extra: dict) -> dict:
    """Per-phase figures of the per-iteration ``step``, ``acc [T, K]``, ``length`` and ``nsteps``."""
    import numpy as np

    h = harmonic_means(acc)
    rec = dict(extra)
    for a, b in PHASES:
        rec[f"it{a}-{b}"] = {"step_gmean": float(np.exp(np.mean(np.log(step[a:b])))), "hm_acc_mean": float(h[a:b].mean()),
                             "acc_mean": float(np.mean(acc[a:b])), "T_mean": float(np.mean(length[a:b])),
                             "nsteps": float(np.mean(nsteps[a:b]))}
    rec["step_every25"] = [float(v) for v in step[:W:25]]
    rec["T_every25"] = [float(v) for v in length[:W:25]]
    return rec


def log_quantiles(inv_mass) -> list[float]:
    import numpy as np

    return [float(v) for v in np.quantile(np.log(np.asarray(inv_mass, dtype=np.float64)), [0, .1, .5, .9, 1])]


def diagnose_chees(x, y, x_test, seed: int, options: dict) -> dict:
    import numpy as np
    import pyrobdl
    import pyrobdl.inference.chees.run as chees_run
    import torch
    from chees_vs_numpyro import make_model
    from pyrobdl.diagnostics import convergence

    caught = {}
    result = chees_run._result

    def keep_run(run, ckpt):  # the final inverse mass matrix is not in the posterior's diagnostics
        caught["run"] = run
        return result(run, ckpt)

    chees_run._result = keep_run
    try:
        cpu = time.process_time()
        post = pyrobdl.fit(make_model(), x, y, method="chees", num_chains=K, seed=seed, progress=False,
                           num_warmup=W, num_samples=S, **options)
        cpu = time.process_time() - cpu
    finally:
        chees_run._result = result
    f = post.function_draws(torch.as_tensor(x_test))[..., 0].double().numpy()
    ess = np.asarray(convergence(f)["ess_bulk"])
    d, a = post.diagnostics, post.adaptation
    return summary(a["step_size"], np.asarray(post.trace.accept_prob).T, a["trajectory_length"], a["num_steps"], {
        "cpu_s": cpu, "final_step": d["step_size"], "final_T": d["trajectory_length"],
        "leapfrog_warmup": d["leapfrog_steps_warmup"], "leapfrog_sampling": d["leapfrog_steps_sampling"],
        "ess_min": float(ess.min()), "certified": bool(d["certification"]["passed"]),
        "log_inv_mass_quantiles": log_quantiles(caught["run"].sampler.inv_mass.cpu())})


def diagnose_blackjax(x, y, x_test, seed: int) -> dict:
    import blackjax
    import jax
    import jax.flatten_util
    import jax.numpy as jnp
    import numpy as np
    import optax
    from blackjax.adaptation.base import get_filter_adapt_info_fn
    from pyrobdl.diagnostics import convergence

    k_warm, k_samp, positions, unravel, logdensity = cb.blackjax_problem(x, y, seed, K)
    warmup = blackjax.chees_adaptation(
        logdensity, K, target_acceptance_rate=0.651, max_leapfrog_steps=1024, mass_matrix_estimation="diagonal",
        adaptation_info_fn=get_filter_adapt_info_fn(info_keys={"num_integration_steps", "acceptance_rate"},
                                                    adapt_state_keys={"step_size", "trajectory_length"}))

    def run(k_warm, k_samp, positions):
        (states, params), winfo = warmup.run(k_warm, positions, 0.05, optax.adam(0.05), W)
        kernel = blackjax.dynamic_hmc(logdensity, **params)

        def one(states, key):
            new, info = jax.vmap(kernel.step)(jax.random.split(key, K), states)
            return new, (new.position, info.acceptance_rate, info.num_integration_steps)

        _, (draws, acc, steps) = jax.lax.scan(one, states, jax.random.split(k_samp, S))
        return ((winfo.info, winfo.adaptation_state), params["step_size"], params["integration_steps_params"][0],
                params["inverse_mass_matrix"], draws, acc, steps)

    cpu = time.process_time()
    (info, state), eps, n_leap, imm, draws, acc, steps = jax.block_until_ready(jax.jit(run)(k_warm, k_samp, positions))
    cpu = time.process_time() - cpu
    d = jax.vmap(jax.vmap(unravel))(jnp.swapaxes(draws, 0, 1))
    f = np.asarray(cb._function_values(d["w0"], d["b0"], d["w1"], d["b1"], jnp.asarray(x_test)), dtype=np.float64)
    ess = np.asarray(convergence(f)["ess_bulk"])
    eps = float(eps)
    # iteration t ran with the state's step and T before its update: shift by one (0.05: the initial step)
    step = np.concatenate([[0.05], np.asarray(state.step_size)[:-1], np.full(S, eps)])
    length = np.concatenate([[0.05], np.asarray(state.trajectory_length)[:-1], np.full(S, eps * float(n_leap))])
    warm_n = np.asarray(info.num_integration_steps)
    return summary(step, np.concatenate([np.asarray(info.acceptance_rate), np.asarray(acc)]), length,
                   np.concatenate([warm_n.mean(1), np.asarray(steps).mean(1)]), {
                       "cpu_s": cpu, "final_step": eps, "final_T": eps * float(n_leap),
                       "leapfrog_warmup": int(warm_n.sum()), "leapfrog_sampling": int(np.asarray(steps).sum()),
                       "ess_min": float(ess.min()), "log_inv_mass_quantiles": log_quantiles(imm)})


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[0] not in ("chees", "blackjax"):
        print(__doc__)
        return 2
    which, seed, out = argv[0], int(argv[1]), argv[2]
    options = dict(cb._option(o) for o in argv[3:])
    cb._jax_env("cpu")
    import torch
    from nuts_vs_numpyro import make_data, make_test_inputs

    torch.set_num_threads(1)
    x, y = make_data(0)
    x_test = make_test_inputs(0)
    rec = diagnose_chees(x, y, x_test, seed, options) if which == "chees" else diagnose_blackjax(x, y, x_test, seed)
    rec = {"sampler": which, "seed": seed, "options": options, **rec}
    line = json.dumps(rec)
    print(line, flush=True)
    with open(out, "a") as fh:
        fh.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
