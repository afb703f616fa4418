"""The receiving side of every message (protos.framing.parse_frame): the data of a frame as every agent writes it is
a view into the received bytes (no copy), and whatever the bytes are, the (frame, data) pair is exactly what
protobuf's own parser gives, or the same DecodeError."""
from __future__ import annotations

import pytest
import torch
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from npu_agent.records import PendingRecord, batch_frame, encode_record
from npu_agent.snapshot import snapshot
from protos import online_check_pb2 as pb
from protos.framing import DATA_TAG, parse_frame
from protos.record_bytes import varint

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)


def _record(seq: int, n: int) -> PendingRecord:
    x = torch.linspace(-2, 2, n)
    return PendingRecord(name=f"Functional.relu.{seq}", step=0, inputs=snapshot(((x,), {})),
                         output=snapshot(torch.relu(x)), seq=seq)


def _agent_frames() -> list[bytes]:
    """Frames as the agent sends them: a record alone, a record in chunks, a batch, an end, a hello."""
    enc = encode_record(_record(0, 64), "parse", 0)
    big_enc = encode_record(_record(1, 3000), "parse", 0, chunk_bytes=4096)
    small = [encode_record(_record(2 + i, 16), "parse", 0) for i in range(3)]
    batch = batch_frame(small)
    assert batch is not None
    return [*enc.wire_frames(1 << 20), *big_enc.wire_frames(4096), batch,
            pb.Frame(end=pb.End(run_id="parse", rank=0, last_seq=4)).SerializeToString(),
            pb.Frame(hello=pb.Hello(run_id="parse", rank=0, world_size=1)).SerializeToString()]


def _protobufs(raw: bytes) -> tuple[pb.Frame, bytes] | type[DecodeError]:
    try:
        frame = pb.Frame.FromString(raw)
    except DecodeError:
        return DecodeError
    data = frame.data
    frame.ClearField("data")
    return frame, data


def _ours(raw: bytes) -> tuple[pb.Frame, bytes] | type[DecodeError]:
    try:
        frame, data = parse_frame(raw)
    except DecodeError:
        return DecodeError
    frame = pb.Frame.FromString(frame.SerializeToString())   # a copy to clear: the original stays as returned
    frame.ClearField("data")
    return frame, bytes(data)


def test_an_agents_data_is_a_view_into_the_message_and_nothing_else_changes():
    views, with_data = 0, 0
    for raw in _agent_frames():
        with_data += bool(pb.Frame.FromString(raw).data)
        frame, data = parse_frame(raw)
        assert _ours(raw) == _protobufs(raw)
        if isinstance(data, memoryview):
            views += 1
            assert data.obj is raw            # no copy of the payload
            assert not frame.data             # the frame was parsed without it
    assert views == with_data >= 4            # every frame that has data (the record, the chunks, the batch)


@pytest.mark.parametrize("layout", ["data first", "data twice", "data as a varint", "cut in the data",
                                    "cut in a length", "a group", "empty"])
def test_other_layouts_are_left_to_protobuf(layout):
    head = pb.Frame(chunk=pb.Chunk(seq=7, offset=64)).SerializeToString()
    data = DATA_TAG + varint(5) + b"abcde"
    raw = {"data first": data + head, "data twice": head + data + DATA_TAG + varint(2) + b"xy",
           "data as a varint": head + b"\x78\x05", "cut in the data": head + DATA_TAG + varint(9) + b"abc",
           "cut in a length": head + DATA_TAG + b"\x85", "a group": head + b"\x7b\x7c" + data, "empty": b""}[layout]
    assert _ours(raw) == _protobufs(raw)
    if layout in ("data first", "data twice"):
        assert not isinstance(parse_frame(raw)[1], memoryview)   # valid, but not the agent's layout: protobuf's parse


@FUZZ
@given(st.data())
def test_any_bytes_parse_as_protobuf_parses_them(data):
    frames = _agent_frames()
    raw = bytearray(data.draw(st.sampled_from(frames)))
    for _ in range(data.draw(st.integers(0, 3))):   # flip, cut or insert bytes anywhere, the header included
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        at = data.draw(st.integers(0, len(raw)))
        if op == "flip" and at < len(raw):
            raw[at] ^= data.draw(st.integers(1, 255))
        elif op == "cut":
            del raw[at:]
        else:
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=8))
    assert _ours(bytes(raw)) == _protobufs(bytes(raw))
