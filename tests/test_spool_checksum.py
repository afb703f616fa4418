"""gpu_server/spool/checksum.py: the spool's CRC-32 is zlib's value, from ISA-L where the `fast` extra installed it
and from zlib itself otherwise; a segment written with one is read back with the other."""
from __future__ import annotations

import importlib
import mmap
import os
import sys
import zlib

import pytest

from gpu_server.spool import checksum, segments
from protos import online_check_pb2 as pb
from protos.limits import DEFAULT_LIMITS


def _without_isal(monkeypatch):
    monkeypatch.setitem(sys.modules, "isal", None)
    monkeypatch.setitem(sys.modules, "isal.isal_zlib", None)
    return importlib.reload(checksum)


@pytest.fixture
def zlib_only(monkeypatch):
    yield _without_isal(monkeypatch)
    monkeypatch.undo()
    importlib.reload(checksum)


def test_the_setup_installs_the_fast_crc():
    pytest.importorskip("isal")
    assert checksum.crc32 is not zlib.crc32 and checksum.crc32.__module__.startswith("isal")


@pytest.mark.parametrize("n", [0, 1, 15, 16, 63, 64, 65, 1000, 4096 + 7, (1 << 20) + 3])
def test_the_values_are_zlibs_at_every_length_offset_and_start(n):
    data = os.urandom(n + 8)
    for off in (0, 1, 7):
        chunk = data[off:off + n]
        assert checksum.crc32(chunk) == zlib.crc32(chunk)
        assert checksum.crc32(chunk, 0xDEADBEEF) == zlib.crc32(chunk, 0xDEADBEEF)
    assert checksum.crc32(data[:n // 2], checksum.crc32(b"x")) == zlib.crc32(data[:n // 2], zlib.crc32(b"x"))


def test_buffers_the_spool_hands_it():
    m = mmap.mmap(-1, 1 << 16)
    m[:] = os.urandom(1 << 16)
    view = memoryview(m)
    for buf in (view, view[3:999], bytearray(view[:100]), bytes(view[:5])):
        assert checksum.crc32(buf) == zlib.crc32(buf)
    del view, buf
    m.close()


def test_the_fallback_is_zlib(zlib_only):
    assert zlib_only.crc32 is zlib.crc32


def test_a_segment_written_with_one_reads_back_with_the_other(tmp_path, monkeypatch):
    record = pb.Record()
    record.header.seq = 3
    record.payload_bytes = 5000
    header, payload = record.SerializeToString(), os.urandom(5000)
    fast = tmp_path / "seg-000000001.spl"
    segments.write_segment(str(fast), [(header, payload)], fsync=False)      # the installed one
    monkeypatch.setattr(segments, "crc32", zlib.crc32)
    plain = tmp_path / "seg-000000002.spl"
    segments.write_segment(str(plain), [(header, payload)], fsync=False)
    assert fast.read_bytes() == plain.read_bytes()
    entries, damage = segments.scan_segment(1, str(fast), DEFAULT_LIMITS)   # zlib reads what the other wrote
    assert len(entries) == 1 and not damage
    assert bytes(segments.read_entry(str(tmp_path), entries[0])[1]) == payload
