"""Where the records of one message are validated (gpu_server/intake/stream.py, `heavy`): on the event loop when it
is little work, whatever the payload's size (decoded tensors are views: a thread hand-off would cost more than the
check), on a thread when it is not (many records, large headers, a large strided tensor that decoding copies)."""
from __future__ import annotations

import torch

from gpu_server.config import ServerConfig
from gpu_server.intake import stream as stream_mod
from gpu_server.intake.admission import Intake
from gpu_server.intake.stream import Arrival, Call, RecordStream, heavy
from npu_agent.records import PendingRecord, batch_frame, encode_record
from npu_agent.snapshot import snapshot
from protos import online_check_pb2 as pb
from protos.limits import DEFAULT_LIMITS


def _record(seq: int, numel: int) -> PendingRecord:
    x = torch.linspace(-2, 2, numel)
    return PendingRecord(name=f"Functional.relu.{seq}", step=0, inputs=snapshot(((x,), {})), seq=seq)


def _steps(raw: bytes) -> tuple[list, list]:
    """Drive RecordStream.message(raw) by hand: (the Calls it asked for, the answers)."""
    jobs: list = []
    door = RecordStream(Intake(ServerConfig(), jobs.append), DEFAULT_LIMITS, None, "test", lambda end: None)
    steps = door.message(raw)
    calls, reply = [], None
    while True:
        try:
            step = steps.send(reply)
        except StopIteration as done:
            return calls, done.value
        assert isinstance(step, Call)
        calls.append(step)
        reply = step.fn(*step.args)


def test_one_large_record_is_validated_on_the_event_loop():
    rec = _record(0, 1 << 18)   # 1 MiB of float32 in one message
    enc = encode_record(rec, "inline", 0)
    (frame,) = list(enc.wire_frames(4 << 20))
    assert len(frame) > stream_mod.INLINE_BYTES
    calls, answers = _steps(bytes(frame))
    assert [c.heavy for c in calls] == [False]
    assert [(a.seq, a.status) for a in answers] == [(0, pb.Ack.ACCEPTED)]


def test_many_records_of_one_batch_are_validated_on_a_thread():
    few = [encode_record(_record(seq, 16), "inline", 0) for seq in range(stream_mod.INLINE_RECORDS)]
    calls, answers = _steps(batch_frame(few))
    assert [c.heavy for c in calls] == [False] and len(answers) == stream_mod.INLINE_RECORDS
    many = [encode_record(_record(seq, 16), "inline", 0) for seq in range(stream_mod.INLINE_RECORDS + 1)]
    calls, answers = _steps(batch_frame(many))
    assert [c.heavy for c in calls] == [True]
    assert all(a.status == pb.Ack.ACCEPTED for a in answers) and len(answers) == stream_mod.INLINE_RECORDS + 1


def _arrival(header_text: str = "", payload_bytes: int = 64, stride: tuple[int, ...] = ()) -> Arrival:
    rec = pb.Record()
    rec.header.name, rec.header.module = "Functional.relu.0", header_text
    meta = rec.tensors.add()
    meta.dtype, meta.nbytes = "float32", payload_bytes
    meta.shape.extend([payload_bytes // 4])
    meta.stride.extend(stride)
    rec.payload_bytes = payload_bytes
    return Arrival(rec, bytes(payload_bytes), 0, "")


def test_large_headers_and_large_strided_tensors_go_to_a_thread():
    assert not heavy([_arrival()])
    assert not heavy([_arrival(payload_bytes=16 << 20)])                 # bytes alone: views, no work
    assert heavy([_arrival("m" * (stream_mod.INLINE_HEADER_BYTES + 1))])  # decoding walks the header
    assert not heavy([_arrival(payload_bytes=1024, stride=(1,))])         # a small copy
    assert heavy([_arrival(payload_bytes=stream_mod.INLINE_BYTES + 4, stride=(1,))])   # decoding copies it
