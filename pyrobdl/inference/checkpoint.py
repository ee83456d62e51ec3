r"""Checkpoints of long sampler runs: a killed run resumes where its last checkpoint left it.

A reference posterior can take hours of CPU (docs/results.md: ~1.5 h per certified wine split on
two cores) and the machines it runs on are shared, so a run must survive being killed.  A
:class:`SamplerCheckpoint` is one file holding the whole state of a sampler between two of its
iterations; the sampler writes it every ``every_s`` seconds and after its last iteration, and a
new run given the same file continues from it.  The contract, which ``tests/test_checkpoint.py``
proves for ``"chees"``: **a run resumed from a checkpoint gives the same draws and statistics,
to the bit, as the same run never interrupted** (on the same device, thread count and kernel:
those are not part of the run's identity, and another kernel changes only rounding).

The file is written atomically (a temporary file in the same folder, ``fsync``, ``os.replace``),
so a process killed while writing leaves the previous checkpoint whole; it records the run's
*identity* (the model, a hash of the data, the options that shape the chain) and a run with
another identity refuses it with an error naming every difference, before any work.  While a run
uses a checkpoint it holds an exclusive lock on ``<file>.lock`` (``flock``; the kernel drops it
when the process ends in any way), so two processes cannot write one checkpoint.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from .._io import WriteError, atomic_write_bytes, lock_exclusive
from .._saved import _jsonable, model_spec

__all__ = ["CheckpointError", "CheckpointLockedError", "SamplerCheckpoint", "run_identity"]

#: Version of the file's layout; a file of another version is refused.
FORMAT = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be used by this run (another run's, unreadable, or unwritable)."""


class CheckpointLockedError(CheckpointError):
    """Another process is using the checkpoint."""


def _data_hash(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def run_identity(model: Any, x: torch.Tensor, y: torch.Tensor, options: Mapping[str, Any],
                 exclude: Iterable[str] = ()) -> dict[str, Any]:
    """What a checkpoint must match to be resumed by a run: model, data, options, device type.

    Parameters
    ----------
    model : pyrobdl.BayesianMLP
    x, y : torch.Tensor
        The training data (hashed with their dtypes and shapes).
    options : Mapping
        The run's options; every one not in ``exclude`` must be equal (as JSON) to resume.
    exclude : iterable of str
        Options that do not change the chain (where the checkpoint is, how often it is written,
        the thread count, the kernel), or that the sampler reconciles itself.

    Returns
    -------
    dict
        JSON-serialisable.
    """
    skip = set(exclude)
    return {
        "model": model_spec(model),
        "data_sha256": _data_hash(x, y),
        "device_type": x.device.type,
        "options": {k: _jsonable(v) for k, v in sorted(options.items()) if k not in skip},
    }


def _differences(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    out = []
    for key in ("model", "data_sha256", "device_type"):
        if saved.get(key) != now.get(key):
            what = {"model": "the model", "data_sha256": "the training data",
                    "device_type": "the device type"}[key]
            detail = f" ({saved.get(key)} in the file, {now.get(key)} now)" if key == "device_type" else ""
            out.append(f"{what} differs{detail}")
    a, b = saved.get("options", {}), now.get("options", {})
    for name in sorted(set(a) | set(b)):
        if a.get(name, "<absent>") != b.get(name, "<absent>"):
            out.append(f"option {name}: {a.get(name, '<absent>')!r} in the file, {b.get(name, '<absent>')!r} now")
    return out


class SamplerCheckpoint:
    """One checkpoint file of one sampler run (a context manager holding its lock).

    Parameters
    ----------
    path : str or os.PathLike
        The checkpoint file (its folder is created when first written).
    identity : dict
        :func:`run_identity` of the run.
    every_s : float
        Seconds of wall time between two writes; 0 writes after every iteration.

    Raises
    ------
    CheckpointLockedError
        On entering, when another process holds the checkpoint's lock.
    CheckpointError
        On entering, when the lock file cannot be created (the folder is not writable).
    """

    def __init__(self, path: str | os.PathLike[str], identity: Mapping[str, Any], every_s: float) -> None:
        self.path = Path(path)
        self.identity = dict(identity)
        self.every_s = float(every_s)
        self.saves = 0
        self._last = time.monotonic()
        self._fd: int | None = None

    # ------------------------------------------------------------------------------ lock
    def __enter__(self) -> "SamplerCheckpoint":
        lock = self.path.with_name(self.path.name + ".lock")
        try:
            lock.parent.mkdir(parents=True, exist_ok=True)
            self._fd = lock_exclusive(lock)
        except BlockingIOError:
            raise CheckpointLockedError(
                f"checkpoint {self.path} is in use by another process; wait for it or pass another "
                "checkpoint path") from None
        except OSError as e:
            what = "create its lock file" if e.filename else "lock it"
            raise CheckpointError(f"checkpoint {self.path}: cannot {what}: {e.strerror or e}") from None
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None

    # ------------------------------------------------------------------------ read, write
    def load(self, device: torch.device) -> dict[str, Any] | None:
        """The saved state, its tensors on ``device``; None when there is no checkpoint yet.

        Raises
        ------
        CheckpointError
            When the file cannot be read, has another format, or was written by a run of
            another identity; the message names the file and every difference.
        """
        if not self.path.exists():
            return None
        try:
            blob = torch.load(self.path, map_location=device, weights_only=True)
        except Exception as e:  # truncated by a full disk, not a checkpoint at all, ...
            # torch's own message suggests weights_only=False, i.e. running code from the file: not here
            raise CheckpointError(f"checkpoint {self.path} cannot be read: not a pyrobdl checkpoint, or cut short "
                                  f"({type(e).__name__}); delete it to start afresh") from None
        if not isinstance(blob, dict) or blob.get("format") != FORMAT:
            got = blob.get("format") if isinstance(blob, dict) else type(blob).__name__
            raise CheckpointError(f"checkpoint {self.path} has format {got!r}, this pyrobdl writes {FORMAT}; "
                                  "delete it to start afresh")
        saved = json.loads(blob["identity"])
        diff = _differences(saved, self.identity)
        if diff:
            raise CheckpointError(f"checkpoint {self.path} belongs to another run: " + "; ".join(diff)
                                  + ". Pass the same settings to resume it, or another checkpoint path")
        return blob["state"]

    def due(self, final: bool = False) -> bool:
        """Whether to write now: ``every_s`` has passed since the last write, or ``final``."""
        return final or time.monotonic() - self._last >= self.every_s

    def save(self, state: Mapping[str, Any]) -> None:
        """Write ``state`` (tensors, numbers, strings, lists and dicts of them) atomically.

        Raises
        ------
        CheckpointError
            When the file cannot be written; the previous checkpoint is then unchanged.
        """
        buffer = io.BytesIO()
        torch.save({"format": FORMAT, "identity": json.dumps(self.identity), "state": dict(state)}, buffer)
        try:
            atomic_write_bytes(self.path, buffer.getvalue())
        except WriteError as e:
            raise CheckpointError(f"checkpoint {self.path}: cannot write it: {e.reason}") from None
        self.saves += 1
        self._last = time.monotonic()
