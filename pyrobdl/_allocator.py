r"""Keep freed heap memory in the process, so that hot loops stop paying page faults (glibc only).

The compiled log joint allocates its activations afresh on every call — at wine's reference
shape (64 chains, 1,439 rows, 50 units) an 18 MB buffer — and frees them before it returns.
glibc's ``malloc`` serves a block that size with its own ``mmap``, or trims it off the top of the
heap when it is freed, so the next call faults every page back in, zero-filled by the kernel; its
adaptive threshold, which would keep such blocks on the heap, held only some of the time with the
compiled graph's pattern of allocations.  Measured on a short chees fit at wine's reference
shape: 736–1,385 minor page faults per call and 12–20% of the process's time in the kernel, **1.34×
the CPU per chain-gradient** (136.2 against 101.9 µs, the same chains;
``comparisons/benchmarks/malloc_faults.py``, docs/benchmarks/chees.md).  The eager kernel at that
shape did not fault.  Raising ``M_MMAP_THRESHOLD`` keeps blocks up to 32 MB on the heap and
raising ``M_TRIM_THRESHOLD`` keeps the freed top of the heap mapped, so the pages are reused.  The
price is memory held after it is freed (up to the trim threshold), which a long-running sampler
or a suite of fits re-uses on its next call anyway.

The settings are process-wide and cannot be undone (``mallopt`` switches off glibc's own
adaptive threshold), so :func:`pyrobdl.fit` does not apply them behind a user's back: the
suite runner (every cell, in whichever process or worker runs it: ``pyrobdl compare``'s fits) and
the comparison scripts do, and a script that calls :func:`pyrobdl.fit` may
(:func:`retain_freed_memory`).
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["MAX_MMAP_THRESHOLD", "retain_freed_memory"]

#: glibc's mallopt parameter numbers (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: The largest ``M_MMAP_THRESHOLD`` glibc accepts on a 64-bit system (HEAP_MAX_SIZE / 2).
MAX_MMAP_THRESHOLD = 32 * 1024 * 1024

_applied: tuple[int, int] | None = None


def retain_freed_memory(mmap_threshold: int = MAX_MMAP_THRESHOLD, trim_threshold: int = 1 << 30) -> bool:
    """Tell glibc's ``malloc`` to keep freed blocks mapped, for the rest of the process.

    Call once, before the fits (the suite runner does it for every cell, whether run by
    ``pyrobdl compare`` or from Python; so does ``comparisons/uci_references.py``).  Values and gradients are unchanged — only where the
    memory comes from — and a second call with the same values does nothing.

    Parameters
    ----------
    mmap_threshold : int, default 32 MiB
        Blocks below this many bytes come from the heap instead of their own ``mmap``;
        at most :data:`MAX_MMAP_THRESHOLD`.
    trim_threshold : int, default 1 GiB
        Free memory at the top of the heap is returned to the system only above this many bytes.

    Returns
    -------
    bool
        True when the settings are in force; False on a C library without ``mallopt``
        (macOS, Windows, musl), where nothing is changed.

    Raises
    ------
    ValueError
        For a threshold that is not a positive integer, or ``mmap_threshold`` above
        :data:`MAX_MMAP_THRESHOLD`, naming it.
    """
    global _applied
    for name, value in (("mmap_threshold", mmap_threshold), ("trim_threshold", trim_threshold)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive number of bytes, got {value!r}")
    if mmap_threshold > MAX_MMAP_THRESHOLD:
        raise ValueError(f"mmap_threshold must be at most {MAX_MMAP_THRESHOLD} bytes (glibc's limit), "
                         f"got {mmap_threshold}")
    if _applied == (mmap_threshold, trim_threshold):
        return True
    mallopt = _mallopt()
    if mallopt is None:
        return False
    if not (mallopt(_M_MMAP_THRESHOLD, mmap_threshold) and mallopt(_M_TRIM_THRESHOLD, min(trim_threshold, 2**31 - 1))):
        return False
    _applied = (mmap_threshold, trim_threshold)
    return True


def _mallopt():
    """glibc's ``mallopt`` as a ctypes function, or None on any other C library."""
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION") or ""  # "glibc 2.36"; unset elsewhere
    except (AttributeError, ValueError, OSError):
        return None
    if not libc.startswith("glibc"):
        return None
    try:
        fn = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return fn
