"""Writing a spool segment around the page cache: O_DIRECT from an aligned staging buffer (docs/design.md §6.3).

A segment is written once and read back only after a restart. A buffered write copies each of its bytes into the
page cache, memory the kernel takes, charges, writes back and (once the segment is durable) drops again. With
O_DIRECT the device takes the bytes from the process's own memory instead. `python bench/spool_write.py` on this
project's 2-core VM, 2 GiB of 8 MiB records: 0.35 s of CPU against 0.67 s through the page cache, and 1.3 s against
2.4 s of system CPU in the spool thread of a server checking bench/server.py's 4.5 GB of records.

O_DIRECT wants the memory, the file offset and the length of each write aligned to the device's blocks, and the
segment format packs its entries without padding. So the bytes are copied into a staging buffer (page-aligned,
`STAGE_BYTES`, one per writing thread, kept), which is written whenever it is full; at the end the last block is
padded with zeros and the file cut back to its length (`ftruncate`). The file holds exactly the bytes a buffered
write of the same pieces gives. The copy into the stage is a `memmove` that releases the interpreter lock.

Where O_DIRECT is refused (a file system without it, or a device whose blocks are larger than `BLOCK`), or would
only cost (tmpfs and ramfs, whose files are the page cache), `Refused` is raised before anything is made durable,
and the file system is remembered so that its next files go through the page cache straight away
(`segments.write_segment`)."""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from typing import Any

from gpu_server.memcopy import address

O_DIRECT: int = getattr(os, "O_DIRECT", 0)   # Linux; elsewhere every file goes through the page cache
BLOCK = 4096                  # alignment of memory, offsets and lengths (a multiple of 512-byte sectors too)
STAGE_BYTES = 8 << 20         # the staging buffer: one write per 8 MiB

_refused_devices: set[int] = set()   # st_dev of the file systems that refused O_DIRECT in this process
# file systems that keep files in memory: O_DIRECT still copies into their pages, and the stage's copy is one more
_IN_MEMORY = {0x01021994, 0x858458F6}   # TMPFS_MAGIC, RAMFS_MAGIC (linux/magic.h)


class _StatFs(ctypes.Structure):
    _fields_ = [("f_type", ctypes.c_long), ("_rest", ctypes.c_byte * 256)]   # struct statfs: f_type first


def _statfs() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.statfs
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_char_p, ctypes.POINTER(_StatFs)]
    fn.restype = ctypes.c_int
    return fn


_STATFS = _statfs() if O_DIRECT else None


def _in_memory(folder: str) -> bool:
    """Whether `folder` lies on tmpfs or ramfs (Linux; False where that cannot be told)."""
    if _STATFS is None:
        return False
    buf = _StatFs()
    if _STATFS(os.fsencode(folder), ctypes.byref(buf)) != 0:
        return False
    return (buf.f_type & 0xFFFFFFFF) in _IN_MEMORY


_stages = threading.local()   # each writing thread's staging buffer


class Refused(Exception):
    """The file system (or device) does not take this file's writes through O_DIRECT."""


def _stage() -> tuple[mmap.mmap, int]:
    """This thread's staging buffer (anonymous memory: page-aligned) and its address."""
    stage = getattr(_stages, "stage", None)
    if stage is None:
        buf = mmap.mmap(-1, STAGE_BYTES)
        pin = ctypes.c_char.from_buffer(buf)   # kept: the buffer lives as long as its thread
        stage = _stages.stage = (buf, ctypes.addressof(pin), pin)
    return stage[0], stage[1]


class DirectFile:
    """A new file written through O_DIRECT: `write` any buffers, then `flush` once (pads and truncates), `fileno`
    for fsync, `close`. Opened by `open_direct`."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._stage, self._at = _stage()
        self._fill = 0          # bytes in the stage
        self._size = 0          # bytes written by the caller
        self._flushed = False

    def write(self, data: Any) -> int:
        if self._flushed:
            raise ValueError("write after flush: a DirectFile is flushed once, at its end")
        addr, n, held = address(data)   # (held exported while it is copied)
        done = 0
        while done < n:
            k = min(n - done, STAGE_BYTES - self._fill)
            ctypes.memmove(self._at + self._fill, addr + done, k)
            self._fill += k
            done += k
            if self._fill == STAGE_BYTES:
                self._write_stage(STAGE_BYTES)
        self._size += n
        del held
        return n

    def _write_stage(self, n: int) -> None:
        """Write the first n bytes of the stage (a multiple of BLOCK) at the file's current offset."""
        view = memoryview(self._stage)
        try:
            done = 0
            while done < n:
                try:
                    done += os.write(self.fd, view[done:n])
                except OSError as exc:
                    if exc.errno == errno.EINVAL:   # alignment the device does not take: through the page cache
                        _refused_devices.add(os.fstat(self.fd).st_dev)
                        raise Refused(str(exc)) from None
                    raise
        finally:
            view.release()
        self._fill = 0

    def flush(self) -> None:
        """The last bytes: padded to a whole block, written, and the file cut back to the bytes written."""
        if self._flushed:
            return
        self._flushed = True
        tail = self._fill
        if tail:
            padded = -(-tail // BLOCK) * BLOCK
            ctypes.memset(self._at + tail, 0, padded - tail)
            self._write_stage(padded)
        if os.fstat(self.fd).st_size != self._size:
            os.ftruncate(self.fd, self._size)

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

    def __enter__(self) -> DirectFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_direct(path: str) -> DirectFile:
    """Create (or empty) `path` for writing through O_DIRECT; `Refused` where its file system does not take it."""
    folder = os.path.dirname(path) or "."
    if not O_DIRECT:
        raise Refused("O_DIRECT does not exist on this system")
    try:
        dev = os.stat(folder).st_dev
    except OSError:
        dev = -1
    if dev in _refused_devices:
        raise Refused("this file system refused O_DIRECT before")
    if _in_memory(folder):
        _refused_devices.add(dev)
        raise Refused("the folder is on a file system in memory (tmpfs): nothing to go around")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | O_DIRECT, 0o666)   # as open()
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            _refused_devices.add(dev)
            raise Refused(str(exc)) from None
        raise
    return DirectFile(fd)

