"""A hostile or broken client against a real gpu-server process on loopback (issue 11, findings 3, 5, the fake End,
the oversized record, strict names and forged log lines). The client speaks the wire contract of
protos/online_check.proto with a generic gRPC stream, as anyone who reaches the port could."""
from __future__ import annotations

import glob
import json
import os
import queue
import re
import threading
import time

import grpc
import pytest
import torch

from npu_agent.records import PendingRecord, encode_record
from npu_agent.snapshot import snapshot
from protos import online_check_pb2 as pb
from protos.contract import STREAM_METHOD
from protos.limits import API_NAME, RUN_ID, log_text, valid_call_name
from tests import support
from tests.test_durability import counts_of

METHOD = STREAM_METHOD
MiB = 1 << 20

TRAIN = support.SMALL_TRAIN   # argv: config (2 steps); prints COUNTS {json}


class RawStream:
    """One stream with a generic client: frames go out when `send` is called, acknowledgements are collected."""

    def __init__(self, port: int, timeout: float = 120):
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", -1),
                                                                            ("grpc.use_local_subchannel_pool", 1)])
        self._out: queue.Queue = queue.Queue()
        self.acks: list[pb.Ack] = []
        self.error: grpc.RpcError | None = None
        self._cv = threading.Condition()
        stub = self.channel.stream_stream(METHOD, request_serializer=None, response_deserializer=pb.Ack.FromString)
        self.call = stub(self._requests(), timeout=timeout)
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _requests(self):
        while True:
            item = self._out.get()
            if item is None:
                return
            yield item

    def _pump(self) -> None:
        try:
            for ack in self.call:
                with self._cv:
                    self.acks.append(ack)
                    self._cv.notify_all()
        except grpc.RpcError as exc:
            self.error = exc
        with self._cv:
            self._cv.notify_all()

    def send(self, *frames: bytes) -> "RawStream":
        for f in frames:
            self._out.put(f)
        return self

    def wait(self, n: int, timeout: float = 60) -> list[pb.Ack]:
        with self._cv:
            self._cv.wait_for(lambda: len(self.acks) >= n or not self._thread.is_alive(), timeout)
            return list(self.acks)

    def ended(self, timeout: float = 60) -> grpc.RpcError | None:
        self._thread.join(timeout)
        return self.error

    def close(self) -> None:
        self._out.put(None)
        self.call.cancel()
        self._thread.join(10)
        self.channel.close()


def hello(run_id: str = "hostile", rank: int = 0) -> bytes:
    return pb.Frame(hello=pb.Hello(run_id=run_id, rank=rank)).SerializeToString()


def relu_frames(run_id: str, seq: int, rank: int = 0) -> list[bytes]:
    x = torch.linspace(-2, 2, 8)
    rec = PendingRecord(name=f"Functional.relu.{seq}", step=0, inputs=snapshot(((x,), {})),
                        output=snapshot(torch.relu(x)), seq=seq)
    enc = encode_record(rec, run_id, rank)
    return list(enc.wire_frames(1 << 20))


def header(seq: int, payload_bytes: int, data: bytes = b"", run_id: str = "hostile") -> bytes:
    rec = pb.Record(header=pb.RecordHeader(run_id=run_id, rank=0, seq=seq, name=f"Functional.relu.{seq}",
                                           direction=pb.FORWARD), payload_bytes=payload_bytes)
    return pb.Frame(record=rec, data=data).SerializeToString()


def end(run_id: str, rank: int, last_seq: int = 0) -> bytes:
    return pb.Frame(end=pb.End(run_id=run_id, rank=rank, last_seq=last_seq, world_size=2)).SerializeToString()


def peak_rss(pid: int) -> int:
    return support.memory_of(pid, "VmHWM")


