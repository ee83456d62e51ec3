"""The ``pyrobdl`` command line: ``compare``, ``report``, ``methods``.

Exit status (every command):

====  ==========================================================================
0     success
1     ``compare``: the run finished but at least one cell failed (see its record)
2     usage error: bad arguments, an invalid suite file, ``--only`` filter or device, an
      ``--out`` folder that cannot be created or written, or one another run is writing into;
      nothing was run
3     results folder problem: corrupt or stale records (``compare``; see
      ``--rerun-invalid``), no results to report or a corrupt cell (``report``)
4     ``compare``: a file could not be written (disk full, I/O or permission error); the
      run stopped, finished cells are kept, the message names the file
130   interrupted (Ctrl-C or SIGTERM); finished cells are kept and a rerun resumes; worker
      processes end with the run (also when it is killed: they watch their driver)
====  ==========================================================================
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

__all__ = ["EXIT_CODES", "main"]

#: Exit status by meaning (documented in ``pyrobdl --help`` and docs/compare.md).
EXIT_CODES = {"ok": 0, "cells_failed": 1, "usage": 2, "results": 3, "write_failed": 4, "interrupted": 130}

_EPILOG = """exit status:
  0    success
  1    compare: at least one cell failed (its error is in its result.json and the report)
  2    usage error: bad arguments, invalid suite, --only filter or device, unusable --out,
       --out in use by another run (nothing ran)
  3    results folder problem: corrupt/stale records (compare), no results or a corrupt
       cell (report)
  4    compare: a file could not be written (disk full, I/O, permission); finished cells kept
  130  interrupted (Ctrl-C, SIGTERM); finished cells are kept, rerunning resumes
"""


def _parser() -> argparse.ArgumentParser:
    from . import __version__

    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="pyrobdl", formatter_class=fmt, epilog=_EPILOG,
        description="Compare Bayesian-neural-network inference methods: run suites, build reports.",
    )
    parser.add_argument("--version", action="version", version=f"pyrobdl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "compare", formatter_class=fmt, epilog=_EPILOG,
        help="run (or resume) a comparison suite",
        description="Run every cell (dataset x split x method x seed) of a suite, or the ones not yet done "
                    "in --out. Each finished cell is written atomically to OUT/cells/<cell>/; rerunning the "
                    "same command resumes. Reference cells run first.",
    )
    p.add_argument("suite", metavar="SUITE.toml", help="suite file (see docs/compare.md)")
    p.add_argument("--out", required=True, metavar="DIR", help="results folder (created; reused to resume)")
    p.add_argument("--data-dir", metavar="D", help="datasets root (containing uci/, mnist/); "
                   "default: the suite's data_dir, else $PYROBDL_DATA_DIR")
    p.add_argument("--device", metavar="D", help="torch device for every fit, e.g. cpu, cuda, cuda:1 "
                   "(default: the suite's device, else cpu)")
    p.add_argument("--only", metavar="KEY=VAL,...", help="run only matching cells (keys: dataset, method, "
                   "split, seed; repeat a key to allow several values); their reference cells are added")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="run N cells at a time in worker processes (default 1: in this process)")
    p.add_argument("--executor", choices=("local", "ray"), default="local",
                   help="where cells run: 'local' (this machine: in this process, or --workers processes) "
                        "or 'ray' (each cell a Ray task; needs pip install \"pyrobdl[ray]\"; see docs/compare.md)")
    p.add_argument("--ray-address", metavar="ADDR", help="join a running Ray cluster (e.g. 'auto', or "
                   "ray://host:10001); default: start a local Ray using this machine's cores")
    p.add_argument("--ship-data", action="store_true", help="with --executor ray: load each dataset split "
                   "here and ship it to the workers through Ray's object store (for workers that cannot see "
                   "the data directory; default: workers read it from the data directory)")
    p.add_argument("--max-retries", type=int, metavar="N", help="with --executor ray: run a cell again up to N "
                   "times when its worker process dies (default 2); then it is recorded failed and reruns next time")
    p.add_argument("--threads", type=int, metavar="N", help="torch CPU threads per fit (default: "
                   "fit's 'auto': 1 for small networks, else the cores the load leaves idle)")
    p.add_argument("--rerun-invalid", action="store_true", help="set corrupt or stale result files "
                   "aside (renamed *.invalid-<time>) and rerun their cells instead of stopping")
    p.add_argument("--dry-run", action="store_true", help="validate and list the cells and their state; run nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (log lines only)")
    p.add_argument("--report", action="store_true", help="then build DIR's report, as `pyrobdl report DIR` does, in "
                   "this process (saves a second start-up and its imports, ~2 CPU s); also when cells failed")

    r = sub.add_parser("report", formatter_class=fmt, epilog=_EPILOG, help="build report.html and report.md",
                       description="Write DIR/report.html (self-contained: figures embedded, no network) and "
                                   "DIR/report.md from the stored results in DIR; nothing is refitted.")
    r.add_argument("dir", metavar="DIR", help="results folder written by `pyrobdl compare`")
    r.add_argument("--title", help="page title (default: names the suite)")

    m = sub.add_parser("methods", formatter_class=fmt, epilog=_EPILOG,
                       help="list the registered inference methods with their options and defaults",
                       description="List every method of the registry, its summary, and each option with its default.")
    m.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def _err(message: str) -> None:
    print(f"pyrobdl: error: {message}", file=sys.stderr)


def _cmd_methods(args: argparse.Namespace) -> int:
    # the static copy of the registry: listing names must not import torch (tests keep them equal)
    from .method_catalog import COMMON_OPTIONS, METHODS

    table = {name: {"summary": summary, "options": dict(options)} for name, (summary, options) in METHODS.items()}
    if args.json:
        print(json.dumps(table, indent=1, default=str))
        return 0
    for name, info in table.items():
        print(f"{name}: {info['summary']}")
        width = max((len(k) for k in info["options"]), default=0)
        for key, default in info["options"].items():
            print(f"    {key:<{width}} = {default!r}")
    print(f"\nEvery method also takes {', '.join(COMMON_OPTIONS)} (set by the suite and the command line).")
    return 0


def _init_worker(threads: int | None, parent_pid: int | None = None) -> None:
    """Set up a worker process of ``--workers``: it ends with the driver ``parent_pid``; torch's thread count."""
    if parent_pid is not None:
        from .compare.workers import die_with_parent

        die_with_parent(parent_pid)
    if threads is not None:
        import torch

        from .inference.registry import DEFAULTS

        torch.set_num_threads(threads)
        DEFAULTS["threads"] = threads  # fit's default: this count for every cell


