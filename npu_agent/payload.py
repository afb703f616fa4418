"""Where a record's tensor bytes are written on the agent: the one copy each tensor gets (docs/design.md §5).

For the shared folder, a large record goes straight into its file instead (`FilePayload`: the kernel copies each
tensor from the training's memory, no frame in memory). Otherwise:

A small payload is a zeroed bytearray (several such records may share one Batch frame). A large one is written
straight into its wire frames: each frame is a `bytes` object allocated at its final size, its header copied in
first, then the tensors, so that no payload byte is copied again before gRPC takes the message (gRPC's Python API
accepts `bytes` only). Either way a dense CPU tensor is copied with one `memmove` from its memory: no torch call,
so no OpenMP team is started from the sender thread on top of the training's, and the GIL is released. Anything
else (a strided view, a lazily conjugated or negated tensor, another device) is first made a contiguous host
tensor by torch.

Memory for frames: fresh memory costs a page fault per 4 KiB page on its first touch (about 1 ms per MiB on a VM,
as much as the copy itself), and with many records in flight the allocator hands out fresh memory for almost
every large frame. So the frames of acknowledged records (a large record's, the Batch frame of small ones) go back
to `FRAMES` (a pool bounded in bytes), and a new frame of the same size class (`frame_class`) is written into one
of them once nobody else holds it. Records of the same call site have frames of the same length from step to step,
and Batch frames of nearby lengths share a class, so in a training most frames are reused. With
`ONLINE_CHECK_HUGE_PAGES=1` (protos/huge_pages.py: off by default, it costs more than it saves on a virtual machine
that returns freed memory to its host), a new frame (the first steps, a pool miss) asks the kernel for transparent
huge pages for the whole 2 MiB pages inside it before it is written (`huge_pages`): one fault per 2 MiB instead of
512.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from protos import huge_pages as thp
from protos.folder_format import FOLDER_MAGIC, FRAME_LENGTH
from protos.framing import DATA_TAG, chunk_head
from protos.record_bytes import varint
from protos.reuse_pool import ReusePool
from protos.torch_compat import disable_torch_function

_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
_BYTES_DATA = bytes.__basicsize__ - 1   # CPython: offsetof(PyBytesObject, ob_sval)


def _bytes_in_place_works() -> bool:
    """Whether a new bytes object can be filled through its address (CPython's layout); checked once, at import."""
    if sys.implementation.name != "cpython":
        return False
    probe = _new_bytes(None, 8)
    ctypes.memmove(id(probe) + _BYTES_DATA, b"payload!", 8)
    return bool(probe == b"payload!")


FRAMES_IN_PLACE = _bytes_in_place_works()


def _hash_slot() -> int | None:
    """Where CPython caches a bytes object's hash (just before its contents), when it can be checked to be there:
    a reused frame must forget the hash of its former contents."""
    if not FRAMES_IN_PLACE:
        return None
    probe = _new_bytes(None, 16)
    ctypes.memmove(id(probe) + _BYTES_DATA, b"hash-slot-probe!", 16)
    h = hash(probe)
    slot = _BYTES_DATA - ctypes.sizeof(ctypes.c_ssize_t)
    return slot if ctypes.c_ssize_t.from_address(id(probe) + slot).value == h else None


_HASH_SLOT = _hash_slot()


def _size_slot() -> int | None:
    """Where CPython keeps a bytes object's length (just before its hash), when it can be checked to be there and
    set lower than the bytes allocated: a frame of the pool's size class is handed out at the length asked for."""
    if _HASH_SLOT is None:
        return None
    slot = _HASH_SLOT - ctypes.sizeof(ctypes.c_ssize_t)
    probe = _new_bytes(None, 24)
    length = ctypes.c_ssize_t.from_address(id(probe) + slot)
    if length.value != 24:
        return None
    ctypes.memmove(id(probe) + _BYTES_DATA, b"0123456789abcdefghijklmn", 24)
    _set_length(probe, slot, 10)
    return slot if len(probe) == 10 and probe == b"0123456789" and hash(probe) == hash(b"0123456789") else None


def _set_length(b: bytes, slot: int, n: int) -> None:
    """Make `b` (allocated for at least n bytes, held by no one else) n bytes long: its length, the terminating
    zero CPython keeps after the contents, and its cached hash forgotten."""
    ctypes.c_ssize_t.from_address(id(b) + slot).value = n
    ctypes.c_char.from_address(id(b) + _BYTES_DATA + n).value = b"\0"
    ctypes.c_ssize_t.from_address(id(b) + slot + ctypes.sizeof(ctypes.c_ssize_t)).value = -1   # "not computed yet"


_SIZE_SLOT = _size_slot()
POOLED_MIN = 64 * 1024   # frames this long or longer are reused; shorter ones come from the allocator's free lists


def frame_class(n: int) -> int:
    """The capacity a frame of n bytes is allocated with, and kept in the pool under: n rounded up to one of eight
    steps per power of two (at most 12.5 % more, never touched unless a longer frame of the class reuses it), so
    that frames of nearby lengths (Batch frames of a few more or fewer records) reuse each other's memory."""
    if n < POOLED_MIN or _SIZE_SLOT is None:   # (then lengths are reused exactly)
        return n
    step = 1 << (n.bit_length() - 4)
    return -(-n // step) * step


class FramePool(ReusePool[bytes]):
    """Frames by size class (`frame_class`), for reuse (at most `limit` bytes of capacity: protos/reuse_pool.py).

    Every frame the agent writes is made by `frame`, at its class's capacity, and only those are ever given back:
    the pool lengthens a frame it hands out up to its class, never beyond."""

    def frame(self, n: int) -> bytes:
        """A bytes object of n bytes, held by no one else, to be written through its address: a frame of n's class
        that the pool is the last holder of, made n bytes long (its cached hash forgotten), else a new one allocated
        at the class's capacity."""
        c = frame_class(n)
        b = self.take(c) if self.limit and _HASH_SLOT is not None else None
        if b is None:
            fresh: bytes = _new_bytes(None, c)
            b = fresh
            if n > thp.HUGE_PAGE:
                huge_pages(id(b) + _BYTES_DATA, n)
            if c == n:
                return b
        if _SIZE_SLOT is not None:
            _set_length(b, _SIZE_SLOT, n)   # (forgets the cached hash too)
        elif _HASH_SLOT is not None:   # exact lengths only (c == n)
            ctypes.c_ssize_t.from_address(id(b) + _HASH_SLOT).value = -1   # "not computed yet"
        return b

    def give(self, frames: list[bytes]) -> None:
        """Take the frames of an acknowledged record (emptying the list), made by `frame`, each one that fits under
        the limit. gRPC may still hold one (it keeps the message it wrote last until it takes the next): `take` hands
        a frame out only once the pool is its last holder, so a sender slower than its server still reuses its
        frames."""
        if _HASH_SLOT is None or not self.limit:
            frames.clear()
            return
        while frames:
            b = frames.pop()
            self.keep(b, frame_class(len(b)))


FRAMES = FramePool()   # its limit is set by the sender (npu_agent.sender: a share of the memory budget)


def _uninitialised_bytes(n: int) -> tuple[bytes, int]:
    """A bytes object of length n, not shared with anyone, and the address of its contents (`FRAMES.frame`)."""
    b = FRAMES.frame(n)
    return b, id(b) + _BYTES_DATA


_MADV_HUGEPAGE: int | None = getattr(mmap, "MADV_HUGEPAGE", None)   # Linux only
_libc: Any = None
if _MADV_HUGEPAGE is not None:
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        _libc = None


def huge_pages(addr: int, n: int) -> bool:
    """Ask for transparent huge pages for the whole huge pages inside [addr, addr + n) (memory not touched yet: its
    first touch then costs one fault per 2 MiB instead of one per 4 KiB page), when `ONLINE_CHECK_HUGE_PAGES=1`
    asks for them (protos/huge_pages.py). Only what lies inside the range, which is about to be written completely
    anyway; a hint the kernel may ignore (no transparent huge pages, or none free). True when asked."""
    lo, hi = thp.whole_huge_pages(0, addr, addr + n)
    if _libc is None or _MADV_HUGEPAGE is None or hi <= lo or not thp.wanted():
        return False
    return bool(_libc.madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0)


# npu_agent/_fastencode.c's gather(tensor, nbytes, addr, skip, count)
Gather = Callable[[torch.Tensor, int, int, int, int], bool]


def dense_address(t: torch.Tensor, nbytes: int) -> int:
    """The address of `t`'s nbytes when they lie in host memory exactly as the wire wants them; else 0."""
    if (not t.is_cpu or not t.is_contiguous() or t.is_conj() or t.is_neg()
            or t.nbytes != nbytes):   # (resized since the layout: torch's copy raises below)
        return 0
    try:
        return int(t.data_ptr())
    except RuntimeError:   # a wrapper subclass without storage
        return 0


class Spans:
    """A payload held in pieces: payload bytes [start, end) live at address `addr`, for each (start, end, addr)."""

    spans: list[tuple[int, int, int]]

    def pieces(self, off: int, n: int) -> Iterator[tuple[int, int, int]]:
        """Payload bytes [off, off + n) span by span: (where the piece lives, its distance from off, its length)."""
        for start, end, at in self.spans:
            lo, hi = max(start, off), min(end, off + n)
            if lo < hi:
                yield at + lo - start, lo - off, hi - lo

    def write(self, off: int, src: int, n: int) -> None:
        for at, skip, count in self.pieces(off, n):
            ctypes.memmove(at, src + skip, count)

    def zero(self, off: int, n: int) -> None:
        for at, _, count in self.pieces(off, n):
            ctypes.memset(at, 0, count)

    def zero_padding(self, size: int, places: list[tuple[int, int, Any]]) -> None:
        """Zero what no tensor of `places` [(offset, nbytes, tensor)] covers: alignment padding goes out as zeros."""
        end = 0
        for off, nbytes, _ in sorted(places, key=lambda p: p[0]):
            if off > end:
                self.zero(end, off - end)
            end = max(end, off + nbytes)
        if size > end:
            self.zero(end, size - end)

    def one_span(self) -> int:
        """The address of the whole payload when it lies in one piece written by `Region.write`, else 0."""
        return 0

    def copy(self, off: int, nbytes: int, t: torch.Tensor, gather: Gather | None = None) -> None:
        """Write tensor `t` (nbytes of it) at payload offset `off`. `gather`: the compiled copy of a host tensor's
        elements (npu_agent/_fastencode.c, which passes it), for a tensor that is not dense: its elements written in
        row-major order without a contiguous copy first (the bytes the Python path writes)."""
        src = dense_address(t, nbytes)
        if src:
            self.write(off, src, nbytes)
            return
        if gather is not None and self.gathered(off, nbytes, t, gather):
            return
        with torch.no_grad(), disable_torch_function():   # the agent's own torch calls are not captured
            host = t.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
        if host.numel() * host.element_size() != nbytes:
            raise ValueError(f"a {tuple(t.shape)} tensor does not fill the {nbytes} bytes laid out for it")
        self.write(off, int(host.data_ptr()), nbytes)

    def gathered(self, off: int, nbytes: int, t: torch.Tensor, gather: Gather) -> bool:
        """`gather` each span's part of `t`'s bytes into it; False, with nothing written, where it cannot read `t`."""
        for at, skip, count in self.pieces(off, nbytes):
            if not gather(t, nbytes, at, skip, count):
                return False
        return True


class Region(Spans):
    """`size` payload bytes in one piece at address `addr`, inside a buffer held elsewhere (a record's own buffer,
    or its place in a Batch frame: npu_agent.records.encode_together). With `places` [(offset, nbytes, tensor)],
    what they do not cover (the alignment padding) is zeroed now; None: the memory is zeroed already."""

    def __init__(self, addr: int, size: int, places: list[tuple[int, int, Any]] | None):
        self._addr = addr
        self.spans = [(0, size, addr)] if size else []
        if places is not None:
            self.zero_padding(size, places)

    def write(self, off: int, src: int, n: int) -> None:   # one span: no search
        ctypes.memmove(self._addr + off, src, n)

    def one_span(self) -> int:
        return self._addr if type(self).write is Region.write else 0


class SmallPayload(Region):
    """A record's whole payload in one buffer: `buffers` for protos.framing (a record alone, or one of a Batch).
    Where bytes can be written in place (FRAMES_IN_PLACE), a new bytes object whose tensors' bytes are copied in
    and whose padding is zeroed, nothing written twice; else a zeroed bytearray."""

    def __init__(self, size: int, places: list[tuple[int, int, Any]]):
        self._pin: Any = None
        self.data: bytes | bytearray
        if size and FRAMES_IN_PLACE:
            self.data = _new_bytes(None, size)
            super().__init__(id(self.data) + _BYTES_DATA, size, places)
            return
        self.data = bytearray(size)
        addr = 0
        if size:
            self._pin = (ctypes.c_char * size).from_buffer(self.data)   # the bytearray cannot move while we write
            addr = ctypes.addressof(self._pin)
        super().__init__(addr, size, None)

    def close(self) -> bytes | bytearray:
        self._pin = None
        return self.data


class FramePayload(Spans):
    """A large record's payload written straight into its frames: the first carries the Record (`head`, the
    serialized Frame with the Record), the others a Chunk header; at most chunk_bytes of payload each."""

    def __init__(self, head: bytes, seq: int, size: int, chunk_bytes: int, places: list[tuple[int, int, Any]]):
        self.frames: list[bytes] = []
        self.spans = []
        for pos, n, header in frame_headers(head, seq, size, chunk_bytes):
            frame, addr = _uninitialised_bytes(len(header) + n)
            ctypes.memmove(addr, header, len(header))
            self.frames.append(frame)
            self.spans.append((pos, pos + n, addr + len(header)))
        self.zero_padding(size, places)


def frame_headers(head: bytes, seq: int, size: int, chunk_bytes: int) -> Iterator[tuple[int, int, bytes]]:
    """A large record's frames, as (payload offset, payload bytes, the frame's bytes before them): the first frame
    carries the Record (`head`, the serialized Frame with the Record), the others a Chunk header; at most
    chunk_bytes of payload each."""
    pos = 0
    while True:
        n = min(chunk_bytes, size - pos)
        prefix = head if pos == 0 else chunk_head(seq, pos)
        yield pos, n, (prefix + DATA_TAG + varint(n) if n else prefix)
        pos += n
        if pos >= size:
            return


def pwrite_all(fd: int, data: Any, at: int) -> int:
    """Write all of `data` (a bytes-like object) into file `fd` at offset `at`; returns its length."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], at + done)
    return done


class FilePayload(Spans):
    """A large record written straight into a record file (the shared folder, npu_agent/transport_folder.py): the
    same frames as `FramePayload` (the first carries the Record, the others a Chunk header, at most chunk_bytes of
    payload each), laid out as `protos.folder_format.file_chunks` lays them out from offset `at` of file `fd` (the
    magic, then each frame's length and the frame). Each tensor is copied once, by the kernel, from the training's
    memory into the file (`os.pwrite`, without the interpreter lock): no frame in memory, no second copy. `end`:
    the file offset after the last frame."""

    def __init__(self, fd: int, at: int, head: bytes, seq: int, size: int, chunk_bytes: int,
                 places: list[tuple[int, int, Any]]):
        self.fd = fd
        self.spans = []
        heads = [FOLDER_MAGIC]
        where = at + len(FOLDER_MAGIC)
        for pos, n, header in frame_headers(head, seq, size, chunk_bytes):
            heads.append(FRAME_LENGTH.pack(len(header) + n) + header)
            where += FRAME_LENGTH.size + len(header)
            self.spans.append((pos, pos + n, where))
            where += n
        self.end = where
        pwrite_all(fd, heads[0], at)
        for (_, _, data_at), piece in zip(self.spans, heads[1:]):
            pwrite_all(fd, piece, data_at - len(piece))
        self.zero_padding(size, places)

    def write(self, off: int, src: int, n: int) -> None:
        for file_at, skip, count in self.pieces(off, n):
            pwrite_all(self.fd, (ctypes.c_char * count).from_address(src + skip), file_at)

    def zero(self, off: int, n: int) -> None:
        for file_at, _, count in self.pieces(off, n):
            pwrite_all(self.fd, bytes(count), file_at)

    def gathered(self, off: int, nbytes: int, t: torch.Tensor, gather: Gather) -> bool:
        """`gather` `t`'s bytes into a scratch buffer of at most GATHER_BYTES, reused, and write each piece."""
        scratch, addr = _scratch(min(nbytes, GATHER_BYTES))
        for file_at, skip, count in self.pieces(off, nbytes):
            for done in range(0, count, len(scratch)):
                n = min(count - done, len(scratch))
                if not gather(t, nbytes, addr, skip + done, n):
                    return False
                pwrite_all(self.fd, memoryview(scratch)[:n], file_at + done)
        return True


GATHER_BYTES = 4 << 20
_SCRATCH = threading.local()   # FilePayload.gathered's buffer, one a thread (the sender's), kept for reuse


def _scratch(n: int) -> tuple[bytearray, int]:
    """This thread's buffer of at least n bytes, and its address."""
    kept = getattr(_SCRATCH, "buf", None)
    if kept is None or len(kept[0]) < n:
        buf = bytearray(n)
        kept = _SCRATCH.buf = (buf, (ctypes.c_char * n).from_buffer(buf))   # (pinned: the bytearray cannot move)
    return kept[0], ctypes.addressof(kept[1])
