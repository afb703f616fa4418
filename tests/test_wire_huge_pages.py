"""With ONLINE_CHECK_HUGE_PAGES=1 (protos/huge_pages.py; off by default), fresh memory for large records asks for
transparent huge pages, on both ends of the wire, only for the whole 2 MiB pages inside what is about to be written
(npu_agent/payload.py `huge_pages`, gpu_server/intake/assembler.py `_Payload`); without it neither end asks. The
bytes are the same either way: the agent's frames, and the payload the server joins from chunks."""
from __future__ import annotations

import pytest
import torch

from gpu_server.intake import assembler
from gpu_server.intake.assembler import FrameAssembler, _Payload
from npu_agent import payload
from npu_agent.records import PendingRecord, encode_record
from npu_agent.snapshot import snapshot
from protos.framing import parse_frame
from protos.huge_pages import ENV, HUGE_PAGE, whole_huge_pages
from protos.limits import MiB

HUGE = 2 * MiB


class _Libc:
    """Stands in for libc: records the madvise calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []

    def madvise(self, addr: int, n: int, advice: int) -> int:
        self.calls.append((addr, n, advice))
        return 0


@pytest.mark.parametrize("addr,n", [(HUGE * 5 + 48, 4 * MiB + 60), (HUGE * 7, 4 * MiB), (HUGE * 3 - 16, 6 * MiB),
                                    (HUGE + 1, HUGE), (HUGE + 4096, 3 * MiB), (HUGE * 9, HUGE - 1)])
def test_the_agent_asks_huge_pages_only_for_whole_ones_inside_the_frame(monkeypatch, addr, n):
    libc = _Libc()
    monkeypatch.setattr(payload, "_libc", libc)
    monkeypatch.setattr(payload, "_MADV_HUGEPAGE", 14)
    monkeypatch.setenv(ENV, "1")
    asked = payload.huge_pages(addr, n)
    first = -(-addr // HUGE) * HUGE               # the first huge page boundary inside
    whole = max(0, (addr + n - first) // HUGE)    # whole huge pages from there
    if whole == 0:
        assert not asked and libc.calls == []
        return
    assert asked and libc.calls == [(first, whole * HUGE, 14)]
    lo, length, _ = libc.calls[0]
    assert addr <= lo and lo + length <= addr + n and lo % HUGE == 0


def test_no_madvise_no_huge_pages_asked(monkeypatch):
    monkeypatch.setenv(ENV, "1")
    monkeypatch.setattr(payload, "_libc", None)
    assert payload.huge_pages(HUGE * 4, 8 * MiB) is False


@pytest.mark.parametrize("value", [None, "", "0", "yes"])
def test_neither_end_asks_for_huge_pages_unless_told(monkeypatch, value):
    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    libc = _Libc()
    monkeypatch.setattr(payload, "_libc", libc)
    monkeypatch.setattr(payload, "_MADV_HUGEPAGE", 14)
    assert payload.huge_pages(HUGE * 4, 8 * MiB) is False and libc.calls == []
    buf = _Payload(8 * MiB)
    try:
        assert buf._base == -1   # no stretch is asked for as huge pages
        buf.write(0, b"x" * (4 * MiB))
        assert buf.map[:4] == b"xxxx"
    finally:
        buf.map.close()


def test_the_server_buffer_knows_its_address_when_told(monkeypatch):
    monkeypatch.setenv(ENV, "1")
    buf = _Payload(8 * MiB)
    try:
        if assembler._HUGE_ON is not None:   # Linux: the stretches a chunk fills are asked for
            assert buf._base > 0
    finally:
        buf.map.close()


@pytest.mark.parametrize("base", [0, 48, HUGE - 4096, 12345 * 4096])
def test_the_server_asks_huge_pages_only_for_whole_ones_inside_each_chunk(base):
    assert HUGE_PAGE == HUGE
    for start, end in [(0, 4 * MiB), (4 * MiB, 8 * MiB + 17), (3, HUGE + 2), (HUGE, 2 * HUGE), (5, 9)]:
        lo, hi = whole_huge_pages(base, start, end)
        inside = [p for p in range(0, (base + end) // HUGE + 1) if base + start <= p * HUGE
                  and (p + 1) * HUGE <= base + end]
        if not inside:
            assert hi <= lo
            continue
        assert (lo, hi) == (inside[0] * HUGE - base, (inside[-1] + 1) * HUGE - base)
        assert start <= lo < hi <= end and (base + lo) % HUGE == 0 and (hi - lo) % HUGE == 0


def _record(numel: int, seq: int = 0) -> PendingRecord:
    g = torch.Generator().manual_seed(seq)
    t = torch.randn(numel, generator=g)
    rec = PendingRecord(name="Functional.relu.0", step=0, inputs=snapshot(((t,), {})))
    rec.seq = seq
    return rec


def _frames(numel: int, chunk: int) -> list[bytes]:
    payload.FRAMES.clear()
    enc = encode_record(_record(numel), "wire", 0, chunk)
    return [bytes(f) for f in enc.wire_frames(chunk)]


def test_frames_are_the_same_bytes_with_and_without_huge_pages(monkeypatch):
    numel, chunk = (9 * MiB + 12) // 4, 3 * MiB + 5
    monkeypatch.setenv(ENV, "1")
    with_huge = _frames(numel, chunk)
    asked: list[int] = []
    monkeypatch.setattr(payload, "huge_pages", lambda addr, n: asked.append(n) or False)
    without = _frames(numel, chunk)
    assert asked, "new frames above a huge page ask for huge pages"
    monkeypatch.delenv(ENV)
    by_default = _frames(numel, chunk)
    assert with_huge == without == by_default and len(with_huge) == 3


def _join(frames: list[bytes]) -> tuple[object, bytes]:
    asm = FrameAssembler()
    done = None
    for raw in frames:
        frame, data = parse_frame(raw)
        asm.before(frame, data)
        done = asm.feed(frame, data)
    assert done is not None
    rec, joined = done
    return rec, bytes(joined)


def test_the_server_joins_chunks_byte_for_byte_with_and_without_huge_pages(monkeypatch):
    numel, chunk = (9 * MiB + 12) // 4, 3 * MiB + 5
    monkeypatch.setenv(ENV, "1")
    frames = _frames(numel, chunk)
    enc = encode_record(_record(numel), "wire", 0, chunk)
    expect = b"".join(bytes(parse_frame(f)[1]) for f in enc.wire_frames(chunk))
    rec, joined = _join(frames)
    assert joined == expect and len(joined) == rec.payload_bytes
    values = torch.frombuffer(bytearray(joined[:numel * 4]), dtype=torch.float32)
    assert torch.equal(values, torch.randn(numel, generator=torch.Generator().manual_seed(0)))
    monkeypatch.setattr(assembler, "_HUGE_ON", None)    # no transparent huge pages on this host
    assert _join(frames)[1] == expect
    monkeypatch.undo()                                  # the default: not asked for
    assert _join(frames)[1] == expect


def test_a_half_joined_record_is_dropped_and_its_buffer_closed(monkeypatch):
    # without the pool of joined records' memory (a server's budget turns it on for its process, and a test that made
    # an assembler with a budget in this process left it on): the mapping is closed, not kept for reuse
    monkeypatch.setattr(assembler.PAYLOADS, "limit", 0)
    frames = _frames((9 * MiB) // 4, 2 * MiB)
    asm = FrameAssembler()
    for raw in frames[:3]:
        frame, data = parse_frame(raw)
        asm.before(frame, data)
        assert asm.feed(frame, data) is None
    buffer = asm.payload
    assert buffer is not None and asm.filled == 6 * MiB
    asm.reset()   # the buffer holds no export: it closes
    assert asm.payload is None and buffer.map.closed
