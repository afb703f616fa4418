"""Copying bytes between buffers without holding the interpreter lock (a `memmove` through ctypes).

A slice assignment (`mapping[a:b] = data`) copies under the interpreter lock, so while the folder reader joins a
4 MiB chunk into a record, or a server worker copies a record into its replay worker's arena, no other thread of the
server runs Python, and a first touch of fresh memory (a page fault per 4 KiB) happens under the lock too. On
bench/server.py's 660 records with 2 workers, `py-spy record --gil` put 2.3 s of the 11.6 s the lock was held in
those two copies. `ctypes.memmove` lets the lock go for the copy; the buffers' addresses come from numpy, which
takes read-only ones (bytes, a memoryview of a message) too, and whose arrays hold both buffers exported while the
copy runs (a mapping cannot be closed under it). Small copies keep the slice assignment: its overhead is lower.
"""
from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

LARGE = 256 << 10   # bytes from which a copy lets the interpreter lock go


def address(buf: Any) -> tuple[int, int, np.ndarray]:
    """The address and length of a C-contiguous buffer, and the array that holds it exported (keep it while the
    address is used)."""
    arr = np.frombuffer(buf, dtype=np.uint8)
    return (arr.ctypes.data if arr.size else 0), int(arr.size), arr


def copy_into(dst: Any, offset: int, src: Any) -> int:
    """Copy all of `src` into `dst` from byte `offset` (both C-contiguous buffers, `dst` writable and long enough:
    IndexError otherwise); returns the bytes copied."""
    source = memoryview(src).cast("B")
    n = len(source)
    if n < LARGE:
        memoryview(dst).cast("B")[offset:offset + n] = source
        return n
    s_addr, _, s_arr = address(source)
    d_addr, d_len, d_arr = address(dst)
    if offset < 0 or offset + n > d_len:
        raise IndexError(f"{n} bytes at offset {offset} do not fit in a buffer of {d_len}")
    if not d_arr.flags.writeable:
        raise TypeError("the destination buffer is read-only")
    ctypes.memmove(d_addr + offset, s_addr, n)
    del s_arr, d_arr   # (held exported until the copy is done)
    return n
