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

__all__ = ["LOCK_FILE", "FolderLockedError", "OutFolderError", "RunLock", "check_out_contents", "check_out_folder",
           "lock_exclusive"]

LOCK_FILE = ".pyrobdl.lock"


class FolderLockedError(ResultsError):
    """Another run holds the results folder's lock."""


class OutFolderError(ValueError):
    """The results folder cannot be created or written (a usage error: nothing was run)."""


#: Entries a results folder holds before its manifest (``cells.json``) is written.
_EARLY_ENTRIES = frozenset({"cells", "checkpoints", LOCK_FILE, "suite.toml"})
_MAX_NAME = 255  # bytes in one path component (Linux, macOS)


def _lock_content(path: Path) -> str:
    """``"absent"``, ``"ours"`` (empty, or a pyrobdl lock record) or ``"foreign"`` (anything else,
    a symbolic link or a folder included): a foreign file is never opened for writing."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return "absent"
    except OSError:
        return "foreign"  # a symbolic link (ELOOP), a fifo, no permission to read
    try:
        import stat

        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return "foreign"
        head = os.read(fd, 4097)
    except OSError:
        return "foreign"
    finally:
        os.close(fd)
    if not head.strip():
        return "ours"  # the released lock of an earlier version; nothing to lose
    try:
        info = json.loads(head.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return "foreign"
    ours = isinstance(info, dict) and (info.get("pyrobdl") == "run lock" or {"pid", "host", "run"} <= set(info))
    return "ours" if ours else "foreign"


def _manifest_is_ours(path: Path) -> bool:
    try:
        doc = json.loads(path.read_bytes()[:1 << 26].decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False
    return isinstance(doc, dict) and isinstance(doc.get("schema"), str) and doc["schema"].startswith("pyrobdl.cells/")


def _check_out_name(out: str | Path) -> Path:
    text = os.fspath(out)
    if not isinstance(text, str) or not text.strip():
        raise OutFolderError("--out is empty: name the results folder (a new or empty folder, or an earlier "
                             "pyrobdl results folder to resume); the current folder is never used implicitly")
    if "\0" in text:
        raise OutFolderError("--out contains a NUL character: name the results folder with an ordinary path")
    for part in Path(text).parts:
        size = len(os.fsencode(part))
        if size > _MAX_NAME:
            raise OutFolderError(f"--out {text[:60]}...: the name {part[:40]!r}... is {size} bytes long; a folder "
                                 f"name can be at most {_MAX_NAME} bytes: use a shorter --out")
    return Path(text)


def check_out_contents(out: str | Path) -> Path:
    """Refuse an ``--out`` that would overwrite or empty what a user wrote, before any work.

    ``out`` must be absent, an empty folder, or a pyrobdl results folder: one with a pyrobdl
    manifest ``cells.json``, or (a run stopped before writing it) holding only pyrobdl's own
    entries (``cells/``, ``checkpoints/``, the lock file and the suite's copy next to a pyrobdl
    lock).  Nothing is created.

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
        If ``out`` is empty (``''``), a name too long for the file system, a file, or a folder
        with files pyrobdl did not write (the message names a few of them); exit status 2.
    ResultsError
        If ``out`` is a pyrobdl results folder (its lock file and ``cells/`` are pyrobdl's) whose
        manifest ``cells.json`` is damaged; exit status 3.
    """
    out = _check_out_name(out)
    try:
        if not out.exists():
            return out
        if not out.is_dir():
            raise OutFolderError(f"--out {out}: exists and is not a folder")
        names = sorted(p.name for p in out.iterdir())
    except OSError as e:
        raise OutFolderError(f"--out {out}: cannot read it: {e.strerror or e}") from None
    if not names:
        return out
    lock = _lock_content(out / LOCK_FILE)
    if lock == "foreign":
        raise OutFolderError(f"--out {out}: it holds a file named {LOCK_FILE} that pyrobdl did not write; pyrobdl "
                             "will not touch it: use another --out (a new or empty folder)")
    if "cells.json" in names:
        if _manifest_is_ours(out / "cells.json"):
            return out
        if lock == "ours" and (out / "cells").is_dir():
            raise ResultsError(f"results folder {out}: its manifest {out / 'cells.json'} is damaged (not a pyrobdl "
                               "manifest): restore it, or use another --out")
    elif set(names) <= _EARLY_ENTRIES and ("suite.toml" not in names or lock == "ours"):
        return out
    foreign = [n for n in names if n not in _EARLY_ENTRIES] or names
    shown = ", ".join(repr(n) for n in foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
    raise OutFolderError(f"--out {out}: not empty and not a pyrobdl results folder (it holds {shown}); pyrobdl "
                         "writes only into a new or empty folder, or into its own results folder to resume: "
                         "use another --out")


def check_out_folder(out: str | Path) -> Path:
    """Check ``out`` (:func:`check_out_contents`), create it if needed and make sure files can be
    created in it, before any work.

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
        If ``out`` is refused by :func:`check_out_contents`, lies inside a file, or cannot be
        created or written (read-only file system, no permission); the message names the folder
        and the reason.
    ResultsError
        A pyrobdl results folder with a damaged manifest.
    """
    out = check_out_contents(out)
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
        if _lock_content(self.path) == "foreign":
            raise OutFolderError(f"--out {self.path.parent}: it holds a file named {LOCK_FILE} that pyrobdl did not "
                                 "write; pyrobdl will not touch it: use another --out (a new or empty folder)")
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
        info = json.dumps({"pyrobdl": "run lock", "pid": os.getpid(), "host": socket.gethostname(), "run": self.run_id,
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
            try:  # released: still recognisably pyrobdl's file (an empty one could be anybody's)
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps({"pyrobdl": "run lock", "held": False}).encode() + b"\n", 0)
            except OSError:
                pass
            os.close(fd)  # closing the descriptor releases the flock
