"""Small records travel several to a message (protos/framing.py, "Batch"; docs/design.md §5): the hand-built
encoding is exactly protobuf's own, a broken batch is refused record by record with the reason, every record of a
batch is validated, stored and answered as if it had come alone, and a real agent against a real server gets
every record checked exactly once."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from npu_agent import sender as sender_module
from npu_agent.config import Endpoint
from npu_agent.records import CHANGED_REASON, PendingRecord, batch_frame, encode_record, encode_together
from npu_agent.records import _PayloadEncoder as PayloadEncoder
from npu_agent.sender import Sender
from npu_agent.snapshot import snapshot
from npu_agent.transport import StreamIdentity
from npu_agent.transport_grpc import GrpcTransport
from protos import online_check_pb2 as pb
from protos.codec import WireError
from protos.folder_format import FOLDER_MAGIC, FRAME_LENGTH
from protos.framing import encode_batch, split_batch
from protos.limits import DEFAULT_LIMITS
from tests import support
from tests.test_hostile import RawStream, hello


def _relu(seq: int, n: int = 8, name: str = "relu") -> PendingRecord:
    x = torch.linspace(-2, 2, n)
    return PendingRecord(name=f"Functional.{name}.{seq}", step=0, inputs=snapshot(((x,), {})),
                         output=snapshot(torch.relu(x)), seq=seq)


def _encoded(recs: list[PendingRecord], run_id: str = "batch") -> list[tuple[bytes, list, int]]:
    out = []
    for rec in recs:
        enc = encode_record(rec, run_id, 0)
        record = enc.record
        out.append((record.SerializeToString(), enc.buffers, enc.size))
    return out


def test_batch_bytes_are_protobufs_own_encoding():
    parts = _encoded([_relu(0, 8), _relu(1, 0), _relu(2, 100)])
    frame = encode_batch(parts)
    payloads = [b"".join(bytes(v) for _, v in buffers).ljust(size, b"\0") for _, buffers, size in parts]
    expect = pb.Frame(batch=pb.Batch(records=[pb.Record.FromString(s) for s, _, _ in parts]),
                      data=b"".join(payloads)).SerializeToString()
    assert frame == expect
    split = split_batch(pb.Frame.FromString(frame), DEFAULT_LIMITS)
    assert [r.header.seq for r, _ in split] == [0, 1, 2]
    assert [p for _, p in split] == payloads



def _mixed(seq: int) -> PendingRecord:
    """Tensors whose layout needs padding, a strided one, a zero-size one and a half-precision one."""
    g = torch.Generator().manual_seed(seq)
    a = torch.randn(7, 5, generator=g).to(torch.bfloat16)   # 70 bytes: padding follows
    b = torch.randn(6, 4, generator=g).t()                    # strided: copied dense
    c = torch.empty(0, 3)
    return PendingRecord(name=f"Functional.mix.{seq}", step=1, inputs=snapshot(((a, b, c), {"k": a + 1})),
                         output=snapshot((a * 2, b.sum())), seq=seq)


@pytest.mark.parametrize("makers", [[_mixed] * 3, [_relu, _mixed, _relu], [lambda s: _relu(s, 0)] * 2])
def test_records_encoded_together_are_the_batch_of_records_encoded_alone(makers):
    alone = [make(seq) for seq, make in enumerate(makers)]
    together = [make(seq) for seq, make in enumerate(makers)]
    expect = encode_batch(_encoded(alone))
    assert encode_together(together, "batch", 0)
    encoded = [rec.encoded for rec in together]
    assert batch_frame(encoded) == expect                                       # the frame they were written into
    assert batch_frame(encoded) is batch_frame(encoded)
    assert [enc.record for enc in encoded] == [rec.encoded.record for rec in alone]
    for enc, rec in zip(encoded, alone):   # each payload on its own: its slice of the frame
        assert [bytes(v) for _, v in enc.buffers] == [bytes(v) for _, v in rec.encoded.buffers]
    # sent again in another grouping (after a reconnect): joined from the slices, the same bytes as alone
    if len(encoded) > 2:
        assert batch_frame(encoded[1:]) == encode_batch(_encoded(alone)[1:])
    assert batch_frame(encoded[::-1]) == encode_batch(_encoded(alone)[::-1])


def test_encoding_together_leaves_what_it_cannot_do_alone():
    one, large = [_relu(0)], [_relu(0), _large_record(1)]
    assert not encode_together(one, "batch", 0) and one[0].encoded is None
    assert not encode_together(large, "batch", 0) and all(rec.encoded is None for rec in large)
    done = [_relu(0), _relu(1)]
    encode_record(done[0], "batch", 0)
    assert not encode_together(done, "batch", 0) and done[1].encoded is None


def test_a_changed_tensor_skips_its_record_and_the_others_keep_their_values(monkeypatch):
    recs = [_relu(0), _mixed(1), _relu(2)]
    alone = [_relu(0), _mixed(1), _relu(2)]
    real = PayloadEncoder.copy_into
    calls = []

    def copy_into(self, target, snaps):
        calls.append(1)
        changed = real(self, target, snaps)
        return [12345] if len(calls) == 2 else changed   # the second record's tensor "changed"

    monkeypatch.setattr(PayloadEncoder, "copy_into", copy_into)
    assert encode_together(recs, "batch", 0)
    assert recs[1].skip_reason == CHANGED_REASON and recs[1].encoded.size == 0
    assert all(rec.encoded.batch is None for rec in recs)   # that frame is not sent: the batch is joined again
    frame = batch_frame([rec.encoded for rec in recs])
    monkeypatch.setattr(PayloadEncoder, "copy_into", real)
    skipped = _mixed(1)
    encode_record(skipped, "batch", 0, changed=[12345])
    assert frame == encode_batch(_encoded([alone[0], skipped, alone[2]]))


def _large_record(seq: int) -> PendingRecord:
    g = torch.Generator().manual_seed(seq)
    dense = torch.randn(300, 257, generator=g)                                  # 308 KB, memmove
    transposed = torch.randn(64, 96, generator=g).t()                            # strided: torch makes it dense
    half = torch.randn(1000, 33, generator=g).to(torch.bfloat16)                 # odd size: padding follows
    conj = torch.randn(50, 3, dtype=torch.complex64, generator=g).conj()         # lazily conjugated
    return PendingRecord(name=f"Functional.mul.{seq}", step=0, seq=seq,
                         inputs=snapshot(((dense, transposed, half, conj), {})), output=snapshot(dense * 2))


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 100_003])
def test_large_payload_written_into_its_frames_is_the_generic_encoding(monkeypatch, chunk_bytes):
    import npu_agent.records as records
    from gpu_server.intake.assembler import FrameAssembler
    from protos.codec import RecordDecoder

    assert records.FRAMES_IN_PLACE, "CPython: large payloads are written straight into their frames"
    enc = encode_record(_large_record(1), "big", 0, chunk_bytes)
    assert enc.frames is not None and len(enc.frames) == -(-enc.size // chunk_bytes)
    monkeypatch.setattr(records, "FRAMES_IN_PLACE", False)
    ref = encode_record(_large_record(1), "big", 0, chunk_bytes)
    assert ref.frames is None
    assert list(enc.wire_frames(chunk_bytes)) == list(ref.wire_frames(chunk_bytes))
    asm = FrameAssembler()
    done = [asm.feed(pb.Frame.FromString(f)) for f in enc.frames][-1]
    got_record, payload = done
    dec = RecordDecoder(got_record, payload, DEFAULT_LIMITS)
    args = [dec.value(v) for v in got_record.args.items]
    src = _large_record(1).inputs.tree[0]
    for a, b in zip(args, src):
        assert a.dtype == b.dtype and torch.equal(a, b.resolve_conj())


def test_broken_batches_are_refused_before_anything_is_held():
    parts = _encoded([_relu(0), _relu(1)])
    good = pb.Frame.FromString(encode_batch(parts))
    short = pb.Frame()
    short.CopyFrom(good)
    short.data = good.data[:-1]
    with pytest.raises(WireError, match="announces .* payload bytes but carries"):
        split_batch(short, DEFAULT_LIMITS)
    with pytest.raises(WireError, match="without records"):
        split_batch(pb.Frame(batch=pb.Batch()), DEFAULT_LIMITS)
    with pytest.raises(WireError, match="above the limit of 1"):
        split_batch(good, DEFAULT_LIMITS.replace(max_batch_records=1))
    with pytest.raises(WireError, match="record 0 of a batch announces"):
        split_batch(good, DEFAULT_LIMITS.replace(max_record_bytes=16))


class _InProcessTransport:
    """A transport that delivers nowhere: subclasses say what `send_records` does with what it is given."""

    identity = StreamIdentity("in-process", 0, 1)
    connect_timeout_s = 0.1
    chunk_bytes = 1 << 20
    reached = True
    generation = 1

    def start(self, events):
        self.events = events
        events.on_reconnect(1)

    def send_end(self, frame, timeout):
        return True

    def close(self):
        pass

    def describe_state(self):
        return "in process"


def test_sender_batches_only_small_records_that_queued_up():
    sent: list[list[int]] = []
    busy = threading.Event()

    class Recording(_InProcessTransport):   # records what it is given; busy with the first until released
        def send_records(self, recs, generation):
            sent.append([r.seq for r in recs])
            busy.wait(30)
            for r in recs:
                self.events.on_ack(r.seq, "ACCEPTED", "")
            return True

    sender = Sender(Recording(), budget_bytes=1 << 30)
    big = torch.zeros((1 << 16) + 1)   # just over 256 KiB of tensor: above the batching limit, always alone
    for seq in range(6):
        sender.submit(_relu(seq) if seq != 3 else PendingRecord(name="Functional.relu.3", step=0,
                                                                inputs=snapshot(((big,), {}))))
        if seq == 0:
            while not sent:   # the first record is with the transport: the others queue up behind it
                time.sleep(0.001)
    busy.set()
    counts = sender.close(timeout=30)
    assert counts["acknowledged"] == 6
    assert sent == [[0], [1, 2], [3], [4, 5]]


class _Answering(_InProcessTransport):
    """Acknowledges every record at once; `sent` is what each call was given, `calls` is set on each call."""

    def __init__(self):
        self.sent: list[list[int]] = []
        self.calls = threading.Event()

    def send_records(self, recs, generation):
        self.sent.append([r.seq for r in recs])
        self.calls.set()
        for r in recs:
            self.events.on_ack(r.seq, "ACCEPTED", "")
        return True


def _sent_within(transport: _Answering, n: int, seconds: float = 10.0) -> list[list[int]]:
    """What the transport was given, once it was given `n` batches (fails after `seconds`: LINGER_S is far longer
    in these tests, so only what ends a linger can send them sooner)."""
    deadline = time.monotonic() + seconds
    while len(transport.sent) < n and time.monotonic() < deadline:
        transport.calls.wait(0.05)
        transport.calls.clear()
    assert len(transport.sent) >= n, f"only {transport.sent} sent within {seconds} s"
    return transport.sent


def _submit_slowly(sender: Sender, records: list[PendingRecord]) -> None:
    """Submit each record with a pause before the next: time for the sender to send it, did it not linger. The
    first waits for the sender to be idle (its start's re-send done: a re-send ends a linger)."""
    deadline = time.monotonic() + 10
    while not (sender._sender_idle and not sender._resend) and time.monotonic() < deadline:
        time.sleep(0.001)
    for rec in records:
        sender.submit(rec)
        time.sleep(0.05)


@pytest.fixture
def lingering(monkeypatch):
    """A linger far longer than any test: a record goes out before it only when something ends the linger."""
    monkeypatch.setattr(sender_module, "LINGER_S", 600.0)


def test_a_small_record_that_finds_the_sender_idle_waits_for_others_to_join_it(lingering, monkeypatch):
    """The records a training submits one after the other go out in one message (npu_agent/sender.py,
    "Lingering"); a full batch ends the wait, and so does `close`."""
    monkeypatch.setattr(sender_module, "BATCH_RECORDS", 4)
    transport = _Answering()
    sender = Sender(transport, budget_bytes=1 << 30)
    _submit_slowly(sender, [_relu(seq) for seq in range(4)])
    assert _sent_within(transport, 1) == [[0, 1, 2, 3]]
    _submit_slowly(sender, [_relu(4)])
    counts = sender.close(timeout=10)   # what it waits for: the linger ends
    assert counts["unacknowledged"] == 0 and counts["acknowledged"] == 5
    assert transport.sent == [[0, 1, 2, 3], [4]]


def test_a_large_record_ends_the_linger(lingering):
    """Nothing can join small records past a large one (it goes alone): they go at once, then it."""
    transport = _Answering()
    sender = Sender(transport, budget_bytes=1 << 30)
    big = torch.zeros((1 << 16) + 1)   # just over 256 KiB of tensor: above the batching limit
    _submit_slowly(sender, [_relu(0), _relu(1),
                            PendingRecord(name="Functional.relu.2", step=0, inputs=snapshot(((big,), {})))])
    assert _sent_within(transport, 2) == [[0, 1], [2]]
    sender.close(timeout=10)


def test_a_training_that_waits_for_room_ends_the_linger(lingering):
    """At the memory budget the training waits for acknowledgements: the sender sends what it holds at once."""
    transport = _Answering()
    one = _relu(0).nbytes
    sender = Sender(transport, budget_bytes=2 * one)
    submitted = threading.Thread(target=_submit_slowly, args=(sender, [_relu(seq) for seq in range(3)]), daemon=True)
    submitted.start()
    submitted.join(10)
    assert not submitted.is_alive(), "the training waited for the linger to end"
    assert _sent_within(transport, 1)[0] == [0, 1]
    counts = sender.close(timeout=10)
    assert counts["acknowledged"] == 3 and transport.sent == [[0, 1], [2]]


def test_one_answer_releases_a_run_of_records():
    """An Ack for records seq..seq+count-1 releases them together: counted once each by status, their budget
    freed; sequence numbers not held (already answered, never sent) are ignored."""
    class Holding(_InProcessTransport):   # takes records and answers nothing by itself
        taken: list[int] = []

        def send_records(self, recs, generation):
            self.taken += [r.seq for r in recs]
            return True

    transport = Holding()
    sender = Sender(transport, budget_bytes=1 << 30)
    for seq in range(8):
        sender.submit(_relu(seq))
    deadline = time.monotonic() + 30
    while len(transport.taken) < 8 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert sender._held > 0
    sender.on_ack(0, "ACCEPTED", "", 4)
    sender.on_ack(4, "DUPLICATE", "", 2)
    sender.on_ack(3, "ACCEPTED", "", 1)   # already answered: not counted again
    sender.on_ack(6, "REJECTED", "bad", 5)   # 6 and 7 held; 8..10 were never sent
    counts = sender.close(timeout=5)
    assert (counts["acknowledged"], counts["duplicates"], counts["rejected"]) == (6, 2, 2)
    assert counts["unacknowledged"] == 0 and sender._held == 0


def test_a_batch_is_answered_record_by_record(tmp_path):
    with support.Server(str(tmp_path)) as server:
        stream = RawStream(server.port)
        try:
            recs = [_relu(seq) for seq in range(5)]
            bad = _relu(5, name="no_such_api_xyz")
            stream.send(hello("batch"), encode_batch(_encoded(recs + [bad, _relu(6)])))
            acks = stream.wait(3)
            covered = {}
            for ack in acks[:3]:
                for seq in range(ack.seq, ack.seq + max(1, ack.count)):
                    covered[seq] = (pb.Ack.Status.Name(ack.status), ack.reason)
            assert sorted(covered) == list(range(7))
            assert all(covered[s] == ("ACCEPTED", "") for s in (0, 1, 2, 3, 4, 6))
            assert covered[5][0] == "REJECTED" and "no_such_api_xyz" in covered[5][1]
            assert acks[0].count == 5   # consecutive records with the same answer share one
            # the same batch again: every record is a duplicate, nothing is checked twice
            stream.send(encode_batch(_encoded(recs)))
            again = stream.wait(4)[3]
            assert (pb.Ack.Status.Name(again.status), again.seq, again.count) == ("DUPLICATE", 0, 5)
            # a batch whose sizes do not add up: each of its records is refused, the stream goes on
            frame = pb.Frame.FromString(encode_batch(_encoded([_relu(7), _relu(8)])))
            frame.data = frame.data + b"x"
            stream.send(frame.SerializeToString(), encode_batch(_encoded([_relu(9), _relu(10)])))
            later = stream.wait(7)[4:7]
            assert [(pb.Ack.Status.Name(a.status), a.seq) for a in later[:2]] == [("REJECTED", 7), ("REJECTED", 8)]
            assert "but carries" in later[0].reason
            assert (pb.Ack.Status.Name(later[2].status), later[2].seq, later[2].count) == ("ACCEPTED", 9, 2)
        finally:
            stream.close()


def test_agent_with_batches_gets_every_record_checked_once(tmp_path):
    with support.Server(str(tmp_path)) as server:
        transport = GrpcTransport(Endpoint("127.0.0.1", server.port), "", "batched", 0, 1)
        sizes: list[int] = []
        send = transport.send_records

        def observed(recs, generation):
            sizes.append(len(recs))
            return send(recs, generation)

        transport.send_records = observed  # type: ignore[method-assign]
        sender = Sender(transport, budget_bytes=256 << 20)
        n = 400
        for seq in range(n):
            sender.submit(_relu(seq, 16 + seq % 5))
        counts = sender.close(timeout=120)
        assert counts["acknowledged"] == n and counts["rejected"] == 0
    assert max(sizes) > 1, "records queued behind a busy transport should have gone out together"
    rows = support.read_csv(server.out, "accuracy_checking_result")
    names = [r["API name"] for r in rows]
    assert len(names) == len(set(names)) == n


class _Acks:
    def __init__(self):
        self.acks = []

    def on_ack(self, seq, status, reason, count=1):
        self.acks += [(s, status) for s in range(seq, seq + count)]

    def on_reconnect(self, generation):
        pass

    def on_refused(self, refusal):
        raise AssertionError(refusal)


def test_folder_small_records_share_one_file_and_are_read_in_order(tmp_path):
    from npu_agent.transport import Counts, end_frame
    from npu_agent.transport_folder import FolderTransport
    from protos.folder_format import folder_end_name, folder_record_name
    from tests.test_folder import Collect

    nfs = tmp_path / "nfs"
    transport = FolderTransport(str(nfs), "folderbatch", 0, 1)
    events = _Acks()
    transport.start(events)
    assert transport.send_records([_relu(seq) for seq in range(4)], 1)
    assert transport.send_records([_relu(4), _relu(6)], 1)   # not consecutive: a file each
    assert events.acks == [(s, "ACCEPTED") for s in (0, 1, 2, 3, 4, 6)]
    assert transport.send_end(end_frame(transport.identity, Counts(captured=7, sent=7, acknowledged=7), 10), 5)
    assert sorted(os.listdir(nfs / "rank0")) == sorted([folder_end_name("folderbatch", 0)] + [
        folder_record_name("folderbatch", 0, s) for s in (0, 4, 6)])
    # a forged batch file: its second record claims another sequence number
    forged = encode_batch(_encoded([_relu(7), _relu(9)], run_id="folderbatch"))
    (nfs / "rank0" / folder_record_name("folderbatch", 0, 7)).write_bytes(
        FOLDER_MAGIC + FRAME_LENGTH.pack(len(forged)) + forged)
    c = Collect()
    reader = c.reader(nfs, gap_grace_s=0.0)
    while reader.poll_once():
        pass
    assert [j.seq for j in c.jobs] == [0, 1, 2, 3, 4, 6] and len(c.ends) == 1
    rejected = os.listdir(nfs / "rejected")
    assert len(rejected) == 1 and folder_record_name("folderbatch", 0, 7) in rejected[0]
