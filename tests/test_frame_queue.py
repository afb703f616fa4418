"""The queue between the agent's sender thread and gRPC's request thread (npu_agent.transport_grpc.FrameQueue): frames
come out in the order they went in, a full queue refuses or blocks as `queue.Queue` does, a sender blocked on a full
queue goes on only once the queue has drained to its low mark, and the request thread waiting on an empty queue
wakes for the next frame. The threads here wait on events with generous timeouts: no assertion depends on how fast
this machine runs."""
from __future__ import annotations

import queue
import threading
import time

import pytest

from npu_agent.transport_grpc import FrameQueue

WAIT_S = 30.0


def test_frames_come_out_in_order_and_a_full_queue_refuses_at_once() -> None:
    q = FrameQueue(maxsize=3)
    for frame in (b"a", b"b", b"c"):
        q.put_nowait(frame)
    with pytest.raises(queue.Full):
        q.put_nowait(b"d")
    assert [q.get(), q.get(), q.get()] == [b"a", b"b", b"c"]
    q.put_nowait(b"e")
    assert q.get() == b"e"


def test_put_on_a_full_queue_gives_up_after_its_timeout() -> None:
    q = FrameQueue(maxsize=1)
    q.put(b"a", timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(queue.Full):
        q.put(b"b", timeout=0.05)
    assert time.monotonic() - t0 >= 0.05
    assert q.get() == b"a"


def _blocked_sender(q: FrameQueue, frames: list[bytes]) -> tuple[threading.Thread, list[bytes], threading.Event]:
    """A thread putting `frames` into `q` (no timeout), the frames it has put so far, and an event set when done."""
    put: list[bytes] = []
    done = threading.Event()

    def run() -> None:
        for frame in frames:
            q.put(frame)
            put.append(frame)
        done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, put, done


def test_a_blocked_sender_goes_on_only_once_the_queue_drained_to_its_low_mark() -> None:
    q = FrameQueue(maxsize=8)   # low mark: 4
    assert q.low == 4
    frames = [bytes([i]) * 4 for i in range(9)]
    thread, put, done = _blocked_sender(q, frames)
    deadline = time.monotonic() + WAIT_S
    while q._putting < 1 and time.monotonic() < deadline:   # the first eight fill the queue; the ninth waits
        time.sleep(0.001)
    assert len(put) == 8 and q._putting == 1
    taken = [q.get() for _ in range(3)]   # 5 left: above the low mark, the sender is not woken
    assert taken == frames[:3]
    assert not done.wait(0.2)
    assert len(put) == 8
    assert q.get() == frames[3]   # 4 left: the sender is woken and puts its last frame
    assert done.wait(WAIT_S)
    thread.join(WAIT_S)
    assert [q.get() for _ in range(5)] == frames[4:]


def test_a_timed_put_still_goes_on_when_the_queue_has_room_above_its_low_mark() -> None:
    """A sender's `put(timeout=...)` that times out looks again: one frame taken is room enough then."""
    q = FrameQueue(maxsize=2, low=0)
    q.put(b"a")
    q.put(b"b")
    result: list[BaseException | None] = []

    def run() -> None:
        try:
            q.put(b"c", timeout=1.0)
            result.append(None)
        except queue.Full as exc:
            result.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while q._putting == 0 and time.monotonic() < deadline:   # the sender waits on the full queue (its timer runs)
        time.sleep(0.001)
    assert q._putting == 1
    assert q.get() == b"a"   # one left, above the low mark 0: the waiting sender is not woken ...
    thread.join(WAIT_S)
    assert result == [None]  # ... yet its put succeeds once its wait ends and it finds room
    assert [q.get(), q.get()] == [b"b", b"c"]


def test_the_request_thread_waiting_on_an_empty_queue_wakes_for_the_next_frame() -> None:
    q = FrameQueue(maxsize=8)
    got: list[bytes] = []
    ready = threading.Event()

    def request_thread() -> None:
        ready.set()
        for _ in range(3):
            got.append(q.get())

    thread = threading.Thread(target=request_thread, daemon=True)
    thread.start()
    assert ready.wait(WAIT_S)
    for frame in (b"x", b"y", b"z"):
        time.sleep(0.01)   # most of these find the request thread waiting
        q.put(frame)
    thread.join(WAIT_S)
    assert got == [b"x", b"y", b"z"]
