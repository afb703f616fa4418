"""Frames of acknowledged large records are reused (npu_agent/payload.py, FRAMES): only once nothing else holds
them, never above the pool's limit, a reused frame forgets the hash of what it held, and a real agent reusing them
against a real server gets every record through with its own values."""
from __future__ import annotations

import ctypes
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


def _frames(*sizes: int) -> list[bytes]:
    return [bytes(range(256)) * (n // 256) for n in sizes]


def test_a_frame_is_handed_out_only_once_nothing_else_holds_it():
    pool = FramePool(1 << 20)
    mine = _frames(4096)[0]
    kept = id(mine)
    pool.give([mine])                       # still held here (as gRPC holds the message it wrote last)
    assert pool.held == 4096
    assert pool.take(4096) is None          # not the pool's to reuse yet
    del mine                                # let go: now it is
    assert pool.take(1024) is None          # only the exact length is reused
    again = pool.take(4096)
    assert id(again) == kept and pool.held == 0 and pool.take(4096) is None


def test_a_held_frame_does_not_keep_a_free_one_of_its_length_from_being_reused():
    pool = FramePool(1 << 20)
    held, free = _frames(4096, 4096)
    ids = id(held), id(free)
    pool.give([held])                       # the older one, still held
    pool.give([free])
    del free
    assert id(pool.take(4096)) == ids[1]
    assert pool.take(4096) is None
    del held
    assert id(pool.take(4096)) == ids[0]


def test_the_pool_keeps_at_most_its_limit_oldest_dropped_first():
    pool = FramePool(3 * 1024)
    first, second = _frames(1024), _frames(2048)
    ids = [id(first[0]), id(second[0])]
    pool.give(first)
    pool.give(second)
    pool.give(_frames(1024))                # 1024 + 2048 + 1024 > 3072: the oldest (first) goes
    assert pool.held == 3072
    assert id(pool.take(2048)) == ids[1]
    assert id(pool.take(1024)) != ids[0]
    pool.give(_frames(8192))                # larger than the whole pool: not kept
    assert pool.held == 0


def test_over_the_limit_frames_still_held_are_forgotten_before_free_ones():
    pool = FramePool(3 * 1024)
    free, held = _frames(1024, 1024)
    ids = id(free), id(held)
    pool.give([free])                       # the oldest, and free
    pool.give([held])                       # still held (gRPC's last message)
    del free
    pool.give(_frames(1024))
    pool.give(_frames(1024))                # one too many: the held one goes, the older free one stays
    assert pool.held == 3072
    taken = [pool.take(1024) for _ in range(3)]
    assert ids[0] in {id(b) for b in taken} and ids[1] not in {id(b) for b in taken}
    del held


def test_a_reused_frame_forgets_the_hash_of_its_former_contents():
    pool = FramePool(1 << 20)
    frames = _frames(512)
    old_hash = hash(frames[0])              # cached inside the bytes object
    pool.give(frames)
    b = pool.take(512)
    ctypes.memmove(id(b) + payload._BYTES_DATA, b"\x07" * 512, 512)
    assert hash(b) == hash(b"\x07" * 512) != old_hash


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
    """Each record is acknowledged while gRPC still holds its frame (the message it wrote last, until it takes the
    next one): the frame is handed out again only after that, so record k + 2 is written into record k's frame."""
    FRAMES.clear()
    reused = FRAMES.reused
    n = 8
    with support.Server(str(tmp_path)) as server:
        transport = GrpcTransport(Endpoint("127.0.0.1", server.port), "", "slow", 0, 1)
        sender = Sender(transport, budget_bytes=16 << 20)   # the pool keeps a quarter: several frames
        for i, seq in enumerate(range(10, 10 + n)):   # names of one length: frames of one length
            sender.submit(_record(seq, 72 << 10))
            deadline = time.monotonic() + 60
            while sender.counts.acknowledged <= i:
                assert time.monotonic() < deadline, "no acknowledgement in 60 s"
                time.sleep(0.005)
        counts = sender.close(timeout=120)
        assert counts["acknowledged"] == n and counts["rejected"] == 0
    # the first record's frame is 2 bytes shorter (its sequence number, 0, is not written); the next two find no free
    # frame of their length; each later one finds the frame of the record two before it
    assert FRAMES.reused - reused == n - 3
    rows = support.read_csv(server.out, "accuracy_checking_result")
    assert sorted(int(r["API name"].rsplit(".", 1)[1]) for r in rows) == list(range(10, 10 + n))
    assert {r["Forward Test Success"] for r in rows} == {"pass"}, rows
