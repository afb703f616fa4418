"""Hostile input (docs/design.md §5, §8): random and mutated frames and records never crash the decoder or the intake
with
anything but WireError, never hang and never allocate beyond the limits; a real server answers every bad message
with REJECTED and a reason and keeps serving; pickle bytes are never loaded; oversized messages get a clear error."""
from __future__ import annotations

import pickle
import tracemalloc

import grpc
import pytest
import torch
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpu_server.config import ServerConfig
from gpu_server.intake.admission import Intake
from gpu_server.intake.assembler import FrameAssembler
from npu_agent.records import PendingRecord, encode_record
from npu_agent.snapshot import snapshot
from protos import online_check_pb2 as pb
from protos.codec import RecordDecoder, WireError
from protos.limits import Limits, MiB
from tests import support

LIMITS = Limits(max_frame_bytes=1 * MiB, max_record_bytes=1 * MiB, max_tensors=64, max_numel=1 << 20,
                max_values=10_000, max_depth=16)
FUZZ = settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.too_slow], database=None)


def valid_record(seq: int = 0, name: str = "Functional.linear.0") -> tuple[pb.Record, list[bytes]]:
    """A real record as the agent encodes it: several dtypes, a non-contiguous tensor, nested arguments."""
    g = torch.Generator().manual_seed(seq)
    x = torch.randn(4, 6, generator=g)
    w = torch.randn(6, 3, generator=g).t()  # non-contiguous: strides travel
    args = ((x, w, [1, 2.5, None, (torch.arange(3), {"k": slice(0, 2)})]), {"bias": None, "dt": torch.bfloat16})
    rec = PendingRecord(name=name, step=0, inputs=snapshot(args), output=snapshot(x.to(torch.bfloat16)), seq=seq)
    enc = encode_record(rec, "fuzzrun", 0)
    record = enc.record
    frames = list(enc.wire_frames(96))
    return record, frames


RECORD, FRAMES = valid_record()
PAYLOAD = bytearray(b"".join(pb.Frame.FromString(f).data for f in FRAMES))


def new_intake() -> tuple[Intake, list]:
    jobs: list = []
    return Intake(ServerConfig(), jobs.append, LIMITS), jobs


def feed_all(frames: list[bytes]) -> None:
    """What the gRPC service does with each message, minus the network: only WireError may come out."""
    asm = FrameAssembler(LIMITS)
    intake, _ = new_intake()
    for raw in frames:
        try:
            frame = pb.Frame.FromString(raw)
        except DecodeError:
            asm.reset()
            continue
        if frame.WhichOneof("body") in ("hello", "end"):
            continue
        try:
            done = asm.feed(frame)
        except WireError:
            continue
        if done is not None:
            status, reason = intake.accept(*done)  # never raises: bad records are REJECTED with a reason
            assert status in (pb.Ack.ACCEPTED, pb.Ack.REJECTED, pb.Ack.DUPLICATE)
            assert status != pb.Ack.REJECTED or reason


def bounded(fn, *args, limit: int = 8 * LIMITS.max_record_bytes):
    """Run fn under tracemalloc: Python-side allocations stay within a few times the record limit."""
    tracemalloc.start()
    try:
        return fn(*args)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < limit, f"allocated {peak} bytes"


def test_the_valid_record_is_accepted():
    intake, jobs = new_intake()
    asm = FrameAssembler(LIMITS)
    done = [asm.feed(pb.Frame.FromString(f)) for f in FRAMES]
    assert done[-1] is not None and all(d is None for d in done[:-1]) and len(FRAMES) > 3
    assert intake.accept(*done[-1]) == (pb.Ack.ACCEPTED, "")
    assert jobs[0].args[1].stride() == (1, 3)