def test_a_stalled_stream_beside_a_healthy_training(tmp_path):
    """One stream announces the largest record it may (half the budget) and stalls; another announces 60 GiB. A real
    training beside them gets every record acknowledged and reported, without waiting for the stalled one (which
    holds the bytes it sent, not what it announced: tests/test_byte_budget.py)."""
    work = str(tmp_path)
    with support.Server(work, args=("--memory-mb", "64")) as srv:
        stalled = RawStream(srv.port).send(hello(), header(0, 32 * MiB, b"x" * 10))
        huge = RawStream(srv.port).send(hello("huge"), header(0, 60 << 30, b"x" * 10, run_id="huge"))
        acks = huge.wait(1)
        assert acks and acks[0].status == pb.Ack.REJECTED, acks
        assert "--max-record-mb" in acks[0].reason and "--memory-mb" in acks[0].reason, acks[0].reason
        cfg = support.agent_config(os.path.join(work, "agent.json"), srv.port, online_close_timeout_s=60)
        proc = support.run_training(TRAIN, cfg, timeout=120)
        counts = counts_of(proc)
        assert stalled.error is None and not stalled.acks, "the stalled stream is still open (not cut yet)"
        stalled.close()
        huge.close()
    assert counts["captured"] > 10 and counts["acknowledged"] == counts["captured"], counts
    with open(glob.glob(os.path.join(srv.out, "summary_*.json"))[0]) as fh:
        summary = json.load(fh)
    assert summary["records_received"] == {"0": counts["captured"]}, summary["records_received"]
    rows = support.read_csv(srv.out, "accuracy_checking_result")
    assert len(rows) >= 5 and not [r for r in rows if "SKIP" in (r["Forward Test Success"],
                                                                  r["Backward Test Success"])], rows
    assert "Traceback" not in srv.log()


def test_a_half_open_record_is_cut_after_the_deadline_and_its_memory_released(tmp_path):
    """Two streams stall mid-record, each announcing half the budget: after --record-timeout-s each is cut with the
    reason (nothing arrived for that long) and what it held is released; a record beside them is accepted meanwhile
    (they hold the bytes they sent, not what they announced)."""
    work = str(tmp_path)
    with support.Server(work, args=("--memory-mb", "64", "--record-timeout-s", "2")) as srv:
        first = RawStream(srv.port).send(hello("stall1"), header(0, 32 * MiB, b"x" * 10, run_id="stall1"))
        second = RawStream(srv.port).send(hello("stall2"), header(0, 32 * MiB, b"y" * 10, run_id="stall2"))
        time.sleep(0.5)
        healthy = RawStream(srv.port).send(hello("healthy"), *relu_frames("healthy", 0))
        acks = healthy.wait(1, timeout=60)
        errors = [first.ended(30), second.ended(30)]
        healthy.close()
    assert acks and acks[0].status == pb.Ack.ACCEPTED, acks
    for err in errors:
        assert err is not None and err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err
        assert "nothing for 2 s" in err.details() and "--record-timeout-s" in err.details(), err.details()
    log = srv.log()
    assert log.count("then nothing for 2 s") == 2, log[-2000:]
    rows = support.read_csv(srv.out, "accuracy_checking_result")
    assert [r["API name"] for r in rows] == ["Functional.relu.0"]


def test_a_poison_record_is_rejected_at_intake_never_spooled_and_a_restart_is_clean(tmp_path):
    """Finding 3: stride [0, 0] for shape [2, 2] made the decoder raise a plain RuntimeError after the record was
    spooled, and every restart died on it. Now: REJECTED at once with the reason, a SKIP row, nothing spooled."""
    work = str(tmp_path)
    poison = pb.Record(header=pb.RecordHeader(run_id="poison", rank=0, seq=0, name="Functional.relu.0",
                                              direction=pb.FORWARD),
                       tensors=[pb.TensorMeta(dtype="float32", shape=[2, 2], stride=[0, 0], nbytes=16, device="cpu")],
                       payload_bytes=16)
    poison.args.items.append(pb.Value(tensor=0))
    frame = pb.Frame(record=poison, data=bytes(16)).SerializeToString()
    srv = support.Server(work).start()
    try:
        stream = RawStream(srv.port).send(hello("poison"), frame, *relu_frames("poison", 1))
        acks = stream.wait(2)
        stream.close()
        segments = glob.glob(os.path.join(srv.out, "spool", "seg-*.spl"))
        spooled = b"".join(open(p, "rb").read() for p in segments)
    finally:
        srv.kill()   # no drain: what is in the spool is what a crash leaves
    assert [(a.seq, a.status) for a in acks] == [(0, pb.Ack.REJECTED), (1, pb.Ack.ACCEPTED)], acks
    assert "strides [0, 0] do not describe a dense, non-overlapping layout" in acks[0].reason, acks[0].reason
    assert poison.SerializeToString() not in spooled
    again = support.Server(work, out=srv.out).start()
    code = again.stop()
    assert code == 0, again.log()[-3000:]
    assert "Traceback" not in again.log()


