"""What crosses between the server and its replay worker processes (docs/design.md §6.8).

Two channels per worker:
- a pipe of messages: a 4-byte little-endian length, then one JSON object (never pickle: the worker has handled
  hostile data, so the server reads what it answers as it reads a client, with every size checked);
- two shared-memory arenas (files in a private folder under /dev/shm, mapped by both sides): the server writes the
  records a request needs into its `in-N` arena, the worker writes the tensors of its answer into one of its
  `out-N` arenas (which one, and how the server reads them in place: gpu_server/replay/answer_arenas.py). A side
  that needs a larger arena makes a new one (the next N) and names it in its message.

A tensor in an answer is `{"t": [dtype, shape, offset, nbytes]}` into the worker's arena (offsets aligned to
`ALIGN`); other values are `{"v": number|bool|str|null}` and `{"c": [re, im]}`. `read_leaves` checks every field
against the arena before it reads anything.
"""
from __future__ import annotations

import errno
import itertools
import json
import mmap
import os
import re
import select
import struct
import time
from typing import Any, Iterator

import torch

from protos.codec import dtype_from_name, dtype_name

MAX_MESSAGE = 16 << 20        # a JSON message (the tensors travel in the arenas)
MAX_DIMS = 64
_LEN = struct.Struct("<I")
ARENA_NAME = re.compile(r"(in|out)-\d{1,12}")


class ChannelClosed(Exception):
    """The other side closed its end (a worker that died) or sent something that is not a message."""


class ChannelTimeout(Exception):
    """No answer within the time given."""


