"""The agent reads acknowledgements without protobuf messages (protos/framing.py `parse_ack`; docs/design.md §5,
"Records written as bytes"): every Ack, canonical or not, valid or not, reads as `pb.Ack.FromString` reads it (the
same four fields, or the same DecodeError), and the plain ones every server writes build no message."""
from __future__ import annotations

import random

import pytest
from google.protobuf.message import DecodeError

from protos import online_check_pb2 as pb
from protos.framing import AckView, parse_ack
from protos.record_bytes import varint


def _fields(ack) -> tuple[int, int, str, int]:
    return ack.seq, ack.status, ack.reason, ack.count


def _same(raw: bytes) -> AckView | pb.Ack | None:
    """parse_ack(raw) read as protobuf reads raw; None when both refuse it."""
    try:
        want = _fields(pb.Ack.FromString(raw))
    except DecodeError:
        with pytest.raises(DecodeError):
            parse_ack(raw)
        return None
    got = parse_ack(raw)
    assert _fields(got) == want, raw
    return got


def _acks() -> list[pb.Ack]:
    rng = random.Random(7)
    out = [pb.Ack(), pb.Ack(seq=1, status=pb.Ack.ACCEPTED), pb.Ack(seq=(1 << 63) - 1, status=pb.Ack.DUPLICATE, count=5),
           pb.Ack(seq=3, status=pb.Ack.REJECTED, reason="bytes do not match shape: naïve ✓ \u202e"),
           pb.Ack(status=pb.Ack.END_ACCEPTED), pb.Ack(reason="x" * 5000, count=1 << 40)]
    for _ in range(300):
        out.append(pb.Ack(seq=rng.getrandbits(rng.choice((7, 14, 35, 63))), status=rng.randrange(5),
                          reason="".join(chr(rng.randrange(32, 0x3000)) for _ in range(rng.randrange(0, 40))),
                          count=rng.getrandbits(rng.choice((1, 7, 20)))))
    return out


def test_the_acks_a_server_writes_are_read_without_protobuf():
    for ack in _acks():
        got = _same(ack.SerializeToString())
        assert isinstance(got, AckView), ack


def test_other_layouts_read_as_protobuf_reads_them():
    seq = b"\x08" + varint(300)
    cases = [
        b"\x20\x02" + seq + b"\x10\x01",                 # fields out of order
        seq + b"\x08\x07" + b"\x1a\x01a\x1a\x02bc",      # repeated: the last one counts
        b"\x10\x05", b"\x10" + b"\xff" * 9 + b"\x01",    # a status out of the enum, a negative one
        b"\x10" + varint(1 << 40), b"\x10" + varint((1 << 32) + 1),   # past 32 bits: protobuf keeps the low ones
        b"\x08" + b"\xff" * 9 + b"\x7f",               # 10 bytes past 64 bits: protobuf keeps the low ones
        b"\x08" + b"\x80" * 9 + b"\x01",                 # a 10-byte varint
        b"\x08" + b"\x80" * 10 + b"\x01",                # longer than protobuf allows
        b"\x08\x81\x80\x80\x80\x80\x80\x80\x80\x00",     # 9 bytes, not minimal
        b"\x1a\x02\xc3\x28", b"\x1a\x03\xed\xa0\x80",    # not UTF-8, an encoded surrogate
        b"\x1a\x05abc", b"\x08", b"\x08\x80",            # cut off
        b"\x28\x01", b"\x0a\x00", b"\x09" + bytes(8),    # another field, wrong wire types
        b"\x00", b"\x07",                                # field 0, an end-group
        seq + b"\x38\x05" + b"\x10\x01",                 # an unknown field between known ones
    ]
    for raw in cases:
        _same(raw)
    assert isinstance(parse_ack(b"\x20\x02" + seq + b"\x10\x01"), AckView)


def test_random_bytes_and_mutated_acks_read_as_protobuf_reads_them():
    rng = random.Random(11)
    acks = [a.SerializeToString() for a in _acks()]
    for i in range(5000):
        if i % 2:
            raw = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 24)))
        else:
            b = bytearray(rng.choice(acks))
            for _ in range(rng.randrange(1, 4)):
                if b:
                    b[rng.randrange(len(b))] = rng.getrandbits(8)
            raw = bytes(b[:rng.randrange(len(b) + 1)] if rng.random() < 0.3 else b)
        _same(raw)