def test_a_poison_record_already_in_the_spool_is_quarantined_on_restart(tmp_path):
    """A spool written before intake validated fully (or damaged in a way the checksums do not see) may hold a
    record that no longer decodes: the restart reports it as a SKIP row with the reason and goes on."""
    from gpu_server.spool.store import Spool

    out = str(tmp_path / "out")
    poison = pb.Record(header=pb.RecordHeader(run_id="old", rank=0, seq=0, name="Functional.relu.0",
                                              direction=pb.FORWARD),
                       tensors=[pb.TensorMeta(dtype="float32", shape=[2, 2], stride=[0, 0], nbytes=16, device="cpu")],
                       payload_bytes=16)
    poison.args.items.append(pb.Value(tensor=0))
    spool = Spool(out)
    spool.open("20260101000000")
    spool.append(poison, bytearray(16)).wait(30)
    spool.close()
    srv = support.Server(str(tmp_path), out=out).start()
    code = srv.stop()
    assert code == 0, srv.log()[-3000:]
    assert "Traceback" not in srv.log()
    rows = support.read_csv(out, "accuracy_checking_result")
    assert [(r["API name"], r["Forward Test Success"]) for r in rows] == [("Functional.relu.0", "SKIP")], rows
    assert "dense, non-overlapping" in rows[0]["Message"], rows[0]


def test_memory_mb_bounds_one_record(tmp_path):
    """Finding: a 512 MiB record with --memory-mb 64 took the server to 2.65 GB. The largest record is derived
    from the budget (half of it by default); a larger one is refused at its header, its chunks dropped unread, and
    the stream goes on. --max-record-mb above --memory-mb is refused at start."""
    work = str(tmp_path)
    with support.Server(work, args=("--memory-mb", "64")) as srv:
        stream = RawStream(srv.port).send(hello(), *relu_frames("hostile", 0))
        assert stream.wait(1)[0].status == pb.Ack.ACCEPTED
        time.sleep(1.0)   # the first record is checked: the workers are warm
        base = peak_rss(srv.proc.pid)
        chunk = bytes(4 * MiB)
        total = 512 * MiB
        stream.send(header(1, total, chunk))
        for off in range(4 * MiB, total, 4 * MiB):
            stream.send(pb.Frame(chunk=pb.Chunk(seq=1, offset=off), data=chunk).SerializeToString())
        stream.send(*relu_frames("hostile", 2))
        acks = stream.wait(3)[1:]
        stream.close()
        peak = peak_rss(srv.proc.pid)
    assert [(a.seq, a.status) for a in acks] == [(1, pb.Ack.REJECTED), (2, pb.Ack.ACCEPTED)], acks
    reason = acks[0].reason
    assert "512.0 MiB" in reason and "32.0 MiB" in reason and "--max-record-mb" in reason and "--memory-mb" in reason
    print(f"\nserver peak RSS {peak / MiB:.0f} MiB ({base / MiB:.0f} MiB before the 512 MiB record)")
    # 4 MiB frames in flight and the allocator's slack (about 110 MiB measured), never the 512 MiB record
    assert peak - base < 192 * MiB, (base / MiB, peak / MiB)
    (tmp_path / "cli").mkdir()
    bad = support.Server(str(tmp_path / "cli"), args=("--memory-mb", "64", "--max-record-mb", "100"))
    with pytest.raises(RuntimeError, match=r"--max-record-mb 100 is more than the memory budget \(64 MiB"):
        bad.start()


