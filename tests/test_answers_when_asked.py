"""Answers when asked (docs/design.md §5): an agent that says in its Hello that it asks for its answers gets
ASKS_TAKEN from the server, and from its first Ask on, the server holds the answers of its messages until the next
Ask, an End, the stream's end, or its bound. An agent that never asks is answered message by message, as before.

A real gpu-server process on loopback; the raw side is a generic gRPC client writing the frames an agent writes
(tests/support.py `stream_acks`), the agent side the real Sender and GrpcTransport. Held answers show as one Ack
covering records that came in several messages: a server that answers message by message writes one Ack per
message, whatever the timing."""
from __future__ import annotations

import time

import torch

from npu_agent.records import PendingRecord, encode_record
from npu_agent.snapshot import snapshot
from protos import online_check_pb2 as pb
from tests import support

RECORDS = 5


def hello(run_id: str, asks: bool) -> bytes:
    return pb.Frame(hello=pb.Hello(run_id=run_id, rank=0, world_size=1, asks=asks)).SerializeToString()


ASK = pb.Frame(ask=pb.Ask()).SerializeToString()


def record(run_id: str, seq: int) -> bytes:
    """One relu record alone in its message (one frame)."""
    x = torch.linspace(-2, 2, 8) + seq
    rec = PendingRecord(name=f"Functional.relu.{seq}", step=0, inputs=snapshot(((x,), {})),
                        output=snapshot(torch.relu(x)), seq=seq)
    (frame,) = encode_record(rec, run_id, 0).wire_frames(1 << 20)
    return frame


def end(run_id: str, n: int) -> bytes:
    return pb.Frame(end=pb.End(run_id=run_id, rank=0, captured=n, sent=n, acknowledged=n, last_seq=n)
                    ).SerializeToString()


def covered(acks) -> list[int]:
    """The record numbers the ACCEPTED answers cover, in order."""
    return [seq for a in acks if a.status == pb.Ack.ACCEPTED for seq in range(a.seq, a.seq + max(1, a.count))]


def records_answered(n: int):
    return lambda acks: len(covered(acks)) >= n


def test_held_answers_come_as_one_when_the_agent_asks(tmp_path):
    records = [record("asked", i) for i in range(RECORDS)]
    with support.Server(str(tmp_path), args=("--replay-in", "thread")) as srv:
        acks = support.stream_acks(srv.port, [hello("asked", True), ASK, *records, ASK], records_answered(RECORDS))
    assert acks[0].status == pb.Ack.ASKS_TAKEN
    answers = acks[1:]
    # five messages, one answer: they were held until the Ask and merged
    assert [(a.status, a.seq, a.count) for a in answers] == [(pb.Ack.ACCEPTED, 0, RECORDS)], answers


def test_an_agent_that_does_not_ask_is_answered_message_by_message(tmp_path):
    records = [record("plain", i) for i in range(RECORDS)]
    with support.Server(str(tmp_path), args=("--replay-in", "thread")) as srv:
        acks = support.stream_acks(srv.port, [hello("plain", False), *records], records_answered(RECORDS))
        # an agent that asks, before its first Ask: every message answered at once, as for one that never asks
        first = support.stream_acks(srv.port, [hello("first", True), *[record("first", i) for i in range(RECORDS)]],
                                    records_answered(RECORDS))
    assert [(a.status, a.seq, a.count) for a in acks] == [(pb.Ack.ACCEPTED, i, 0) for i in range(RECORDS)], acks
    assert first[0].status == pb.Ack.ASKS_TAKEN
    assert [(a.seq, max(1, a.count)) for a in first[1:]] == [(i, 1) for i in range(RECORDS)], first


def test_an_end_sends_what_is_held_before_its_own_answer(tmp_path):
    records = [record("ended", i) for i in range(RECORDS)]
    with support.Server(str(tmp_path), args=("--replay-in", "thread")) as srv:
        acks = support.stream_acks(srv.port, [hello("ended", True), ASK, *records, end("ended", RECORDS)],
                                   lambda acks: any(a.status == pb.Ack.END_ACCEPTED for a in acks))
    assert [(a.status, a.seq, a.count) for a in acks[1:]] == [(pb.Ack.ACCEPTED, 0, RECORDS),
                                                              (pb.Ack.END_ACCEPTED, RECORDS, 0)], acks


def test_an_agent_that_stops_asking_still_gets_its_answers_at_the_bound(tmp_path):
    """An agent that asked once and never again holds the server to HELD_MESSAGES messages of answers: the answers
    of the first HELD_MESSAGES messages come together, unasked."""
    from gpu_server.intake.grpc_service import HELD_MESSAGES

    n = HELD_MESSAGES + 3
    records = [record("silent", i) for i in range(n)]
    with support.Server(str(tmp_path), args=("--replay-in", "thread")) as srv:
        acks = support.stream_acks(srv.port, [hello("silent", True), ASK, *records], records_answered(HELD_MESSAGES),
                                   timeout=120)
    assert [(a.status, a.seq, a.count) for a in acks[1:]] == [(pb.Ack.ACCEPTED, 0, HELD_MESSAGES)], acks


def test_the_agent_asks_and_every_record_is_acknowledged(tmp_path, monkeypatch):
    """The real Sender on a GrpcTransport: the server takes its asks, every record is acknowledged by `close()`, and
    far fewer answers than records come back. Each record (300 KiB, above npu_agent/sender.py's BATCH_RECORD_BYTES)
    travels in a message of its own, so an agent that did not ask would get an answer per record. The sender's idle
    ask is put off here (a busy machine pausing this loop for ASK_AFTER_S between two records would make it ask for
    each): it asks at a quarter of its budget and when `close()` waits (tests/test_frame_pool.py's slow sender gets
    every answer from its idle asks)."""
    from npu_agent import sender as sender_module
    from npu_agent.config import Endpoint
    from npu_agent.sender import Sender
    from npu_agent.transport_grpc import GrpcTransport

    monkeypatch.setattr(sender_module, "ASK_AFTER_S", 3600.0)

    n = 64
    with support.Server(str(tmp_path), args=("--replay-in", "thread")) as srv:
        transport = GrpcTransport(Endpoint("127.0.0.1", srv.port), "", "agent", 0, 1)
        sender = Sender(transport, budget_bytes=64 << 20)
        answers: list[int] = []
        on_ack = sender.on_ack

        def counting(seq: int, status: str, reason: str, count: int = 1) -> None:
            answers.append(count)
            on_ack(seq, status, reason, count)

        sender.on_ack = counting   # type: ignore[method-assign]
        # the stream's server takes asks (the records sent before the agent's first Ask are answered one by one)
        deadline = time.monotonic() + 60
        while transport._asked_on != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        for i in range(n):
            x = torch.full((300 * 256,), float(i))
            sender.submit(PendingRecord(name=f"Functional.relu.{i}", step=0, inputs=snapshot(((x,), {})),
                                        output=snapshot(torch.relu(x))))
        counts = sender.close(timeout=120)
        asked_on = transport._asked_on
    assert asked_on == 1   # the first stream's server took the agent's asks
    assert counts["acknowledged"] == n and counts["unacknowledged"] == 0 and counts["dropped"] == 0, counts
    assert sum(answers) == n
    assert len(answers) <= n // 4, f"{len(answers)} answers for {n} records"
