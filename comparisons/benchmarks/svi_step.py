"""Cost per step of pyrobdl's SVI loop against plain PyTorch training of the same MLP.

Setting (issue 12): N = 1000 points, 8 features, one hidden layer of 50 ReLU units, Gaussian
likelihood, batch 32 and full batch, one torch thread by default.  Every variant runs through
the real ``pyrobdl.fit`` loop; the baseline is a plain ``torch.nn`` MLP trained with Adam on a
Gaussian negative log-likelihood over the same shuffled epochs (default Adam, and the fused Adam
kernel).  Variants are interleaved within each repeat so that machine noise hits all of them
alike; the table gives medians over repeats of CPU time (this process, all threads) and wall time
per optimizer step (each fit runs at least ``--min-steps``, so one-off set-up is amortised), and
the ratio of each median to the plain-PyTorch median of the same run.

With ``--numpyro`` (issue 41) the same model trained by NumPyro joins the interleaved repeats:
an ``AutoNormal`` guide, ``numpyro.optim.Adam`` and ``TraceMeanField_ELBO`` (closed-form KL, as
pyrobdl's default ``kl="analytic"``) or ``Trace_ELBO`` (Monte Carlo KL, as ``kl="monte_carlo"``),
float32, one XLA thread.  Two loops: ``jit(svi.update)`` called once per step on the host's
minibatches (NumPy arrays cut from a shuffled epoch, as the plain PyTorch loop cuts its own), and
all steps inside one jitted ``lax.scan`` (the minibatches gathered on the device inside it, so no
per-step dispatch at all).  Compilation happens in the warm-up, outside the timings.  The table
then also gives each row's CPU ratio to NumPyro's ``jit(svi.update)`` step and to its
``lax.scan`` step (TraceMeanField_ELBO).

Usage::

    python comparisons/benchmarks/svi_step.py [--repeats 7] [--epochs 5] [--min-steps 300] [--threads 1] [--variants ...] [--numpyro]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from typing import Any, Callable

# one XLA thread, like the one torch thread; must be set before JAX is imported (--numpyro)
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import pyrobdl  # noqa: E402

N, D, H = 1000, 8, 50
#: an option of a variant (not of fit): run bbvi's elbo="direct_score_function" without the flat path
OLD_PATH = "_distributions_path"
#: a variant's option key: run it with the flat path's torch kernel only (FlatLogJoint.numpy_kernel off),
#: beside the default, where small CPU steps go to the numpy twin (issue 41, twelfth session)
TORCH_KERNEL = "_torch_kernel"

#: name -> (method, options)
VARIANTS = {
    "mean_field (flat path)": ("mean_field", {}),
    "mean_field (flat path, torch kernel only)": ("mean_field", {TORCH_KERNEL: True}),
    "mean_field, MC KL (flat path)": ("mean_field", {"kl": "monte_carlo"}),
    # issue 41: ELBO, gradient and Adam in one torch.compile graph (compiled in the warm-up)
    "mean_field, compiled step (elbo=direct_compiled)": ("mean_field", {"elbo": "direct_compiled"}),
    "mean_field, MC KL, compiled step (elbo=direct_compiled)": ("mean_field", {"kl": "monte_carlo", "elbo": "direct_compiled"}),
    "map, compiled step (elbo=direct_compiled)": ("map", {"elbo": "direct_compiled"}),
    "mean_field, local reparam, compiled step (elbo=direct_compiled)": ("mean_field", {"local_reparameterization": True,
                                                                                      "elbo": "direct_compiled"}),
    "variational_dropout, local reparam, compiled step (elbo=direct_compiled)": ("variational_dropout", {"elbo": "direct_compiled"}),
    "dropout, compiled step (elbo=direct_compiled)": ("dropout", {"elbo": "direct_compiled"}),
    "gaussian_dropout, compiled step (elbo=direct_compiled)": ("gaussian_dropout", {"elbo": "direct_compiled"}),
    "mean_field, 4 particles (flat path)": ("mean_field", {"num_particles": 4}),
    "map (flat path)": ("map", {}),
    "map (flat path, torch kernel only)": ("map", {TORCH_KERNEL: True}),
    "dropout (flat path)": ("dropout", {}),
    "dropout, MC KL (flat path)": ("dropout", {"kl": "monte_carlo"}),
    "gaussian_dropout (flat path)": ("gaussian_dropout", {}),
    "variational_dropout (flat path, local reparam)": ("variational_dropout", {}),
    "variational_dropout (flat path, local reparam, torch kernel only)": ("variational_dropout", {TORCH_KERNEL: True}),
    "variational_dropout, weights sampled (flat path)": ("variational_dropout", {"local_reparameterization": False}),
    "mean_field (distributions path)": ("mean_field", {"elbo": "distributions"}),
    "dropout (distributions path)": ("dropout", {"elbo": "distributions"}),
    "variational_dropout (distributions path)": ("variational_dropout", {"elbo": "distributions"}),
    "mean_field, local reparam (flat path)": ("mean_field", {"local_reparameterization": True}),
    "mean_field, local reparam (distributions path)": ("mean_field", {"local_reparameterization": True, "elbo": "distributions"}),
    "mean_field, Pyro TraceMeanField_ELBO": ("mean_field", {"elbo": "trace"}),
    # issue 38: bbvi's default estimator is elbo="direct_score_function"; Pyro's path is an option
    "bbvi (default: 4 particles, leave-one-out, direct_score_function)": ("bbvi", {}),
    # issue 41: the default above runs the flat score-function path; this row forces the
    # distributions path it replaced (DirectScoreFunctionELBO), same draws
    "bbvi, old direct path (DirectScoreFunctionELBO)": ("bbvi", {OLD_PATH: True}),
    "bbvi, elbo=trace_graph (Pyro's TraceGraph_ELBO)": ("bbvi", {"elbo": "trace_graph"}),
    "bbvi (16 particles, decaying average, TraceGraph_ELBO)": ("bbvi", {"num_particles": 16, "baseline": "decaying_average",
                                                                       "elbo": "trace_graph"}),
}


def plain_torch_step(x, y, batch: int, steps: int, fused: bool = False) -> tuple[float, float]:
    net = torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.ReLU(), torch.nn.Linear(H, 1))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, fused=fused)
    perm, pos = torch.randperm(N), 0
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        if batch < N:
            if pos + batch > N:
                perm, pos = torch.randperm(N), 0
            idx = perm[pos : pos + batch]
            pos += batch
            xb, yb = x[idx], y[idx]
        else:
            xb, yb = x, y
        loss = 0.5 * (net(xb).squeeze(-1) - yb).pow(2).sum() * (N / xb.shape[0])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return (time.process_time() - cpu) / steps, (time.perf_counter() - wall) / steps


def pyrobdl_step(x, y, batch: int, steps: int, method: str, options: dict, threads: int) -> tuple[float, float]:
    options = dict(options)
    if options.pop(TORCH_KERNEL, False):
        from pyrobdl.flat import FlatLogJoint

        FlatLogJoint.numpy_kernel = False
        try:
            return pyrobdl_step(x, y, batch, steps, method, options, threads)
        finally:
            FlatLogJoint.numpy_kernel = True
    if options.pop(OLD_PATH, False):  # the flat path refuses, so make_elbo falls back (issue 41)
        from unittest import mock

        with mock.patch("pyrobdl.inference.flat_score_function.flat_score_function_support",
                        lambda model, guide: "forced off by the benchmark"):
            return pyrobdl_step(x, y, batch, steps, method, options, threads)
    model = pyrobdl.BayesianMLP(D, (H,), 1, prior=pyrobdl.priors.Gaussian(1.0),
                                likelihood=pyrobdl.likelihoods.Gaussian(1.0))
    if method == "variational_dropout":
        model = pyrobdl.BayesianMLP(D, (H,), 1, prior=pyrobdl.priors.LogUniform(),
                                    likelihood=pyrobdl.likelihoods.Gaussian(1.0))
    post = pyrobdl.fit(model, x, y, method=method, num_steps=steps, lr=1e-3,
                       batch_size=None if batch >= N else batch, progress=False, threads=threads, **options)
    return post.cost.cpu_time_s / steps, post.cost.wall_time_s / steps


class NumPyroSVI:
    """The benchmark's model in NumPyro: AutoNormal guide, Adam, one ELBO; jitted step and scan."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch: int, elbo: str) -> None:
        import jax
        import jax.numpy as jnp
        import numpyro
        import numpyro.distributions as dist
        from numpyro.infer import SVI, Trace_ELBO, TraceMeanField_ELBO
        from numpyro.infer.autoguide import AutoNormal

        self.jax = jax
        self.batch = min(batch, N)
        self.xn, self.yn = x.numpy(), y.numpy()
        self.x, self.y = jnp.asarray(self.xn), jnp.asarray(self.yn)

        def model(xb, yb):
            w0 = numpyro.sample("w0", dist.Normal(0.0, 1.0).expand([D, H]).to_event(2))
            b0 = numpyro.sample("b0", dist.Normal(0.0, 1.0).expand([H]).to_event(1))
            w1 = numpyro.sample("w1", dist.Normal(0.0, 1.0).expand([H, 1]).to_event(2))
            b1 = numpyro.sample("b1", dist.Normal(0.0, 1.0).expand([1]).to_event(1))
            f = (jax.nn.relu(xb @ w0 + b0) @ w1 + b1)[:, 0]
            with numpyro.plate("data", N, subsample_size=xb.shape[0]):  # likelihood scaled by N/B
                numpyro.sample("y", dist.Normal(f, 1.0), obs=yb)

        loss = {"TraceMeanField_ELBO": TraceMeanField_ELBO, "Trace_ELBO": Trace_ELBO}[elbo]()
        self.svi = SVI(model, AutoNormal(model, init_scale=1e-2), numpyro.optim.Adam(1e-3), loss)
        self.state0 = self.svi.init(jax.random.PRNGKey(0), self.x[: self.batch], self.y[: self.batch])
        self.update = jax.jit(self.svi.update)
        svi = self.svi

        def scan(state, perm):  # perm [steps, B]: the minibatches gathered here, on the device
            def body(s, idx):
                s, loss = svi.update(s, self.x[idx], self.y[idx])
                return s, loss
            return jax.lax.scan(body, state, perm)

        self.scan = jax.jit(scan)
        self.rng = np.random.default_rng(0)
        self._warm: set[int] = set()

    def _perms(self, steps: int) -> np.ndarray:
        b = self.batch
        per_epoch = N // b
        epochs = -(-steps // per_epoch)
        rows = [self.rng.permutation(N)[: per_epoch * b].reshape(per_epoch, b) for _ in range(epochs)]
        return np.concatenate(rows)[:steps]

    def jit_step(self, steps: int) -> tuple[float, float]:
        """CPU and wall seconds per step of ``jit(svi.update)`` on host minibatches."""
        perms = self._perms(steps)
        xn, yn = self.xn, self.yn
        full = self.batch >= N
        state = self.state0
        wall, cpu = time.perf_counter(), time.process_time()
        for i in range(steps):
            state, loss = self.update(state, xn, yn) if full else self.update(state, xn[perms[i]], yn[perms[i]])
        self.jax.block_until_ready(loss)
        return (time.process_time() - cpu) / steps, (time.perf_counter() - wall) / steps

    def scan_step(self, steps: int) -> tuple[float, float]:
        """CPU and wall seconds per step of all ``steps`` inside one jitted ``lax.scan``."""
        perms = self.jax.numpy.asarray(self._perms(steps))
        if steps not in self._warm:  # compile for this number of steps outside the timing
            self.jax.block_until_ready(self.scan(self.state0, perms)[1])
            self._warm.add(steps)
        wall, cpu = time.perf_counter(), time.process_time()
        _, losses = self.scan(self.state0, perms)
        self.jax.block_until_ready(losses)
        return (time.process_time() - cpu) / steps, (time.perf_counter() - wall) / steps


def numpyro_variants(x: torch.Tensor, y: torch.Tensor, batch: int) -> dict[str, Callable[[int], tuple[float, float]]]:
    """Name -> timing function of the NumPyro rows (compiled here, outside any timing)."""
    out = {}
    for elbo in ("TraceMeanField_ELBO", "Trace_ELBO"):
        svi = NumPyroSVI(x, y, batch, elbo)
        svi.jit_step(30)
        out[f"NumPyro jit(svi.update), AutoNormal, {elbo}"] = svi.jit_step
        out[f"NumPyro lax.scan of svi.update, AutoNormal, {elbo}"] = svi.scan_step
    return out


def decompose_compiled_step(x: torch.Tensor, y: torch.Tensor, batch: int, repeats: int, steps: int = 3000) -> None:
    """Where a compiled mean-field step's time goes: CPU us per call of the fit loop's step, of
    ``FusedFlatAdam.loss_and_step`` on a fixed minibatch (the draw and the graph), of the compiled
    graph alone, and of the graph with Dynamo's guard check skipped."""
    from pyrobdl.guides import MeanField
    from pyrobdl.inference.elbo import make_elbo
    from pyrobdl.inference.flat_step import FusedFlatAdam

    model = pyrobdl.BayesianMLP(D, (H,), 1, prior=pyrobdl.priors.Gaussian(1.0), likelihood=pyrobdl.likelihoods.Gaussian(1.0))
    opt = FusedFlatAdam(make_elbo(model, MeanField(model), elbo="direct_compiled"), lr=1e-3)
    idx = None if batch >= N else torch.randperm(N)[:batch]
    opt.loss_and_step(x, y, idx)
    args = (opt.params, opt.exp_avg, opt.exp_avg_sq, opt._hyper, idx, opt._noise(N if idx is None else batch))

    def per_call(fn: Callable[[], Any]) -> float:
        cpu = time.process_time()
        for _ in range(steps):
            fn()
        return (time.process_time() - cpu) / steps

    rows: dict[str, list[float]] = {}
    for _ in range(repeats):
        rows.setdefault("fit loop, per step", []).append(
            pyrobdl_step(x, y, batch, steps, "mean_field", {"elbo": "direct_compiled"}, 1)[0])
        rows.setdefault("loss_and_step (draw + graph)", []).append(per_call(lambda: opt.loss_and_step(x, y, idx)))
        with torch.no_grad():  # as loss_and_step calls it (grad mode is one of the graph's guards)
            rows.setdefault("compiled graph alone", []).append(per_call(lambda: opt._fn(*args)))
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                rows.setdefault("compiled graph, guards skipped", []).append(per_call(lambda: opt._fn(*args)))
    label = "full batch" if batch >= N else f"batch {batch}"
    print(f"\ncompiled mean-field step, {label}: CPU us per call (median of {repeats}); load average {os.getloadavg()[0]:.1f}")
    print("| part | CPU us |\n|---|---|")
    for name, ts in rows.items():
        print(f"| {name} | {1e6 * statistics.median(ts):.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--min-steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", type=int, nargs="*", default=[32, N])
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS), metavar="VARIANT")
    parser.add_argument("--numpyro", action="store_true", help="add NumPyro's jitted step and lax.scan rows")
    parser.add_argument("--decompose", action="store_true", help="only: where a compiled mean-field step's time goes")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
    torch.manual_seed(0)
    x = torch.randn(N, D)
    y = torch.sin(x[:, 0]) + 0.1 * torch.randn(N)
    print(f"torch {torch.__version__}, pyrobdl {pyrobdl.__version__}, threads={args.threads}, "
          f"repeats={args.repeats}, epochs/repeat={args.epochs} (>= {args.min_steps} steps), load average at start {os.getloadavg()[0]:.1f}")
    if args.decompose:
        for batch in args.batches:
            decompose_compiled_step(x, y, batch, args.repeats)
        return
    # warm-up: the first fit and the first torch step in a process pay one-off costs (a compiled
    # step compiles once per batch shape: its first fit's cost is printed, then excluded)
    plain_torch_step(x, y, 32, 30)
    for batch in args.batches:
        for name in args.variants:
            wall, cpu = time.perf_counter(), time.process_time()
            pyrobdl_step(x, y, batch, 30, *VARIANTS[name], args.threads)
            if VARIANTS[name][1].get("elbo") == "direct_compiled":
                print(f"one-off: first fit of {name!r} at batch {batch} (compiles): {time.perf_counter() - wall:.1f} s wall, "
                      f"{time.process_time() - cpu:.1f} s CPU in this process (the compiler's worker processes not counted)")
    for batch in args.batches:
        steps = max(args.epochs * max(N // batch, 1), args.min_steps)
        numpyro = numpyro_variants(x, y, batch) if args.numpyro else {}
        times: dict[str, list[tuple[float, float]]] = {"plain PyTorch": [], "plain PyTorch, fused Adam": []}
        for _ in range(args.repeats):
            times["plain PyTorch"].append(plain_torch_step(x, y, batch, steps))
            times["plain PyTorch, fused Adam"].append(plain_torch_step(x, y, batch, steps, fused=True))
            for name in args.variants:
                times.setdefault(name, []).append(pyrobdl_step(x, y, batch, steps, *VARIANTS[name], args.threads))
            for name, run in numpyro.items():
                times.setdefault(name, []).append(run(steps))
        label = "full batch" if batch >= N else f"batch {batch}"
        print(f"\n{label}, {steps} steps per fit: median per step (ratio to plain PyTorch); "
              f"load average now {os.getloadavg()[0]:.1f}")
        print_table(times, numpyro=args.numpyro)


def print_table(times: dict[str, list[tuple[float, float]]], numpyro: bool) -> None:
    """Medians per step and their ratios (CPU: to plain PyTorch, and to NumPyro's two loops)."""
    med = {name: (statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts)) for name, ts in times.items()}
    base_cpu, base_wall = med["plain PyTorch"]
    head = "| variant | CPU us/step | CPU ratio | wall us/step | wall ratio |"
    jit = scan = None
    if numpyro:
        jit = med["NumPyro jit(svi.update), AutoNormal, TraceMeanField_ELBO"][0]
        scan = med["NumPyro lax.scan of svi.update, AutoNormal, TraceMeanField_ELBO"][0]
        head += " CPU / NumPyro jit step | CPU / NumPyro lax.scan step |"
    print(head + "\n|" + "---|" * head.count(" |"))
    for name, (cpu, wall) in med.items():
        row = f"| {name} | {1e6 * cpu:.0f} | {cpu / base_cpu:.2f}x | {1e6 * wall:.0f} | {wall / base_wall:.2f}x |"
        if numpyro:
            row += f" {cpu / jit:.2f}x | {cpu / scan:.2f}x |"
        print(row)


if __name__ == "__main__":
    main()
