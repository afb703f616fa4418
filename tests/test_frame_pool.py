"""Frames are reused (npu_agent/payload.py, FRAMES): only once nothing else holds them, for any frame of their size
class at the length asked for, never above the pool's limit, a reused frame forgets the hash of what it held, and a
real agent reusing them against a real server gets every record through with its own values."""
from __future__ import annotations

import ctypes
import threading
import time

import pytest
import torch

from npu_agent import payload
from npu_agent.config import Endpoint
from npu_agent.payload import FRAMES, FramePool
from npu_agent.records import PendingRecord
from npu_agent.sender import Sender
from npu_agent.snapshot import snapshot
from npu_agent.transport_grpc import GrpcTransport
from tests import support

pytestmark = pytest.mark.skipif(payload._HASH_SLOT is None, reason="frames are reused on CPython only")


def _write(b: bytes, fill: bytes) -> None:
    ctypes.memmove(id(b) + payload._BYTES_DATA, fill, len(fill))


def test_a_frame_is_handed_out_only_once_nothing_else_holds_it():
    pool = FramePool(1 << 22)
    mine = pool.frame(100_000)
    kept = id(mine)
    pool.give([mine])                       # still held here (as gRPC holds the message it wrote last)
    assert pool.held == payload.frame_class(100_000)
    assert pool.take(payload.frame_class(100_000)) is None   # not the pool's to reuse yet
    del mine                                # let go: now it is
    again = pool.frame(100_000)
    assert id(again) == kept and len(again) == 100_000 and pool.held == 0 and pool.reused == 1


def test_frames_of_one_size_class_reuse_each_other_at_the_length_asked_for():
    pool = FramePool(1 << 22)
    c = payload.frame_class(70_000)
    assert payload.frame_class(66_000) == payload.frame_class(73_000) == c and 70_000 < c <= 70_000 * 1.125
    assert payload.frame_class(200_000) != c
    first = pool.frame(70_000)
    kept = id(first)
    pool.give([first])
    del first
    longer = pool.frame(73_000)             # the same memory, now 73,000 bytes long
    assert id(longer) == kept and len(longer) == 73_000
    _write(longer, b"\x05" * 73_000)
    assert longer == b"\x05" * 73_000 and hash(longer) == hash(b"\x05" * 73_000)
    assert ctypes.string_at(id(longer) + payload._BYTES_DATA + 73_000, 1) == b"\0"   # CPython's terminating zero
    pool.give([longer])
    del longer
    shorter = pool.frame(66_000)
    assert id(shorter) == kept and len(shorter) == 66_000 and bytes(shorter[-3:]) == b"\x05" * 3
    pool.give([shorter])
    assert pool.frame(200_000) is not shorter   # another class: a new frame
    assert pool.reused == 2


def test_a_held_frame_does_not_keep_a_free_one_of_its_class_from_being_reused():
    pool = FramePool(1 << 22)
    held, free = pool.frame(80_000), pool.frame(80_000)
    ids = id(held), id(free)
    pool.give([held])                       # the older one, still held
    pool.give([free])
    del free
    assert id(pool.frame(80_000)) == ids[1]
    assert pool.take(payload.frame_class(80_000)) is None
    del held
    assert id(pool.frame(80_000)) == ids[0]


def test_the_pool_keeps_at_most_its_limit_held_frames_forgotten_first():
    size = payload.frame_class(100_000)
    pool = FramePool(3 * size)
    made = [pool.frame(100_000) for _ in range(4)]
    kept, held = id(made[0]), made[1]
    for _ in range(4):                      # oldest first, each let go at once but `held` (as gRPC holds the
        pool.give([made.pop(0)])            # message it wrote last)
    pool.give([pool.frame(300_000)])        # larger than the whole pool: not kept
    assert pool.held == 3 * size            # three of the four kept: the held one was forgotten
    taken = [pool.frame(100_000) for _ in range(3)]
    assert kept in {id(b) for b in taken} and pool.reused == 3 and pool.held == 0
    assert all(b is not held for b in taken)


def test_short_frames_are_reused_at_their_exact_length_and_a_pool_without_limit_keeps_nothing():
    pool = FramePool(1 << 22)
    small = pool.frame(payload.POOLED_MIN - 1)
    kept = id(small)
    pool.give([small])
    del small
    assert pool.take(payload.POOLED_MIN - 2) is None and id(pool.frame(payload.POOLED_MIN - 1)) == kept
    off = FramePool(0)
    big = off.frame(1 << 20)
    off.give([big])
    assert len(big) == 1 << 20 and off.held == 0


def test_a_reused_frame_forgets_the_hash_of_its_former_contents():
    pool = FramePool(1 << 22)
    b = pool.frame(100_000)
    _write(b, b"\x01" * 100_000)
    old_hash = hash(b)                      # cached inside the bytes object
    pool.give([b])
    b = pool.frame(100_000)
    _write(b, b"\x07" * 100_000)
    assert hash(b) == hash(b"\x07" * 100_000) != old_hash


