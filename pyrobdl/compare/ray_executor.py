r"""Run a suite's cells on Ray: a local Ray started here, or a running cluster.

``pyrobdl compare SUITE --out DIR --executor ray [--ray-address auto]``.  Each cell is one Ray
task declaring the resources of its method (``resources = { cpu = 1, gpu = 0.25 }`` in the suite;
default one CPU, no GPU), so Ray places it on a node with room and lets several small cells share
one GPU.  What a task returns is the cell's record and the bytes of its files; this process (the
driver) writes them, under the results folder's lock, exactly as a local run does — a results
folder never depends on a shared file system, and a suite interrupted on Ray resumes locally and
vice versa.

Data: by default each worker loads its cell's split from the data directory, which must then be
visible at the same path on every node; with ``ship_data`` (``--ship-data``) the driver loads each
split once and puts it in Ray's object store, from which the workers read it.  Reference draws
always travel through the object store (read and verified by the driver), once per reference.

Faults: a task whose worker process dies (killed, out of memory, node lost) is retried by Ray up
to ``max_retries`` times; when the retries are spent the cell is recorded as failed, as a cell
that raises is locally.  An interrupt (Ctrl-C) cancels the outstanding tasks before it
propagates, so the command exits as a local run does (130) and resumes the same way.

No orphans: a local Ray started here ends with this process, however it ends.  On Ctrl-C
(and SIGTERM in ``pyrobdl compare``) or a normal exit, :meth:`RayExecutor.shutdown` (or Ray's
own exit hook) shuts it down.  Ray's head processes (GCS, raylet, monitors) die with the driver
even on ``kill -9`` (Ray's fate sharing), but the dashboard and runtime-env agents that the
raylet starts did not: after a ``kill -9`` they ran on for ~60 s, waiting on the dead GCS.  So
on Linux the executor also starts a small watcher process (``pyrobdl-watcher`` in ``ps -o
comm``; this file run by a bare Python, no torch) that follows every process of that Ray and,
once the driver is gone or has shut Ray down, stops what is left (SIGTERM, then SIGKILL after
3 s), then exits.  A cluster joined by address, and a Ray the caller initialised, are never
touched.

Ray is an optional dependency (``pip install "pyrobdl[ray]"``); it is imported only when this
executor is created.
"""

from __future__ import annotations

import dataclasses
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TypeVar

__all__ = ["RayExecutor", "WATCHER_NAME"]

T = TypeVar("T")
R = TypeVar("R")


def _require_ray() -> Any:
    try:
        import ray
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            'the Ray executor needs Ray: pip install "pyrobdl[ray]" (or pip install ray)'
        ) from e
    return ray


#: The watcher's process name (``ps -o comm``; at most 15 characters).
WATCHER_NAME = "pyrobdl-watcher"
_PROC = Path("/proc")


