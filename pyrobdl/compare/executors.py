r"""Executors: how the independent cells of a grid are run.

The runner hands an executor a picklable function and a list of picklable tasks and reads back
results as they finish; it never needs to know where the work happened.  A task returns its
cell's record and the bytes of its files; the runner's process alone writes them into the results
folder (atomically, with checksums, under the folder's lock), so a worker never needs the results
folder at all.

* :class:`InProcessExecutor` (default): one cell after the other in this process, with live
  per-cell progress bars.
* :class:`FuturesExecutor`: any :class:`concurrent.futures.Executor` — a local
  ``ProcessPoolExecutor``, or a distributed engine's futures interface (Dask's
  ``distributed.Client.get_executor()``, ...).  Nothing in the runner changes.
* :class:`~pyrobdl.compare.ray_executor.RayExecutor` (``pip install "pyrobdl[ray]"``): each cell a
  Ray task with its declared CPU and (fractional) GPU resources, retried when its worker dies.
"""

from __future__ import annotations

import concurrent.futures as cf
import concurrent.futures.process  # noqa: F401  (cf.process.BrokenProcessPool)
from typing import Callable, Iterator, Protocol, Sequence, TypeVar, runtime_checkable

__all__ = ["Executor", "FuturesExecutor", "InProcessExecutor"]

T = TypeVar("T")
R = TypeVar("R")


@runtime_checkable
class Executor(Protocol):
    """Runs ``fn`` on every task and yields the results in completion order.

    Implementations must call ``fn(task)`` exactly once per task (in any process or machine)
    and yield every return value; ``fn`` handles its own errors and always returns.
    """

    #: Whether cells run in this process (so per-cell progress bars can be shown).
    in_process: bool

    def map_unordered(self, fn: Callable[[T], R], tasks: Sequence[T],
                      on_crash: Callable[[T, str], R] | None = None) -> Iterator[R]:
        """Yield ``fn(task)`` for each task as it completes.

        ``on_crash(task, message)`` gives the result of a task whose worker died and could not
        be retried, for executors that can tell (a distributed one); the others raise.
        """
        ...

    def in_flight(self) -> int:
        """Tasks started and not yet returned (for the progress bar)."""
        ...


class InProcessExecutor:
    """Run cells sequentially in the calling process (the default)."""

    in_process = True

    def __init__(self) -> None:
        self._running = 0

    def map_unordered(self, fn: Callable[[T], R], tasks: Sequence[T],
                      on_crash: Callable[[T, str], R] | None = None) -> Iterator[R]:
        for task in tasks:
            self._running = 1
            try:
                result = fn(task)
            finally:
                self._running = 0
            yield result

    def in_flight(self) -> int:
        return self._running


class FuturesExecutor:
    """Run cells on a :class:`concurrent.futures.Executor`.

    Parameters
    ----------
    pool : concurrent.futures.Executor
        E.g. ``ProcessPoolExecutor(max_workers=4)`` or a distributed engine's futures
        executor.  It is not shut down here; the caller owns it.

    Notes
    -----
    Tasks and ``fn`` must be picklable for process or remote pools; the runner's are (plain
    dataclasses and a module-level function).
    """

    in_process = False

    def __init__(self, pool: cf.Executor) -> None:
        if not isinstance(pool, cf.Executor):
            raise TypeError(f"pool must be a concurrent.futures.Executor, got {type(pool).__name__}")
        self.pool = pool
        self._futures: list[cf.Future] = []
        #: Why the pool broke (a worker process died), once it has: it is never submitted to again.
        self.broken: str | None = None

    def _not_run(self, tasks: Sequence[T], on_crash: Callable[[T, str], R] | None) -> Iterator[R]:
        """The results of tasks never submitted because the pool broke (in this stage or an earlier one)."""
        if on_crash is None:
            raise cf.process.BrokenProcessPool(self.broken)
        for t in tasks:
            yield on_crash(t, f"not run: the worker pool broke earlier in this run ({self.broken}); "
                              "rerun the same command to run it")

    def map_unordered(self, fn: Callable[[T], R], tasks: Sequence[T],
                      on_crash: Callable[[T, str], R] | None = None) -> Iterator[R]:
        if self.broken is not None:  # a broken pool is never reused: every later stage's cells fail, rerun later
            yield from self._not_run(tasks, on_crash)
            return
        futures: dict[cf.Future, T] = {}
        for i, t in enumerate(tasks):
            try:
                futures[self.pool.submit(fn, t)] = t
            except cf.process.BrokenProcessPool as err:  # broke between stages, or while submitting
                self.broken = f"a worker process died: {err}"  # those submitted before fail below
                yield from self._not_run(tasks[i:], on_crash)
                break
        self._futures = list(futures)
        try:
            for fut in cf.as_completed(futures):
                try:
                    result = fut.result()
                except cf.process.BrokenProcessPool as err:
                    # a worker process died (killed, out of memory, a crash in native code): the
                    # pool is unusable, so every task not finished yet ends here too
                    self.broken = f"a worker process died: {err}"
                    if on_crash is None:
                        raise
                    result = on_crash(futures[fut], "a worker process of the pool died (killed, out of memory "
                                      f"or a crash in native code) before this cell finished: {err}")
                yield result
        finally:
            for fut in futures:
                fut.cancel()
            self._futures = []

    def in_flight(self) -> int:
        return sum(f.running() for f in self._futures)
