"""The comparison suite on Ray (pyrobdl.compare.ray_executor): a local Ray cluster started by the
tests (2 CPUs, no dashboard), the driver as the only writer, same metrics as a local run, shipped
data, retries of a killed worker, cells that keep failing, Ctrl-C, resume across executors."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason='Ray is an optional extra: pip install "pyrobdl[ray]"')

from ray import cloudpickle  # noqa: E402  (vendored by Ray)

from pyrobdl.compare import load_suite, run_suite  # noqa: E402
from pyrobdl.compare import runner as runner_module  # noqa: E402
from pyrobdl.compare.config import ConfigError  # noqa: E402
from pyrobdl.compare.ray_executor import RayExecutor  # noqa: E402
from pyrobdl.compare.store import RESULT_FILE, read_result, scan_results  # noqa: E402
from test_compare import TINY as _COMPARE_TINY  # noqa: E402

# The fault-injecting functions below run in Ray's worker processes, which cannot import this
# test module by name: ship it by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

# test_compare's tiny suite, with MAP as the reference and a resources table
TINY = (_COMPARE_TINY.replace("[suite]\n", '[suite]\nreference = "map"\n')
        .replace("[methods.mean_field]\nnum_steps = 30\n", "[methods.mean_field]\nnum_steps = 30\nresources = { cpu = 1 }\n"))
assert 'reference = "map"' in TINY and "resources" in TINY


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for the module (its start-up, several seconds, is paid once)."""
    if ray.is_initialized():
        ray.shutdown()
    # one logical GPU is declared (the machine need not have one) so GPU shares can be granted
    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def write(tmp_path: Path, text: str = TINY, name: str = "suite.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def run(path: Path, out: Path, **kwargs):
    return run_suite(load_suite(path), out, progress=False, threads=1, **kwargs)


def metrics_by_cell(out: Path) -> dict[str, dict]:
    return {p.parent.name: read_result(p)["metrics"] for p in sorted((out / "cells").glob(f"*/{RESULT_FILE}"))}


def test_same_cells_give_the_same_metrics_as_a_local_run(tmp_path, local_ray):
    path = write(tmp_path)
    local = run(path, tmp_path / "local")
    on_ray = run(path, tmp_path / "ray", executor=RayExecutor())
    assert local.success and on_ray.success and len(on_ray.ok) == 4
    a, b = metrics_by_cell(tmp_path / "local"), metrics_by_cell(tmp_path / "ray")
    assert a.keys() == b.keys() and len(a) == 4
    for cid in a:  # seeded, one torch thread per task: the same numbers, not merely close ones
        assert a[cid] == b[cid], cid
    # the driver wrote everything, with the same layout and verified checksums, plus each cell's log
    records, skipped = scan_results(tmp_path / "ray")
    assert len(records) == 4 and not skipped
    for rec in records:
        assert rec["artifacts"]["log"] == "cell.log" and "cell.log" in rec["checksums"]
        assert rec["data"]["loaded_by"] == "worker"
    assert not list((tmp_path / "ray" / "cells").glob("*/.*tmp*"))


def test_interrupted_on_ray_resumes_locally_and_vice_versa(tmp_path, local_ray):
    path = write(tmp_path)
    out = tmp_path / "out"
    first = run(path, out, executor=RayExecutor(), only={"split": {"0"}})
    assert first.success and len(first.ok) == 2
    second = run(path, out)  # local: resumes, runs only split 1
    assert second.success and len(second.ok) == 2 and set(second.skipped) == set(first.ok)
    third = run(path, out, executor=RayExecutor())  # back on Ray: nothing left
    assert third.success and not third.ok and len(third.skipped) == 4


def test_shipped_data_reaches_workers_that_cannot_see_the_file(tmp_path, local_ray, monkeypatch):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 2))
    np.savetxt(tmp_path / "mine.csv", np.column_stack([x, x.sum(1)]), delimiter=",", header="a,b,y", comments="")
    text = TINY.replace('[datasets.gap]\nsource = "gap"\nnum_train = 20\nnum_test = 30\nsplits = [0, 1]',
                        '[datasets.mine]\nsource = "file"\npath = "mine.csv"\ntarget = "y"')
    path = write(tmp_path, text)
    real_load = runner_module.load_dataset

    def load_then_delete(*args, **kwargs):  # the driver loads once, then the file is gone for the workers
        data = real_load(*args, **kwargs)
        (tmp_path / "mine.csv").unlink(missing_ok=True)
        return data

    monkeypatch.setattr(runner_module, "load_dataset", load_then_delete)
    shipped = run(path, tmp_path / "shipped", executor=RayExecutor(), ship_data=True)
    assert shipped.success and len(shipped.ok) == 2
    assert all(r["data"]["loaded_by"] == "driver (shipped)" for r in scan_results(tmp_path / "shipped")[0])
    # without shipping, workers that cannot see the file fail with a message saying what to do
    assert not (tmp_path / "mine.csv").exists()
    np.savetxt(tmp_path / "mine.csv", np.column_stack([x, x.sum(1)]), delimiter=",", header="a,b,y", comments="")
    real_plan = runner_module.check_plan

    def plan_then_delete(*args, **kwargs):  # the driver plans with the file, the workers never see it
        real_plan(*args, **kwargs)
        (tmp_path / "mine.csv").unlink()

    monkeypatch.setattr(runner_module, "check_plan", plan_then_delete)
    unseen = run(path, tmp_path / "unseen", executor=RayExecutor())
    assert not unseen.ok and len(unseen.failed) == 2
    assert all("--ship-data" in e for e in unseen.errors.values())


