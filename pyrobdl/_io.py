r"""Shared file I/O below every layer: atomic writes, checksums, exclusive locks.

The sampler's checkpoints (:mod:`pyrobdl.inference.checkpoint`) and the comparison suite's
results folder (:mod:`pyrobdl.compare.store`, :mod:`pyrobdl.compare.lock`) both write files that
must survive a process killed at any moment, and both lock what one process owns.  The functions
live here, at the bottom of the package (docs/architecture.md), so that neither has to import the
other; :mod:`pyrobdl.compare.store` and :mod:`pyrobdl.compare.lock` re-export them under their
old names.

Every file is serialised in memory, written to a temporary name in the same folder
(``.<name>.tmp-<run>-<pid>-<random>``: the run that owns it is in its name), flushed to disk, then
renamed with :func:`os.replace`, which is atomic on POSIX and Windows.  A write that fails (a full
disk, an I/O error, a permission) raises :class:`WriteError` naming the file; nothing
half-written is renamed into place.
"""

from __future__ import annotations

import errno
import hashlib
import os
import uuid
from pathlib import Path
from typing import Any, Callable

__all__ = ["WriteError", "atomic_write", "atomic_write_bytes", "file_sha256", "lock_exclusive", "new_run_id"]


class WriteError(RuntimeError):
    """Writing a file failed (disk full, I/O error, no permission).

    Parameters
    ----------
    path : str
        The file that could not be written.
    reason : str
        The operating system's error, e.g. ``"[Errno 28] No space left on device"``.
    """

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(str(path), str(reason))
        self.path, self.reason = str(path), str(reason)

    def __str__(self) -> str:
        return f"cannot write {self.path}: {self.reason}"


def new_run_id() -> str:
    """A fresh run id (``r`` + 12 hex digits); temporary files carry the id of their run."""
    return "r" + uuid.uuid4().hex[:12]


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's bytes (read in 1 MiB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open folders; the rename itself is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes, *, owner: str | None = None) -> str:
    """Write ``data`` to ``path`` atomically and durably; return its SHA-256.

    Parameters
    ----------
    path : pathlib.Path
        Destination (its folder is created).
    data : bytes
        The complete contents.
    owner : str, optional
        Run id (:func:`new_run_id`) that owns the temporary file; default a fresh one.

    Raises
    ------
    WriteError
        If any step fails (the folder cannot be created, the disk is full, an I/O or permission
        error); the message names ``path``.  The destination is then unchanged.
    """
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp-{owner or new_run_id()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as e:
        raise WriteError(str(path), f"[Errno {e.errno}] {e.strerror or e}" if e.errno else str(e)) from e
    finally:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        except OSError:  # a read-only or vanished folder: nothing more to clean up
            pass
    return hashlib.sha256(data).hexdigest()


def atomic_write(path: Path, writer: Callable[[Path], Any], *, owner: str | None = None) -> Path:
    """Create ``path`` atomically: ``writer(tmp)`` writes a temporary file that is then renamed.

    Prefer :func:`atomic_write_bytes` for anything whose serialiser can write to memory: a library
    writing a file itself may fail in ways that are not exceptions.

    Parameters
    ----------
    path : pathlib.Path
        Destination.
    writer : callable
        ``writer(tmp_path)`` writes the complete file at ``tmp_path`` (same folder).
    owner : str, optional
        Run id that owns the temporary file.

    Returns
    -------
    pathlib.Path
        ``path``.

    Raises
    ------
    WriteError
        If writing, flushing or renaming fails with an ``OSError`` (naming ``path``).
    """
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp-{owner or new_run_id()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        writer(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as e:
        raise WriteError(str(path), f"[Errno {e.errno}] {e.strerror or e}" if e.errno else str(e)) from e
    finally:
        try:
            tmp.unlink()
        except OSError:
            pass
    return path


def lock_exclusive(path: str | Path) -> int:
    """Open (creating) ``path`` and take an exclusive, non-blocking :func:`fcntl.flock` on it.

    Returns
    -------
    int
        The open descriptor; closing it releases the lock (the kernel also does when the process
        ends in any way).  Without :mod:`fcntl` (Windows) the descriptor holds no lock.

    Raises
    ------
    BlockingIOError
        When another process holds the lock (nothing stays open).
    OSError
        When the file cannot be created or locked; ``filename`` is None for a failed lock.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: no flock
        return fd
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise BlockingIOError(e.errno, e.strerror) from None
        raise
    return fd