def _cap_workers(workers: int, cells: int) -> int:
    """``--workers`` capped at the number of cells; a warning when above the machine's cores."""
    import os

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    capped = max(1, min(workers, cells))
    if capped < workers:
        print(f"pyrobdl: note: --workers {workers} capped at {capped}, the number of cells", file=sys.stderr)
    if capped > cores:
        print(f"pyrobdl: warning: --workers {capped} is more than the {cores} CPU core(s) available: each worker "
              "is a process with its own copy of torch, and they compete for the cores", file=sys.stderr)
    return capped


def _cmd_compare(args: argparse.Namespace) -> int:
    from .compare import ConfigError, ResultsError, load_suite
    from .compare.grid import expand, parse_only, select

    problem = _compare_flag_problem(args)
    if problem:
        _err(problem)
        return 2
    if args.threads is not None:
        _set_threads(args.threads)
    try:
        suite = load_suite(args.suite)
        only = parse_only(args.only)
        if args.workers > 1:
            args.workers = _cap_workers(args.workers, len(select(expand(suite, args.data_dir or suite.data_dir), only)))
        if args.dry_run:
            return _dry_run(suite, args, only)
    except FileNotFoundError as e:
        _err(str(e))
        return 2
    except (ConfigError, ValueError, TypeError) as e:
        _err(str(e))
        return 2
    except ResultsError as e:
        _err(str(e))
        return 3
    try:
        executor, pool = _compare_executor(args)
    except (ConnectionError, RuntimeError, ValueError) as e:
        if args.executor != "ray":
            raise
        _err(f"cannot start or join Ray{' at ' + args.ray_address if args.ray_address else ''}: {e}")
        return 2
    summary = _run_compare(suite, args, only, executor, pool)
    if isinstance(summary, int):
        return summary
    print(
        f"{suite.name}: {len(summary.ok)} cell(s) ran ok, {len(summary.failed)} failed, "
        f"{len(summary.skipped)} already done; {summary.wall_time_s:.1f} s; results in {summary.out}"
    )
    for cid, error in summary.errors.items():
        print(f"  failed: {cid}: {error}", file=sys.stderr)
    status = 0 if summary.success else 1
    if args.report:  # a failed report's own status wins: the run's is printed above
        return _build_report(args.out, None) or status
    return status


