"""Where a record's tensor bytes are written on the agent: the one copy each tensor gets (docs/design.md §5).

A small payload is a zeroed bytearray (several such records may share one Batch frame). A large one is written
straight into its wire frames: each frame is a `bytes` object allocated at its final size, its header copied in
first, then the tensors, so that no payload byte is copied again before gRPC takes the message (gRPC's Python API
accepts `bytes` only). Either way a dense CPU tensor is copied with one `memmove` from its memory: no torch call,
so no OpenMP team is started from the sender thread on top of the training's, and the GIL is released. Anything
else (a strided view, a lazily conjugated or negated tensor, another device) is first made a contiguous host
tensor by torch.

Fresh `bytes` frames reuse the memory of the ones freed before them (glibc keeps such blocks once it has seen
them freed); fresh tensors of that size do not, and paid a page fault per 4 KiB page on every record.
"""
from __future__ import annotations

import ctypes
import sys
from typing import Any

import torch

from protos import online_check_pb2 as pb
from protos.framing import DATA_TAG, varint
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


def _uninitialised_bytes(n: int) -> tuple[bytes, int]:
    """A new bytes object of length n, not yet shared with anyone, and the address of its contents."""
    b = _new_bytes(None, n)
    return b, id(b) + _BYTES_DATA


def dense_address(t: torch.Tensor, nbytes: int) -> int:
    """The address of `t`'s nbytes when they lie in host memory exactly as the wire wants them; else 0."""
    if (not t.is_cpu or not t.is_contiguous() or t.is_conj() or t.is_neg()
            or t.nbytes != nbytes):   # (resized since the layout: torch's copy raises below)
        return 0
    try:
        return int(t.data_ptr())
    except RuntimeError:   # a wrapper subclass without storage
        return 0


class _Spans:
    """A payload held in pieces: payload bytes [start, end) live at address `addr`, for each (start, end, addr)."""

    spans: list[tuple[int, int, int]]

    def write(self, off: int, src: int, n: int) -> None:
        for start, end, addr in self.spans:
            lo, hi = max(start, off), min(end, off + n)
            if lo < hi:
                ctypes.memmove(addr + lo - start, src + lo - off, hi - lo)

    def zero(self, off: int, n: int) -> None:
        for start, end, addr in self.spans:
            lo, hi = max(start, off), min(end, off + n)
            if lo < hi:
                ctypes.memset(addr + lo - start, 0, hi - lo)

    def copy(self, off: int, nbytes: int, t: torch.Tensor) -> None:
        """Write tensor `t` (nbytes of it) at payload offset `off`."""
        src = dense_address(t, nbytes)
        if src:
            self.write(off, src, nbytes)
            return
        with torch.no_grad(), disable_torch_function():   # the agent's own torch calls are not captured
            host = t.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
        if host.numel() * host.element_size() != nbytes:
            raise ValueError(f"a {tuple(t.shape)} tensor does not fill the {nbytes} bytes laid out for it")
        self.write(off, int(host.data_ptr()), nbytes)


class SmallPayload(_Spans):
    """A zeroed bytearray: `buffers` for protos.framing (a record alone, or one of a Batch)."""

    def __init__(self, size: int):
        self.data = bytearray(size)
        self._pin: Any = None
        self.spans = []
        self._addr = 0
        if size:
            self._pin = (ctypes.c_char * size).from_buffer(self.data)   # the bytearray cannot move while we write
            self._addr = ctypes.addressof(self._pin)
            self.spans = [(0, size, self._addr)]

    def write(self, off: int, src: int, n: int) -> None:   # one span: no search
        ctypes.memmove(self._addr + off, src, n)

    def close(self) -> list[tuple[int, memoryview]]:
        self._pin = None
        return [(0, memoryview(self.data))] if self.data else []


class FramePayload(_Spans):
    """A large record's payload written straight into its frames: the first carries the Record (`head`, the
    serialized Frame with the Record), the others a Chunk header; at most chunk_bytes of payload each."""

    def __init__(self, head: bytes, seq: int, size: int, chunk_bytes: int, places: list[tuple[int, int, Any]]):
        self.frames: list[bytes] = []
        self.spans = []
        pos = 0
        while True:
            n = min(chunk_bytes, size - pos)
            prefix = head if pos == 0 else pb.Frame(chunk=pb.Chunk(seq=seq, offset=pos)).SerializeToString()
            header = prefix + DATA_TAG + varint(n) if n else prefix
            frame, addr = _uninitialised_bytes(len(header) + n)
            ctypes.memmove(addr, header, len(header))
            self.frames.append(frame)
            self.spans.append((pos, pos + n, addr + len(header)))
            pos += n
            if pos >= size:
                break
        end = 0
        for off, nbytes, _ in sorted(places, key=lambda p: p[0]):   # alignment padding goes out as zeros
            if off > end:
                self.zero(end, off - end)
            end = max(end, off + nbytes)
        if size > end:
            self.zero(end, size - end)
