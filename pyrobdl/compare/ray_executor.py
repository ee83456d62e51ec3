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
on Linux the executor starts, just before ``ray.init``, a small watcher process
(``pyrobdl-watcher`` in ``ps -o comm``; this file run by a bare Python, no torch).  It follows
the processes that ``ray.init`` starts and their descendants (twice a second), and once the
driver is gone or has shut Ray down it stops them (SIGTERM, then SIGKILL after 3 s), then exits.
When the driver died, it also stops any process of the driver's terminal session that names
this Ray's session folder (an agent started just before, re-parented before it was seen).  A
cluster joined by address, and a Ray the caller initialised, are never touched.

Ray is an optional dependency (``pip install "pyrobdl[ray]"``); it is imported only when this
executor is created.
"""

from __future__ import annotations

import dataclasses
import os
import re
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


#: A Ray session's folder (``<temp dir>/session_<date>_<time>_<microseconds>_<pid of the driver>``),
#: named in its processes' arguments and open files (every Ray process writes its logs there).
_SESSION_DIR = re.compile(r"(/(?:[^/\0]+/)*session_\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_\d+_(\d+))(?:/|$)")


def _named_sessions(pid: int, driver_pid: int | None = None) -> set[str]:
    """The Ray session folders that a process names in its arguments or open files (only those
    of a Ray that ``driver_pid`` started, if given)."""
    texts: list[str] = []
    try:
        texts += (_PROC / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")
        fds = _PROC / str(pid) / "fd"
        for fd in os.listdir(fds):
            try:
                texts.append(os.readlink(fds / fd))
            except OSError:
                continue
    except OSError:  # gone, or another user's
        pass
    return {m.group(1) for text in texts if (m := _SESSION_DIR.search(text))
            and (driver_pid is None or int(m.group(2)) == driver_pid)}


def _of_sessions(sessions: set[str], sid: int, skip: set[int]) -> dict[int, str]:
    """Live processes of the terminal session ``sid`` (not in ``skip``) that name one of the Ray
    session folders ``sessions``: the Ray processes that the process tree lost (re-parented)."""
    found: dict[int, str] = {}
    for pid in _parents() if sessions else ():
        fields = _stat(pid)
        if pid not in skip and fields and int(fields[3]) == sid and _named_sessions(pid) & sessions:
            found[pid] = fields[19]
    return found


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


#: What the driver writes to the watcher before closing its pipe on purpose (Ray shut down, or a
#: failed start): without it, the end of the pipe means the driver died.
STOP = b"stop\n"


def _watch(driver_pid: int, existing: Sequence[int], interval_s: float = 0.5) -> None:
    """The watcher's main loop.  While ``ray.init`` runs, follow the driver's new children (not in
    ``existing``) and their descendants; once the driver writes the head processes' pids (one
    line on our stdin), follow only those and their descendants.  When the pipe closes (the
    driver shut Ray down, or died) or the driver is gone, stop every process followed, and, if the
    driver died, every process of our terminal session that names this Ray's session folder."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a terminal's Ctrl-C or hang-up
        signal.signal(sig, signal.SIG_IGN)                      # is for the driver: outlive it
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(WATCHER_NAME.encode()), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):  # pragma: no cover - no libc / no prctl
        pass
    skip, tracked, heads, line = {*existing, os.getpid()}, {}, None, b""
    sessions: set[str] = set()

    def adopt() -> None:  # Ray is starting: what the driver starts now is Ray's
        if heads is None:
            for pid in set(_children(driver_pid)) - skip:
                if pid not in tracked and (start := _identity(pid)) is not None:
                    tracked[pid] = start

    stdin = sys.stdin.fileno()
    while os.getppid() == driver_pid:
        adopt()
        _follow(tracked)
        if not sessions:  # learnt once, from the first Ray process that names it
            sessions = set().union(*(_named_sessions(pid, driver_pid) for pid in tracked))
        if not select.select([stdin], [], [], interval_s)[0]:
            continue
        data = os.read(stdin, 4096)
        if not data:
            break  # the driver shut its Ray down, or died: the kernel closed its end of the pipe
        line += data
        if heads is None and b"\n" in line and not line.startswith(STOP):  # ray.init returned: Ray's head processes
            heads = [int(pid) for pid in line.split(b"\n", 1)[0].split()]
            tracked = {pid: start for pid in heads if (start := _identity(pid)) is not None}
    # The driver closes the pipe on purpose only after writing STOP (_stop_watcher); an end of the
    # pipe without it is the driver's exit.  (The kernel closes a dying process's files before it
    # re-parents its children, so os.getppid() alone can still name the dying driver here: seen as
    # two Ray agents left running after a kill -9 of the driver on a loaded core.)
    driver_gone = STOP not in line or os.getppid() != driver_pid
    adopt()  # a start that failed (or was cut short): its processes may still be the driver's children
    _follow(tracked)
    if driver_gone:  # (a live driver's own forks may hold its Ray log open: never swept)
        # a process started just before the driver died (an agent the raylet starts) may have been
        # re-parented before it was seen: find it by its Ray session folder, in our terminal session
        tracked.update(_of_sessions(sessions, os.getsid(0), {driver_pid, os.getpid()}))
    _stop(tracked)


