"""The folder reader puts a frame's data straight from the file into its place in the record's payload (a chunk
that continues the record, or a record frame that more chunks complete: gpu_server/intake/folder.py `_read_in_place`,
FrameAssembler.place): the records it delivers must hold exactly the bytes of the whole-frame path (every frame read
as a message, `parse_frame`, `feed` copying the data), for every layout a frame can have, with the head read apart
as large as the reader's or as small as 512 bytes, and every file the whole-frame path refuses is refused with the
same words."""
from __future__ import annotations

import os
import random
import types

import pytest

from gpu_server.intake import assembler as assembler_mod
from gpu_server.intake import folder as folder_mod
from gpu_server.intake.assembler import FrameAssembler
from gpu_server.intake.folder import BadFile, FolderReader, _Dir
from protos import online_check_pb2 as pb
from protos.codec import WireError
from protos.folder_format import FOLDER_MAGIC, FRAME_LENGTH
from protos.framing import DATA_TAG, data_field_at, parse_frame
from protos.limits import Limits
from protos.record_bytes import varint

RUN = "readinto0123456789"
WHOLE = 1 << 40   # a HEAD_BYTES no frame exceeds: every frame read as a whole (the path before)
READER_HEAD = folder_mod.HEAD_BYTES   # the reader's own, taken before any test sets another (`_deliver` does)


