"""Thousands of agents per server (issue 11, finding 4): a real gpu-server process with `--max-streams 1024` serves
1,024 concurrent agent streams on loopback (each one acknowledged and reported), refuses the 1,025th with
RESOURCE_EXHAUSTED and a message naming the limit and the fix, logs the refusal, and serves a new stream as soon
as one closes. The client is a light `grpc.aio` one (64 streams per connection), written against the wire
contract in protos/online_check.proto."""
from __future__ import annotations

import asyncio
import os
import time

import grpc
import torch

from npu_agent.records import PendingRecord, encode_record
from npu_agent.snapshot import snapshot
from protos import online_check_pb2 as pb
from protos.contract import STREAM_METHOD
from tests import support

METHOD = STREAM_METHOD
STREAMS = 1024
PER_CONNECTION = 64


def record_frames(run_id: str, seq: int = 0) -> list[bytes]:
    x = torch.linspace(-2, 2, 8)
    rec = PendingRecord(name="Functional.relu.0", step=0, inputs=snapshot(((x,), {})), output=snapshot(torch.relu(x)),
                        seq=seq)
    enc = encode_record(rec, run_id, 0)
    return list(enc.wire_frames(1 << 20))


def hello(run_id: str) -> bytes:
    return pb.Frame(hello=pb.Hello(run_id=run_id, rank=0, world_size=1)).SerializeToString()


def end(run_id: str) -> bytes:
    return pb.Frame(end=pb.End(run_id=run_id, rank=0, captured=1, sent=1, acknowledged=1, last_seq=1)
                    ).SerializeToString()