def _compare_flag_problem(args: argparse.Namespace) -> str | None:
    """The first problem with ``compare``'s flags by themselves (before the suite is read), or None."""
    if args.workers < 1:
        return f"--workers must be >= 1, got {args.workers}"
    if args.executor == "ray" and args.workers != 1:
        return ("--workers is for --executor local; with --executor ray the cluster's resources decide how many "
                "cells run at once (see the suite's per-method resources)")
    if args.executor != "ray" and (args.ray_address or args.ship_data or args.max_retries is not None):
        flag = "--ray-address" if args.ray_address else "--ship-data" if args.ship_data else "--max-retries"
        return f"{flag} needs --executor ray"
    if args.max_retries is not None and args.max_retries < 0:
        return f"--max-retries must be >= 0, got {args.max_retries}"
    if args.executor == "ray":
        try:
            import ray  # noqa: F401
        except ImportError:
            return '--executor ray needs Ray: pip install "pyrobdl[ray]"'
    if args.threads is not None and args.threads < 1:
        return f"--threads must be >= 1, got {args.threads}"
    if args.report and args.dry_run:
        return "--report needs a run: with --dry-run nothing runs (use `pyrobdl report DIR` for results already there)"
    return None


def _set_threads(threads: int) -> None:
    """``--threads``: torch's thread count here, and ``fit``'s default for every cell."""
    import torch

    from .inference.registry import DEFAULTS

    torch.set_num_threads(threads)
    DEFAULTS["threads"] = threads


def _compare_executor(args: argparse.Namespace) -> tuple[Any, Any]:
    """The executor ``--executor``/``--workers`` ask for, and the pool to shut down afterwards (or None).

    Raises what :class:`~pyrobdl.compare.ray_executor.RayExecutor` raises when Ray cannot start or be joined.
    """
    from .compare.executors import FuturesExecutor, InProcessExecutor

    if args.executor == "ray":
        from .compare.ray_executor import RayExecutor

        retries = {} if args.max_retries is None else {"max_retries": args.max_retries}
        executor = RayExecutor(args.ray_address, **retries)
        return executor, executor
    if args.workers > 1:
        import concurrent.futures as cf
        import multiprocessing as mp
        import os

        # --threads applies to every worker too: torch's thread count is per process
        pool = cf.ProcessPoolExecutor(max_workers=args.workers, mp_context=mp.get_context("spawn"),
                                      initializer=_init_worker, initargs=(args.threads, os.getpid()))
        return FuturesExecutor(pool), pool
    return InProcessExecutor(), None


def _run_compare(suite: Any, args: argparse.Namespace, only: Any, executor: Any, pool: Any) -> Any:
    """``run_suite`` with ``compare``'s flags; its summary, or the exit code of what stopped it."""
    from .compare import ConfigError, ResultsError, run_suite
    from .compare.lock import FolderLockedError
    from .compare.store import WriteError

    finished = False
    previous_term = _raise_on_sigterm()
    try:
        summary = run_suite(
            suite, args.out, data_dir=args.data_dir, device=args.device, only=only, executor=executor,
            progress=not args.no_progress, rerun_invalid=args.rerun_invalid,
            log=(lambda line: print(line, flush=True)) if args.no_progress else None,
            ship_data=args.ship_data, threads=args.threads,
        )
        finished = True
        return summary
    except (ConfigError, ValueError, FolderLockedError) as e:
        _err(str(e))
        return 2
    except ResultsError as e:
        _err(str(e))
        return 3
    except WriteError as e:
        _err(f"{e}; the run stopped. Cells finished before are kept; free space (or fix the permission) "
             "and rerun the same command to resume")
        return 4
    except KeyboardInterrupt:
        _err("interrupted; finished cells are kept, rerun the same command to resume (chees cells run "
             "in this process resume from their last checkpoint)")
        return 130
    finally:
        _shut_down(pool, finished)
        if previous_term is not None:
            import signal

            signal.signal(signal.SIGTERM, previous_term)


