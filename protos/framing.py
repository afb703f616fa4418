"""Records <-> gRPC messages (docs/design.md §5, "Frames"): the one place a record is cut into Frames, and small
records are put together into one.

A record whose payload fits one chunk travels in one Frame (the Record, then its payload in Frame.data); a larger
one is followed by Chunk frames. Several small, complete records may travel in one Batch frame: their Records,
then their payloads one after another in Frame.data. Either way the payload bytes are appended to the serialized
header by concatenation (Frame.data is field 15, the last on the wire), so each byte is copied once into the
message; and a batch is built by concatenating records serialized once each, never by copying messages.

`parse_frame` is the receiving side of every message: the Frame without its data, and the data as a view into the
received bytes (no copy). `split_batch` takes a Batch apart: it checks the frame against the limits before anything
is held.
"""
from __future__ import annotations

from collections.abc import Iterator

from protos import online_check_pb2 as pb
from protos.codec import WireError
from protos.limits import Limits
from protos.record_bytes import message, uint, varint

Buffers = list[tuple[int, memoryview]]   # (offset inside the payload, bytes); the gaps between them are zeros

# Frame field numbers and wire types, as online_check.proto declares them (tests/test_protos.py pins them).
_DATA_FIELD = 15           # Frame.data
DATA_TAG = bytes([_DATA_FIELD << 3 | 2])   # its tag, length-delimited (b"\x7a")
_BATCH_TAG = b"\x2a"       # Frame.batch = 5, length-delimited
_RECORD_TAG = b"\x0a"      # Batch.records = 1, length-delimited


def record_head(serialized: bytes) -> bytes:
    """`pb.Frame(record=record).SerializeToString()` from the Record's own bytes (`serialized`), without building
    a Frame: each protobuf message the agent makes is an allocation arena in protobuf's C library (upb), and that
    library calls the C allocator's malloc_trim(0) every 10,000 arena blocks it frees, which hands back every free
    page of the training process too, so that its next tensors fault in new pages (docs/design.md §5, "Records
    written as bytes")."""
    return message(1, serialized)   # Frame.record


def chunk_head(seq: int, offset: int) -> bytes:
    """`pb.Frame(chunk=pb.Chunk(seq=seq, offset=offset)).SerializeToString()`, built by hand (see record_head)."""
    return message(2, uint(1, seq) + uint(2, offset))   # Frame.chunk: Chunk.seq, Chunk.offset


def encode_frames(serialized: bytes, seq: int, buffers: Buffers, payload_bytes: int,
                  chunk_bytes: int) -> Iterator[bytes]:
    """Yield one record as Frame messages (bytes) carrying at most chunk_bytes of payload each: `serialized` is the
    Record's bytes (its payload_bytes set), `seq` its sequence number."""
    head = record_head(serialized)
    pos = 0
    cursor = _Cursor(buffers, payload_bytes)
    while True:
        n = min(chunk_bytes, payload_bytes - pos)
        prefix = head if pos == 0 else chunk_head(seq, pos)
        yield b"".join([prefix, DATA_TAG, varint(n), *cursor.take(n)]) if n else prefix
        pos += n
        if pos >= payload_bytes:
            return


def batch_head(serialized: list[bytes], total: int) -> bytes:
    """A Batch frame up to its data: the records (serialized, payload_bytes set), then the data field's tag and
    length when their payloads, `total` bytes in all, follow (each record's in order, nothing between them)."""
    parts: list[bytes] = []
    for record in serialized:
        parts += [_RECORD_TAG, varint(len(record)), record]
    batch = b"".join(parts)
    head = [_BATCH_TAG, varint(len(batch)), batch]
    if total:
        head += [DATA_TAG, varint(total)]
    return b"".join(head)


def encode_batch(records: list[tuple[bytes, Buffers, int]]) -> bytes:
    """One Batch frame of several complete records, given as (serialized Record with its payload_bytes set,
    payload buffers, payload bytes)."""
    total = sum(size for _, _, size in records)
    out: list[bytes | memoryview] = [batch_head([serialized for serialized, _, _ in records], total)]
    if total:
        for _, buffers, size in records:
            if len(buffers) == 1 and buffers[0][0] == 0 and buffers[0][1].nbytes == size:
                out.append(buffers[0][1])   # the whole payload in one buffer (every small record): as it is
            elif size:
                out += _Cursor(buffers, size).take(size)
    return b"".join(out)


def parse_frame(raw: bytes) -> tuple[pb.Frame, bytes | memoryview]:
    """A received message as (the Frame, its data). Raises DecodeError like `pb.Frame.FromString(raw)`.

    The data is what `pb.Frame.FromString(raw).data` holds, without the two copies protobuf makes (one parsing,
    one reading the field): when Frame.data appears once, as the last field (as every agent writes it), it is a
    view into `raw` and only the fields before it are parsed (the Frame returned then has no data). Any other
    layout, valid or not, is parsed by protobuf as a whole: same results, with the copies."""
    start = data_field_at(raw, len(raw))
    if start is None:
        frame = pb.Frame.FromString(raw)
        return frame, frame.data
    tag_at, data_at = start
    frame = pb.Frame.FromString(raw[:tag_at])
    return frame, memoryview(raw)[data_at:]