def _stat(pid: int) -> list[str] | None:
    """``/proc/PID/stat`` after the command name: state, ppid, ..., start time at index 19."""
    try:
        return (_PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _parents() -> dict[int, int]:
    """Every live process's parent pid, by pid (empty without ``/proc``)."""
    found = {}
    try:
        entries = [int(e.name) for e in _PROC.iterdir() if e.name.isdigit()]
    except OSError:
        return found
    for pid in entries:
        fields = _stat(pid)
        if fields and fields[0] not in ("Z", "X"):
            found[pid] = int(fields[1])
    return found


def _children(pid: int) -> list[int]:
    return [kid for kid, parent in _parents().items() if parent == pid]


def _identity(pid: int) -> str | None:
    """A live process's start time: with its pid, it names the process (pids are reused)."""
    fields = _stat(pid)
    return fields[19] if fields and fields[0] not in ("Z", "X") else None


def _follow(tracked: dict[int, str]) -> None:
    """Add to ``tracked`` (pid -> start time) every live descendant of a tracked live process."""
    parents = _parents()
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    todo = [pid for pid, start in tracked.items() if pid in parents and _identity(pid) == start]
    while todo:
        for kid in children.get(todo.pop(), ()):
            if kid not in tracked and (start := _identity(kid)) is not None:
                tracked[kid] = start
                todo.append(kid)


def _stop(tracked: dict[int, str], grace_s: float = 3.0) -> None:
    """SIGTERM every tracked process still alive (same pid, same start time), SIGKILL after ``grace_s``."""
    def alive() -> list[int]:
        return [pid for pid, start in tracked.items() if _identity(pid) == start]

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in alive():
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + grace_s
        while alive() and time.monotonic() < deadline:
            time.sleep(0.1)


def _watch(driver_pid: int, heads: Sequence[int], interval_s: float = 0.5) -> None:
    """The watcher's main loop: follow the Ray processes ``heads`` and their descendants while
    the driver lives; when its pipe (our stdin) closes or the driver is gone, stop them all."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a terminal's Ctrl-C or hang-up
        signal.signal(sig, signal.SIG_IGN)                      # is for the driver: outlive it
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(WATCHER_NAME.encode()), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):  # pragma: no cover - no libc / no prctl
        pass
    tracked = {pid: start for pid in heads if (start := _identity(pid)) is not None}
    stdin = sys.stdin.fileno()
    while os.getppid() == driver_pid:
        _follow(tracked)
        if select.select([stdin], [], [], interval_s)[0] and not os.read(stdin, 4096):
            break  # the driver shut its Ray down, or died: the kernel closed its end of the pipe
    _follow(tracked)
    _stop(tracked)


def _start_watcher(heads: Sequence[int]) -> subprocess.Popen | None:
    """Start the watcher of the Ray processes ``heads`` (children of this process); None where it
    cannot run (no ``/proc``, no source file)."""
    source = Path(__file__)
    if not heads or not _PROC.is_dir() or not source.is_file():
        return None
    # -I: a bare interpreter (no pyrobdl package, no torch): only this file's stdlib imports
    return subprocess.Popen([sys.executable, "-I", str(source), str(os.getpid()), *map(str, heads)],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, process_group=0)


def _run_task(fn: Callable[[Any], Any], task: Any, **shared: Any) -> Any:
    """The Ray task: put the shared objects (top-level keyword arguments, so Ray resolves them
    from the object store) back into the task, then run ``fn``."""
    if shared:
        task = dataclasses.replace(task, **shared)
    return fn(task)


class RayExecutor:
    """Run cells as Ray tasks with per-cell CPU and (fractional) GPU resources.

    Parameters
    ----------
    address : str, optional
        A running cluster's address (``"auto"`` finds the local node's); default: start a
        local Ray in this process (``ray.init`` with ``num_cpus`` and ``num_gpus``), shut down
        again by :meth:`shutdown`, and on Linux by a watcher process if this process dies first
        (see the module's notes).  An already initialised Ray (e.g. a test's) is used as it is.
    num_cpus, num_gpus : int, optional
        Resources of a local Ray started here (default: Ray's detection).
    max_retries : int, default 2
        Retries of a cell whose worker process died; then it is recorded as failed.
    init_kwargs : dict, optional
        More keyword arguments of ``ray.init``.

    Notes
    -----
    Tasks are the runner's :class:`~pyrobdl.compare.runner.CellTask`: their ``cell.resources``
    give the task's ``num_cpus``/``num_gpus``, and their ``threads`` (torch threads) default to
    the whole CPUs they declare, so one cell does not oversubscribe its share.  The large shared
    attributes of tasks (``data``, ``reference``) are put in the object store once per distinct
    object, not once per task.
    """

    in_process = False

    def __init__(self, address: str | None = None, *, num_cpus: int | None = None, num_gpus: int | None = None,
                 max_retries: int = 2, init_kwargs: dict[str, Any] | None = None) -> None:
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be an integer >= 0, got {max_retries!r}")
        ray = _require_ray()
        self.max_retries = max_retries
        self._owns = False
        self._watcher: subprocess.Popen | None = None
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                                      "configure_logging": False, **(init_kwargs or {})}
            if address is None:
                kwargs.update(num_cpus=num_cpus, num_gpus=num_gpus)
            before = set(_children(os.getpid()))
            ray.init(address=address, **kwargs)
            self._owns = True
            if address is None:  # the processes ray.init started: this Ray's head processes
                self._watcher = _start_watcher(sorted(set(_children(os.getpid())) - before))
        self._ray = ray
        self._remote = ray.remote(_run_task)
        self._pending: dict[Any, Any] = {}

    def shutdown(self) -> None:
        """Shut down the local Ray this executor started (nothing for a joined cluster's or a
        caller's own Ray)."""
        if self._owns and self._ray.is_initialized():
            self._ray.shutdown()
        self._owns = False
        watcher, self._watcher = self._watcher, None
        if watcher is not None:  # closing its pipe: it stops what ray.shutdown left, then exits
            watcher.stdin.close()
            try:
                watcher.wait(30)
            except subprocess.TimeoutExpired:  # pragma: no cover - a watcher stuck on a dying process
                watcher.kill()

    def __enter__(self) -> "RayExecutor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def in_flight(self) -> int:
        """Tasks submitted and not yet returned (running, or queued until the cluster has room)."""
        return len(self._pending)

    def _submit(self, fn: Callable[[T], R], task: T, cache: dict[int, Any]) -> Any:
        shared = {}
        for name in ("data", "reference"):
            value = getattr(task, name, None)
            if value is not None:
                key = id(value)
                if key not in cache:
                    cache[key] = (value, self._ray.put(value))  # keep value alive: ids stay unique
                shared[name] = cache[key][1]
        if shared:
            task = dataclasses.replace(task, **{k: None for k in shared})
        resources = dict(getattr(getattr(task, "cell", None), "resources", None) or {})
        cpu, gpu = float(resources.get("cpu", 1.0)), float(resources.get("gpu", 0.0))
        if getattr(task, "threads", "absent") is None:
            task = dataclasses.replace(task, threads=max(1, int(cpu)))
        options: dict[str, Any] = {"num_cpus": cpu, "max_retries": self.max_retries}
        if gpu:
            options["num_gpus"] = gpu
        return self._remote.options(**options).remote(fn, task, **shared)

    def map_unordered(self, fn: Callable[[T], R], tasks: Sequence[T],
                      on_crash: Callable[[T, str], R] | None = None) -> Iterator[R]:
        """Submit every task, then yield results as they finish.

        A task whose worker died more than ``max_retries`` times yields ``on_crash(task,
        message)`` (raises without ``on_crash``).  On an exception in the caller (Ctrl-C) or
        when the generator is closed early, the outstanding tasks are cancelled.
        """
        ray = self._ray
        cache: dict[int, Any] = {}
        self._pending = {self._submit(fn, t, cache): t for t in tasks}
        try:
            while self._pending:
                done, _ = ray.wait(list(self._pending), num_returns=1)
                ref = done[0]
                task = self._pending.pop(ref)
                try:
                    result = ray.get(ref)
                except (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError,
                        ray.exceptions.OutOfMemoryError, ray.exceptions.TaskUnschedulableError,
                        ray.exceptions.RayTaskError) as e:
                    if on_crash is None:
                        raise
                    kind = "raised" if type(e) is ray.exceptions.RayTaskError else "died"
                    result = on_crash(task, f"the Ray worker {kind} ({self.max_retries} retries spent): "
                                            f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
                yield result
        finally:
            for ref in list(self._pending):
                ray.cancel(ref, force=True)
            self._pending = {}


if __name__ == "__main__":  # the watcher: python -I ray_executor.py DRIVER_PID HEAD_PID...
    _watch(int(sys.argv[1]), [int(pid) for pid in sys.argv[2:]])