def test_fake_ends_do_not_count_and_wire_strings_cannot_forge_log_lines(tmp_path):
    """Ends for (run, rank) pairs that sent nothing are acknowledged but not counted toward --exit-when-done; a
    run id carrying a newline and a forged log line is escaped in the log and rejected in a record."""
    work = str(tmp_path)
    srv = support.Server(work, args=("--exit-when-done", "--world-size", "2")).start()
    try:
        forged = "x\n[gpu-server] ERROR forged line"
        fake = RawStream(srv.port).send(hello(forged), end("ghost", 0), end("ghost", 1),
                                        *relu_frames(forged, 0))
        acks = fake.wait(3)
        fake.close()
        time.sleep(1.0)
        assert srv.proc.poll() is None, "fake ends made the server exit"
        real = RawStream(srv.port)
        real.send(hello("real", 0), *relu_frames("real", 0, rank=0), hello("real", 1), *relu_frames("real", 0, rank=1))
        real.wait(2)
        real.send(end("real", 0, 1), end("real", 1, 1))
        real_acks = real.wait(4)
        real.close()
        code = srv.proc.wait(timeout=120)
    finally:
        if srv.proc.poll() is None:
            srv.stop()
    assert code == 0
    assert [a.status for a in acks[:2]] == [pb.Ack.END_ACCEPTED] * 2 and all("not counted" in a.reason
                                                                           for a in acks[:2]), acks
    assert acks[2].status == pb.Ack.REJECTED and "run id" in acks[2].reason
    assert [a.status for a in real_acks] == [pb.Ack.ACCEPTED] * 2 + [pb.Ack.END_ACCEPTED] * 2, real_acks
    assert all(not a.reason for a in real_acks[2:])
    log = srv.log()
    assert not re.search(r"^\[gpu-server\] ERROR forged", log, re.M), log
    assert "x\\n[gpu-server] ERROR forged" in log
    assert "end message of run ghost rank 0 not counted" in log


def test_strict_names():
    for bad in ("Functional.linear.0\n", "Functional.linear.\u0663", "Functional.linear.0 ", "Functional.lin\u0435ar.0",
                "Functional.linear.\uff10", "Functional.linear\n.0"):
        assert valid_call_name(bad) is None, repr(bad)
    assert valid_call_name("Functional.linear.12").groups() == ("Functional", "linear", "12")
    for bad in ("run\n", "r\u00e9n", "run\u0663", "", "x" * 65):
        assert not RUN_ID.match(bad), repr(bad)
    assert RUN_ID.match("run-1_A") and API_NAME.match("linear") and not API_NAME.match("linear\n")
    assert "\n" not in log_text("a\nb\r\x1b[31m") and log_text("a\nb") == "a\\nb"
    assert log_text("y" * 100, 10) == "y" * 10 + "..."


def test_the_budget_grants_in_order_without_starving_and_a_cancelled_wait_holds_nothing():
    import asyncio

    from gpu_server.intake.budget import ByteBudget

    async def scenario():
        budget = ByteBudget(100)
        budget.AGING_S = 30.0   # no request ages by itself while the test runs, however slowly
        await budget.acquire_async(60)
        big = asyncio.ensure_future(budget.acquire_async(80))
        await asyncio.sleep(0.01)
        small = asyncio.ensure_future(budget.acquire_async(30))
        await asyncio.sleep(0.01)
        assert small.done() and not big.done(), "a small request that fits passes a large one that does not"
        for waiter in budget._waiters:   # the large one has now waited past AGING_S
            waiter.since -= 60
        late = asyncio.ensure_future(budget.acquire_async(5))
        await asyncio.sleep(0.01)
        budget.release(1)   # the large one has waited past AGING_S: nobody passes it any more
        await asyncio.sleep(0.01)
        assert not late.done() and budget.held == 89
        budget.release(59)
        budget.release(30)
        await asyncio.sleep(0.01)
        assert big.done() and late.done() and budget.held == 85
        cancelled = asyncio.ensure_future(budget.acquire_async(50))
        await asyncio.sleep(0.01)
        held = budget.held
        cancelled.cancel()
        await asyncio.sleep(0.01)
        assert budget.held == held and not budget._waiters, "a cancelled wait holds nothing"
        return budget

    budget = asyncio.run(scenario())
    assert budget.peak == 90
    assert ByteBudget(10).acquire(20), "one request above the whole budget passes alone (a spool replay)"
    b = ByteBudget(10)
    b.acquire(8)
    assert not b.acquire(5, cancelled=lambda: True), "a thread that gives up holds nothing"
    assert b.held == 8