def data_field_at(raw: bytes, n: int) -> tuple[int, int] | None:
    """(where Frame.data's tag starts, where its bytes start) in an `n`-byte message of which `raw` holds the first
    bytes (all of them for `parse_frame`; the folder reads only a head first, then the data straight into its place,
    gpu_server/intake/folder.py), when Frame.data is the last field, the only one of its number, and every
    top-level field before it is well formed; else None. Every field before the data lies in `raw` when the data's
    bytes start there, and nothing follows the last field, so a head gives the answer the whole message gives; None
    also when `raw` ends before the data's bytes start."""
    pos = 0
    try:
        while pos < n:
            at = pos
            key, pos = _read_varint(raw, pos)
            field, wire = key >> 3, key & 7
            if wire == 2:
                length, pos = _read_varint(raw, pos)
                if field == _DATA_FIELD:
                    if pos + length != n:   # not the last field (so also not the only one): protobuf decides
                        return None
                    return at, pos   # the last field: nothing follows it
                pos += length
            elif wire == 0:
                _, pos = _read_varint(raw, pos)
            elif wire in (1, 5):
                pos += 8 if wire == 1 else 4
            else:
                return None   # groups and invalid wire types: protobuf decides
            if field == _DATA_FIELD and wire != 2:
                return None
    except IndexError:   # a cut-off message (or `raw` ends before the data's bytes start)
        return None
    return None   # no Frame.data, or the last field runs past the end: protobuf decides


def _read_varint(raw: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        b = raw[pos]   # IndexError at the end: a cut-off message
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise IndexError("varint longer than 10 bytes")


class AckView:
    """An acknowledgement as `parse_ack` read it: the fields of `pb.Ack`, without a protobuf message."""

    __slots__ = ("seq", "status", "reason", "count")

    def __init__(self, seq: int, status: int, reason: str, count: int) -> None:
        self.seq, self.status, self.reason, self.count = seq, status, reason, count


_ACK_SEQ, _ACK_STATUS, _ACK_REASON, _ACK_COUNT = 0x08, 0x10, 0x1A, 0x20   # Ack's keys: 1, 2, 4 varints, 3 a string
_ACK_STATUSES = frozenset(pb.Ack.Status.values())


def parse_ack(raw: bytes) -> AckView | pb.Ack:
    """An Ack the agent receives, as `pb.Ack.FromString(raw)` reads it (same fields, same DecodeError), without
    building a protobuf message when it is the plain kind every server writes: each message protobuf's library
    builds is an arena it frees, and it trims the process's heap every 10,000 (see `record_head`). Fields in any
    order and repeated (the last one counts); anything else (another field, a varint of 10 bytes, an unknown status,
    a reason that is not UTF-8, a cut-off message) is left to protobuf."""
    seq = status = count = 0
    reason = ""
    pos, n = 0, len(raw)
    try:
        while pos < n:
            key = raw[pos]
            pos += 1
            if key == _ACK_REASON:
                length, pos = _read_varint(raw, pos)
                if pos + length > n:
                    return pb.Ack.FromString(raw)
                reason = raw[pos:pos + length].decode()
                pos += length
                continue
            if key not in (_ACK_SEQ, _ACK_STATUS, _ACK_COUNT):
                return pb.Ack.FromString(raw)   # another field
            start = pos
            value, pos = _read_varint(raw, pos)
            if pos - start > 9:
                return pb.Ack.FromString(raw)
            if key == _ACK_SEQ:
                seq = value
            elif key == _ACK_COUNT:
                count = value
            elif value in _ACK_STATUSES:
                status = value
            else:
                return pb.Ack.FromString(raw)
    except (IndexError, UnicodeDecodeError):
        return pb.Ack.FromString(raw)
    return AckView(seq, status, reason, count)


def split_batch(frame: pb.Frame, limits: Limits, data: bytes | memoryview | None = None
                ) -> list[tuple[pb.Record, bytes | memoryview]]:
    """The records of a Batch frame, each with its own payload (views into `data`: the frame's data, by default
    frame.data). Raises WireError (nothing is held) when the frame breaks the contract: too many records, or payload
    sizes that do not add up to the data exactly."""
    records = frame.batch.records
    if data is None:
        data = frame.data
    if not records:
        raise WireError("a batch frame without records")
    if len(records) > limits.max_batch_records:
        raise WireError(f"a batch of {len(records)} records, above the limit of {limits.max_batch_records}")
    for rec in records:
        if rec.payload_bytes > limits.max_record_bytes:
            raise WireError(f"record {rec.header.seq} of a batch announces {rec.payload_bytes} payload bytes, above "
                            f"the limit of {limits.max_record_bytes}")
    total = sum(r.payload_bytes for r in records)
    if total != len(data):
        raise WireError(f"a batch of {len(records)} records announces {total} payload bytes but carries {len(data)}")
    out = []
    pos = 0
    for rec in records:
        out.append((rec, data[pos:pos + rec.payload_bytes]))
        pos += rec.payload_bytes
    return out


class _Cursor:
    """Walks a payload given as buffers at offsets, handing out consecutive pieces (zeros in the gaps)."""

    def __init__(self, buffers: Buffers, payload_bytes: int):
        self.buffers, self.payload_bytes = buffers, payload_bytes
        self.pos = 0
        self.bi = 0

    def take(self, want: int) -> list[bytes | memoryview]:
        pieces: list[bytes | memoryview] = []
        buffers = self.buffers
        while want > 0:
            if self.bi < len(buffers) and buffers[self.bi][0] <= self.pos:
                off, view = buffers[self.bi]
                start = self.pos - off
                take = min(want, view.nbytes - start)
                if take > 0:
                    pieces.append(view[start:start + take])
                    self.pos += take
                    want -= take
                if self.pos >= off + view.nbytes:
                    self.bi += 1
                continue
            gap_end = buffers[self.bi][0] if self.bi < len(buffers) else self.payload_bytes
            take = min(want, gap_end - self.pos)
            pieces.append(bytes(take))
            self.pos += take
            want -= take
        return pieces

