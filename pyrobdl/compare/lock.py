r"""One writer per results folder: the run lock, and the checks on ``--out`` made before any work.

A run takes an exclusive :func:`fcntl.flock` on ``OUT/.pyrobdl.lock`` for its whole duration and
writes its pid, host and run id into the file.  A second run on the same folder fails at once
with :class:`FolderLockedError`, naming the folder and the holder's pid.  The kernel drops the lock
when the holding process ends in any way (``kill -9`` included), so a stale lock needs no manual
step: the lock file stays, but nobody holds it, and the next run takes it.

Not guaranteed: ``flock`` on a network file system (NFS, SMB, some FUSE mounts) may lock only
within one machine, or not at all; runs on several machines must not share a results folder
(docs/compare.md).  On platforms without :mod:`fcntl` (Windows) no lock is taken.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

from .._io import lock_exclusive
from .store import ResultsError

__all__ = ["LOCK_FILE", "FolderLockedError", "OutFolderError", "RunLock", "check_out_folder", "lock_exclusive"]

LOCK_FILE = ".pyrobdl.lock"


class FolderLockedError(ResultsError):
    """Another run holds the results folder's lock."""


class OutFolderError(ValueError):
    """The results folder cannot be created or written (a usage error: nothing was run)."""


def check_out_folder(out: str | Path) -> Path:
    """Create ``out`` if needed and make sure files can be created in it, before any work.

    Parameters
    ----------
    out : str or pathlib.Path
        The results folder.

    Returns
    -------
    pathlib.Path

    Raises
    ------
    OutFolderError
        If ``out`` is a file, lies inside a file, or cannot be created or written (read-only
        file system, no permission); the message names the folder and the reason.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OutFolderError(f"--out {out}: exists and is not a folder")
    try:
        (out / "cells").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        why = "a parent is not a folder" if e.errno in (errno.ENOTDIR, errno.EEXIST) else (e.strerror or str(e))
        raise OutFolderError(f"--out {out}: cannot create it: {why}") from None
    probe = out / "cells" / f".write-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise OutFolderError(f"--out {out}: cannot write in it: {e.strerror or e}") from None
    return out


class RunLock:
    """The exclusive lock of a results folder, held by one run (a context manager).

    Parameters
    ----------
    out : str or pathlib.Path
        The results folder (must exist).
    run_id : str
        The id of the run taking the lock (written into the lock file).

    Raises
    ------
    FolderLockedError
        On entering, if another process holds the lock; the message names the folder and the
        holder's pid (and host).
    OutFolderError
        If the lock file cannot be created.
    """

    def __init__(self, out: str | Path, run_id: str) -> None:
        self.path = Path(out) / LOCK_FILE
        self.run_id = run_id
        self._fd: int | None = None

    def holder(self) -> dict[str, Any]:
        """What the lock file says about its holder (empty when unreadable)."""
        try:
            info = json.loads(self.path.read_text()[:4096])
        except (OSError, ValueError):
            return {}
        return info if isinstance(info, dict) else {}

    def __enter__(self) -> "RunLock":
        try:
            import fcntl  # noqa: F401
        except ImportError:  # pragma: no cover - Windows: no flock
            return self
        try:
            fd = lock_exclusive(self.path)
        except BlockingIOError:
            h = self.holder()
            who = f"pid {h.get('pid', '?')}" + (f" on {h['host']}" if h.get("host") else "")
            since = f" since {h['started']}" if h.get("started") else ""
            raise FolderLockedError(
                f"results folder {self.path.parent} is in use by another pyrobdl run ({who}{since}); "
                "wait for it to finish or use another --out") from None
        except OSError as e:
            what = "create its lock file" if e.filename else "lock it"
            raise OutFolderError(f"--out {self.path.parent}: cannot {what}: {e.strerror or e}") from None
        info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "run": self.run_id,
                           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, info.encode() + b"\n", 0)
        except OSError:  # the lock is held; the holder's description is only informative
            pass
        self._fd = fd
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.ftruncate(fd, 0)
            except OSError:
                pass
            os.close(fd)  # closing the descriptor releases the flock