def test_a_batch_frame_goes_back_to_the_pool_once_its_first_record_is_acknowledged():
    """Small records that queued up are written into one Batch frame (npu_agent.records.encode_together); once
    acknowledged, it takes the next Batch frame of its size class."""
    from npu_agent.records import batch_frame
    from tests.test_batching import _InProcessTransport

    calls: list[tuple[list[int], int, threading.Event]] = []

    class Gated(_InProcessTransport):   # each call waits for the test, then answers every record
        def send_records(self, recs, generation):
            frame = batch_frame([r.encoded for r in recs]) if len(recs) > 1 else None
            gate = threading.Event()
            calls.append(([r.seq for r in recs], id(frame) if frame is not None else 0, gate))
            del frame
            gate.wait(30)
            for r in recs:
                self.events.on_ack(r.seq, "ACCEPTED", "")
            return True

    def wait_calls(n: int) -> None:
        deadline = time.monotonic() + 30
        while len(calls) < n:
            assert time.monotonic() < deadline, calls
            time.sleep(0.001)

    FRAMES.clear()
    reused = FRAMES.reused
    sender = Sender(Gated(), budget_bytes=64 << 20)
    for first in (0, 5):
        sender.submit(_record(first, 4 << 10))   # alone: the transport is busy with it while the next queue up
        wait_calls(len(calls) + 1)
        for seq in range(first + 1, first + 5):
            sender.submit(_record(seq, 4 << 10))   # 32 KiB each: four make a Batch frame over 128 KiB
        calls[-1][2].set()
        wait_calls(len(calls) + 1)
        calls[-1][2].set()
    counts = sender.close(timeout=30)
    assert counts["acknowledged"] == 10
    assert [c[0] for c in calls] == [[0], [1, 2, 3, 4], [5], [6, 7, 8, 9]]
    assert calls[1][1] == calls[3][1] != 0 and FRAMES.reused - reused == 1   # the second batch in the first's frame


def _record(seq: int, n: int) -> PendingRecord:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seq))
    return PendingRecord(name=f"Functional.relu.{seq}", step=0, inputs=snapshot(((x,), {})),
                         output=snapshot(torch.relu(x)), seq=seq)


def test_an_agent_reusing_frames_gets_every_record_checked_with_its_own_values(tmp_path):
    FRAMES.clear()
    reused = FRAMES.reused
    n = 12
    with support.Server(str(tmp_path)) as server:
        transport = GrpcTransport(Endpoint("127.0.0.1", server.port), "", "pool", 0, 1)
        # a budget of a few records: the later ones wait for acknowledgements, and the frames those free are reused
        sender = Sender(transport, budget_bytes=4 << 20)
        for seq in range(n):
            sender.submit(_record(seq, 72 << 10))   # 2 x 288 KiB: written straight into frames
        counts = sender.close(timeout=120)
        assert counts["acknowledged"] == n and counts["rejected"] == 0
        assert FRAMES.held == 0   # nothing kept past the sender's end
    assert FRAMES.reused - reused >= 1   # how many: timing
    rows = support.read_csv(server.out, "accuracy_checking_result")
    assert sorted(int(r["API name"].rsplit(".", 1)[1]) for r in rows) == list(range(n))
    # a frame overwritten before the server had it would carry another record's output: relu would not match
    assert {r["Forward Test Success"] for r in rows} == {"pass"}, rows


def test_a_sender_slower_than_its_server_reuses_its_frames(tmp_path):
    """Each record is sent alone, then the idle sender asks for its answer (docs/design.md §5, "Answers when
    asked"): gRPC has taken the Ask after the record's frame, so the frame is free when the answer comes, and record
    k + 1 is written into record k's frame. (A server that answers unasked answers while gRPC still holds the frame,
    the message it wrote last: then record k + 2 takes record k's frame.)"""
    FRAMES.clear()
    reused = FRAMES.reused
    n = 8
    with support.Server(str(tmp_path)) as server:
        transport = GrpcTransport(Endpoint("127.0.0.1", server.port), "", "slow", 0, 1)
        sender = Sender(transport, budget_bytes=16 << 20)   # the pool keeps a quarter: several frames
        deadline = time.monotonic() + 60
        while transport._asked_on != 1:   # the server takes asks: every record below is answered when asked
            assert time.monotonic() < deadline, "no ASKS_TAKEN in 60 s"
            time.sleep(0.005)
        for i, seq in enumerate(range(10, 10 + n)):   # names of one length: frames of one length
            sender.submit(_record(seq, 72 << 10))
            deadline = time.monotonic() + 60
            while sender.counts.acknowledged <= i:
                assert time.monotonic() < deadline, "no acknowledgement in 60 s"
                time.sleep(0.005)
        counts = sender.close(timeout=120)
        assert counts["acknowledged"] == n and counts["rejected"] == 0
    # the first finds no free frame of its class; each later one finds the frame of the record before it
    assert FRAMES.reused - reused == n - 1
    rows = support.read_csv(server.out, "accuracy_checking_result")
    assert sorted(int(r["API name"].rsplit(".", 1)[1]) for r in rows) == list(range(10, 10 + n))
    assert {r["Forward Test Success"] for r in rows} == {"pass"}, rows