async def many_agents(port: int) -> dict:
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(STREAMS // PER_CONNECTION + 1)]
    try:
        calls = []
        for i in range(STREAMS):
            stub = channels[i // PER_CONNECTION].stream_stream(METHOD, request_serializer=None,
                                                                response_deserializer=pb.Ack.FromString)
            call = stub(timeout=120)
            await call.write(hello(f"many{i}"))
            for frame in record_frames(f"many{i}"):
                await call.write(frame)
            calls.append(call)
        acks = await asyncio.gather(*(call.read() for call in calls))
        # every stream is open and answered: one more is refused, with the reason
        extra = channels[-1].stream_stream(METHOD, request_serializer=None, response_deserializer=pb.Ack.FromString)
        refused = extra(timeout=60)
        try:
            # no write first: the server refuses as the stream opens, and a client write that loses the race with
            # the refusal makes grpc.aio set the call's status to INTERNAL locally, hiding the server's answer
            await refused.read()
            refusal = None
        except grpc.aio.AioRpcError as err:
            refusal = (err.code(), err.details())
        # one agent leaves: a new one is served
        await calls[0].write(end("many0"))
        end_ack = await calls[0].read()
        await calls[0].done_writing()
        await calls[0].read()
        await asyncio.sleep(0.2)
        late = extra(timeout=60)
        await late.write(hello("late"))
        for frame in record_frames("late"):
            await late.write(frame)
        late_ack = await late.read()
        calls[0] = late
        for call, run_id in zip(calls, ["late"] + [f"many{i}" for i in range(1, STREAMS)]):
            await call.write(end(run_id))
        ends = await asyncio.gather(*(call.read() for call in calls))
        for call in calls:
            await call.done_writing()
        return {"acks": acks, "refusal": refusal, "end": end_ack, "late": late_ack, "ends": ends}
    finally:
        for ch in channels:
            await ch.close()


def test_1024_streams_are_served_and_the_1025th_is_refused_with_the_reason(tmp_path):
    work = str(tmp_path)
    srv = support.Server(work, args=("--max-streams", str(STREAMS))).start()
    try:
        got = asyncio.run(many_agents(srv.port))
    finally:
        code = srv.stop()
    assert code == 0, srv.log()[-3000:]
    assert len(got["acks"]) == STREAMS
    assert all(a.status == pb.Ack.ACCEPTED and a.seq == 0 for a in got["acks"]), {a.status for a in got["acks"]}
    assert got["refusal"] is not None, "the 1,025th stream was served"
    status, details = got["refusal"]
    assert status == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-streams 1024" in details and "several servers" in details, details
    assert got["end"].status == pb.Ack.END_ACCEPTED
    assert got["late"].status == pb.Ack.ACCEPTED, "a stream is served again once one closed"
    assert all(a.status == pb.Ack.END_ACCEPTED for a in got["ends"])
    log = srv.log()
    assert "refused a stream from" in log and "the limit (--max-streams) is 1024" in log, log[-3000:]
    rows = support.read_csv(srv.out, "accuracy_checking_result")
    assert len(rows) == STREAMS + 1, len(rows)   # every agent's record is reported, the late one's too
    assert {r["Forward Test Success"] for r in rows} == {"pass"}
    assert "Traceback" not in log
    assert os.path.isdir(srv.out)


def test_an_agent_over_the_limit_logs_why_and_gets_in_once_a_slot_frees(tmp_path):
    """A real training against a server whose only stream slot is taken: its agent logs the server's reason (the
    limit and the fix), keeps its records, and delivers them all once the slot frees."""
    from tests.test_hostile import TRAIN, RawStream, counts_of

    work = str(tmp_path)
    with support.Server(work, args=("--max-streams", "1")) as srv:
        holder = RawStream(srv.port).send(hello("holder"))
        cfg = support.agent_config(os.path.join(work, "agent.json"), srv.port, online_max_retry_s=1,
                                   online_close_timeout_s=120)
        t = support.Training(TRAIN, cfg, timeout=180)
        deadline = time.time() + 120
        while "refused a stream from" not in srv.log() and time.time() < deadline and t.is_alive():
            time.sleep(0.1)
        refused_while_training = t.is_alive()
        holder.close()
        t.join(180)
    proc = t.result(0)
    assert refused_while_training, "the training finished before it was refused: the test proves nothing"
    counts = counts_of(proc)
    assert counts["captured"] > 0 and counts["acknowledged"] == counts["captured"], counts
    assert "RESOURCE_EXHAUSTED" in proc.stderr and "--max-streams 1" in proc.stderr, proc.stderr[-3000:]
    assert "the limit (--max-streams) is 1" in srv.log()


class _SlowToFinish:
    """A stream handler whose streams, once cancelled, take a while to finish (as ours do while an intake or ack
    thread answers): `GrpcServer.stop` must wait for them, or stopping the loop destroys them mid-flight and gRPC
    logs a `GeneratorExit` traceback per stream."""
    budget = None
    peak = refused = cut = 0

    def __init__(self, limits):
        self.limits = limits
        self.open = 0
        self.finished = 0

    async def stream(self, request_iterator, context):
        self.open += 1
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.3)
            self.finished += 1
        yield pb.Ack()

    def close(self) -> None:
        pass


def test_stopping_the_server_lets_every_stream_finish_before_its_loop_ends():
    from gpu_server.intake.admission import Limits
    from gpu_server.intake.grpc_service import GrpcServer

    handler = _SlowToFinish(Limits())
    server = GrpcServer(handler, "127.0.0.1:0", handler.limits)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        stub = channel.stream_stream(METHOD, request_serializer=None, response_deserializer=pb.Ack.FromString)
        calls = [stub(iter(()), timeout=60) for _ in range(20)]
        deadline = time.time() + 30
        while handler.open < len(calls) and time.time() < deadline:
            time.sleep(0.05)
        assert handler.open == len(calls)
        server.stop(grace=0.1).wait()
        pending = [t for t in asyncio.all_tasks(server._loop) if not t.done()]
        assert not pending, f"{len(pending)} tasks left pending on the stopped loop, e.g. {pending[0]!r}"
        assert handler.finished == len(calls)
    finally:
        channel.close()