def _dies_once(marker: str):
    """A compute function whose worker process dies on the first attempt of each cell."""

    def fn(task):
        flag = Path(marker) / task.cell.id
        if not flag.exists():
            flag.write_text(str(os.getpid()))
            os._exit(1)  # the worker process dies mid-cell, as if killed
        return runner_module.compute_cell(task)

    return fn


def _always_dies(task):
    os._exit(1)


def test_a_killed_worker_is_retried(tmp_path, local_ray, monkeypatch):
    path = write(tmp_path)
    (tmp_path / "marks").mkdir()
    monkeypatch.setattr(runner_module, "compute_cell", _dies_once(str(tmp_path / "marks")))
    summary = run(path, tmp_path / "out", executor=RayExecutor(max_retries=1), only={"split": {"0"}})
    assert summary.success and len(summary.ok) == 2
    assert len(list((tmp_path / "marks").iterdir())) == 2  # every cell's first worker died
    assert len(scan_results(tmp_path / "out")[0]) == 2


def test_a_cell_that_keeps_killing_its_worker_is_recorded_as_failed(tmp_path, local_ray, monkeypatch):
    path = write(tmp_path)
    monkeypatch.setattr(runner_module, "compute_cell", _always_dies)
    summary = run(path, tmp_path / "out", executor=RayExecutor(max_retries=1), only={"method": {"map"}, "split": {"0"}})
    assert summary.failed == ("gap__map__split-0__seed-0",) and not summary.ok
    rec = read_result(tmp_path / "out" / "cells" / "gap__map__split-0__seed-0" / RESULT_FILE)
    assert rec["status"] == "failed" and rec["error"]["stage"] == "worker"
    assert "1 retries spent" in rec["error"]["message"]
    # like a local failure: rerunning the same command runs it again
    monkeypatch.setattr(runner_module, "compute_cell", _real_compute)
    again = run(path, tmp_path / "out", executor=RayExecutor(), only={"method": {"map"}, "split": {"0"}})
    assert again.ok == ("gap__map__split-0__seed-0",)


_real_compute = runner_module.compute_cell


def test_resources_are_validated():
    from pyrobdl.compare.config import parse_suite
    import tomllib

    base = tomllib.loads(TINY)
    for bad, match in (({"gpu": -1}, "gpu"), ({"cpu": 0}, "cpu"), ({"tpu": 1}, "tpu"), ({"gpu": 1.5}, "fraction"),
                       ("two", "table")):
        raw = json.loads(json.dumps(base))
        raw["methods"]["map"]["resources"] = bad
        with pytest.raises(ConfigError, match=match):
            parse_suite(raw)
    raw = json.loads(json.dumps(base))
    raw["methods"]["map"]["resources"] = {"cpu": 2, "gpu": 0.25}
    suite = parse_suite(raw)
    assert dict(suite.method("map").resources) == {"cpu": 2.0, "gpu": 0.25}


