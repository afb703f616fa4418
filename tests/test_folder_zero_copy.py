"""A large record in the shared folder is copied straight from the training's memory into its file (npu_agent/records.py
`write_file`, npu_agent/payload.py `FilePayload`): the file must hold exactly the bytes of the in-memory path
(`encode_record` + `file_chunks`), for every layout a record can have, and a record whose tensor changed, or whose
file could not be published, must never be sent with the wrong values nor lost."""
from __future__ import annotations

import os

import pytest
import torch

from npu_agent.payload import FRAMES
from npu_agent.records import PendingRecord, encode_record, write_file
from npu_agent.snapshot import snapshot
from npu_agent.transport import Refusal
from npu_agent.transport_folder import FolderTransport
from protos import online_check_pb2 as pb
from protos.folder_format import FOLDER_MAGIC, FRAME_LENGTH, file_chunks, folder_record_name

RUN = "zerocopy0123456789"
BIG = 300 << 10   # above the size written straight into frames or files (records._SMALL)


def _tensors(kind: str) -> tuple[tuple, dict]:
    g = torch.Generator().manual_seed(hash(kind) % 1000)
    if kind == "one":
        return (torch.randn(BIG // 4, generator=g),), {}
    if kind == "several":   # odd sizes: alignment padding between them
        return (torch.randn(BIG // 4 + 3, generator=g), torch.randn(1001, generator=g).to(torch.bfloat16)), \
            {"weight": torch.randn(77, 13, generator=g)}
    if kind == "strided":   # a transpose (dense, kept strided) and a slice (copied row-major)
        x = torch.randn(512, 300, generator=g)
        return (x.t(), x[::2, 1:]), {}
    if kind == "conj":
        return (torch.randn(BIG // 8, dtype=torch.complex64, generator=g).conj(),), {}
    raise ValueError(kind)


def _record(kind: str, seq: int) -> PendingRecord:
    args, kwargs = _tensors(kind)
    rec = PendingRecord(name=f"Functional.linear.{seq}", step=3, inputs=snapshot((args, kwargs)),
                        output=snapshot(args[0] * 2), module="Net.fc", source="train.py:7 (forward)")
    rec.rng_state, rec.rng_device = b"\x01\x02\x03", "cpu"
    rec.mask = torch.rand(BIG // 8, generator=torch.Generator().manual_seed(seq)) > 0.5
    rec.seq = seq
    return rec


def _in_memory(kind: str, seq: int, chunk: int) -> bytes:
    enc = encode_record(_record(kind, seq), RUN, 2, chunk)
    return b"".join(file_chunks(enc.wire_frames(chunk)))


def _into_file(rec: PendingRecord, path: str, chunk: int) -> bytes:
    enc = encode_record(rec, RUN, 2, chunk, defer=True)
    assert enc.later is not None and rec.inputs is not None   # laid out, nothing copied yet
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        n = write_file(rec, fd)
    finally:
        os.close(fd)
    with open(path, "rb") as fh:
        data = fh.read()
    assert n == len(data)
    return data


@pytest.mark.parametrize("kind", ["one", "several", "strided", "conj"])
@pytest.mark.parametrize("chunk", [4 << 20, 100_000])   # one frame; several Chunk frames, tensors across them
def test_the_file_holds_exactly_the_bytes_of_the_in_memory_path(tmp_path, kind, chunk):
    rec = _record(kind, 11)
    data = _into_file(rec, str(tmp_path / "r.rec"), chunk)
    assert data == _in_memory(kind, 11, chunk)
    assert data.count(FOLDER_MAGIC) >= 1 and (chunk > BIG * 2 or FRAME_LENGTH.unpack_from(data, 8)[0] < len(data))
    # the training's tensors are let go, as after an in-memory encoding
    assert rec.inputs is None and rec.output is None and rec.mask is None
    assert rec.encoded is not None and rec.encoded.in_file and rec.encoded.later is None


def test_a_tensor_changed_without_a_copy_makes_the_file_a_skipped_record(tmp_path):
    rec = _record("one", 4)
    x = rec.inputs.tree[0][0]   # type: ignore[union-attr]
    encode_record(rec, RUN, 2, defer=True)
    x.add_(1)   # written by code the capture mode did not see: its `_version` moves, no copy was made
    fd = os.open(tmp_path / "r.rec", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        n = write_file(rec, fd)
    finally:
        os.close(fd)
    data = (tmp_path / "r.rec").read_bytes()
    assert n == len(data)
    frame = pb.Frame.FromString(data[12:12 + FRAME_LENGTH.unpack_from(data, 8)[0]])
    assert frame.record.skip_reason.startswith("a captured tensor was changed in place")
    assert not frame.record.tensors and frame.record.payload_bytes == 0


class _Events:
    def __init__(self) -> None:
        self.acks: list[int] = []

    def on_ack(self, seq: int, status: str, reason: str, count: int = 1) -> None:
        self.acks += range(seq, seq + count)

    def on_reconnect(self, generation: int) -> None:
        pass

    def on_refused(self, refusal: Refusal) -> None:
        raise AssertionError(refusal)


def _fail_first_rename(monkeypatch) -> list[str]:
    """os.replace fails once (the first publication), then works; returns where it failed."""
    real_replace, failed = os.replace, []

    def replace_once(src, dst, **kw):
        if not failed:
            failed.append(dst)
            raise OSError(5, "Input/output error (injected)")
        return real_replace(src, dst, **kw)

    monkeypatch.setattr(os, "replace", replace_once)
    return failed


def test_the_transport_writes_large_records_straight_and_a_failed_rename_loses_nothing(tmp_path, monkeypatch):
    """Through FolderTransport as the Sender drives it: the first rename fails once after the payload was copied
    (the training's tensors are let go by then): the frames are read back from the unpublished file and the retry
    publishes the very same bytes."""
    t = FolderTransport(str(tmp_path), RUN, 2, 4, max_retry_s=0.01)
    ev = _Events()
    t.start(ev)
    recs = [_record("several", 0), _record("one", 1)]
    for rec in recs:
        encode_record(rec, RUN, 2, t.chunk_bytes, defer=t.copies_into_files)
    made: list[bytes] = []   # (held: their ids stay theirs)
    real_frame = FRAMES.frame
    monkeypatch.setattr(FRAMES, "frame", lambda n: made.append(real_frame(n)) or made[-1])
    failed = _fail_first_rename(monkeypatch)
    assert t.send_records(recs, 1)
    assert ev.acks == [0, 1] and failed
    read = [f for rec in recs if rec.encoded.frames for f in rec.encoded.frames]
    # the frames read back go to the frame pool once acknowledged: only frames it made (it lengthens them within
    # their size class)
    assert read and all(any(f is m for m in made) for f in read)
    folder = tmp_path / "rank2"
    for seq, kind in ((0, "several"), (1, "one")):
        assert (folder / folder_record_name(RUN, 2, seq)).read_bytes() == _in_memory(kind, seq, t.chunk_bytes)
    assert not [f for f in os.listdir(folder) if f.endswith(".tmp")]
    t.close()


def test_a_record_whose_file_cannot_be_read_back_goes_out_skipped_with_the_reason(tmp_path, monkeypatch):
    t = FolderTransport(str(tmp_path), RUN, 2, 4, max_retry_s=0.01)
    ev = _Events()
    t.start(ev)
    rec = _record("one", 0)
    encode_record(rec, RUN, 2, t.chunk_bytes, defer=True)
    def no_read(*a, **kw):
        raise OSError(5, "read failed (injected)")

    _fail_first_rename(monkeypatch)
    monkeypatch.setattr(os, "pread", no_read)
    assert t.send_records([rec], 1)
    assert ev.acks == [0]
    data = (tmp_path / "rank2" / folder_record_name(RUN, 2, 0)).read_bytes()
    frame = pb.Frame.FromString(data[12:12 + FRAME_LENGTH.unpack_from(data, 8)[0]])
    assert frame.record.header.seq == 0 and not frame.record.tensors
    assert "could not write this record to the shared folder" in frame.record.skip_reason
    assert "read failed (injected)" in frame.record.skip_reason
    t.close()
