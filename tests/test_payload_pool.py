"""The memory records are joined in is reused (gpu_server/intake/payload_pool.py, PAYLOADS): only once nothing else
holds it, by size class, within the pool's limit (forgetting mappings still in use first); a record joined in reused
memory holds exactly its own bytes and its own length; a real server reusing it over gRPC checks every record with
its own values and says how often it reused."""
from __future__ import annotations

import mmap
import random
import time

import pytest
import torch

from gpu_server.intake import payload_pool
from gpu_server.intake.assembler import FrameAssembler
from gpu_server.intake.budget import ByteBudget
from gpu_server.intake.payload_pool import GRAIN, PAYLOADS, PayloadPool, size_class
from npu_agent.config import Endpoint
from npu_agent.records import PendingRecord
from npu_agent.sender import Sender
from npu_agent.snapshot import snapshot
from npu_agent.transport_grpc import GrpcTransport
from protos import online_check_pb2 as pb
from tests import support
from tests.test_durability import summary_of


def _map(n: int) -> mmap.mmap:
    return mmap.mmap(-1, n)


def test_size_classes_are_whole_grains():
    assert size_class(1) == GRAIN and size_class(GRAIN) == GRAIN and size_class(GRAIN + 1) == 2 * GRAIN


def test_a_mapping_is_handed_out_only_once_nothing_else_holds_it():
    pool = PayloadPool(16 * GRAIN)
    m = _map(2 * GRAIN)
    kept = id(m)
    pool.keep(m)
    view = memoryview(m)[:10]
    del m
    assert pool.take(2 * GRAIN - 5) is None    # a view of it is held (a job, a spool batch)
    view.release()
    assert pool.take(GRAIN) is None            # another class
    again = pool.take(2 * GRAIN - 5)
    assert id(again) == kept and pool.held == 0 and pool.reused == 1
    assert pool.take(2 * GRAIN) is None        # forgotten once handed out


def test_a_tensor_over_a_mapping_keeps_it_from_being_reused():
    pool = PayloadPool(16 * GRAIN)
    m = _map(GRAIN)
    pool.keep(m)
    t = torch.frombuffer(memoryview(m), dtype=torch.uint8, count=16)
    del m
    assert pool.take(GRAIN) is None
    del t
    assert pool.take(GRAIN) is not None


def test_over_the_limit_mappings_in_use_are_forgotten_first():
    pool = PayloadPool(3 * GRAIN)
    free_one, busy = _map(GRAIN), _map(GRAIN)
    ids = id(free_one), id(busy)
    pool.keep(free_one)
    pool.keep(busy)
    del free_one                               # only the pool holds it now
    newest = _map(2 * GRAIN)
    pool.keep(newest)                          # 4 grains > 3: the one in use goes, not the older free one
    assert pool.held == 3 * GRAIN
    assert id(pool.take(GRAIN)) == ids[0]
    del busy
    assert pool.take(GRAIN) is None            # forgotten: freed as before, never reused
    pool.keep(_map(8 * GRAIN))                 # larger than the whole pool: not kept
    assert pool.held == 2 * GRAIN


def test_a_closed_mapping_is_never_handed_out():
    pool = PayloadPool(4 * GRAIN)
    m = _map(GRAIN)
    pool.keep(m)
    m.close()
    del m
    assert pool.take(GRAIN) is None


def _record_frames(seq: int, payload: bytes, chunk: int) -> list[pb.Frame]:
    rec = pb.Record(payload_bytes=len(payload))
    rec.header.run_id, rec.header.rank, rec.header.seq = "pool", 0, seq
    frames = [pb.Frame(record=rec, data=payload[:chunk])]
    for off in range(chunk, len(payload), chunk):
        frames.append(pb.Frame(chunk=pb.Chunk(seq=seq, offset=off), data=payload[off:off + chunk]))
    return frames


def _join(asm: FrameAssembler, seq: int, payload: bytes, chunk: int = 300_000):
    done = None
    for frame in _record_frames(seq, payload, chunk):
        asm.arrived(frame.ByteSize())
        asm.granted(asm.before(frame))
        done = asm.feed(frame)
    assert done is not None
    asm.budget.release(asm.take_reserved())
    return done[1]


@pytest.fixture
def pool(monkeypatch):
    fresh = PayloadPool()
    monkeypatch.setattr(payload_pool, "PAYLOADS", fresh)
    import gpu_server.intake.assembler as assembler
    monkeypatch.setattr(assembler, "PAYLOADS", fresh)
    return fresh


def test_records_joined_in_reused_memory_hold_their_own_bytes_and_length(pool):
    asm = FrameAssembler(budget=ByteBudget(64 * GRAIN))   # the pool's limit: a quarter of the budget
    assert pool.limit == 16 * GRAIN
    rng = random.Random(0)
    first = rng.randbytes(GRAIN + 300_000)
    view = _join(asm, 1, first)
    assert len(view) == len(first) and bytes(view) == first
    shorter = rng.randbytes(GRAIN + 1000)                 # the same class, shorter: the old bytes past it stay hidden
    held = _join(asm, 2, shorter)                         # the first is still held: a mapping of its own
    assert pool.reused == 0 and bytes(view) == first and bytes(held) == shorter
    del view
    third = rng.randbytes(GRAIN + 5)
    again = _join(asm, 3, third)                          # joined where the first was
    assert pool.reused == 1
    assert len(again) == len(third) and bytes(again) == third and bytes(held) == shorter
    asm.close()


def _relu_record(seq: int, n: int) -> PendingRecord:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seq))
    return PendingRecord(name=f"Functional.relu.{seq}", step=0, inputs=snapshot(((x,), {})),
                         output=snapshot(torch.relu(x)), seq=seq)


def _rows(out: str) -> list[dict]:
    try:
        return support.read_csv(out, "accuracy_checking_result")
    except (FileNotFoundError, IndexError):
        return []


def test_a_server_reusing_payload_memory_checks_every_record_with_its_own_values(tmp_path):
    n = 6
    with support.Server(str(tmp_path)) as server:
        transport = GrpcTransport(Endpoint("127.0.0.1", server.port), "", "pool", 0, 1)
        sender = Sender(transport, budget_bytes=64 << 20)
        for i, seq in enumerate(range(10, 10 + n)):   # one after the other: each record's memory is free for the next
            sender.submit(_relu_record(seq, 1 << 20))   # 2 x 4 MiB: joined from chunks
            deadline = time.monotonic() + 60
            while len(_rows(server.out)) <= i:   # checked: its memory is let go
                assert time.monotonic() < deadline, "no row in 60 s"
                time.sleep(0.02)
        counts = sender.close(timeout=120)
        assert counts["acknowledged"] == n and counts["rejected"] == 0
    rows = support.read_csv(server.out, "accuracy_checking_result")
    assert sorted(int(r["API name"].rsplit(".", 1)[1]) for r in rows) == list(range(10, 10 + n))
    assert {r["Forward Test Success"] for r in rows} == {"pass"}, rows
    # how many: when the checking thread lets the record go after its row (4 of 6 here, 0 without the pool)
    assert summary_of(server.out)["memory"]["payloads_reused"] >= 1


def test_the_module_pool_is_the_assemblers():
    import gpu_server.intake.assembler as assembler
    assert assembler.PAYLOADS is PAYLOADS
