"""Checkpoints of "chees" runs (pyrobdl.inference.checkpoint): a run killed at any iteration and
resumed from its checkpoint gives the same draws and statistics, to the bit, as the run never
interrupted; a run can be extended; a checkpoint of another run, an unreadable one or one in use
is refused before any work, naming why; a failed write leaves the previous checkpoint whole."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from conftest import DEVICES

import pyrobdl
import pyrobdl.inference.chees as chees
from pyrobdl.inference.checkpoint import CheckpointError, CheckpointLockedError, SamplerCheckpoint, run_identity


class Crash(Exception):
    """Stands for the process being killed."""


def small_mlp() -> pyrobdl.BayesianMLP:
    return pyrobdl.BayesianMLP(2, (4,), 1, activation="tanh", likelihood=pyrobdl.likelihoods.GaussianLearnedPrecision())


def small_data(n: int = 20, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=g)
    return x, torch.sin(x[:, 0]) + 0.1 * torch.randn(n, generator=g)


# 40 warm-up iterations: an initial buffer of 6, mass-matrix windows ending at 36, a final buffer
BASE = dict(method="chees", num_chains=4, num_warmup=40, num_samples=8, seed=5, progress=False)
CONFIGS = {
    "plain": {},
    "superchains, per-chain metric": dict(superchain_size=2, mass_matrix="per-chain"),
    "map start, uniform jitter": dict(init_strategy="map", map_num_steps=20, jitter="uniform"),
    # 4 rungs of 2 chains, the ladder respaced at the end of each window
    "adapted replica exchange": dict(num_chains=8, temperatures=[1.0, 0.6, 0.3, 0.1], adapt_temperatures=True),
    # the window's dense second moment and the quarter-period ceiling are carried across a kill
    "eigen trajectory, continuous step": dict(trajectory_adaptation="eigen", step_size_adaptation="continuous"),
}


def quiet_fit(*args, **kw):
    with warnings.catch_warnings():
        # short runs are not certified, and may need more than max_num_steps: not what is tested here
        warnings.filterwarnings("ignore", category=UserWarning, module="pyrobdl")
        warnings.filterwarnings("ignore", message="the chees posterior is not certified", category=UserWarning)
        return pyrobdl.fit(*args, **kw)


def crash_at(monkeypatch, iteration: int) -> None:
    """Make the ``iteration``-th transition (0-based) raise, as if the process died there."""
    real = chees._Sampler.transition
    calls = {"n": 0}

    def transition(self, *a, **kw):
        if calls["n"] == iteration:
            raise Crash(f"killed at iteration {iteration}")
        calls["n"] += 1
        return real(self, *a, **kw)

    monkeypatch.setattr(chees._Sampler, "transition", transition)


def assert_same_run(a, b) -> None:
    for name in a.samples:
        assert torch.equal(a.samples[name], b.samples[name]), name
    for field in ("accept_prob", "energy", "log_joint", "diverging", "num_steps", "step_size"):
        np.testing.assert_array_equal(getattr(a.trace, field), getattr(b.trace, field), err_msg=field)
    assert sorted(a.adaptation) == sorted(b.adaptation)
    for name in a.adaptation:  # step size, T, leapfrog steps; with exchanges the replica in each slot
        np.testing.assert_array_equal(a.adaptation[name], b.adaptation[name], err_msg=name)
    for key in ("chain_gradients", "step_size", "trajectory_length", "inverse_mass_matrix", "temperatures",
                "swap_accept_prob", "round_trips", "ladder_span", "ebfmi", "map_chain_gradients",
                "step_size_search_chain_gradients"):
        assert a.diagnostics[key] == b.diagnostics[key], key
    assert a.cost.gradient_evaluations == b.cost.gradient_evaluations


@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_killed_run_resumes_to_the_same_draws(config, tmp_path, monkeypatch):
    """Killed in the first buffer, inside a mass-matrix window, at the last warm-up iteration, in
    sampling, and after the last iteration (a crash while the result is built): every resumed run
    equals the run never interrupted, to the bit."""
    x, y = small_data()
    kw = {**BASE, **CONFIGS[config]}
    whole = quiet_fit(small_mlp(), x, y, **kw)
    assert whole.diagnostics["resumed_at"] == [] and whole.diagnostics["checkpoint_saves"] == 0
    total = kw["num_warmup"] + kw["num_samples"]
    for kill in (3, 20, kw["num_warmup"] - 1, kw["num_warmup"] + 3, total):
        path = tmp_path / f"{kill}.pt"
        with monkeypatch.context() as m:
            crash_at(m, kill) if kill < total else m.setattr(chees.result, "MCMCPosterior", _crash_on_build)
            with pytest.raises(Crash):
                quiet_fit(small_mlp(), x, y, checkpoint=str(path), checkpoint_every_s=0, **kw)
        resumed = quiet_fit(small_mlp(), x, y, checkpoint=str(path), checkpoint_every_s=0, **kw)
        assert resumed.diagnostics["resumed_at"] == [kill], kill
        assert_same_run(whole, resumed)
        assert resumed.settings["checkpoint"] == str(path)


def _crash_on_build(*args, **kwargs):
    raise Crash("killed after the last iteration")


def test_a_run_killed_twice_resumes_twice(tmp_path, monkeypatch):
    x, y = small_data()
    whole = quiet_fit(small_mlp(), x, y, **BASE)
    path = tmp_path / "run.pt"
    for kill in (10, 30):
        with monkeypatch.context() as m:
            crash_at(m, kill - (10 if kill == 30 else 0))  # counts the resumed process's transitions
            with pytest.raises(Crash):
                quiet_fit(small_mlp(), x, y, checkpoint=path, checkpoint_every_s=0, **BASE)
    state = torch.load(path, weights_only=True)["state"]
    resumed = quiet_fit(small_mlp(), x, y, checkpoint=path, checkpoint_every_s=0, **BASE)
    assert resumed.diagnostics["resumed_at"] == [10, 30]
    assert_same_run(whole, resumed)
    # the cost counts the killed processes' seconds up to their last checkpoint, and this one's
    assert resumed.cost.wall_time_s > state["wall_s"] > 0 and resumed.cost.cpu_time_s > state["cpu_s"] > 0


def test_a_finished_run_is_extended_by_more_samples(tmp_path):
    """num_samples grown: the checkpoint of a finished run goes on sampling, and the result equals
    a run started with the larger num_samples; a smaller one is refused."""
    x, y = small_data()
    path = tmp_path / "run.pt"
    short = quiet_fit(small_mlp(), x, y, checkpoint=path, **BASE)
    assert short.diagnostics["checkpoint_saves"] == 1  # every_s = 300: only the final write
    longer = {**BASE, "num_samples": 13}
    extended = quiet_fit(small_mlp(), x, y, checkpoint=path, **longer)
    assert extended.diagnostics["resumed_at"] == [BASE["num_warmup"] + BASE["num_samples"]]
    assert_same_run(quiet_fit(small_mlp(), x, y, **longer), extended)
    with pytest.raises(CheckpointError, match=r"num_samples=13; a resumed run can extend it, not shorten it"):
        quiet_fit(small_mlp(), x, y, checkpoint=path, **BASE)


def test_a_run_sampling_until_certified_resumes_inside_an_extension(tmp_path, monkeypatch):
    """max_num_samples: killed in its second extension, the same command resumes it (the file then
    holds more draws per chain than num_samples) to the run never interrupted, certifications
    included; a checkpoint holding more draws than max_num_samples is refused."""
    x, y = small_data()
    kw = {**BASE, "num_samples": 4, "max_num_samples": 12, "extend_by": 4}
    whole = quiet_fit(small_mlp(), x, y, **kw)
    assert [e["num_samples"] for e in whole.diagnostics["extensions"]] == [4, 8, 12]  # never certified
    path = tmp_path / "run.pt"
    kill = BASE["num_warmup"] + 4 + 4 + 2
    with monkeypatch.context() as m:
        crash_at(m, kill)
        with pytest.raises(Crash):
            quiet_fit(small_mlp(), x, y, checkpoint=path, checkpoint_every_s=0, **kw)
    assert torch.load(path, weights_only=True)["state"]["num_samples"] == 12
    resumed = quiet_fit(small_mlp(), x, y, checkpoint=path, checkpoint_every_s=0, **kw)
    assert resumed.diagnostics["resumed_at"] == [kill]
    assert_same_run(whole, resumed)
    assert resumed.diagnostics["extensions"] == whole.diagnostics["extensions"]
    with pytest.raises(CheckpointError, match=r"num_samples=12; a resumed run can extend it, not shorten it "
                                              r"\(num_samples=4, max_num_samples=10 now\)"):
        quiet_fit(small_mlp(), x, y, checkpoint=path, **{**kw, "max_num_samples": 10})


def test_a_checkpoint_of_another_run_is_refused_before_any_work(tmp_path, monkeypatch):
    x, y = small_data()
    path = tmp_path / "run.pt"
    quiet_fit(small_mlp(), x, y, checkpoint=path, **BASE)

    def no_work(*a, **kw):
        raise AssertionError("work started")

    monkeypatch.setattr(chees.run, "FlatLogJoint", no_work)
    with pytest.raises(CheckpointError, match=r"option num_chains: 4 in the file, 6 now; option seed: 5 in the file"):
        quiet_fit(small_mlp(), x, y, checkpoint=path, **{**BASE, "num_chains": 6, "seed": 6})
    with pytest.raises(CheckpointError, match=r"belongs to another run: the training data differs"):
        quiet_fit(small_mlp(), *small_data(seed=1), checkpoint=path, **BASE)
    other = pyrobdl.BayesianMLP(2, (5,), 1, activation="tanh", likelihood=pyrobdl.likelihoods.GaussianLearnedPrecision())
    with pytest.raises(CheckpointError, match=r"the model differs"):
        quiet_fit(other, x, y, checkpoint=path, **BASE)


def test_options_that_do_not_shape_the_chains_are_not_identity():
    x, y = small_data()
    opts = {**chees.CHEES_OPTIONS, "seed": 0, "device": "cpu", "threads": 1}
    a = run_identity(small_mlp(), x, y, opts, exclude=chees._NOT_IDENTITY)
    b = run_identity(small_mlp(), x, y, {**opts, "compile": True, "chunk_size": 2, "threads": 2, "num_samples": 9,
                                         "checkpoint": "elsewhere.pt", "checkpoint_every_s": 1.0,
                                         "diagnostic_points": 7, "certify_inputs": x[:3], "max_num_samples": 50,
                                         "extend_by": 5},
                     exclude=chees._NOT_IDENTITY)
    assert a == b
    assert run_identity(small_mlp(), x, y, {**opts, "max_num_steps": 7}, exclude=chees._NOT_IDENTITY) != a


def test_an_unreadable_checkpoint_is_refused(tmp_path):
    x, y = small_data()
    path = tmp_path / "run.pt"
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=r"run.pt cannot be read: not a pyrobdl checkpoint, or cut short \(UnpicklingError\); delete it"):
        quiet_fit(small_mlp(), x, y, checkpoint=path, **BASE)
    assert path.read_bytes() == b"not a checkpoint"  # nothing overwritten


def test_a_checkpoint_in_use_is_refused(tmp_path):
    x, y = small_data()
    path = tmp_path / "run.pt"
    with SamplerCheckpoint(path, {}, 0.0):
        with pytest.raises(CheckpointLockedError, match=r"run.pt is in use by another process"):
            quiet_fit(small_mlp(), x, y, checkpoint=path, **BASE)
    quiet_fit(small_mlp(), x, y, checkpoint=path, **BASE)  # released: usable again


def test_a_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    x, y = small_data()
    path = tmp_path / "run.pt"
    import pyrobdl.compare.store as store

    real, calls = store.os.replace, {"n": 0}

    def replace(src, dst):
        calls["n"] += 1
        if calls["n"] == 6:
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(store.os, "replace", replace)
    with pytest.raises(CheckpointError, match=r"run.pt: cannot write it: \[Errno 28\] No space left on device"):
        quiet_fit(small_mlp(), x, y, checkpoint=path, checkpoint_every_s=0, **BASE)
    monkeypatch.setattr(store.os, "replace", real)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.pt", "run.pt.lock"]  # no temporary file left
    resumed = quiet_fit(small_mlp(), x, y, checkpoint=path, checkpoint_every_s=0, **BASE)
    assert resumed.diagnostics["resumed_at"] == [5]  # the fifth write was the last whole one
    assert_same_run(quiet_fit(small_mlp(), x, y, **BASE), resumed)


@pytest.mark.parametrize("options, error, match", [
    (dict(checkpoint=3), TypeError, r"checkpoint must be None or a file path, got 3"),
    (dict(checkpoint_every_s=-1), ValueError, r"checkpoint_every_s must be a finite number >= 0, got -1"),
    (dict(checkpoint_every_s=float("nan")), ValueError, r"checkpoint_every_s must be a finite number >= 0"),
])
def test_bad_checkpoint_options_raise_before_running(options, error, match):
    x, y = small_data()
    with pytest.raises(error, match=match):
        pyrobdl.fit(small_mlp(), x, y, **{**BASE, **options})


def test_a_folder_is_not_a_checkpoint(tmp_path):
    x, y = small_data()
    with pytest.raises(ValueError, match=r"is a folder; give a file path"):
        pyrobdl.fit(small_mlp(), x, y, checkpoint=tmp_path, **BASE)


@pytest.mark.cuda
@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA device")
def test_cuda_run_resumes_to_the_same_draws(tmp_path, monkeypatch):
    x, y = small_data()
    kw = {**BASE, "device": "cuda", "compile": False}
    whole = quiet_fit(small_mlp(), x, y, **kw)
    path = tmp_path / "run.pt"
    with monkeypatch.context() as m:
        crash_at(m, 25)
        with pytest.raises(Crash):
            quiet_fit(small_mlp(), x, y, checkpoint=path, checkpoint_every_s=0, **kw)
    resumed = quiet_fit(small_mlp(), x, y, checkpoint=path, checkpoint_every_s=0, **kw)
    assert resumed.diagnostics["resumed_at"] == [25] and resumed.samples["layers.0.weight"].device.type == "cuda"
    assert_same_run(whole, resumed)


KILLED = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_checkpoint import BASE, quiet_fit, small_data, small_mlp
x, y = small_data()
quiet_fit(small_mlp(), x, y, checkpoint={path!r}, checkpoint_every_s=0, **{{**BASE, "num_warmup": 150, "num_samples": 150}})
"""


