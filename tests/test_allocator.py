"""pyrobdl.retain_freed_memory: glibc's malloc keeps freed buffers (pyrobdl/_allocator.py).

The effect is read from glibc's own accounting (``mallinfo2``) in fresh processes, since the
settings are process-wide and cannot be undone: a 20 MB tensor is an ``mmap`` of its own under
glibc's defaults, and comes from the heap, which keeps it when it is freed, after the call.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import pyrobdl
from pyrobdl import _allocator

GLIBC = (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc") if hasattr(os, "confstr") else False

PROBE = r"""
import ctypes, json, sys
import torch

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
applied = None
if sys.argv[1] == "retain":
    import pyrobdl
    applied = pyrobdl.retain_freed_memory()
before = libc.mallinfo2()
t = torch.empty(5_000_000)  # 20 MB
t.fill_(1.0)
alive = libc.mallinfo2()
del t
freed = libc.mallinfo2()
print(json.dumps({"applied": applied, "mmapped_alive": alive.hblkhd - before.hblkhd,
                  "heap_alive": alive.arena - before.arena, "heap_after_free": freed.arena - before.arena}))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                         env={**os.environ, "GLIBC_TUNABLES": ""})
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="mallopt and mallinfo2 are glibc's")
def test_a_freed_20_mb_buffer_stays_on_the_heap():
    default, retained = _probe("default"), _probe("retain")
    assert default["mmapped_alive"] >= 20_000_000  # glibc's default: the block is its own mmap
    assert default["heap_alive"] < 1_000_000
    assert retained["applied"] is True
    assert retained["mmapped_alive"] == 0  # now from the heap...
    assert retained["heap_alive"] >= 20_000_000
    assert retained["heap_after_free"] >= 20_000_000  # ...which keeps it after it is freed


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_applying_twice_is_a_no_op():
    assert pyrobdl.retain_freed_memory() is True
    assert pyrobdl.retain_freed_memory() is True


def test_another_c_library_is_left_alone(monkeypatch):
    monkeypatch.setattr(_allocator, "_applied", None)
    monkeypatch.setattr(_allocator.os, "confstr", lambda name: None)  # musl, macOS: no glibc version
    assert _allocator._mallopt() is None
    assert pyrobdl.retain_freed_memory(1 << 20, 1 << 28) is False


@pytest.mark.parametrize("kwargs, name", [
    ({"mmap_threshold": 0}, "mmap_threshold"),
    ({"mmap_threshold": -5}, "mmap_threshold"),
    ({"mmap_threshold": 1.5}, "mmap_threshold"),
    ({"mmap_threshold": True}, "mmap_threshold"),
    ({"trim_threshold": "1G"}, "trim_threshold"),
    ({"mmap_threshold": _allocator.MAX_MMAP_THRESHOLD + 1}, "mmap_threshold"),
])
def test_bad_thresholds_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        pyrobdl.retain_freed_memory(**kwargs)
