"""Spool segments written around the page cache (gpu_server/spool/direct_io.py): the same bytes as a write through
it at every length around the block and the staging buffer, from every kind of buffer the spool holds; O_DIRECT
really used where the file system takes it; where it refuses (at the open or part-way), the segment is written
through the page cache with nothing left of the attempt; a failing write still raises and leaves no file."""
from __future__ import annotations

import errno
import mmap
import os
import shutil
import tempfile

import pytest

from gpu_server.spool import direct_io
from gpu_server.spool.segments import read_entry, scan_segment, write_segment
from protos import online_check_pb2 as pb
from protos.limits import DEFAULT_LIMITS

STAGE, BLOCK = direct_io.STAGE_BYTES, direct_io.BLOCK


def _takes_o_direct(folder) -> bool:
    if not direct_io.O_DIRECT:
        return False
    try:
        fd = os.open(os.path.join(folder, "probe"), os.O_WRONLY | os.O_CREAT | direct_io.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    os.unlink(os.path.join(folder, "probe"))
    return True


@pytest.fixture(autouse=True)
def _fresh_memory(monkeypatch):
    monkeypatch.setattr(direct_io, "_refused_devices", set())   # what an earlier test's file system refused


def _record(seq: int, n: int) -> bytes:
    return pb.Record(header=pb.RecordHeader(run_id="run1", rank=0, step=0, seq=seq, name=f"Torch.add.{seq}",
                                            direction=pb.FORWARD), payload_bytes=n).SerializeToString()


def _payloads() -> list:
    """Payloads of lengths around a block and the stage, as bytes, bytearray, a mapping's memoryview and a slice."""
    out: list = []
    lengths = [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, STAGE - 37, STAGE, STAGE + 1, 2 * STAGE + 5000]
    for i, n in enumerate(lengths):
        data = (bytes(range(251)) * (n // 251 + 1))[:n]
        kind = i % 4
        if kind == 0:
            out.append(data)
        elif kind == 1:
            out.append(bytearray(data))
        elif kind == 2:
            m = mmap.mmap(-1, max(n, 1))
            m[:n] = data
            out.append(memoryview(m)[:n])
        else:
            out.append(memoryview(b"xyz" + data)[3:])   # not aligned anywhere
    return out


def _fdinfo_flags(fd: int) -> int:
    with open(f"/proc/self/fdinfo/{fd}", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("flags:"):
                return int(line.split()[1], 8)
    raise AssertionError("no flags in fdinfo")


def _read(path) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def test_a_segment_written_around_the_page_cache_holds_the_bytes_written_through_it(tmp_path, monkeypatch):
    if not _takes_o_direct(tmp_path) or not os.path.exists("/proc/self/fdinfo"):
        pytest.skip("this file system does not take O_DIRECT")
    payloads = _payloads()
    records = [(_record(i, len(p)), p) for i, p in enumerate(payloads)]
    flags: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (flags.append(_fdinfo_flags(fd)), real_fsync(fd))[1])
    direct, buffered = tmp_path / "direct", tmp_path / "buffered"
    direct.mkdir()
    buffered.mkdir()
    for k in (1, 2, 3, len(records)):   # one record, a few, all (offsets in the stage of every kind)
        write_segment(str(direct / f"seg-00000000{k}.spl"), records[:k], fsync=True)
        assert flags.pop() & direct_io.O_DIRECT, "the segment was not written with O_DIRECT"
        with monkeypatch.context() as m:
            m.setattr(direct_io, "O_DIRECT", 0)
            write_segment(str(buffered / f"seg-00000000{k}.spl"), records[:k], fsync=True)
        assert _read(direct / f"seg-00000000{k}.spl") == _read(buffered / f"seg-00000000{k}.spl"), k
    assert sorted(os.listdir(direct)) == sorted(os.listdir(buffered))   # no temporary file left
    entries, damage = scan_segment(len(records), str(direct / f"seg-00000000{len(records)}.spl"), DEFAULT_LIMITS)
    assert damage == [] and len(entries) == len(payloads)
    for e, p in zip(entries, payloads):
        assert read_entry(str(direct), e)[1] == bytes(p)


def test_a_file_system_that_refuses_o_direct_at_the_open_gets_the_page_cache_and_is_remembered(tmp_path, monkeypatch):
    tried: list[str] = []
    real_open = os.open

    def refusing_open(path, flags, *args, **kwargs):
        if flags & direct_io.O_DIRECT:
            tried.append(path)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(direct_io, "O_DIRECT", direct_io.O_DIRECT or 0o40000)
    monkeypatch.setattr(os, "open", refusing_open)
    records = [(_record(0, 5000), bytes(5000))]
    write_segment(str(tmp_path / "seg-000000001.spl"), records, fsync=True)
    write_segment(str(tmp_path / "seg-000000002.spl"), records, fsync=True)
    assert len(tried) == 1   # the second segment went through the page cache straight away
    assert _read(tmp_path / "seg-000000001.spl") == _read(tmp_path / "seg-000000002.spl")
    assert sorted(os.listdir(tmp_path)) == ["seg-000000001.spl", "seg-000000002.spl"]


def test_a_device_that_refuses_a_direct_write_part_way_gets_the_page_cache(tmp_path, monkeypatch):
    if not _takes_o_direct(tmp_path):
        pytest.skip("this file system does not take O_DIRECT")
    real_write = os.write
    refused: list[int] = []

    def write(fd, data):
        if not refused and _fdinfo_flags(fd) & direct_io.O_DIRECT:   # the first direct write, mid-payload
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    payload = bytes(range(256)) * ((STAGE + 3000) // 256)
    write_segment(str(tmp_path / "seg-000000001.spl"), [(_record(0, len(payload)), payload)], fsync=True)
    assert len(refused) == 1
    monkeypatch.setattr(os, "write", real_write)
    with monkeypatch.context() as m:
        m.setattr(direct_io, "O_DIRECT", 0)
        write_segment(str(tmp_path / "seg-000000002.spl"), [(_record(0, len(payload)), payload)], fsync=True)
    assert _read(tmp_path / "seg-000000001.spl") == _read(tmp_path / "seg-000000002.spl")
    assert sorted(os.listdir(tmp_path)) == ["seg-000000001.spl", "seg-000000002.spl"]
    assert direct_io._refused_devices == {os.stat(tmp_path).st_dev}


def test_a_full_disk_raises_and_leaves_no_file(tmp_path, monkeypatch):
    if not _takes_o_direct(tmp_path):
        pytest.skip("this file system does not take O_DIRECT")

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    payload = bytes(3 * BLOCK)
    with pytest.raises(OSError) as info:
        write_segment(str(tmp_path / "seg-000000001.spl"), [(_record(0, len(payload)), payload)], fsync=True)
    assert info.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == []
    assert direct_io._refused_devices == set()   # a full disk is no refusal of O_DIRECT


def test_a_direct_file_is_flushed_once(tmp_path):
    if not _takes_o_direct(tmp_path):
        pytest.skip("this file system does not take O_DIRECT")
    with direct_io.open_direct(str(tmp_path / "f")) as fh:
        fh.write(b"abc")
        fh.flush()
        fh.flush()
        with pytest.raises(ValueError):
            fh.write(b"d")
    assert _read(tmp_path / "f") == b"abc"


def test_a_folder_in_memory_goes_through_the_page_cache(monkeypatch):
    """tmpfs takes O_DIRECT on recent kernels, but its files are the page cache: the stage would be one more copy."""
    if not os.path.isdir("/dev/shm") or not direct_io._in_memory("/dev/shm"):
        pytest.skip("no tmpfs at /dev/shm here")
    flags: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (flags.append(_fdinfo_flags(fd)), real_fsync(fd))[1])
    folder = tempfile.mkdtemp(dir="/dev/shm")
    try:
        write_segment(os.path.join(folder, "seg-000000001.spl"), [(_record(0, 5000), bytes(5000))], fsync=True)
        assert flags and not flags[0] & (direct_io.O_DIRECT or 0o40000)
        assert os.listdir(folder) == ["seg-000000001.spl"]
    finally:
        shutil.rmtree(folder)
