r"""Executors: how the independent cells of a grid are run.

The runner hands an executor a picklable function and a list of picklable tasks and reads back
outcomes as they finish; it never needs to know where the work happened.  Each task writes its
own results (atomically) into the results folder, so a remote worker only needs that folder on
a shared file system, and the outcome it returns is a small summary.

* :class:`InProcessExecutor` (default): one cell after the other in this process, with live
  per-cell progress bars.
* :class:`FuturesExecutor`: any :class:`concurrent.futures.Executor` — a local
  ``ProcessPoolExecutor``, or a distributed engine's futures interface (Dask's
  ``distributed.Client.get_executor()``, Ray's ``ray.util.multiprocessing.Pool`` through its
  ``concurrent.futures`` adapter, ...).  Nothing in the runner changes.
"""

from __future__ import annotations

import concurrent.futures as cf
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

    def map_unordered(self, fn: Callable[[T], R], tasks: Sequence[T]) -> Iterator[R]:
        """Yield ``fn(task)`` for each task as it completes."""
        ...


class InProcessExecutor:
    """Run cells sequentially in the calling process (the default)."""

    in_process = True

    def map_unordered(self, fn: Callable[[T], R], tasks: Sequence[T]) -> Iterator[R]:
        for task in tasks:
            yield fn(task)


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

    def map_unordered(self, fn: Callable[[T], R], tasks: Sequence[T]) -> Iterator[R]:
        futures = [self.pool.submit(fn, t) for t in tasks]
        try:
            for fut in cf.as_completed(futures):
                yield fut.result()
        finally:
            for fut in futures:
                fut.cancel()