def test_resources_do_not_change_a_cells_identity(tmp_path):
    from pyrobdl.compare.grid import expand

    a = expand(load_suite(write(tmp_path, TINY, "a.toml")), None)
    b = expand(load_suite(write(tmp_path, TINY.replace("resources = { cpu = 1 }", "resources = { cpu = 2, gpu = 0.5 }"),
                                "b.toml")), None)
    assert [c.config_hash for c in a] == [c.config_hash for c in b]
    assert {c.resources["gpu"] for c in b if c.method == "mean_field"} == {0.5}


def test_ctrl_c_cancels_and_exits_130_then_resumes(tmp_path):
    # A real process with its own local Ray: SIGINT while cells run.
    # slow enough that the interrupt always comes first, however fast the CPU (~2 s of 200,000 steps
    # would race it); the interrupt cancels the cells with force, so they never run that long
    slow = TINY.replace("[methods.mean_field]\nnum_steps = 30", "[methods.mean_field]\nnum_steps = 5000000")
    path = write(tmp_path, slow)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "pyrobdl.cli", "compare", str(path), "--out", str(out), "--executor", "ray",
           "--threads", "1", "--no-progress"]
    # SIGINT at its default in the child: a shell that starts the tests in the background (`cmd &`)
    # ignores SIGINT, the child inherits that and Python then never raises KeyboardInterrupt
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while time.time() < deadline and len(list((out / "cells").glob(f"gap__map__*/{RESULT_FILE}"))) < 2:
        time.sleep(0.5)
    time.sleep(2)  # the slow mean-field cells are running now
    proc.send_signal(signal.SIGINT)
    try:
        stdout, stderr = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()  # reap it and close its pipes (else their warnings land in a later test)
        raise
    assert proc.returncode == 130, stderr[-2000:]
    assert "interrupted; finished cells are kept, rerun the same command to resume" in stderr
    done = {p.parent.name for p in (out / "cells").glob(f"*/{RESULT_FILE}")}
    assert done == {"gap__map__split-0__seed-0", "gap__map__split-1__seed-0"}
    # the lock was released and the run resumes (locally, with a short budget)
    path.write_text(textwrap.dedent(TINY))
    summary = run(path, out)
    assert summary.success and set(summary.skipped) == done and len(summary.ok) == 2


def test_a_cells_cpu_count_sets_its_torch_threads(tmp_path, local_ray):
    """Without --threads, a cell runs torch on as many threads as whole CPUs its method asks for."""
    path = write(tmp_path, TINY.replace("resources = { cpu = 1 }", "resources = { cpu = 2 }"))
    summary = run_suite(load_suite(path), tmp_path / "out", progress=False, threads=None, executor=RayExecutor(),
                        only={"split": {"0"}})
    assert summary.success
    threads = {r["method"]: r["versions"]["torch_threads"] for r in scan_results(tmp_path / "out")[0]}
    assert threads == {"map": "1", "mean_field": "2"}


@dataclasses.dataclass(frozen=True)
class _FakeCell:
    resources: dict


@dataclasses.dataclass(frozen=True)
class _FakeTask:
    cell: _FakeCell
    threads: int | None = None


def _what_the_worker_got(task):
    import os as _os

    import ray as _ray

    got = _ray.get_runtime_context().get_assigned_resources()
    return task.cell.resources, got, _ray.get_gpu_ids(), _os.environ.get("CUDA_VISIBLE_DEVICES"), task.threads


def test_a_gpu_share_is_granted_as_asked(local_ray):
    """A cell asking for 0.25 of a GPU is granted exactly that share of the device, which Ray
    names in CUDA_VISIBLE_DEVICES (so torch sees it as cuda:0); a cell asking for none gets no
    device."""
    tasks = [_FakeTask(_FakeCell({"cpu": 1, "gpu": 0.25})), _FakeTask(_FakeCell({"cpu": 1, "gpu": 0}))]
    out = {asked["gpu"]: rest for asked, *rest in RayExecutor().map_unordered(_what_the_worker_got, tasks)}
    got, ids, env, threads = out[0.25]
    assert got.get("GPU") == 0.25 and got.get("CPU") == 1 and len(ids) == 1 and env == str(ids[0]) and threads == 1
    got, ids, env, threads = out[0]
    assert "GPU" not in got and ids == [] and not env