def mutate(data, frames: list[bytes]) -> list[bytes]:
    """A few random edits of a record's frames: bit flips, truncation, insertion, dropped, duplicated, swapped."""
    frames = list(frames)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(frames) - 1))
        raw = bytearray(frames[i])
        op = data.draw(st.sampled_from(["flip", "truncate", "insert", "drop", "dup", "swap"]))
        if op == "flip" and raw:
            for _ in range(data.draw(st.integers(1, 8))):
                j = data.draw(st.integers(0, len(raw) - 1))
                raw[j] ^= data.draw(st.integers(1, 255))
        elif op == "truncate":
            raw = raw[:data.draw(st.integers(0, len(raw)))]
        elif op == "insert":
            j = data.draw(st.integers(0, len(raw)))
            raw[j:j] = data.draw(st.binary(min_size=1, max_size=16))
        elif op == "drop":
            frames.pop(i)
            if not frames:
                return frames
            continue
        elif op == "dup":
            frames.insert(i, bytes(raw))
        elif op == "swap" and len(frames) > 1:
            j = data.draw(st.integers(0, len(frames) - 1))
            frames[i], frames[j] = frames[j], frames[i]
            continue
        frames[i] = bytes(raw)
    return frames


@FUZZ
@given(st.data())
def test_mutated_frames_only_raise_wire_error(data):
    bounded(feed_all, mutate(data, FRAMES))


@FUZZ
@given(st.lists(st.binary(max_size=256), max_size=6))
def test_random_bytes_only_raise_wire_error(blobs):
    bounded(feed_all, blobs)


_names = st.one_of(st.text(max_size=40), st.sampled_from(["Functional.linear.0", "Tensor.add.1", "Aten.mm.3",
                                                           "Functional..0", "Torch.__import__.0", "../../etc.x.1",
                                                           "Functional.linear.99999999999", "x" * 5000]))
_ints = st.one_of(st.integers(-4, 64), st.sampled_from([-(1 << 63), (1 << 63) - 1, 1 << 40, 1 << 62, 2 ** 31]))
_uints = st.one_of(st.integers(0, 4096), st.sampled_from([(1 << 64) - 1, 1 << 40, 1 << 33, 2 ** 31]))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _deep_frame_bytes(depth: int) -> bytes:
    """A Frame whose record's args nest `depth` lists deep, built byte by byte (protobuf cannot build it)."""
    v = b"\x18\x02"                                          # Value{i: 1}
    for _ in range(depth):
        seq = b"\x0a" + _varint(len(v)) + v                   # Sequence{items: [v]}
        v = b"\x42" + _varint(len(seq)) + seq                 # Value{list: seq}
    args = b"\x0a" + _varint(len(v)) + v                      # Sequence{items: [v]}
    record = b"\x22" + _varint(len(args)) + args              # Record{args}
    return b"\x0a" + _varint(len(record)) + record            # Frame{record}


def _deep(depth: int, kind: str) -> pb.Value:
    v = pb.Value(i=1)
    for _ in range(depth):
        v = pb.Value(**{kind: pb.Sequence(items=[v])}) if kind != "dict" else \
            pb.Value(dict=pb.Mapping(keys=["k"], values=[v]))
    return v


@FUZZ
@given(st.data())
def test_mutated_records_are_rejected_with_a_reason(data):
    rec = pb.Record()
    rec.CopyFrom(RECORD)
    payload = bytearray(PAYLOAD)
    for _ in range(data.draw(st.integers(1, 4))):
        what = data.draw(st.sampled_from(["dtype", "shape", "nbytes", "offset", "stride", "name", "payload",
                                          "deep", "tensor_index", "device", "wide", "keys", "mask", "run"]))
        t = rec.tensors[data.draw(st.integers(0, len(rec.tensors) - 1))]
        if what == "dtype":
            t.dtype = data.draw(st.one_of(st.text(max_size=12), st.sampled_from(["float64", "bool", "complex64",
                                                                                    "object", "torch.float32"])))
        elif what == "shape":
            del t.shape[:]
            t.shape.extend(data.draw(st.lists(_ints, max_size=20)))
        elif what == "nbytes":
            t.nbytes = data.draw(_uints)
        elif what == "offset":
            t.offset = data.draw(_uints)
        elif what == "stride":
            del t.stride[:]
            t.stride.extend(data.draw(st.lists(_ints, max_size=4)))
        elif what == "name":
            rec.header.name = data.draw(_names)
        elif what == "payload":
            cut = data.draw(st.integers(0, len(payload)))
            payload = payload[:cut] if data.draw(st.booleans()) else payload + bytes(cut)
            if data.draw(st.booleans()):
                rec.payload_bytes = len(payload)
        elif what == "deep":
            kind = data.draw(st.sampled_from(["tuple", "list", "dict", "named_tuple"]))
            rec.args.items.append(_deep(data.draw(st.integers(10, 45)), kind))  # upb refuses deeper
        elif what == "tensor_index":
            rec.args.items.append(pb.Value(tensor=data.draw(st.integers(0, (1 << 32) - 1))))
        elif what == "device":
            rec.args.items.append(pb.Value(device=data.draw(st.text(max_size=30))))
        elif what == "wide":
            rec.args.items.extend([pb.Value(i=1)] * data.draw(st.integers(1, 20_000)))
        elif what == "keys":
            rec.kwargs.keys.append(data.draw(st.text(max_size=10)))
        elif what == "mask":
            rec.random.has_mask = True
            rec.random.mask = data.draw(st.integers(0, 8))
        elif what == "run":
            rec.header.run_id = data.draw(st.text(max_size=70))
    intake, _ = new_intake()

    def accept():
        return intake.accept(rec, payload)

    status, reason = bounded(accept)
    assert status in (pb.Ack.ACCEPTED, pb.Ack.REJECTED), (status, reason)
    assert status != pb.Ack.REJECTED or reason.strip(), "REJECTED without a reason"
    assert status != pb.Ack.ACCEPTED or not reason, (status, reason)
    # the decoder alone: WireError or a checked record, nothing else; a record it refuses must have been REJECTED
    # by the intake, with a reason (never ACCEPTED and checked)
    why = _decoder_refusal(rec, payload)
    if why:
        assert status == pb.Ack.REJECTED and reason.strip(), f"the decoder refuses it ({why}) but the intake " \
                                                            f"answered {pb.Ack.Status.Name(status)} {reason!r}"


