"""The replay worker's answers read in place (gpu_server/replay/answer_arenas.py, docs/design.md §6.8): the server's
tensors are views of the worker's arena, the worker never writes an arena the server still reads, the server holds
at most HOLD arenas (then copies), and what a hostile worker names is checked before any view is made."""
from __future__ import annotations

import gc
import os
import tempfile
import threading

import pytest
import torch

from gpu_server.replay.answer_arenas import HOLD, AnswerArenas, AnswerMaps
from gpu_server.replay.sandbox import InlineReplayer, ProcessReplayer, SandboxLimits
from gpu_server.replay.sandbox_wire import ALIGN, Arena, ChannelClosed, Mapped, read_leaves, write_leaves
from tests.support import forked_replay_workers  # noqa: F401 - its replay workers forked (an autouse fixture)
from tests.test_sandbox import MiB, frames_of, job_of


class Pair:
    """Both sides of the protocol in one process, with the messages they would exchange."""

    def __init__(self, folder: str):
        self.worker = AnswerArenas(folder, "out")
        self.server = AnswerMaps(folder, "out")
        self.free: list[str] = []

    def answer(self, tensors: list[torch.Tensor]) -> tuple[list, bool]:
        """One request (naming what the server freed) and its answer, read by the server."""
        self.worker.release(self.server.take_free())
        entries, name = write_leaves([tensors], self.worker)
        self.worker.given(name)
        self.server.forget(self.worker.take_gone())
        arena, in_place = self.server.open(name)
        runs = read_leaves(entries, arena, copy=not in_place)
        del arena
        if not in_place:
            self.server.done(name)
        return runs[0], in_place


def _mapped(t: torch.Tensor, folder: str) -> bool:
    """`t`'s memory lies in a file of `folder` (a view of an arena), from /proc/self/maps."""
    ptr = t.untyped_storage().data_ptr()
    with open("/proc/self/maps") as fh:
        for line in fh:
            span, *rest = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= ptr < hi:
                return len(rest) == 5 and rest[4].strip().startswith(folder)
    return False


def test_answers_are_views_of_the_arena_and_the_worker_never_writes_one_the_server_holds():
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as folder:
        pair = Pair(folder)
        torch.manual_seed(0)
        sent = [torch.randn(1000 + i, dtype=torch.float64) for i in range(HOLD)]
        held = [pair.answer([t, t.float()])[0] for t in sent]   # HOLD answers kept alive: both read in place
        assert all(_mapped(r[0], folder) and _mapped(r[1], folder) for r in held)
        assert pair.server.in_place == HOLD and pair.server.copied == 0
        for i in range(5):   # more answers while those are held: copied out, each arena given back at once
            got, in_place = pair.answer([torch.full((999,), float(i))])
            assert not in_place and torch.equal(got[0], torch.full((999,), float(i)))
            assert not _mapped(got[0], folder)
        for t, r in zip(sent, held):   # what the server holds was never overwritten
            assert torch.equal(r[0], t) and torch.equal(r[1], t.float())
        assert len(pair.worker._held) + len(pair.worker._free) <= HOLD + 1
        del held, r
        gc.collect()
        assert sorted(pair.server.take_free()) == sorted(pair.worker._held)   # freed once the views are gone
        got, in_place = pair.answer([torch.ones(5)])
        assert in_place and torch.equal(got[0], torch.ones(5))


def test_views_of_every_dtype_are_aligned_and_equal_to_what_was_written():
    with tempfile.TemporaryDirectory() as folder:
        pair = Pair(folder)
        values = [torch.arange(3, dtype=torch.float16), torch.randn(7, dtype=torch.float64),
                  torch.tensor([True, False, True]), torch.randn(2, 3, dtype=torch.complex64),
                  torch.arange(5, dtype=torch.int64), torch.empty(0, 4)]
        got, in_place = pair.answer(values)
        assert in_place
        for v, g in zip(values, got):
            assert g.dtype == v.dtype and g.shape == v.shape and torch.equal(g, v)
            if g.numel():
                assert g.data_ptr() % ALIGN == 0 or g.is_complex()


def test_an_arena_that_grows_is_named_gone_and_unmapped_by_the_server():
    with tempfile.TemporaryDirectory() as folder:
        pair = Pair(folder)
        pair.answer([torch.zeros(10)])
        first = next(iter(pair.server._maps))
        gc.collect()
        got, _ = pair.answer([torch.ones(1 << 19, dtype=torch.float64)])   # 4 MiB: the 1 MiB arena grows
        assert torch.equal(got[0], torch.ones(1 << 19, dtype=torch.float64))
        assert first not in pair.server._maps and not os.path.exists(os.path.join(folder, first))