@pytest.mark.slow  # over 20 s on a loaded core: the slow run (CI runs it too) keeps the default run under 5 minutes
def test_a_real_sigkill_at_any_moment_resumes_to_the_same_draws(tmp_path):
    """A separate process killed with SIGKILL (no exception, no cleanup; possibly while it writes
    the checkpoint) as soon as its first checkpoint exists: the run resumed here equals the run
    never interrupted."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    path = tmp_path / "run.pt"
    script = tmp_path / "killed.py"
    script.write_text(KILLED.format(tests=str(Path(__file__).parent), path=str(path)))
    log = tmp_path / "killed.log"
    with log.open("wb") as err:
        proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.time() + 120
        while not path.exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.01)
        time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL, log.read_text()[-2000:]  # killed, not finished
    kw = {**BASE, "num_warmup": 150, "num_samples": 150}
    x, y = small_data()
    resumed = quiet_fit(small_mlp(), x, y, checkpoint=path, checkpoint_every_s=0, **kw)
    [at] = resumed.diagnostics["resumed_at"]
    assert 0 < at < 300
    assert_same_run(quiet_fit(small_mlp(), x, y, **kw), resumed)


# ------------------------------------------------------- the UCI reference script (docs/results.md)
def _reference_script(data_dir, tmp_path, *extra: str, out: str = "refs.jsonl"):
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "comparisons" / "uci_references.py"
    done = subprocess.run(
        [sys.executable, str(script), "--data-dir", str(data_dir), "--datasets", "yacht", "--splits", "0",
         "--chains", "4", "--superchain", "2", "--warmup", "10", "--samples", "5", "--out", str(tmp_path / out),
         *extra], capture_output=True, text=True, timeout=300)
    rows = [json.loads(line) for line in (tmp_path / out).read_text().splitlines()] if done.returncode == 0 else []
    return done, rows


@pytest.mark.slow  # over 20 s on a loaded core: the slow run (CI runs it too) keeps the default run under 5 minutes
def test_the_reference_script_samples_until_certified_through_chees(data_dir, tmp_path):
    """comparisons/uci_references.py --extend-to is chees's own max_num_samples (certify_rhat from
    --extend-until, at the held-back inputs): a tiny yacht run is never certified, so every round
    is recorded, and the same command with a checkpoint resumes the finished run to the same row."""
    args = ("--superchain-starts", "--extend-to", "13", "--extend-by", "4", "--checkpoint-dir", str(tmp_path / "ck"))
    done, [row] = _reference_script(data_dir, tmp_path, *args)
    assert done.returncode == 0, done.stderr[-2000:]
    ext = row["extensions"]
    assert [e["num_samples"] for e in ext] == [5, 9, 13] and not any(e["certified"] for e in ext)
    assert row["settings"]["num_samples"] == 13 and not row["certified_split"]
    # "both" (the default --extend-until): each round records both R-hats, and its failures name them
    assert all(e["rhat_split_max"] > 1.01 and e["rhat_nested_max"] > 1.01 for e in ext), ext
    again, [row2] = _reference_script(data_dir, tmp_path, *args, out="again.jsonl")
    assert again.returncode == 0, again.stderr[-2000:]
    assert row2["resumed_at"] == [23] and row2["rmse"] == row["rmse"] and row2["extensions"] == ext
    # nested R-hat needs superchain starts: refused before any work
    refused, _ = _reference_script(data_dir, tmp_path, "--extend-to", "13", out="refused.jsonl")
    assert refused.returncode == 2 and "--extend-until both certifies with nested R-hat" in refused.stderr
