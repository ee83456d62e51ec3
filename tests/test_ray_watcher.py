"""The Ray executor's watcher process on its own (no Ray needed): how it tells its driver's death
from a deliberate shutdown.  ``tests/test_ray_executor.py`` runs it under a real Ray."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pyrobdl.compare import ray_executor

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc (Linux)")


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _sleeper(folder: str) -> list[str]:
    return [sys.executable, "-c", "import time; time.sleep(120)", folder]


@pytest.mark.parametrize("stop", [False, True])
def test_the_watcher_sweeps_the_session_only_when_the_pipe_ends_without_stop(tmp_path, stop):
    """A Ray agent that the raylet started just before the driver was killed can be re-parented
    before the watcher saw it; the watcher then finds it by its Ray session folder.  The kernel
    closes a dying driver's pipe before it re-parents the driver's children, so the watcher cannot
    wait for ``getppid()`` to change: the driver writes ``STOP`` before a deliberate close, and an
    end of the pipe without it is the driver's end.  Here the test process is the driver and stays
    alive: closing without ``STOP`` must sweep a re-parented process naming the session folder (the
    race); with ``STOP`` it must not (a live driver's own processes may name its Ray's folder)."""
    folder = str(tmp_path / f"session_2026-11-29_14-00-00_123456_{os.getpid()}" / "logs")
    before = ray_executor._children(os.getpid())
    watcher = subprocess.Popen([sys.executable, "-I", ray_executor.__file__, str(os.getpid()), *map(str, before)],
                               stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, process_group=0)
    head = stray = None
    try:
        time.sleep(0.3)
        head = subprocess.Popen(_sleeper(folder))  # a Ray head process: the driver's child, adopted
        # a process of this session naming the folder whose parent is gone (double fork)
        out = subprocess.run([sys.executable, "-c", "import subprocess; d = subprocess.DEVNULL; "
                              f"print(subprocess.Popen({_sleeper(folder)!r}, stdin=d, stdout=d, stderr=d).pid)"],
                             capture_output=True, text=True, check=True, timeout=30)
        stray = int(out.stdout)
        deadline = time.time() + 10
        while ray_executor._children(os.getpid()) and time.time() < deadline:
            time.sleep(0.1)  # the intermediate process has exited; the watcher polls twice a second
            if head.pid in ray_executor._children(os.getpid()):
                break
        time.sleep(1.5)  # at least two of the watcher's rounds: the head adopted, its folder learnt
        assert _alive(stray) and head.poll() is None
        if stop:
            watcher.stdin.write(ray_executor.STOP)
            watcher.stdin.flush()
        watcher.stdin.close()
        watcher.wait(30)
        head.wait(10)  # followed from the start: stopped either way
        time.sleep(0.2)
        assert _alive(stray) == stop, "swept after STOP" if stop else "not swept without STOP"
    finally:
        for proc in (watcher, head):
            if proc is not None and proc.poll() is None:
                proc.kill()
        if stray is not None and _alive(stray):
            os.kill(stray, 9)
