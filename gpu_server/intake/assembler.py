"""`FrameAssembler` joins one stream's frames into (Record, payload), reserving the payload's bytes from the
memory budget (gpu_server/intake/admission/budget.py) after `admit` refused a record above
`Limits.max_record_bytes`; `batch` splits a batch frame into its records."""
from __future__ import annotations

import ctypes
import mmap
import time
from typing import Callable

from gpu_server.intake.budget import ByteBudget, ConnectionShare, check_peak
from gpu_server.intake.payload_pool import PAYLOADS, size_class
from gpu_server.memcopy import copy_into
from protos import huge_pages as thp
from protos import online_check_pb2 as pb
from protos.codec import WireError
from protos.framing import split_batch
from protos.limits import DEFAULT_LIMITS, Limits, MiB

# a record of a Batch frame: (record, payload, its peak, why it is refused or "", the record's bytes)
Part = tuple[pb.Record, bytes | memoryview, int, str, bytes]


class FrameAssembler:
    """One stream's frames -> complete records, every byte counted in the memory budget as it arrives.

    The caller counts each message it has in hand (`arrived`: gRPC handed it over already; `reserve`: the folder
    reserves before it reads), asks `before(frame, data)` what more the frame needs (when it completes a record: the
    rest of the record's estimated peak, `check_peak`), reserves that and tells `granted`, then `feed`s the frame;
    what the message held and no record kept is given back with `drop_loose`. A record's bytes are held from the
    moment they arrive, never before: a header announcing 60 GiB holds its own bytes only (and one announcing more than
    `Limits.max_record_bytes`, or needing more than the whole budget to be checked, is refused at once; its chunks are
    dropped unread, without an answer each). The record being assembled must keep coming (`deadline`, `late`).
    Without a budget (tests, offline tools) nothing is counted.
    """

    def __init__(self, limits: Limits = DEFAULT_LIMITS, budget: ByteBudget | None = None,
                 cancelled: Callable[[], bool] = lambda: False, share: ConnectionShare | None = None):
        self.limits = limits
        self.budget = budget
        if budget is not None:   # the mappings records were joined in, kept for reuse: a quarter of the budget more
            PAYLOADS.limit = max(PAYLOADS.limit, budget.limit // 4)
        self.cancelled = cancelled
        self.share = share
        self.record: pb.Record | None = None
        self.payload: _Payload | None = None    # written as the chunks arrive: pages are taken as they are written
        self._first: bytes | memoryview = b""     # the first frame's data, until the second frame comes
        self._placed: memoryview | None = None   # where `place` had the next frame's data read (already in place)
        self._opened: _Payload | None = None     # the payload `place` opened for a record frame's data, until fed
        self.filled = 0
        self.refused_seq: int | None = None
        self._admitted: pb.Frame | None = None   # the record frame `before` admitted, until it is fed
        self.held = 0          # budget bytes of the record being assembled (the messages its bytes came in, and
        self._held_recv = 0    # its peak once complete); of them, received (what its connection holds)
        self.loose = 0         # budget bytes of the message in hand, not yet part of a record
        self._loose_recv = 0
        self.extra = 0         # budget bytes granted for the message in hand beyond it: the rest of a record's peak
        self.reserved = 0      # of the record `feed` just returned, until `take_reserved`
        self._reserved_recv = 0
        self.need = 0          # the estimated peak of the record being assembled, once complete
        self.started = self.last = 0.0
        self.waited = 0.0      # seconds the stream waited for the budget while this record was half received
        self.share_waited = 0.0  # ... and for its connection to hold less than its share (its own doing: counted)
        self._waited_at_last = 0.0
        self._wait_since: float | None = None

    # -- counting ------------------------------------------------------------------------------------------------
    @property
    def holding(self) -> int:
        """Budget bytes this stream holds now."""
        return self.held + self.loose + self.extra + self.reserved

    def arrived(self, n: int) -> None:
        """A message of `n` bytes is in memory: count it (the budget may go over its limit: it is there)."""
        self.loose += n
        self._loose_recv += n
        if self.budget is not None:
            self.budget.force(n)
        if self.share is not None:
            self.share.add(n)

    def reserve(self, n: int) -> bool:
        """Reserve `n` bytes for a message about to be read (waits for the budget; False when cancelled)."""
        if self.budget is not None and not self.budget.acquire(n, self.cancelled, own=self.holding,
                                                               order=self.started or None):
            return False
        self.loose += n
        self._loose_recv += n
        if self.share is not None:
            self.share.add(n)
        return True

    def granted(self, n: int) -> None:
        """`n` more bytes were granted for the message in hand (the rest of its record's peak): the record it
        completes takes them."""
        self.extra += n

    def drop_loose(self) -> None:
        """Give back what the message in hand held and no record kept."""
        self._give(self.loose, self._loose_recv)
        self.loose = self._loose_recv = 0

    def _give(self, n: int, recv: int) -> None:
        if self.budget is not None and n:
            self.budget.release(n)
        if self.share is not None and recv:
            self.share.release(recv)

    def _keep(self, n: int | None = None) -> None:
        """`n` bytes of the message in hand (all of it by default) become part of the record being assembled."""
        n = self.loose if n is None else min(n, self.loose)
        recv = min(n, self._loose_recv)
        self.held += n
        self._held_recv += recv
        self.loose -= n
        self._loose_recv -= recv

    # -- records -------------------------------------------------------------------------------------------------
    def admit(self, frame: pb.Frame) -> int:
        """Check a record header against the limits before anything is held for it; returns its payload size."""
        cut = self.cut_off()
        if cut is not None:
            raise WireError(cut[1])
        rec = frame.record
        self.refused_seq = None
        if rec.payload_bytes > self.limits.max_record_bytes:
            self.refused_seq = rec.header.seq
            raise WireError(f"record {rec.header.seq} announces {rec.payload_bytes} payload bytes "
                            f"({rec.payload_bytes / MiB:.1f} MiB), above the limit of {self.limits.max_record_bytes} "
                            f"({self.limits.max_record_bytes / MiB:.1f} MiB) of what this server can hold (gpu-server "
                            f"--max-record-mb, by default half of --memory-mb: raise them on the server, or capture "
                            f"fewer or smaller tensors with tensor.list / tensor.scope)")
        return rec.payload_bytes

    def cut_off(self) -> tuple[int, str] | None:
        """Drop the half-received record that the next record cuts off: (its seq, why it is refused), or None."""
        if self.record is None:
            return None
        seq, filled = self.record.header.seq, self.filled
        self.reset()
        return seq, f"record {seq} was cut off by the next record after {filled} bytes"

    def _admit_once(self, frame: pb.Frame) -> None:
        """`admit`, unless `before` admitted this very frame already."""
        if frame is not self._admitted:
            self.admit(frame)
        self._admitted = None

    def _check_need(self, rec: pb.Record, need: int) -> None:
        if self.budget is not None and need > self.budget.limit:
            self.refused_seq = rec.header.seq
            raise WireError(
                f"record {rec.header.seq}: checking it needs about {need / MiB:.0f} MiB of server memory "
                f"({len(rec.tensors)} tensors, {rec.payload_bytes / MiB:.1f} MiB; the bench and same-dtype runs cost "
                f"a multiple of each tensor's bytes, docs/security.md), more than this server's memory budget of "
                f"{self.budget.limit / MiB:.0f} MiB (gpu-server --memory-mb): raise it on the server, or capture fewer "
                f"or smaller tensors with tensor.list / tensor.scope")

    def before(self, frame: pb.Frame, data: bytes | memoryview | None = None) -> int:
        """The bytes to reserve (and then `granted`) before `feed`ing this frame: the rest of its record's peak when
        the frame completes it, else 0. Raises WireError for a header that is refused (nothing is held for it)."""
        body = frame.WhichOneof("body")
        if data is None:
            data = frame.data
        if body == "record":
            rec = frame.record
            self._admitted = None
            self.admit(frame)
            single = len(data) == rec.payload_bytes
            need = check_peak(rec, self.loose + rec.payload_bytes - len(data))
            self._check_need(rec, need)
            self._admitted = frame
            return max(0, need - self.loose) if single and self.budget is not None else 0
        if body == "chunk" and self.completes(frame, data) and self.budget is not None:
            return max(0, self.need - self.held - len(data))
        return 0

    def completes(self, frame: pb.Frame, data: bytes | memoryview | None = None) -> bool:
        """True when this chunk frame would complete the record being assembled (the caller may join off-loop).
        `data`: the frame's data where the caller parsed it apart (protos.framing.parse_frame); else frame.data."""
        return (self.record is not None and frame.WhichOneof("body") == "chunk"
                and frame.chunk.seq == self.record.header.seq
                and self.filled + len(frame.data if data is None else data) == self.record.payload_bytes)

    def feed(self, frame: pb.Frame, data: bytes | memoryview | None = None
             ) -> tuple[pb.Record, bytes | memoryview] | None:
        """The complete record and its payload once `frame` completes one, else None (`take_reserved` then gives
        the budget bytes it holds). `data` as for `completes`; a payload that came in one frame is that frame's data
        as it is (a view into the message: no copy)."""
        body = frame.WhichOneof("body")
        if data is None:
            data = frame.data
        opened, self._opened = self._opened, None
        if body == "record":
            rec = frame.record
            self._admit_once(frame)
            self._keep()
            if len(data) == rec.payload_bytes:
                # The whole payload rode on this frame (records up to one chunk: the common case): use its bytes
                # as they are, without a second copy. Decoded tensors are read-only views; replay copies them.
                self._hand_over()
                return rec, data
            # The chunks are written into one buffer as they arrive (each byte is copied once more only); its pages
            # are taken as they are written, so a header announcing much and sending little holds little. The
            # first frame's data stays where it is until the next chunk comes (no copy for a record that stalls).
            self.record, self.filled = rec, len(data)
            if opened is not None and data is self._placed:   # read into the payload already (`place`)
                self.payload, self._placed = opened, None
            else:
                self._first = data
            self.need = check_peak(rec, self.held + rec.payload_bytes - len(data))
            self.started = self.last = time.monotonic()
            self.waited = self._waited_at_last = self.share_waited = 0.0
            if self.share is not None:
                self.share.started(id(self), self.started)
            return None
        elif body == "chunk":
            if self.record is None and frame.chunk.seq == self.refused_seq:
                return None   # the rest of a refused record: it was answered once
            if self.record is None or frame.chunk.seq != self.record.header.seq:
                raise WireError(f"chunk of record {frame.chunk.seq} without its record header")
            offset = frame.chunk.offset
            self.last = time.monotonic()
            self._waited_at_last = self.waited
        else:
            raise WireError(f"unexpected {body or 'empty'} frame inside a record")
        assert self.record is not None
        expected = self.record.payload_bytes
        if offset != self.filled or offset + len(data) > expected:
            rec = self.record
            self.reset()
            raise WireError(f"record {rec.header.seq}: chunk at offset {offset} (+{len(data)} bytes) does not continue "
                            f"the payload at {self.filled} of {rec.payload_bytes}")
        self._keep(len(data))   # the rest of the message (its framing) is given back once it is handled
        placed, self._placed = self._placed, None
        if data is not placed:
            self._buffer().write(offset, data)
        self.filled += len(data)
        if self.filled == expected:
            out = (self.record, memoryview(self.payload.map)[:expected])   # a pooled mapping may be longer
            self.record, self.payload, self.filled = None, None, 0
            if self.share is not None:
                self.share.ended(id(self))
            self._hand_over()
            return out
        return None

    def place(self, frame: pb.Frame, n: int) -> memoryview | None:
        """Where the `n` data bytes of this frame go in the payload being joined, for a reader that can put them
        there itself (the folder reads them from the file straight into it: the only copy they get): a chunk that
        continues the record being joined, or a record frame whose payload more chunks will complete (its payload
        is opened for it, within the record limit); None for any other frame (`feed` then refuses it or takes it
        as it is). `feed` the frame with the view returned as its data after filling it; nothing else of the frame
        is checked here, so what `before` and `feed` check and refuse stays where and as it was (a record frame
        refused there leaves its payload to the next frame)."""
        self._opened = None
        body = frame.WhichOneof("body")
        rec = self.record
        if body == "record":
            size = frame.record.payload_bytes
            if not n < size <= self.limits.max_record_bytes:   # one frame's record; a size refused: no mapping
                return None
            try:
                payload = self._opened = _Payload(size)
            except OSError:   # no mapping that large now: read as a whole, refused or joined as before
                return None
            payload.prepare(0, n)
            self._placed = memoryview(payload.map)[:n]
            return self._placed
        if (rec is None or body != "chunk" or frame.chunk.seq != rec.header.seq
                or frame.chunk.offset != self.filled or self.filled + n > rec.payload_bytes):
            return None
        payload = self._buffer()
        payload.prepare(self.filled, self.filled + n)
        self._placed = memoryview(payload.map)[self.filled:self.filled + n]
        return self._placed

    def _buffer(self) -> _Payload:
        """The buffer the record being assembled is joined in, made (with the first frame's data) when its second
        frame comes."""
        if self.payload is None:
            assert self.record is not None
            self.payload = _Payload(self.record.payload_bytes)
            self.payload.write(0, self._first)
            self._first = b""
        return self.payload

    def _hand_over(self) -> None:
        self.reserved += self.held + self.extra
        self._reserved_recv += self._held_recv
        self.held = self._held_recv = self.extra = 0
        self.need = 0

    def take_reserved(self) -> int:
        """The budget bytes of the record `feed` just returned: the caller releases them (via the intake, or the
        workers once it is checked). Its connection no longer holds it."""
        n, self.reserved = self.reserved, 0
        if self.share is not None and self._reserved_recv:
            self.share.release(self._reserved_recv)
        self._reserved_recv = 0
        return n

    def batch(self, frame: pb.Frame, data: bytes | memoryview) -> list[Part]:
        """The records of a Batch frame, each as (record, payload view, its peak, '', its bytes) or (record, view,
        0, why it is refused, its bytes). Raises WireError (nothing more is held) when the frame breaks the
        contract. Reserve the sum of the peaks, `granted` it, then `unbatch`. A record's bytes (its header: what
        the spool keeps) are made here once, for the estimate and the decoder alike."""
        out = []
        for rec, payload in split_batch(frame, self.limits, data):
            raw = rec.SerializeToString()
            need = check_peak(rec, len(payload) + len(raw), raw)
            try:
                self._check_need(rec, need)
            except WireError as exc:
                out.append((rec, payload, 0, str(exc), raw))
                continue
            out.append((rec, payload, need, "", raw))
        self.refused_seq = None
        return out

    def unbatch(self, parts: list[Part]) -> list[Part]:
        """Each record of a batch with its own copy of its payload and its peak reserved; the message (its bytes
        were granted beforehand as the sum of the peaks) is given back, so no record keeps the others' bytes."""
        out = [(rec, bytes(payload) if not why else b"", need, why, raw) for rec, payload, need, why, raw in parts]
        self.extra = 0      # the records' peaks go with them
        self.drop_loose()   # the message itself
        return out

    # -- time ----------------------------------------------------------------------------------------------------
    def pause(self) -> None:
        """The stream waits for the server's memory budget: not the client's fault, not counted against its rate."""
        if self.record is not None and self._wait_since is None:
            self._wait_since = time.monotonic()

    def resume(self) -> None:
        if self._wait_since is not None:
            self.waited += time.monotonic() - self._wait_since
            self._wait_since = None

    def _deadlines(self) -> dict[str, float]:
        lim = self.limits
        assert self.record is not None
        out = {"stall": self.last + lim.record_timeout_s + (self.waited - self._waited_at_last),
               "cap": self.started + lim.record_max_s}
        if lim.min_record_rate > 0:
            out["rate"] = self.started + self.waited + lim.record_timeout_s + self.filled / lim.min_record_rate
        return out

    def deadline(self) -> float | None:
        """Monotonic time by which the record being assembled must get its next frame; None when none is."""
        return None if self.record is None else min(self._deadlines().values())

    def cap_deadline(self) -> float | None:
        """When the record being assembled will have been half received for `Limits.record_max_s`."""
        return None if self.record is None else self.started + self.limits.record_max_s

    def late(self, now: float | None = None) -> str:
        """Why the record being assembled is cut now (its earliest deadline that passed), in words."""
        rec = self.record
        if rec is None:
            return "no record was being received"
        now = time.monotonic() if now is None else now
        passed = {k: v for k, v in self._deadlines().items() if v <= now + 0.05}
        which = min(passed, key=passed.__getitem__) if passed else "stall"
        lim = self.limits
        head = f"record {rec.header.seq}: {self.filled} of {rec.payload_bytes} payload bytes arrived"
        elapsed = now - self.started
        share = ""
        if self.share is not None and self.share_waited >= 0.05:
            share = (f"; for {self.share_waited:.1f} s of it its connection held its limit of "
                     f"{self.share.limit / MiB:g} MiB in records it had not finished sending, so none of its streams "
                     f"was read (gpu-server --connection-memory-mb {self.share.limit / MiB:g})")
        if which == "cap":
            waited = f"; the server's memory budget was full for {self.waited:.0f} s of it" if self.waited >= 1 else ""
            return (f"{head} in {elapsed:.0f} s, the longest a record may stay half received (gpu-server "
                    f"--record-max-s {lim.record_max_s:g}){waited}{share}")
        if which == "rate":
            active = max(elapsed - self.waited, 1e-9)
            return (f"{head} in {active:.1f} s ({self.filled / active / MiB:.3g} MiB/s), slower than the minimum of "
                    f"{lim.min_record_rate / MiB:g} MiB/s after the first {lim.record_timeout_s:g} s (gpu-server "
                    f"--min-record-rate-mb){share}")
        return f"{head}, then nothing for {lim.record_timeout_s:g} s (gpu-server --record-timeout-s){share}"

    def reset(self) -> None:
        """Drop the record being assembled and give back what it held."""
        if self.payload is not None and not PAYLOADS.limit:   # (a pooled mapping goes back to the pool)
            try:
                self.payload.map.close()
            except BufferError:   # a view `place` handed out is still held (a read cut off): freed with it
                pass
        self._first = b""
        self._placed = self._opened = None
        self._admitted = None
        if self.record is not None and self.share is not None:
            self.share.ended(id(self))
        self.record, self.payload, self.filled = None, None, 0
        self._give(self.held + self.extra, self._held_recv)
        self.held = self._held_recv = self.extra = 0
        self.need = 0
        self._wait_since = None

    def close(self) -> None:
        """The stream ended: give back everything it still holds."""
        self.reset()
        self.drop_loose()
        self._give(self.reserved, self._reserved_recv)
        self.reserved = self._reserved_recv = 0


_PRIVATE = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
_HUGE_ON, _HUGE_OFF = getattr(mmap, "MADV_HUGEPAGE", None), getattr(mmap, "MADV_NOHUGEPAGE", None)


class _Payload:
    """The buffer a record of several chunks is joined in: private anonymous memory whose pages are taken as they are
    written (never what the header announces), or, with the server's pool on, a mapping of the record's size class
    that an earlier record was joined in and nothing holds any more (gpu_server/intake/payload_pool.py: its pages
    were taken already; the record's view is cut to its own length).

    Fresh memory costs a page fault per 4 KiB page on its first touch, several times what copying the bytes in
    costs (a shared mapping, as `mmap.mmap(-1, n)` makes, costs more still). With `ONLINE_CHECK_HUGE_PAGES=1`
    (protos/huge_pages.py: off by default, it costs more than it saves on a virtual machine that returns freed
    memory to its host), each stretch of whole huge pages a chunk fills is asked for as huge pages (`madvise`, where
    the kernel has transparent huge pages). Only stretches a chunk is about to fill completely: the rest of the
    buffer stays in 4 KiB pages, so the memory taken is still the bytes received, rounded to 4 KiB at the ends."""

    __slots__ = ("map", "_base")

    def __init__(self, size: int):
        self._base = -1   # the mapping's address (huge pages are aligned to it), -1: no huge pages
        reused = PAYLOADS.take(size) if PAYLOADS.limit else None   # intake/payload_pool.py: pages already taken
        if reused is not None:
            self.map = reused
            PAYLOADS.keep(reused)
            return
        n = size_class(size) if PAYLOADS.limit else size
        self.map = mmap.mmap(-1, n, flags=_PRIVATE) if _PRIVATE else mmap.mmap(-1, n)
        PAYLOADS.keep(self.map)
        if _HUGE_ON is not None and _HUGE_OFF is not None and size >= thp.HUGE_PAGE:
            try:
                # whatever the system default: no huge page that a chunk does not fill (a record announced large
                # and sent short takes only what it sent)
                self.map.madvise(_HUGE_OFF)
                if thp.wanted():
                    pin = ctypes.c_char.from_buffer(self.map)
                    self._base = ctypes.addressof(pin)
                    del pin   # (it holds an export of the mapping, which cannot close while one is held)
            except (OSError, ValueError):
                self._base = -1

    def write(self, off: int, data: bytes | memoryview) -> None:
        end = off + len(data)
        self.prepare(off, end)
        copy_into(self.map, off, data)   # a large chunk without the interpreter lock (gpu_server/memcopy.py)

    def prepare(self, off: int, end: int) -> None:
        """[off, end) is about to be filled: its whole huge pages are asked for as such."""
        if self._base >= 0:
            lo, hi = thp.whole_huge_pages(self._base, off, end)
            if hi > lo:
                try:
                    self.map.madvise(_HUGE_ON, lo, hi - lo)
                except OSError:
                    pass
