r"""Worker processes of ``pyrobdl compare --workers N``: they end with their driver.

A worker computes a cell and returns it; it never writes into the results folder.  So when the
driver dies (``kill -9``, SIGTERM, Ctrl-C, a crash) its workers have nothing left to do, and each
ends within seconds instead of running its fit on (the issue-42 probe found ~410 MB processes
alive for minutes after the driver was killed):

* on Linux the kernel sends the worker SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``,
  set through :mod:`ctypes` when the worker starts);
* everywhere, a daemon thread of the worker checks once a second that its parent is still the
  driver that started it, and ends the process when it is not (the parent died and the worker
  was re-parented).

Both are armed by the pool's initializer, once the worker has imported pyrobdl (and torch): a
worker still starting when its driver dies ends as soon as it has started, before taking a cell.
On Linux an armed worker shows as ``pyrobdl-worker`` in ``ps -o comm`` and ``top``.

When the driver stops on an exception or an interrupt it does not wait for the running cells:
:func:`stop_pool` cancels what has not started and terminates the worker processes.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

__all__ = ["WORKER_NAME", "die_with_parent", "stop_pool"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_PR_SET_NAME = 15
#: The name a worker process shows (``ps -o comm``, ``top``) once it is armed to die with its driver.
WORKER_NAME = "pyrobdl-worker"


def _parent_death_signal() -> bool:
    """Ask the Linux kernel to SIGKILL this process when its parent dies, and name the process
    :data:`WORKER_NAME`; False where not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        armed = libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(WORKER_NAME.encode()), 0, 0, 0)
        return armed
    except (OSError, AttributeError):  # pragma: no cover - no libc / no prctl
        return False


def _watch(parent_pid: int, interval_s: float) -> None:
    import time

    while True:
        if os.getppid() != parent_pid:
            os._exit(1)  # the driver is gone: nobody will read this worker's result
        time.sleep(interval_s)


def die_with_parent(parent_pid: int, interval_s: float = 1.0) -> None:
    """Make this (worker) process end when the process ``parent_pid`` that started it ends.

    Parameters
    ----------
    parent_pid : int
        The driver's pid, as the driver saw it (``os.getpid()`` there).
    interval_s : float, default 1.0
        How often the watching thread checks the parent.

    Notes
    -----
    Linux: the parent-death signal (SIGKILL) acts at once; the watching thread is the fallback
    elsewhere (and covers a parent that died before the signal was set: this function then ends
    the process itself).
    """
    if isinstance(parent_pid, bool) or not isinstance(parent_pid, int) or parent_pid <= 0:
        raise ValueError(f"parent_pid must be a positive process id, got {parent_pid!r}")
    _parent_death_signal()
    if os.getppid() != parent_pid:  # died before the signal was armed
        os._exit(1)
    threading.Thread(target=_watch, args=(parent_pid, interval_s), name="pyrobdl-parent-watch",
                     daemon=True).start()


def stop_pool(pool: Any, timeout_s: float = 5.0) -> None:
    """Stop a :class:`concurrent.futures.ProcessPoolExecutor` now: cancel the cells not started and
    terminate the worker processes (their running cells are lost; they rerun next time).

    Parameters
    ----------
    pool : concurrent.futures.ProcessPoolExecutor
    timeout_s : float, default 5.0
        How long to wait for each worker to end after SIGTERM before SIGKILL.
    """
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
    for proc in processes:
        proc.join(timeout_s)
        if proc.is_alive():  # pragma: no cover - a worker ignoring SIGTERM
            proc.kill()
            proc.join(timeout_s)
