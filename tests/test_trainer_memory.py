"""The trainer's host memory: glibc hands freed tensors' pages back (`return_freed_memory`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Frees a 16 MiB block (which raises glibc's default mmap threshold to 16 MiB), then fills 64
# blocks of 4 MiB, each followed by a small one that stays, frees the big ones and prints how
# many bytes of them stayed resident. Plain malloc: what torch's CPU allocator calls.
PROBE = """
import ctypes, sys
from pathlib import Path
from asyncrl.device import return_freed_memory

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

def rss():
    status = Path("/proc/self/status").read_text().splitlines()
    return int(next(x for x in status if x.startswith("VmRSS")).split()[1]) * 1024

if sys.argv[1] == "on":
    return_freed_memory()
libc.free(libc.malloc(16 << 20))
before = rss()
blocks, pins = [], []
for _ in range(64):
    blocks.append(libc.malloc(4 << 20))
    ctypes.memset(blocks[-1], 1, 4 << 20)
    pins.append(libc.malloc(256 << 10))
for block in blocks:
    libc.free(block)
print(rss() - before)
"""


def kept_after_free(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
    )
    return int(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc")
def test_freed_tensors_leave_the_trainers_resident_memory() -> None:
    # glibc's default keeps the 256 MiB freed between the small blocks; the trainer's returns it.
    assert kept_after_free("off") > 200 << 20
    assert kept_after_free("on") < 16 << 20