def _payload(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def _record_frame(seq: int, payload_bytes: int, data: bytes, tensors: int = 0) -> bytes:
    rec = pb.Record(payload_bytes=payload_bytes)
    rec.header.run_id, rec.header.rank, rec.header.seq = RUN, 0, seq
    for i in range(tensors):   # a header as long as a backward record's of many tensors
        rec.tensors.add(dtype="float32", shape=[i + 1, 64], offset=0, nbytes=256 * (i + 1))
    return pb.Frame(record=rec).SerializeToString() + DATA_TAG + varint(len(data)) + data


def _chunk(seq: int, offset: int, data: bytes, layout: str = "agent") -> bytes:
    head = pb.Frame(chunk=pb.Chunk(seq=seq, offset=offset)).SerializeToString()
    field = DATA_TAG + varint(len(data)) + data
    if layout == "agent":        # Frame.data last, once (what every agent writes)
        return head + field
    if layout == "data_first":   # valid protobuf, data not last: parsed as a whole
        return field + head
    if layout == "split":        # data given twice: protobuf keeps the last
        return head + DATA_TAG + varint(3) + b"xyz" + field
    if layout == "unknown":      # an unknown field before the data: still parsed apart
        return head + bytes([99 << 3 & 0x7F | 0x80, 99 >> 4, 5]) + field
    raise ValueError(layout)


def _file(frames: list[bytes]) -> bytes:
    return FOLDER_MAGIC + b"".join(FRAME_LENGTH.pack(len(f)) + f for f in frames)


def _deliver(tmp_path, content: bytes, monkeypatch, head_bytes: int, truncate_after: int | None = None,
             limits=None):
    """What the reader makes of a file: ('ok', [(record, payload bytes)]) or ('refused', why)."""
    monkeypatch.setattr(folder_mod, "HEAD_BYTES", head_bytes)
    (tmp_path / "r.rec").write_bytes(content)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    reader = FolderReader(str(tmp_path), intake=types.SimpleNamespace(budget=None))
    asm = FrameAssembler() if limits is None else FrameAssembler(limits)
    out = []
    try:
        frames = reader._read_frames(_Dir(str(tmp_path), fd, "rank0"), "r.rec", asm)
        for i, (frame, data, _left) in enumerate(frames):
            if i == truncate_after:
                os.truncate(tmp_path / "r.rec", len(content) - 1000)
            done = asm.feed(frame, data)
            if done is not None:
                out.append((done[0].SerializeToString(), bytes(done[1])))
    except (BadFile, WireError) as exc:
        return "refused", f"{type(exc).__name__}: {exc}"
    finally:
        asm.close()
        os.close(fd)
    return "ok", out


def _both(tmp_path, content: bytes, monkeypatch, **kw):
    before = _deliver(tmp_path, content, monkeypatch, WHOLE, **kw)
    for head_bytes in (READER_HEAD, 512):
        now = _deliver(tmp_path, content, monkeypatch, head_bytes, **kw)
        assert now == before
    return now


@pytest.fixture
def copies(monkeypatch):
    """The bytes the assembler copies into payloads (what was not read into place), and the payloads it opens."""
    count = {"bytes": 0, "opened": 0}
    write, init = assembler_mod._Payload.write, assembler_mod._Payload.__init__

    def counted(self, off, data):
        count["bytes"] += len(data)
        write(self, off, data)

    def opened(self, size):
        count["opened"] += 1
        init(self, size)

    monkeypatch.setattr(assembler_mod._Payload, "write", counted)
    monkeypatch.setattr(assembler_mod._Payload, "__init__", opened)
    return count


@pytest.mark.parametrize("layout", ["agent", "data_first", "split", "unknown"])
@pytest.mark.parametrize("sizes", [[70_000, 70_000, 5_000], [4096, 100, 600, 513, 512, 511, 1]])
@pytest.mark.parametrize("tensors", [0, 120])
def test_records_hold_exactly_the_bytes_of_the_whole_frame_path(tmp_path, monkeypatch, layout, sizes, tensors):
    payload = _payload(sum(sizes), len(sizes))
    frames = [_record_frame(7, len(payload), payload[:sizes[0]], tensors)]
    off = sizes[0]
    for n in sizes[1:]:
        frames.append(_chunk(7, off, payload[off:off + n], layout))
        off += n
    status, records = _both(tmp_path, _file(frames), monkeypatch)
    assert status == "ok" and len(records) == 1 and records[0][1] == payload


def test_every_data_byte_is_read_into_place(tmp_path, monkeypatch, copies):
    """With the agent's layout and the reader's head, no byte of a record of several frames is copied after it was
    read: neither the first frame's (its header of 120 tensors is longer than 512 bytes) nor the chunks'."""
    payload = _payload(150_000, 11)
    frames = [_record_frame(7, len(payload), payload[:60_000], tensors=120),
              _chunk(7, 60_000, payload[60_000:120_000]), _chunk(7, 120_000, payload[120_000:])]
    assert len(frames[0]) - 60_000 > 512
    status, records = _deliver(tmp_path, _file(frames), monkeypatch, READER_HEAD)
    assert status == "ok" and [p for _, p in records] == [payload]
    assert copies["bytes"] == 0
    status, records = _deliver(tmp_path, _file(frames), monkeypatch, 512)   # the header is not in the head
    assert status == "ok" and [p for _, p in records] == [payload]
    assert copies["bytes"] == 60_000


def test_records_cut_off_or_refused_after_their_first_frame_are_as_before(tmp_path, monkeypatch, copies):
    """A record frame read into place and then cut off by the next record leaves nothing behind: what follows is
    delivered and refused as on the whole-frame path; one announcing more than the record limit is refused without
    a payload opened for it."""
    one, two = _payload(90_000, 12), _payload(50_000, 13)
    cut = [_record_frame(7, len(one), one[:40_000]), _record_frame(8, len(two), two[:30_000]),
           _chunk(8, 30_000, two[30_000:])]
    status, why = _both(tmp_path, _file(cut), monkeypatch)
    assert status == "refused" and "record 7 was cut off by the next record" in why
    status, records = _both(tmp_path, _file(cut[1:]), monkeypatch)
    assert status == "ok" and [p for _, p in records] == [two]
    small = Limits(max_record_bytes=80_000)
    opened = copies["opened"]
    status, why = _both(tmp_path, _file(cut[:1]), monkeypatch, limits=small)
    assert status == "refused" and "above the limit of 80000" in why
    assert copies["opened"] == opened


def test_a_record_in_one_frame_and_chunks_that_do_not_continue_are_as_before(tmp_path, monkeypatch):
    payload = _payload(50_000, 3)
    status, records = _both(tmp_path, _file([_record_frame(7, len(payload), payload)]), monkeypatch)
    assert status == "ok" and [p for _, p in records] == [payload]
    head = [_record_frame(7, len(payload), payload[:10_000])]
    for bad in (_chunk(8, 10_000, payload[10_000:]),            # another record's chunk
                _chunk(7, 9_000, payload[9_000:]),              # not where the payload goes on
                _chunk(7, 10_000, payload[10_000:] + b"x" * 700)):   # past the announced payload
        status, why = _both(tmp_path, _file(head + [bad]), monkeypatch)
        assert status == "refused" and "WireError" in why


def test_a_file_cut_short_in_a_data_field_is_refused_with_the_same_words(tmp_path, monkeypatch):
    payload = _payload(90_000, 5)
    frames = [_record_frame(7, len(payload), payload[:30_000]), _chunk(7, 30_000, payload[30_000:60_000]),
              _chunk(7, 60_000, payload[60_000:])]
    content = _file(frames)
    # cut while being read (after the size was taken): the last chunk's data ends early
    status, why = _both(tmp_path, content, monkeypatch, truncate_after=1)
    last = len(content) - len(frames[2])
    assert (status, why) == ("refused", f"BadFile: truncated frame at byte {last}")
    # cut before: refused by its size, before anything is read
    status, why = _both(tmp_path, content[:-1000], monkeypatch)
    assert (status, why) == ("refused", f"BadFile: a {len(frames[2])}-byte frame at byte {last} runs past the end "
                                        f"of the {len(content) - 1000}-byte file")


def test_the_data_field_is_found_from_the_head_as_from_the_whole_frame():
    payload = _payload(3000, 9)
    for raw in (_chunk(7, 100, payload, layout) for layout in ("agent", "data_first", "split", "unknown")):
        whole = parse_frame(raw)
        at = data_field_at(raw[:512], len(raw))
        if at is None:
            assert not isinstance(whole[1], memoryview) or raw.index(DATA_TAG) > 512
        else:
            assert pb.Frame.FromString(raw[:at[0]]) == whole[0] and raw[at[1]:] == bytes(whole[1])
    assert data_field_at(b"\x7a\x80", 10**6) is None   # the length runs past the head: read as a whole