def _decoder_refusal(rec: pb.Record, payload) -> str:
    """Why RecordDecoder refuses the record (its WireError), or "" when it decodes every tensor and value."""
    try:
        dec = RecordDecoder(rec, payload, LIMITS)
        for i in range(len(rec.tensors)):
            dec.tensor(i)
        for v in rec.args.items:
            dec.value(v)
        for v in rec.kwargs.values:
            dec.value(v)
    except WireError as exc:
        return str(exc) or type(exc).__name__
    return ""


def _broken(what: str) -> tuple[pb.Record, bytearray]:
    """The valid record with one thing made certainly invalid."""
    rec = pb.Record()
    rec.CopyFrom(RECORD)
    payload = bytearray(PAYLOAD)
    t = rec.tensors[0]
    if what == "dtype":
        t.dtype = "object"
    elif what == "nbytes":
        t.nbytes += 4
    elif what == "shape":
        del t.shape[:]
        t.shape.extend([-1, 6])
    elif what == "payload":
        payload = payload[:len(payload) // 2]
        rec.payload_bytes = len(payload)
    elif what == "tensor_index":
        rec.args.items.append(pb.Value(tensor=10_000))
    elif what == "deep":
        rec.args.items.append(_deep(40, "list"))
    elif what == "name":
        rec.header.name = "NoSuchCategory.linear.0"
    elif what == "run":
        rec.header.run_id = "not a run id!"
    return rec, payload


@pytest.mark.parametrize("what", ["dtype", "nbytes", "shape", "payload", "tensor_index", "deep", "name", "run"])
def test_a_certainly_invalid_record_is_rejected_with_a_reason(what):
    """Each edit here makes the record invalid: the answer is REJECTED with a non-empty reason, nothing else."""
    rec, payload = _broken(what)
    intake, jobs = new_intake()
    status, reason = intake.accept(rec, payload)
    assert (pb.Ack.Status.Name(status), bool(reason.strip())) == ("REJECTED", True), (what, status, reason)
    assert all(j.skip_reason for j in jobs), f"{what}: an invalid record was handed on to be checked: {jobs}"
    if what not in ("name", "run"):
        assert _decoder_refusal(rec, payload), what


def test_huge_declared_sizes_are_refused_before_allocation():
    asm = FrameAssembler(LIMITS)
    rec = pb.Record()
    rec.CopyFrom(RECORD)
    rec.payload_bytes = LIMITS.max_record_bytes + 1
    with pytest.raises(WireError, match="above the limit"):
        bounded(asm.feed, pb.Frame(record=rec), limit=1 * MiB)
    rec.CopyFrom(RECORD)
    rec.tensors[0].shape[:] = [1 << 20, 1 << 20, 1 << 20]
    with pytest.raises(WireError, match="exceeds the limit"):
        bounded(RecordDecoder, rec, PAYLOAD, LIMITS, limit=1 * MiB)


class Evil:
    """Loading this pickle would create a file: proof that nothing on the receive path unpickles."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("fuzz_server")
    srv = support.Server(str(work), args=["--max-record-mb", "1"]).start()
    yield srv
    srv.stop()


def _stream(port: int, messages: list[bytes], want: int) -> list[pb.Ack]:
    """Send raw messages on one stream with a generic client; return the first `want` acknowledgements."""
    return support.stream_acks(port, messages, lambda acks: len(acks) >= want, timeout=20)


def _record_frame(record: pb.Record, data: bytes = b"") -> bytes:
    return pb.Frame(record=record, data=data).SerializeToString()


def test_a_real_server_answers_every_bad_message_and_keeps_serving(server, tmp_path):
    marker = tmp_path / "pwned"
    evil = pickle.dumps(Evil(str(marker)))
    hello = pb.Frame(hello=pb.Hello(run_id="fuzz", rank=0)).SerializeToString()

    def rec(seq: int, name: str = "Functional.linear.0", **changes) -> pb.Record:
        r = pb.Record()
        r.CopyFrom(RECORD)
        r.header.seq = seq
        r.header.name = name
        for k, v in changes.items():
            setattr(r, k, v)
        return r

    bad_dtype = rec(3)
    bad_dtype.tensors[0].dtype = "object"
    bad_shape = rec(4)
    bad_shape.tensors[0].shape[:] = [-1, 3]
    too_deep = rec(5)
    too_deep.args.items.append(_deep(40, "list"))
    # the pickle as a record's data: a uint8 tensor argument of a real API; bytes stay bytes
    pickled = pb.Record(header=pb.RecordHeader(run_id="fuzzrun", rank=0, seq=9, name="Tensor.clone.0",
                                               direction=pb.FORWARD),
                        tensors=[pb.TensorMeta(dtype="uint8", shape=[len(evil)], nbytes=len(evil), device="cpu")],
                        payload_bytes=len(evil))
    pickled.args.items.append(pb.Value(tensor=0))
    pickled.output.CopyFrom(pb.Value(tensor=0))
    bad = [
        b"\xff\x00garbage",                                                        # not a Frame
        evil,                                                                      # a pickle as a message
        pb.Frame(chunk=pb.Chunk(seq=1, offset=0), data=b"x").SerializeToString(),  # a chunk without its record
        _record_frame(rec(1, "Functional.__import__('os').0"), bytes(PAYLOAD)),     # bad API name
        _record_frame(rec(2, payload_bytes=5 * MiB)),                              # above --max-record-mb
        _record_frame(bad_dtype, bytes(PAYLOAD)),                                  # unknown dtype
        _record_frame(bad_shape, bytes(PAYLOAD)),                                  # negative dimension
        _record_frame(too_deep, bytes(PAYLOAD)),                                   # nesting beyond the limit
        _record_frame(rec(6, "Torch.no_such_api.0"), bytes(PAYLOAD)),              # unknown API
        _record_frame(rec(10, "Functional.linear.0\n"), bytes(PAYLOAD)),            # a trailing newline
        _record_frame(rec(11, "Functional.linear.\u0663"), bytes(PAYLOAD)),         # an Arabic-Indic digit
        pb.Frame(end=pb.End(run_id="../x")).SerializeToString(),                   # end with a bad run id
        _deep_frame_bytes(5000),                                                   # nesting 5000 deep
    ]
    good = _record_frame(rec(7), bytes(PAYLOAD))
    acks = _stream(server.port, [hello, *bad, _record_frame(pickled, evil), good], want=len(bad) + 2)
    assert [a.status for a in acks[:len(bad)]] == [pb.Ack.REJECTED] * len(bad), acks
    assert all(a.reason for a in acks[:len(bad)])
    reasons = " | ".join(a.reason for a in acks)
    for why in ("not a valid Frame", "without its record header", "is not Category.api.n", "above the limit",
                "unknown dtype 'object'", "negative dimension", "nested deeper", "invalid run id"):
        assert why in reasons, why
    assert acks[-2].seq == 9 and acks[-2].status in (pb.Ack.ACCEPTED, pb.Ack.REJECTED)
    assert acks[-1].seq == 7 and acks[-1].status == pb.Ack.ACCEPTED, acks[-1]
    assert not marker.exists(), "the pickle was never loaded"

    # a message above max_frame_bytes: a clear error for the client, and the server goes on serving
    with pytest.raises(grpc.RpcError) as info:
        _stream(server.port, [hello, b"\x7a" + b"\xff" * 4 + bytes(21 * MiB)], want=1)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in info.value.details()
    acks = _stream(server.port, [hello, _record_frame(rec(8), bytes(PAYLOAD))], want=1)
    assert acks[0].status == pb.Ack.ACCEPTED and acks[0].seq == 8
    assert not marker.exists()
    assert server.proc.poll() is None
    assert "Traceback" not in server.log()


_GOOD_SEQ = iter(range(1000, 1 << 30))
SERVER_FUZZ = settings(max_examples=25, deadline=None, database=None,
                       suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@SERVER_FUZZ
@given(st.data())
def test_fuzzed_frames_through_a_real_server(server, data):
    """Hypothesis-made frames (mutated records, random bytes, stray ends) over a real gRPC stream: every answer
    is a known status (REJECTED with a reason), and a valid record sent after them on the same stream is accepted."""
    kind = data.draw(st.sampled_from(["mutated", "random", "mixed"]))
    frames = mutate(data, FRAMES) if kind != "random" else []
    if kind != "mutated":
        frames += data.draw(st.lists(st.binary(max_size=200), max_size=4))
    if data.draw(st.booleans()):
        frames.insert(0, pb.Frame(end=pb.End(run_id=data.draw(st.text(max_size=8)), rank=data.draw(st.integers(0, 9)))
                                  ).SerializeToString())
    seq = next(_GOOD_SEQ)
    good = pb.Record()
    good.CopyFrom(RECORD)
    good.header.run_id, good.header.seq = "fuzzreal", seq
    hello = pb.Frame(hello=pb.Hello(run_id="fuzzreal", rank=0)).SerializeToString()
    acks = _stream_until(server.port, [hello, *frames, _record_frame(good, bytes(PAYLOAD))], seq)
    assert acks[-1].seq == seq and acks[-1].status == pb.Ack.ACCEPTED, acks[-3:]
    for a in acks:
        assert a.status in (pb.Ack.ACCEPTED, pb.Ack.REJECTED, pb.Ack.DUPLICATE, pb.Ack.END_ACCEPTED), a
        assert a.status != pb.Ack.REJECTED or a.reason
    assert server.proc.poll() is None


def _stream_until(port: int, messages: list[bytes], seq: int) -> list[pb.Ack]:
    """Send raw messages on one stream; collect acknowledgements up to the one for the valid record `seq`."""
    return support.stream_acks(port, messages, lambda acks: acks[-1].seq == seq and acks[-1].status == pb.Ack.ACCEPTED
                               and len(acks[-1].reason) == 0)


def test_the_fuzzing_left_the_server_clean(server):
    assert server.proc.poll() is None
    assert "Traceback" not in server.log() and "internal error" not in server.log()


@pytest.mark.parametrize("shape,stride", [([2, 2], [0, 0]), ([2, 2], [1, 1]), ([3, 2], [1, 0]), ([4, 3], [6, 2]),
                                          ([2, 3], [3, 2])])
def test_strides_that_are_not_one_dense_layout_are_a_wire_error(shape, stride):
    """Finding 3: stride [0, 0] for shape [2, 2] made the decoder raise a plain RuntimeError (copying 4 elements
    into one memory location). Overlapping, gapped or inconsistent strides are WireErrors, found before decoding."""
    n = shape[0] * shape[1]
    rec = pb.Record(tensors=[pb.TensorMeta(dtype="float32", shape=shape, stride=stride, nbytes=4 * n)],
                    payload_bytes=4 * n)
    with pytest.raises(WireError, match="dense, non-overlapping"):
        RecordDecoder(rec, bytes(4 * n), LIMITS)
    ok = pb.Record(tensors=[pb.TensorMeta(dtype="float32", shape=shape, stride=[1, shape[0]], nbytes=4 * n)],
                   payload_bytes=4 * n)
    t = RecordDecoder(ok, torch.arange(n, dtype=torch.float32).numpy().tobytes(), LIMITS).tensor(0)
    assert t.stride() == (1, shape[0]) and t.flatten().tolist() != [] and t.is_contiguous() is False