def test_cli_ray_flags_are_checked_and_max_retries_reaches_the_executor(tmp_path, capsys, monkeypatch):
    from pyrobdl.cli import main
    from pyrobdl.compare import ray_executor

    path, out = write(tmp_path), str(tmp_path / "out")
    for flags, message in [(["--max-retries", "1"], "--max-retries needs --executor ray"),
                           (["--ship-data"], "--ship-data needs --executor ray"),
                           (["--executor", "ray", "--max-retries", "-1"], "--max-retries must be >= 0, got -1"),
                           (["--executor", "ray", "--workers", "2"], "--workers is for --executor local")]:
        assert main(["compare", str(path), "--out", out, "--no-progress", *flags]) == 2, flags
        assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before any work
    seen = {}

    class Stop(RuntimeError):
        pass

    def fake(address=None, **kwargs):
        seen.update(kwargs, address=address)
        raise Stop("stop here")

    monkeypatch.setattr(ray_executor, "RayExecutor", fake)
    assert main(["compare", str(path), "--out", out, "--no-progress", "--executor", "ray", "--max-retries", "5"]) == 2
    assert seen == {"address": None, "max_retries": 5} and "stop here" in capsys.readouterr().err


# ----------------------------------------------------------------------------- no orphans (issue 42)

def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state, ppid, pgrp, session, ...)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _in_session(sid: int) -> dict[int, str]:
    """Live processes of session ``sid`` (zombies have ended: our container's init may not reap
    them), by pid, with their command names."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields and int(fields[3]) == sid and fields[0] not in ("Z", "X"):
                try:
                    found[int(entry.name)] = (entry / "comm").read_text().strip()
                except OSError:
                    continue
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc (Linux)")
def test_only_a_ray_started_here_is_watched_and_its_leftovers_stopped_at_shutdown(monkeypatch):
    """A Ray joined by address, or initialised by the caller, gets no watcher; for a Ray started
    here the watcher follows what ray.init started and stops what ray.shutdown, or a failed
    ray.init, left.  (ray.init is faked by a process that starts a child, so no Ray starts.)"""
    started, grandchildren = [], []

    def fake_init(address=None, fail=False, **kwargs):
        started.append(subprocess.Popen([sys.executable, "-c", "import subprocess, time; "
                                         "subprocess.Popen(['sleep', '120']); time.sleep(120)"]))
        deadline = time.time() + 60
        while time.time() < deadline and not _children_of(started[-1].pid):
            time.sleep(0.05)
        grandchildren.extend(_children_of(started[-1].pid))
        if fail:
            raise RuntimeError("Ray failed to start")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)  # a shutdown that leaves everything behind
    try:
        joined = RayExecutor("ray://head:10001")
        assert joined._watcher is None and len(started) == 1
        joined.shutdown()
        assert started[0].poll() is None  # a cluster joined by address is never touched
        started[0].kill()
        own = RayExecutor()
        head = started[1]
        assert own._watcher is not None and len(grandchildren) == 2
        time.sleep(1.0)  # the watcher has followed the head to its child
        own.shutdown()
        assert head.wait(10) == -signal.SIGTERM and not _live(grandchildren[1])
        # a start that fails (or is interrupted) half-way: what it started is stopped
        with pytest.raises(RuntimeError, match="Ray failed to start"):
            RayExecutor(init_kwargs={"fail": True})
        assert len(grandchildren) == 3 and started[2].wait(10) == -signal.SIGTERM and not _live(grandchildren[2])
    finally:
        for kid in grandchildren:
            if _live(kid):
                os.kill(kid, signal.SIGKILL)
        for proc in started:
            proc.kill()
            proc.wait()
    monkeypatch.undo()
    if ray.is_initialized():  # a caller's Ray (the module's fixture) is used as it is: no watcher
        assert RayExecutor()._watcher is None


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc (Linux)")
def test_the_watcher_finds_a_lost_ray_process_by_its_session_folder_only(tmp_path):
    """The watcher's net for a Ray process re-parented before it was seen: a process of our
    terminal session whose open files lie in the session folder of a Ray *this* driver started
    (the folder's name ends with the driver's pid); not one of another driver's Ray, not
    `session_latest`, not one of another terminal session."""
    from pyrobdl.compare.ray_executor import _named_sessions, _of_sessions

    mine = tmp_path / f"session_2026-11-28_02-35-25_736452_{os.getpid()}"
    other = tmp_path / "session_2026-11-28_02-35-25_736452_1"
    procs = []
    try:
        for folder, new_session in [(mine, False), (other, False), (tmp_path / "session_latest", False),
                                    (mine, True)]:
            (folder / "logs").mkdir(parents=True, exist_ok=True)
            with open(folder / "logs" / f"agent{len(procs)}.out", "w") as log:
                procs.append(subprocess.Popen(["sleep", "60"], stdout=log, start_new_session=new_session))
        assert _named_sessions(procs[0].pid, os.getpid()) == {str(mine)}
        assert _named_sessions(procs[1].pid, os.getpid()) == set() and _named_sessions(procs[1].pid) == {str(other)}
        assert _named_sessions(procs[2].pid) == set()
        found = _of_sessions({str(mine)}, os.getsid(0), {os.getpid()})
        assert set(found) == {procs[0].pid}  # procs[3] names it too, but from another terminal session
        assert _of_sessions(set(), os.getsid(0), set()) == {}
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _children_of(pid: int) -> list[int]:
    return [int(e.name) for e in Path("/proc").iterdir()
            if e.name.isdigit() and (f := _stat(int(e.name))) and int(f[1]) == pid and f[0] not in ("Z", "X")]


def _live(pid: int) -> bool:
    fields = _stat(pid)
    return bool(fields) and fields[0] not in ("Z", "X")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc (Linux)")
@pytest.mark.parametrize("sig, when", [("SIGKILL", "running"), ("SIGTERM", "running"), ("SIGINT", "running"),
                                       ("SIGKILL", "starting")])
def test_a_ray_started_by_compare_ends_when_the_driver_dies(tmp_path, sig, when):
    """Issue 42: after the driver of `compare --executor ray` was killed, two Ray agent processes
    ran on.  A real driver starts its own Ray (GCS, raylet, dashboard and runtime-env agents, a
    worker running a long cell) and is killed; no process of that Ray is left 15 s after the driver
    ended.  ``starting``: killed 0.5 s after the raylet appeared, while it starts its agents (a
    watcher that follows only the process tree lost agents started in its last half second).

    The driver is a session leader, so every process it (or Ray) starts is found by its session id,
    whatever its parent is once the driver is gone."""
    slow = TINY.replace("[methods.map]\nnum_steps = 30", "[methods.map]\nnum_steps = 100000000")
    assert slow != TINY
    path = write(tmp_path, slow)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    driver = subprocess.Popen(
        [sys.executable, "-m", "pyrobdl.cli", "compare", str(path), "--out", str(tmp_path / "out"),
         "--executor", "ray", "--threads", "1", "--no-progress"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
        # SIGINT at its default, as for a user's Ctrl-C (a background job inherits it ignored)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen: dict[int, str] = {}
    try:
        deadline = time.time() + 400  # Ray's start-up took ~40 s at load average 5 on 2 cores
        wanted = ("raylet",) if when == "starting" else ("raylet", "ray::DashboardA", "ray::RuntimeEnv",
                                                          "ray::_run_task")
        while time.time() < deadline and driver.poll() is None:
            seen = _in_session(driver.pid)
            if all(name in seen.values() for name in wanted):
                break
            time.sleep(0.1)
        assert driver.poll() is None, driver.stderr.read()[-2000:]
        assert all(name in seen.values() for name in wanted), f"Ray not up after 400 s: {seen}"
        time.sleep(0.5 if when == "starting" else 1.0)  # the agents are starting / the cell's fit has started
        seen = _in_session(driver.pid)
        os.kill(driver.pid, getattr(signal, sig))
        t0 = time.time()
        code = driver.wait(120)  # SIGTERM/SIGINT: the driver shuts its Ray down, then exits
        t_exit = time.time() - t0
        left = _in_session(driver.pid)
        while time.time() - t0 < t_exit + 15 and left:
            time.sleep(0.2)
            left = _in_session(driver.pid)
        assert not left, (f"{time.time() - t0:.0f} s after {sig} (the driver ended after {t_exit:.0f} s) these "
                          f"processes of the driver's Ray still run: {left} (all were {seen})")
        if sig != "SIGKILL":
            assert code == 130, (code, driver.stderr.read()[-2000:])
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        for pid in _in_session(driver.pid):  # never leave a Ray behind, even when the test failed
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        driver.stderr.close()