def _shut_down(pool: Any, finished: bool) -> None:
    """Close what :func:`_compare_executor` started: a local pool waits for its cells only if the run
    finished (stopped by an error, Ctrl-C or SIGTERM it does not); a Ray started here is shut down, a
    joined cluster left alone."""
    if isinstance(pool, _cf_executor_type()):
        if finished:
            pool.shutdown(cancel_futures=True)
        else:
            from .compare.workers import stop_pool

            stop_pool(pool)
    elif pool is not None:
        pool.shutdown()


#: ``--dry-run``'s label of each stored state (pyrobdl.compare.store.cell_state) and what ``compare`` does with it.
_DRY_RUN_LABELS = {
    "missing": ("new", "runs"),
    "ok": ("done", "kept"),
    "failed": ("failed", "runs again"),
    "stale": ("stale", "configuration changed: stops the run unless --rerun-invalid sets it aside"),
    "stale_reference": ("stale", "its reference changed: runs again"),
    "incomplete": ("stale", "runs again"),
    "corrupt": ("damaged", "stops the run unless --rerun-invalid sets it aside"),
    "damaged": ("damaged", "runs again"),
}


def _dry_run(suite: Any, args: argparse.Namespace, only: Any) -> int:
    """``compare --dry-run``: validate, then list every cell as new, done, failed, stale or damaged."""
    from pathlib import Path

    from .compare.grid import check_plan, describe, expand, matches, select
    from .compare.lock import check_out_contents
    from .compare.store import cell_state

    cells = select(expand(suite, args.data_dir or suite.data_dir), only)
    check_plan(suite, cells, args.data_dir or suite.data_dir)
    check_out_contents(args.out)  # what a run would refuse, refused here too (nothing created)
    print(f"{suite.name}: {describe(cells, only)}")
    counts: dict[str, int] = {}
    for c in cells:
        state, why = cell_state(Path(args.out) / "cells" / c.id, c.config_hash, c.reference is not None)
        label, action = _DRY_RUN_LABELS.get(state, (state, ""))
        counts[label] = counts.get(label, 0) + 1
        role = " (reference, added by --only)" if only and not matches(c, only) else " (reference)" if (
            c.is_reference or c.is_replicate) else ""
        detail = "; ".join(x for x in (action if label not in ("new", "done") else "", why) if x)
        print(f"  {label:8s} {c.id}{role}{': ' + detail if detail else ''}")
    print("  " + ", ".join(f"{n} {label}" for label, n in counts.items())
          + f"; compare would run {len(cells) - counts.get('done', 0)} cell(s)")
    return 0


def _raise_on_sigterm() -> Any:
    """SIGTERM stops ``compare`` as Ctrl-C does (exit 130, worker processes and a Ray started here
    stopped, the lock released); returns the previous handler (None off the main thread)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    return signal.signal(signal.SIGTERM, handler)


def _cf_executor_type() -> type:
    import concurrent.futures as cf

    return cf.Executor


def _cmd_report(args: argparse.Namespace) -> int:
    return _build_report(args.dir, args.title)


def _build_report(out: str, title: str | None) -> int:
    """``pyrobdl report`` of ``out`` (also ``compare --report``); the exit status."""
    from .compare import ResultsError
    from .compare.store import WriteError
    from .report import build_report

    try:
        files = build_report(out, title=title)
    except ResultsError as e:
        _err(str(e))
        return 3
    except WriteError as e:
        _err(str(e))
        return 4
    print(f"wrote {files.html} and {files.markdown} ({files.cells} cells, {files.failed} failed)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pyrobdl`` console script; returns the exit status (see module docstring)."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help/--version exit 0, usage errors exit 2
        return int(e.code or 0)
    if args.command is None:
        parser.print_help()
        return 2
    handlers = {"compare": _cmd_compare, "report": _cmd_report, "methods": _cmd_methods}
    try:
        return handlers[args.command](args)
    except KeyboardInterrupt:
        _err("interrupted")
        return 130
    except BrokenPipeError:  # output piped into e.g. `head`: not an error of ours
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