def test_what_a_hostile_worker_names_is_checked_before_any_view():
    with tempfile.TemporaryDirectory() as folder:
        maps = AnswerMaps(folder, "out")
        for name in ("../etc/passwd", "out-x", "in-0", None, "out-0/.."):
            with pytest.raises(ChannelClosed, match="arena name"):
                maps.open(name)
        with open(os.path.join(folder, "out-0"), "wb") as fh:
            fh.write(bytes(256))
        arena, in_place = maps.open("out-0")
        assert in_place
        with pytest.raises(ChannelClosed, match="does not fit"):
            read_leaves([[{"t": ["float64", [8], 200, 64]}]], arena, copy=False)
        # an offset no dtype view can take is read by copy, not refused
        (t,), = read_leaves([[{"t": ["float64", [2], 3, 16]}]], arena, copy=False)
        assert t.dtype == torch.float64 and t.shape == (2,) and not _mapped(t, folder)
        maps.forget(["out-0", 7, None])   # names it does not hold, or that are not names: ignored
        maps.close()


def test_a_replaced_worker_starts_afresh_and_old_views_name_nothing_free():
    with tempfile.TemporaryDirectory() as folder:
        pair = Pair(folder)
        old, _ = pair.answer([torch.ones(4)])
        pair.server.close()              # the worker was replaced
        pair.worker.close()
        del old
        gc.collect()
        assert pair.server.take_free() == []


def test_outputs_held_across_requests_keep_their_values_in_the_process_replayer():
    """Real requests to a replay worker process: answers the checker still holds are never overwritten by later
    ones, whether they were read in place or copied."""
    torch.manual_seed(0)
    xs = [torch.randn(256 + 17 * i) for i in range(HOLD + 3)]
    jobs = [job_of(frames_of(f"Functional.gelu.{i}", torch.nn.functional.gelu, x, seq=i)) for i, x in enumerate(xs)]
    inline = InlineReplayer(torch.device("cpu"))
    proc = ProcessReplayer(torch.device("cpu"), SandboxLimits(timeout_s=60), 1, 64 * MiB)
    try:
        held = [proc.forward(j, keep=False, match=True) for j in jobs]
        for _ in range(3):   # more answers while every earlier one is held
            proc.forward(jobs[0], keep=False, match=True)
        for j, r in zip(jobs, held):
            want = inline.forward(j, keep=False, match=True)
            assert torch.equal(r.bench[0], want.bench[0]) and torch.equal(r.same[0], want.same[0])
        assert proc.outbox.in_place >= HOLD and proc.outbox.copied >= 3
    finally:
        proc.close()


def test_an_arena_replaced_while_a_view_of_it_is_alive_stays_readable_through_that_view():
    """Both sides re-map when the other's arena grows (a new name); a view something still holds (a tensor of an
    earlier request) keeps the old mapping until it goes, instead of failing the request with BufferError."""
    with tempfile.TemporaryDirectory() as folder:
        for i, fill in enumerate((b"\x01", b"\x02")):
            with open(os.path.join(folder, f"in-{i}"), "wb") as fh:
                fh.write(fill * 4096)
        inbox = Mapped(folder, "in")
        old = torch.frombuffer(inbox.view("in-0"), dtype=torch.uint8)
        assert bytes(inbox.view("in-1")[:2]) == b"\x02\x02"
        assert int(old.sum()) == 4096
        arena = Arena(folder, "out")
        view = arena.reserve(10)
        kept = torch.frombuffer(view, dtype=torch.uint8)
        kept[:3] = 7
        arena.reserve(4 << 20)   # grows: a new file, the old one unlinked
        assert kept[:3].tolist() == [7, 7, 7] and arena.name == "out-1"
        arena.close()


def test_a_view_collected_while_the_server_holds_its_lock_does_not_deadlock():
    """A view in a reference cycle goes when the collector runs, which may be during an allocation the server
    makes under its own lock (take_free makes a list): its finalizer takes that lock again, in the same thread."""
    with tempfile.TemporaryDirectory() as folder:
        pair = Pair(folder)
        got, in_place = pair.answer([torch.ones(8)])
        assert in_place
        cycle: list = [got[0]]
        cycle.append(cycle)
        del got, cycle   # only the cycle holds the view now
        done = threading.Event()

        def collect_under_lock() -> None:
            with pair.server._lock:   # as inside take_free when its new list starts a collection
                gc.collect()
            done.set()

        threading.Thread(target=collect_under_lock, daemon=True).start()
        assert done.wait(30), "the finalizer waited for the lock its own thread held"
        assert pair.server.take_free() == ["out-0"]