def send(fd: int, message: dict) -> None:
    data = json.dumps(message, separators=(",", ":")).encode("utf-8")
    view = memoryview(_LEN.pack(len(data)) + data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BrokenPipeError:
            raise ChannelClosed("the other side has closed the pipe") from None


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    parts, got = [], 0
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChannelTimeout()
            if not poller.poll(max(1, int(left * 1000))):
                raise ChannelTimeout()
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            raise ChannelClosed("the other side has closed the pipe")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def receive(fd: int, timeout: float | None = None) -> dict:
    """One message; ChannelTimeout when none is complete within `timeout` seconds (None: wait)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    (n,) = _LEN.unpack(_read_exact(fd, _LEN.size, deadline))
    if n > MAX_MESSAGE:
        raise ChannelClosed(f"a message of {n} bytes (at most {MAX_MESSAGE})")
    try:
        message = json.loads(_read_exact(fd, n, deadline))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ChannelClosed(f"a message that is not JSON ({exc})") from None
    if not isinstance(message, dict):
        raise ChannelClosed("a message that is not a JSON object")
    return message


class ArenaFull(OSError):
    """The arenas' folder has no room for the bytes an arena must hold (a small /dev/shm: shm_folder.shm_parent)."""

    def __init__(self, folder: str, nbytes: int):
        try:
            st = os.statvfs(folder)
            room = f"{st.f_bavail * st.f_frsize >> 20} MiB free of {st.f_blocks * st.f_frsize >> 20} MiB"
        except OSError:
            room = "its free space unknown"
        super().__init__(errno.ENOSPC, f"the replay workers' shared-memory folder {folder} has no room for "
                                       f"{nbytes / (1 << 20):.0f} MiB ({room}); give the server more shared memory "
                                       "(docker run --shm-size=4g, compose shm_size) or free some")

    def __str__(self) -> str:
        return str(self.strerror)


class Arena:
    """One side's shared-memory area: written by its owner, read by the other side through `Mapped`. The bytes a
    `reserve` asks for are allocated in the file system first (posix_fallocate): where they do not fit, `ArenaFull`
    is raised, where a write into the mapping would have killed the process with SIGBUS."""

    def __init__(self, folder: str, prefix: str, names: Iterator[int] | None = None):
        self.folder, self.prefix = folder, prefix
        self._names = names if names is not None else itertools.count()   # shared by arenas of one prefix
        self.name = ""
        self.size = 0
        self._map: mmap.mmap | None = None
        self._fd = -1
        self._backed = 0   # bytes from the start allocated in the file system

    def reserve(self, nbytes: int) -> memoryview:
        """A writable view of at least `nbytes` (a new, larger arena when the current one is too small); ArenaFull
        when the folder has no room for them."""
        if nbytes > self.size or self._map is None:
            self.close()
            self.size = max(1 << 20, 1 << max(0, (nbytes - 1).bit_length()))
            self.name = f"{self.prefix}-{next(self._names)}"
            path = os.path.join(self.folder, self.name)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                os.ftruncate(fd, self.size)
                self._map = mmap.mmap(fd, self.size)
            except BaseException:
                os.close(fd)
                raise
            self._fd, self._backed = fd, 0
        if nbytes > self._backed:
            self._back(nbytes)
        return memoryview(self._map)

    def is_open(self) -> bool:
        return self._map is not None

    def _back(self, nbytes: int) -> None:
        """Allocate the file's first `nbytes` (only what answers have needed so far: an arena is up to twice that)."""
        try:
            os.posix_fallocate(self._fd, self._backed, nbytes - self._backed)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                self.close()
                raise ArenaFull(self.folder, nbytes) from None
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            nbytes = self.size   # a file system without fallocate: writes are all that is left to try
        self._backed = nbytes

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._map is not None:
            close_map(self._map)
            self._map = None
            try:
                os.unlink(os.path.join(self.folder, self.name))
            except OSError:
                pass


class Mapped:
    """The server's request arena on the worker's side, mapped read-only by name (re-mapped when the name
    changes)."""

    def __init__(self, folder: str, prefix: str):
        self.folder, self.prefix = folder, prefix
        self.name = ""
        self._map: mmap.mmap | None = None

    def view(self, name: str) -> memoryview:
        check_arena_name(name, self.prefix)
        if name != self.name or self._map is None:
            self.close()
            self._map = map_arena(self.folder, name, writable=False)
            self.name = name
        return memoryview(self._map) if self._map is not None else memoryview(b"")

    def close(self) -> None:
        close_map(self._map)
        self._map = None
        self.name = ""


def is_arena_name(name: Any, prefix: str) -> bool:
    """`name` is an arena name of this prefix (`{prefix}-N`): never a path."""
    return isinstance(name, str) and ARENA_NAME.fullmatch(name) is not None and name.startswith(prefix + "-")


def check_arena_name(name: Any, prefix: str) -> None:
    """ChannelClosed unless the other side named an arena of this prefix."""
    if not is_arena_name(name, prefix):
        raise ChannelClosed(f"an arena name {str(name)[:40]!r} that is not {prefix}-N")


def map_arena(folder: str, name: str, writable: bool) -> mmap.mmap | None:
    """The other side's arena `name` in `folder`, mapped whole (never through a link); None when it is empty."""
    fd = os.open(os.path.join(folder, name), (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        if not size:
            return None
        return mmap.mmap(fd, size) if writable else mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def close_map(m: mmap.mmap | None) -> None:
    """Unmap `m` now, or, while views of it are alive (a tensor something still holds), once the last one goes."""
    if m is not None:
        try:
            m.close()
        except BufferError:
            pass


# -- tensors and values of an answer ----------------------------------------------------------------------------------
class NotTransferable(Exception):
    """An output value that has no form here (the call gets a SKIP row naming its type)."""


def _host_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.layout != torch.strided:
        raise NotTransferable(f"a {t.layout} output")
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    return t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


ALIGN = 64   # each tensor of an answer starts at a multiple of this offset: read in place as any dtype


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def write_leaves(runs: list[list], arena: Any) -> tuple[list[list], str]:
    """Each run's values as answer entries, their tensors copied into `arena`; returns (entries, arena name)."""
    flat = [[_host_bytes(v) if isinstance(v, torch.Tensor) else None for v in run] for run in runs]
    total = sum(_aligned(b.numel()) for run in flat for b in run if b is not None)
    view = arena.reserve(total)
    dest = torch.frombuffer(view, dtype=torch.uint8, count=arena.size) if arena.size else None
    entries, offset = [], 0
    for run, raw in zip(runs, flat):
        out: list[Any] = []
        for v, b in zip(run, raw):
            if b is not None:
                n = b.numel()
                if n:
                    dest[offset:offset + n].copy_(b)   # type: ignore[index]
                out.append({"t": [dtype_name(v.dtype), list(v.shape), offset, n]})
                offset += _aligned(n)
            elif v is None or isinstance(v, (bool, int, float, str)):
                if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
                    out.append({"f": repr(float(v))})   # JSON has no inf/NaN
                else:
                    out.append({"v": v})
            elif isinstance(v, complex):
                out.append({"c": [repr(v.real), repr(v.imag)]})
            elif isinstance(v, torch.dtype):
                out.append({"d": dtype_name(v)})
            else:
                raise NotTransferable(f"an output of type {type(v).__name__}")
        entries.append(out)
    del dest, view
    return entries, arena.name


def _float(text: Any) -> float:
    if not isinstance(text, str) or len(text) > 40:
        raise ChannelClosed("a float that is not a short string")
    try:
        return float(text)
    except ValueError:
        raise ChannelClosed(f"a float {text!r}") from None


def read_leaves(entries: Any, arena: Any, device: torch.device | None = None, copy: bool = True) -> list[list]:
    """The runs of an answer, every tensor copied out of the worker's arena (`arena`: a buffer; checked against it
    first), or with `copy=False` a view of it (gpu_server/replay/answer_arenas.py)."""
    if not isinstance(entries, list):
        raise ChannelClosed("runs that are not a list")
    size = len(arena)
    src = torch.frombuffer(arena, dtype=torch.uint8) if size else None
    runs: list[list] = []
    for run in entries:
        if not isinstance(run, list):
            raise ChannelClosed("a run that is not a list")
        values: list[Any] = []
        for e in run:
            if not isinstance(e, dict) or len(e) != 1:
                raise ChannelClosed("a value that is not a one-key object")
            (kind, body), = e.items()
            if kind == "t":
                values.append(_tensor(body, src, size, device, copy))
            elif kind == "v":
                if not (body is None or isinstance(body, (bool, int, float, str))) or \
                        isinstance(body, str) and len(body) > 4096:
                    raise ChannelClosed("a plain value of the wrong type")
                values.append(body)
            elif kind == "f":
                values.append(_float(body))
            elif kind == "c" and isinstance(body, list) and len(body) == 2:
                values.append(complex(_float(body[0]), _float(body[1])))
            elif kind == "d" and isinstance(body, str):
                values.append(_dtype(body))
            else:
                raise ChannelClosed(f"a value of unknown kind {str(kind)[:20]!r}")
        runs.append(values)
    return runs


def _dtype(name: str) -> torch.dtype:
    try:
        return dtype_from_name(name)
    except Exception:  # noqa: BLE001 - protos' WireError: the worker named no dtype the wire knows
        raise ChannelClosed(f"an unknown dtype {name[:40]!r}") from None


def _tensor(body: Any, src: torch.Tensor | None, size: int, device: torch.device | None, copy: bool) -> torch.Tensor:
    if not (isinstance(body, list) and len(body) == 4 and isinstance(body[0], str) and isinstance(body[1], list)):
        raise ChannelClosed("a tensor entry that is not [dtype, shape, offset, nbytes]")
    dtype, shape, offset, nbytes = _dtype(body[0]), body[1], body[2], body[3]
    if len(shape) > MAX_DIMS or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise ChannelClosed("a tensor shape that is not a list of sizes")
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (offset, nbytes)):
        raise ChannelClosed("a tensor offset or size that is not a non-negative integer")
    numel = 1
    for s in shape:
        numel *= s
    itemsize = torch.empty((), dtype=dtype).element_size()
    if numel * itemsize != nbytes or offset + nbytes > size:
        raise ChannelClosed(f"a tensor of {nbytes} bytes at {offset} that does not fit its shape {shape} or the "
                            f"arena ({size} bytes)")
    if not nbytes:
        t = torch.empty(shape, dtype=dtype)
    else:
        raw = src[offset:offset + nbytes]   # type: ignore[index]
        if copy or offset % ALIGN:   # a view of another dtype needs an aligned offset (write_leaves aligns them)
            raw = raw.clone()
        t = raw.view(dtype).reshape(shape) if not dtype.is_complex else \
            torch.view_as_complex(raw.view(torch.float32 if dtype == torch.complex64 else torch.float64)
                                  .reshape(-1, 2)).reshape(shape)
    return t.to(device, non_blocking=True) if device is not None and device.type != "cpu" else t