def _start_watcher(existing: Sequence[int]) -> subprocess.Popen | None:
    """Start the watcher of the Ray this process is about to start (``existing``: this process's
    children before); None where it cannot run (no ``/proc``, no source file)."""
    source = Path(__file__)
    if not _PROC.is_dir() or not source.is_file():
        return None
    # -I: a bare interpreter (no pyrobdl package, no torch): only this file's stdlib imports
    return subprocess.Popen([sys.executable, "-I", str(source), str(os.getpid()), *map(str, existing)],
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
                self._start_local(ray, {**kwargs, "num_cpus": num_cpus, "num_gpus": num_gpus})
            else:
                ray.init(address=address, **kwargs)
            self._owns = True
        self._ray = ray
        self._remote = ray.remote(_run_task)
        self._pending: dict[Any, Any] = {}

    def _start_local(self, ray: Any, kwargs: dict[str, Any]) -> None:
        """``ray.init`` a local Ray, watched from before it starts (a driver killed while Ray
        starts leaves nothing either); then tell the watcher which processes are Ray's."""
        before = _children(os.getpid())
        self._watcher = _start_watcher(before)
        try:
            ray.init(**kwargs)
        except BaseException:  # a failed or interrupted start: the watcher stops what it left
            self._stop_watcher()
            raise
        if self._watcher is not None:
            skip = {*before, self._watcher.pid}
            heads = [pid for pid in _children(os.getpid()) if pid not in skip]
            try:
                self._watcher.stdin.write(" ".join(map(str, heads)).encode() + b"\n")
                self._watcher.stdin.flush()
            except OSError:  # pragma: no cover - the watcher was killed: nothing watches this Ray
                self._watcher = None

    def _stop_watcher(self) -> None:
        watcher, self._watcher = self._watcher, None
        if watcher is not None:  # STOP, then closing its pipe: it stops what is left of this Ray, then exits
            try:
                watcher.stdin.write(STOP)
                watcher.stdin.flush()
            except OSError:  # pragma: no cover - the watcher is gone
                pass
            watcher.stdin.close()
            try:
                watcher.wait(30)
            except subprocess.TimeoutExpired:  # pragma: no cover - a watcher stuck on a dying process
                watcher.kill()

    def shutdown(self) -> None:
        """Shut down the local Ray this executor started (nothing for a joined cluster's or a
        caller's own Ray)."""
        if self._owns and self._ray.is_initialized():
            self._ray.shutdown()
        self._owns = False
        self._stop_watcher()  # it stops what ray.shutdown left

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


if __name__ == "__main__":  # the watcher: python -I ray_executor.py DRIVER_PID [EXISTING_CHILD_PID...]
    _watch(int(sys.argv[1]), [int(pid) for pid in sys.argv[2:]])
