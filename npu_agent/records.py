"""A captured call as it waits on the agent (snapshots, not yet encoded), and its encoding into wire frames.

Encoding runs on the sender thread. It copies each tensor once, straight from the training's memory into the
record's payload (the layout the codec defines: 64-byte aligned, contiguous, padding zeroed; where the bytes go:
npu_agent/payload.py), with the copy-on-write
handshake of npu_agent.snapshot: a tensor changed without a copy is never sent; its record goes out skipped, with
the reason. The encoding is kept on the record (a re-send after a reconnect sends the same bytes) and the
references to the training's tensors are dropped.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from npu_agent.location import MAX_TEXT
from npu_agent.payload import (
    _BYTES_DATA,
    FRAMES_IN_PLACE,
    FilePayload,
    FramePayload,
    Region,
    SmallPayload,
    Spans,
    _uninitialised_bytes,
    pwrite_all,
)
from npu_agent.snapshot import HELD, Snapshot
from protos import online_check_pb2 as pb
from protos import record_bytes as wire
from protos.codec import _ALIGN, _DTYPE_NAMES, dtype_name
from protos.folder_format import FOLDER_MAGIC, FRAME_LENGTH, file_chunks
from protos.framing import batch_head, encode_batch, encode_frames, record_head
from protos.limits import CHUNK_BYTES
from protos.record_bytes import RecordEncoder

FORWARD, BACKWARD = pb.FORWARD, pb.BACKWARD
log = logging.getLogger("npu_agent")

CHANGED_REASON = ("a captured tensor was changed in place by code the capture mode did not see before the agent "
                  "could send it; the record is not sent with the changed value")


@dataclasses.dataclass(slots=True)
class CollectiveCall:
    """Where a torch.distributed call sits among the ranks (wire: pb.Collective; npu_agent/collectives.py fills it)."""

    job: str                      # the training, the same on every rank
    group: str                    # the process group's name; "p2p" for send/recv
    ranks: tuple[int, ...]        # members as global ranks in group-rank order; p2p: (source, destination)
    seq: int                      # this group's collectives on this rank, from 0; p2p: messages source -> destination
    op: str = ""                  # reduce op ("sum", "avg", ...), "" when none
    root: int = -1                # src/dst/peer as a global rank, -1 when none
    async_op: bool = False
    error: str = ""               # the call raised: its message
    unfinished: bool = False      # its output was never taken


@dataclasses.dataclass(slots=True)
class PendingRecord:
    name: str                         # "Functional.linear.0"
    step: int
    direction: pb.Direction = FORWARD
    inputs: Snapshot | None = None    # forward: (args, kwargs) before the call
    output: Snapshot | None = None    # forward: the result after the call
    grad_output: Snapshot | None = None
    grad_input: Snapshot | None = None
    grad_input_positions: tuple[int, ...] = ()
    grad_enabled: bool = False
    autocast: tuple[bool, str, str] = (False, "", "")
    inplace: bool = False
    backward_expected: bool = False
    rng_state: bytes = b""
    rng_device: str = ""
    mask: Any = None                  # dropout family: the true keep-mask (bool tensor)
    skip_reason: str = ""
    module: str = ""                  # the module path it ran in ("TinyLM.blocks.0.attn"; npu_agent.location)
    source: str = ""                  # the user's line that made the call ("train.py:42 (forward)")
    collective: CollectiveCall | None = None   # a torch.distributed call: its group and place in it
    seq: int = -1                     # assigned when the sender accepts it
    held_bytes: int = 0               # what it counts against the sender's budget (`nbytes` when accepted)
    encoded: Encoded | None = None    # once encoded (then the snapshots are let go)

    @property
    def nbytes(self) -> int:
        total = sum(s.nbytes for s in (self.inputs, self.output, self.grad_output, self.grad_input) if s)
        if self.mask is not None:
            total += self.mask.numel()
        return total + len(self.rng_state)


class Encoded:
    """A record ready for the wire: the Record (`serialized`: its bytes, payload_bytes set; protos/record_bytes.py),
    and its payload in one buffer (small records) or its complete `frames` (large ones, written straight into them:
    npu_agent/payload.py).

    It is what an encoded record keeps until the server acknowledges it, so it is kept to few objects the garbage
    collector tracks (a record alive across collections is promoted; enough promotions start a full collection of
    the training's whole heap): no per-buffer tuples or views until `buffers` is asked for."""

    __slots__ = ("serialized", "seq", "_data", "size", "frames", "later", "in_file", "batch")

    def __init__(self, serialized: bytes, seq: int, data: bytes | bytearray | memoryview | None, size: int,
                 frames: list[bytes] | None = None, later: _Later | None = None) -> None:
        self.serialized, self.seq = serialized, seq
        self._data, self.size, self.frames, self.later = data, size, frames, later
        self.in_file = False   # written by write_file: the payload is in that file only (read_back gets it again)
        self.batch: _Together | None = None   # encoded with others straight into their Batch frame

    @property
    def record(self) -> pb.Record:
        """The Record as protobuf reads it (tests, tools: the agent itself never builds one)."""
        return pb.Record.FromString(self.serialized)

    @property
    def buffers(self) -> list[tuple[int, memoryview]]:
        if self.frames is not None:
            raise ValueError("this record's payload was written straight into its frames: use wire_frames()")
        if self.later is not None or self.in_file:
            raise ValueError("this record's tensors are copied into a file (write_file), not into memory")
        return [(0, memoryview(self._data))] if self._data else []

    def wire_frames(self, chunk_bytes: int) -> Iterable[bytes]:
        """The record's frames (any chunking below the limit is valid on the wire)."""
        if self.frames is not None:
            return self.frames
        return encode_frames(self.serialized, self.seq, self.buffers, self.size, chunk_bytes)


class _Later:
    """What a record encoded with `defer=True` keeps until its tensors are copied into a file (`write_file`): its
    layout, its snapshots and the arguments to encode it again (skipped) should a tensor turn out changed."""

    __slots__ = ("enc", "snaps", "head", "run_id", "rank", "chunk_bytes")

    def __init__(self, enc: _PayloadEncoder, snaps: list[Snapshot], head: bytes, run_id: str, rank: int,
                 chunk_bytes: int) -> None:
        self.enc, self.snaps, self.head = enc, snaps, head
        self.run_id, self.rank, self.chunk_bytes = run_id, rank, chunk_bytes


def write_file(rec: PendingRecord, fd: int, at: int = 0) -> int:
    """Write record `rec` (encoded with `defer=True`) into file `fd` from offset `at`, exactly the bytes
    `file_chunks(wire_frames())` would give, each tensor copied once by the kernel straight from the training's
    memory into the file (npu_agent/payload.py `FilePayload`), with the copy-on-write handshake of npu_agent.snapshot.
    Returns the bytes written. A tensor found changed without a copy makes the record skipped (the file then holds
    that record instead). On an error nothing is let go: the call may be repeated (on a fresh file)."""
    done = rec.encoded
    assert done is not None
    later = done.later
    if later is None:   # copied already (a small record, or written once before): the frames as they are
        return write_frames(fd, at, done.wire_frames(CHUNK_BYTES))
    target = FilePayload(fd, at, later.head, rec.seq, later.enc.size, later.chunk_bytes, later.enc.places)
    changed = later.enc.copy_into(target, later.snaps)
    if changed:
        rec.encoded = None
        os.ftruncate(fd, at)
        enc = encode_record(rec, later.run_id, later.rank, later.chunk_bytes, changed=changed)
        return write_frames(fd, at, enc.wire_frames(later.chunk_bytes))
    done.later, done.in_file = None, True
    _let_go(rec)
    return target.end - at


def read_back(rec: PendingRecord, fd: int, at: int, end: int) -> None:
    """Take the frames of a record that `write_file` put in file `fd` (from `at` to `end`) back into memory, for a
    record whose file could not be published after all (fsync or rename failed): it is written again from them."""
    done = rec.encoded
    assert done is not None and done.in_file
    data = os.pread(fd, end - at, at)
    if len(data) != end - at or not data.startswith(FOLDER_MAGIC):
        raise OSError(f"record {rec.seq}: read {len(data)} of the {end - at} bytes written")
    frames, pos = [], len(FOLDER_MAGIC)
    while pos < len(data):
        (n,) = FRAME_LENGTH.unpack_from(data, pos)
        frames.append(_pool_frame(data, pos + FRAME_LENGTH.size, n))
        pos += FRAME_LENGTH.size + n
    done.frames, done.in_file = frames, False


def _pool_frame(data: bytes, start: int, n: int) -> bytes:
    """`data[start:start + n]`, in a frame made by the frame pool (npu_agent/payload.py): the frames of an
    acknowledged record go back to it, which lengthens a frame up to its size class, so it must be given no other
    bytes object. One copy, from `data`'s own memory."""
    if not FRAMES_IN_PLACE:
        return data[start:start + n]
    frame, addr = _uninitialised_bytes(n)
    ctypes.memmove(addr, id(data) + _BYTES_DATA + start, n)
    return frame


def write_frames(fd: int, at: int, frames: Iterable[bytes]) -> int:
    """Write serialized frames as a record file holds them (`protos.folder_format.file_chunks`) from offset `at`."""
    pos = at
    for piece in file_chunks(frames):
        pos += pwrite_all(fd, piece, pos)
    return pos - at


def batch_frame(encoded: list[Encoded]) -> bytes | None:
    """One Batch frame carrying several encoded records, or None when they cannot share one: fewer than two, or a
    payload that was written straight into its own frames or file (a large record). Records encoded together
    (`encode_together`) and sent together as they were get the frame they were written into."""
    if len(encoded) < 2 or any(enc.frames is not None or enc.later is not None or enc.in_file for enc in encoded):
        return None
    shared = encoded[0].batch
    if shared is not None and shared.seqs == tuple(enc.seq for enc in encoded) \
            and all(enc.batch is shared for enc in encoded):
        return shared.frame
    return encode_batch([(enc.serialized, enc.buffers, enc.size) for enc in encoded])


class _Together:
    """The Batch frame records were encoded into together, and their sequence numbers in its order."""

    __slots__ = ("frame", "seqs", "given")

    def __init__(self, frame: bytes, seqs: tuple[int, ...]) -> None:
        self.frame, self.seqs = frame, seqs
        self.given = False   # to the frame pool, by the sender, once the first of the records is acknowledged


def encode_together(recs: list[PendingRecord], run_id: str, rank: int) -> bool:
    """Encode small records that travel in one Batch frame straight into that frame: each tensor is copied once,
    from the training's memory into the frame (not into a payload, then with the others into the frame). Each
    record's payload is its slice of the frame (for a re-send in another batch). The frame's bytes are exactly
    `encode_batch`'s. False, with nothing done, when that does not apply (fewer than two, one encoded already, a
    large one, or frames cannot be written in place): then each is encoded alone. A record with a tensor found
    changed goes out skipped, as `encode_record` sends it; the others keep their slices, in a frame not sent."""
    if len(recs) < 2 or not FRAMES_IN_PLACE or any(rec.encoded is not None for rec in recs):
        return False
    laid = [_encode(rec, run_id, rank, CHUNK_BYTES, layout_only=True) for rec in recs]
    if any(enc.size > _SMALL for _, enc, _ in laid):
        return False
    total = sum(enc.size for _, enc, _ in laid)
    head = batch_head([out for out, _, _ in laid], total)
    frame, addr = _uninitialised_bytes(len(head) + total)
    ctypes.memmove(addr, head, len(head))
    view = memoryview(frame)
    at = len(head)
    changed: list[list[int]] = []
    for _, enc, snaps in laid:
        changed.append(enc.copy_into(Region(addr + at, enc.size, enc.places), snaps))
        enc.data = view[at:at + enc.size] if enc.size else None
        at += enc.size
    shared = None if any(changed) else _Together(frame, tuple(rec.seq for rec in recs))
    for rec, (out, enc, _), bad in zip(recs, laid, changed):
        if bad:
            encode_record(rec, run_id, rank, changed=bad)
            continue
        rec.encoded = Encoded(out, rec.seq, enc.data, enc.size)
        rec.encoded.batch = shared
        _let_go(rec)
    return True


class _PayloadEncoder(RecordEncoder):
    """RecordEncoder that only lays tensors out (their TensorMeta and their offset); `copy_payload()` copies them
    into one payload."""

    def __init__(self) -> None:
        super().__init__()
        self.places: list[tuple[int, int, torch.Tensor]] = []   # (offset, nbytes, tensor as referenced)
        self.frames: list[bytes] | None = None
        self.data: bytes | bytearray | memoryview | None = None
        self.later: list[Snapshot] | None = None   # defer: the snapshots whose tensors write_file copies

    def tensor(self, t: torch.Tensor, requires_grad: bool | None = None, device: str | None = None) -> int:
        if t.layout != torch.strided:
            raise TypeError(f"{t.layout} tensors are not supported on the wire")
        stride = _clone_stride(t) if not t.is_contiguous() else None
        nbytes = t.numel() * t.element_size()
        self.size = (self.size + _ALIGN - 1) // _ALIGN * _ALIGN
        self.metas.append(wire.tensor_entry(dtype_name(t.dtype), t.shape, stride or (), self.size, nbytes,
                                            t.requires_grad if requires_grad is None else requires_grad,
                                            device or _device_name(t.device)))
        self.places.append((self.size, nbytes, t))
        self.size += nbytes
        return len(self.metas) - 1

    def copy_payload(self, snaps: list[Snapshot], head: Callable[[], bytes], seq: int, chunk_bytes: int) -> list[int]:
        """Copy every tensor into the payload; returns the ids of tensors found changed (not sendable). `head()`:
        the serialized Frame carrying the Record (complete but for the payload), for a payload written straight
        into its frames."""
        target: SmallPayload | FramePayload
        if self.size > _SMALL and FRAMES_IN_PLACE:
            target = FramePayload(head(), seq, self.size, chunk_bytes, self.places)
        else:
            target = SmallPayload(self.size, self.places)
        changed = self.copy_into(target, snaps)
        if isinstance(target, FramePayload):
            self.data, self.frames = None, target.frames
        else:
            self.data, self.frames = target.close(), None
        return changed

    def copy_into(self, target: Spans, snaps: list[Snapshot]) -> list[int]:
        """Copy every tensor into `target` under the copy-on-write handshake; the ids of tensors found changed."""
        reads = [(s, HELD.begin(s)) for s in snaps]
        source = {tid: src for _, read in reads for tid, src in read}
        walker().copy_places(target, self.places, source, target.one_span())
        changed: list[int] = []
        again: dict[int, torch.Tensor] = {}
        for s, read in reads:
            a, c = HELD.finish(s, read)
            again.update(a)
            changed += c
        if again:
            for off, nbytes, t in self.places:
                if id(t) in again and nbytes:
                    target.copy(off, nbytes, again[id(t)])
        return changed


_SMALL = 256 << 10   # larger payloads are written straight into their frames
_AUTOCAST: dict[tuple[bool, str, str], bytes] = {}   # Record.autocast's bytes by (enabled, dtype, device type)
_GRAD_ENABLED, _INPLACE, _BACKWARD_EXPECTED = wire.boolean(7, True), wire.boolean(9, True), wire.boolean(13, True)
_DEVICE_NAMES: dict[torch.device, str] = {}


def _device_name(device: torch.device) -> str:
    name = _DEVICE_NAMES.get(device)
    if name is None:
        name = _DEVICE_NAMES[device] = str(device)
    return name


def _clone_stride(t: torch.Tensor) -> tuple[int, ...] | None:
    """The strides a private clone of non-contiguous `t` has: t's own when t is dense (a transpose, channels last),
    None (row-major) when it is a view into a larger storage (a slice)."""
    if t.dim() in (4, 5):   # clone may pick channels-last for a non-dense view: ask torch
        layout = torch.empty_like(t, device="meta")
        return None if layout.is_contiguous() else layout.stride()
    expect = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expect:
            return None
        expect *= size
    return t.stride()


def encode_record(rec: PendingRecord, run_id: str, rank: int, chunk_bytes: int = CHUNK_BYTES,
                  defer: bool = False, changed: list[int] | None = None) -> Encoded:
    """Write the Record and its payload (each tensor copied once from the training's memory; a large
    payload straight into frames of at most chunk_bytes). A record is encoded once; later calls (re-sends) return
    the same encoding. `defer`: a large payload is only laid out; `write_file` copies it later, straight into a
    file. `changed`: tensors found changed already (the record goes out skipped)."""
    if rec.encoded is not None:
        return rec.encoded
    if not changed:
        out, enc, changed = _encode(rec, run_id, rank, chunk_bytes, defer=defer)
        if enc.later is not None:
            rec.encoded = Encoded(out, rec.seq, None, enc.size, None,
                                  _Later(enc, enc.later, record_head(out), run_id, rank, chunk_bytes))
            return rec.encoded
    if changed:
        with HELD.lock:
            first = HELD.changed == len(changed)
        if first:
            log.warning("online check: %s (%s, step %d); further such records are counted", CHANGED_REASON,
                        rec.name, rec.step)
        rec.skip_reason = CHANGED_REASON
        for s in (rec.inputs, rec.output, rec.grad_output, rec.grad_input):
            if s is not None:
                s.tree = None
        out, enc, _ = _encode(rec, run_id, rank, chunk_bytes, with_tensors=False)
    done = rec.encoded = Encoded(out, rec.seq, enc.data, enc.size, enc.frames)
    _let_go(rec)
    return done


def _let_go(rec: PendingRecord) -> None:
    """The payload holds the values now: let the training's tensors go, and the snapshots and the mask (an encoded
    record waiting for its acknowledgement holds only its encoding)."""
    for s in (rec.inputs, rec.output, rec.grad_output, rec.grad_input):
        if s is not None:
            s.tree = None
            s.held = {}
    rec.inputs = rec.output = rec.grad_output = rec.grad_input = rec.mask = None


def _encode(rec: PendingRecord, run_id: str, rank: int, chunk_bytes: int, with_tensors: bool = True,
            defer: bool = False, layout_only: bool = False) -> tuple[bytes, _PayloadEncoder, Any]:
    """(the Record's bytes, its encoder, the ids of tensors found changed); `layout_only`: the Record and the
    layout, with the snapshots to copy from in place of the ids (encode_together copies them). The Record is
    written as bytes, fields in number order (protos/record_bytes.py)."""
    enc = _PayloadEncoder()
    walk = walker()
    snaps: list[Snapshot] = []
    args = kwargs = output = grad_output = grad_input = positions = b""
    if with_tensors:
        if rec.inputs is not None and rec.inputs.tree is not None:
            grads = rec.inputs.requires_grad
            hook = lambda t: {"requires_grad": id(t) in grads}  # noqa: E731
            tree_args, tree_kwargs = rec.inputs.tree
            args = wire.message(4, walk.sequence(enc, tree_args, grads, hook))
            kwargs = wire.message(5, walk.mapping(enc, tree_kwargs, grads, hook))
            snaps.append(rec.inputs)
        trees = []
        for field, snap in ((6, rec.output), (11, rec.grad_output), (12, rec.grad_input)):
            if snap is not None and snap.tree is not None:
                trees.append(wire.message(field, walk.value(enc, snap.tree, None, _not_requiring_grad)))
                snaps.append(snap)
            else:
                trees.append(b"")
        output, grad_output, grad_input = trees
        if rec.grad_input is not None:
            positions = wire.packed(15, rec.grad_input_positions)
    random = b""
    if rec.rng_state or rec.mask is not None:
        mask = b""
        if rec.mask is not None and with_tensors:
            mask = wire.uint(3, enc.tensor(rec.mask, requires_grad=False)) + wire.boolean(4, True)
        random = wire.message(10, wire.raw(1, rec.rng_state) + wire.string(2, rec.rng_device) + mask)
    autocast = _AUTOCAST.get(rec.autocast)
    if autocast is None:
        enabled, dtype, device_type = rec.autocast
        autocast = _AUTOCAST[rec.autocast] = wire.message(
            8, wire.boolean(1, enabled) + wire.string(2, dtype) + wire.string(3, device_type))
    collective = b""
    if rec.collective is not None:
        c = rec.collective
        collective = wire.message(17, b"".join((
            wire.string(1, c.job), wire.string(2, c.group), wire.packed(3, c.ranks), wire.uint(4, c.seq),
            wire.string(5, c.op), wire.sint32(6, c.root), wire.boolean(7, c.async_op),
            wire.string(8, c.error[:MAX_TEXT]), wire.boolean(9, c.unfinished))))
    out = walk.record(
        (run_id, rank, rec.step, rec.seq, rec.name, rec.direction, rec.module[:MAX_TEXT], rec.source[:MAX_TEXT]),
        enc.metas, enc.size,
        (args, kwargs, output, _GRAD_ENABLED if rec.grad_enabled else b"", autocast, _INPLACE if rec.inplace else b"",
         random, grad_output, grad_input, _BACKWARD_EXPECTED if rec.backward_expected else b"",
         wire.string(14, rec.skip_reason), positions,
         wire.uint(16, torch.get_num_threads() if rec.autocast[2] in ("cpu", "") else 0), collective))
    if layout_only:
        return out, enc, snaps
    if defer and enc.size > _SMALL:
        enc.later = snaps
        return out, enc, []
    changed = enc.copy_payload(snaps, lambda: record_head(out), rec.seq, chunk_bytes)
    return out, enc, changed


def _not_requiring_grad(t: torch.Tensor) -> dict[str, Any]:
    return {"requires_grad": False}


class PythonWalk:
    """A record's values written by its encoder's own methods (protos.record_bytes.RecordEncoder), its tensors
    copied by the target's. `grads`: the ids of the tensors that require grad, or None (none does): what `hook`
    answers. npu_agent/_fastencode.c has the same five functions and writes the same bytes
    (tests/test_fastencode.py)."""

    @staticmethod
    def sequence(enc: _PayloadEncoder, items: Any, grads: Any, hook: Callable[[torch.Tensor], dict[str, Any]]
                 ) -> bytes:
        return enc.sequence(items, hook)

    @staticmethod
    def mapping(enc: _PayloadEncoder, obj: dict[str, Any], grads: Any, hook: Callable[[torch.Tensor], dict[str, Any]]
                ) -> bytes:
        return enc.mapping(obj, hook)

    @staticmethod
    def value(enc: _PayloadEncoder, obj: Any, grads: Any, hook: Callable[[torch.Tensor], dict[str, Any]]) -> bytes:
        return enc.value(obj, hook)

    @staticmethod
    def record(head: tuple[str, int, int, int, str, int, str, str], metas: list[bytes], size: int,
               tail: tuple[bytes, ...]) -> bytes:
        """The Record's bytes: its header (`head`: run id, rank, step, seq, name, direction, module, source), its
        tensor table, the payload's size, then `tail`, its other fields as written already."""
        run_id, rank, step, seq, name, direction, module, source = head
        header = wire.message(1, b"".join((
            wire.string_seen(1, run_id), wire.uint(2, rank), wire.uint(3, step), wire.uint(4, seq),
            wire.string(5, name), wire.uint(6, direction), wire.string_seen(7, module), wire.string_seen(8, source))))
        return b"".join((header, *metas, wire.uint(3, size), *tail))

    @staticmethod
    def copy_places(target: Spans, places: list[tuple[int, int, torch.Tensor]], source: dict[int, torch.Tensor],
                    addr: int) -> None:
        """Each place's tensor, or its copy-on-write source (`source[id(tensor)]`), into the target. (`addr`, the
        target's one span or 0, is what the compiled copy writes to directly.)"""
        for off, nbytes, t in places:
            if nbytes:
                target.copy(off, nbytes, source.get(id(t), t))


_WALK: list[Any] = []   # the walk `_encode` uses: the compiled module or PythonWalk, chosen at the first record


def walker() -> Any:
    """npu_agent/_fastencode.c where it is built and loads (npu_agent.compiled), else PythonWalk; chosen once."""
    if not _WALK:
        # imported here: `python -m npu_agent.compiled` imports the package first
        from npu_agent.compiled import ENCODE

        module = ENCODE.load()
        if module is not None and type(torch.Tensor).__instancecheck__ is not type.__instancecheck__:
            module = None   # the C walk takes a subclass check for isinstance(obj, torch.Tensor)
        if module is not None:
            module.configure(torch.Tensor, torch.nn.Parameter, torch.Size, torch.dtype, torch.strided, _DTYPE_NAMES,
                             _DEVICE_NAMES, _ALIGN)
        _WALK.append(module if module is not None else PythonWalk)
    return _WALK[0]


@contextlib.contextmanager
def walking(walk: Any) -> Iterator[None]:
    """Records encoded meanwhile use `walk` (PythonWalk, or the compiled module): how tests/test_fastencode.py and
    bench/encode.py run both paths in one process."""
    keep = list(_WALK)
    _WALK[:] = [walk]
    try:
        yield
    finally:
        _WALK[:] = keep
