"""Records <-> gRPC messages (docs/design.md §5, "Frames"): the one place a record is cut into Frames, and small
records are put together into one.

A record whose payload fits one chunk travels in one Frame (the Record, then its payload in Frame.data); a larger
one is followed by Chunk frames. Several small, complete records may travel in one Batch frame: their Records,
then their payloads one after another in Frame.data. Either way the payload bytes are appended to the serialized
header by concatenation (Frame.data is field 15, the last on the wire), so each byte is copied once into the
message; and a batch is built by concatenating records serialized once each, never by copying messages.

`split_batch` is the receiving side of a Batch: it checks the frame against the limits before anything is held.
"""
from __future__ import annotations

from collections.abc import Iterator

from protos import online_check_pb2 as pb
from protos.codec import WireError
from protos.limits import Limits

Buffers = list[tuple[int, memoryview]]   # (offset inside the payload, bytes); the gaps between them are zeros

# Frame field numbers and wire types, as online_check.proto declares them (tests/test_protos.py pins them).
DATA_TAG = b"\x7a"        # Frame.data = 15, length-delimited
_BATCH_TAG = b"\x2a"       # Frame.batch = 5, length-delimited
_RECORD_TAG = b"\x0a"      # Batch.records = 1, length-delimited


def encode_frames(record: pb.Record, buffers: Buffers, payload_bytes: int, chunk_bytes: int) -> Iterator[bytes]:
    """Yield one record as Frame messages (bytes) carrying at most chunk_bytes of payload each."""
    record.payload_bytes = payload_bytes
    seq = record.header.seq
    head = pb.Frame(record=record).SerializeToString()
    pos = 0
    cursor = _Cursor(buffers, payload_bytes)
    while True:
        n = min(chunk_bytes, payload_bytes - pos)
        prefix = head if pos == 0 else pb.Frame(chunk=pb.Chunk(seq=seq, offset=pos)).SerializeToString()
        yield b"".join([prefix, DATA_TAG, varint(n), *cursor.take(n)]) if n else prefix
        pos += n
        if pos >= payload_bytes:
            return


def encode_batch(records: list[tuple[bytes, Buffers, int]]) -> bytes:
    """One Batch frame of several complete records, given as (serialized Record with its payload_bytes set,
    payload buffers, payload bytes)."""
    parts: list[bytes | memoryview] = []
    for serialized, _, _ in records:
        parts += [_RECORD_TAG, varint(len(serialized)), serialized]
    batch = b"".join(parts)
    total = sum(size for _, _, size in records)
    out: list[bytes | memoryview] = [_BATCH_TAG, varint(len(batch)), batch]
    if total:
        out += [DATA_TAG, varint(total)]
        for _, buffers, size in records:
            out += _Cursor(buffers, size).take(size)
    return b"".join(out)


def split_batch(frame: pb.Frame, limits: Limits) -> list[tuple[pb.Record, bytes]]:
    """The records of a Batch frame, each with its own payload. Raises WireError (nothing is held) when the frame
    breaks the contract: too many records, or payload sizes that do not add up to Frame.data exactly."""
    records = frame.batch.records
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


def varint(n: int) -> bytes:
    """Protobuf's base-128 varint of a non-negative integer."""
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)
