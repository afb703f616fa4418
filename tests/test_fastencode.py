"""A record's values in C (npu_agent/_fastencode.c, issue 25): the compiled walk writes exactly the bytes of the
Python walk (protos.record_bytes.RecordEncoder, as npu_agent.records.PythonWalk calls it), for every kind of value
the wire carries, for the cases it hands back to Python (tensor subclasses, non-contiguous tensors, strings, named
tuples, subclasses of int, float and dict, deep nesting), for records encoded together into a Batch frame, and for
every record of a real training step; and the agent falls back to the Python walk where the module is not built."""
from __future__ import annotations

import collections
import enum
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from npu_agent import compiled, records
from npu_agent.backward import BackwardTaps
from npu_agent.capture import CaptureMode, Capturer
from npu_agent.records import PendingRecord, batch_frame, encode_record, encode_together
from npu_agent.snapshot import snapshot
from protos import online_check_pb2 as pb
from protos.codec import Opaque
from protos.limits import CHUNK_BYTES
from tests.support import ListSink, built

Point = collections.namedtuple("Point", "x y")


class Color(enum.IntEnum):
    RED = 3


class Tag(str):
    """A str subclass: the C walk hands it to the encoder's Python method."""


class Tagged(torch.Tensor):
    """A tensor subclass: the C walk hands it to the encoder's Python method."""


@pytest.fixture(scope="module")
def fast():
    """The compiled module, built here if the set-up did not build it (scripts/setup.sh does)."""
    built(compiled.ENCODE)
    records._WALK.clear()
    walk = records.walker()
    assert walk is not records.PythonWalk, "npu_agent/_fastencode.c did not load"
    return walk


def _nested(depth: int):
    v: object = torch.ones(2)
    for i in range(depth):
        v = [v, i] if i % 2 else (v, {"k": i})
    return v


def _values() -> list[tuple[tuple, dict, object]]:
    """(args, kwargs, output) of calls whose values cover what the wire carries."""
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(4, 4))
    big = (1 << 63)
    return [
        ((x, w), {"bias": None}, torch.randn(3, 4)),
        ((torch.randn(2, 3).t(), torch.tensor(2.5)), {}, torch.empty(0, 4)),                     # non-contiguous, 0-d
        ((torch.randn(5).to(torch.bfloat16), torch.arange(6, dtype=torch.int64).view(2, 3)), {"dim": -1}, None),
        ((torch.ones(4, dtype=torch.bool), torch.zeros(3, dtype=torch.complex64)), {}, (torch.ones(1), 7)),
        ((None, True, False, 0, 1, -1, 127, 128, -(1 << 63), big - 1, big, -big - 1, 1 << 80), {}, 3.0),
        ((0.0, -0.0, 1.5, math.inf, -math.inf, math.nan, 1e-310), {"alpha": 2.0}, [0.5, None]),
        ((torch.Size([2, 3]), torch.Size([]), torch.Size([0, 1 << 40])), {"size": torch.Size([4])}, torch.Size([1])),
        (((1, (2, [3, {"a": 4}])), [], ()), {"d": {}, "l": [1, [2]]}, {"out": torch.ones(2), "n": [None]}),
        (("text", "", "é", torch.float32, torch.device("cpu"), torch.channels_last, torch.strided), {}, "s"),
        ((Tag("sub"), torch.bfloat16, torch.int8, torch.bool, torch.complex128, torch.float8_e4m3fn, torch.uint16),
         {"dtype": torch.float64, "reduction": "mean"}, [torch.qint8, "x"]),
        ((slice(1, None, 2), slice(torch.tensor(1), 3), Ellipsis, 1 + 2j, Opaque("Thing")), {}, object()),
        ((Point(1, torch.ones(2)), Color.RED, np.float64(2.5), collections.OrderedDict(b=1, a=2)), {}, True),
        (({1: "int key"}, {"s": 1, 2: "mixed"}), {"k": {3: 4}}, torch.ones(2).as_subclass(Tagged)),
        ((_nested(80), _nested(3)), {"deep": _nested(70)}, _nested(66)),
        ((x[:, 1:3], x.detach()[::2]), {}, x.sum()),                                              # views of a slice
        ((torch.empty(2, 0, 3, 4).transpose(1, 2), torch.empty(3, 0).t(), torch.empty(0, 2)[:, ::2]),  # empty views
         {"cl": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)},                   # 4-D, dense
         torch.randn(2, 3, 4, 5, 6).permute(0, 2, 4, 1, 3)[:, 1:]),                               # 5-D, not dense
    ]


def _record(i: int, args: tuple, kwargs: dict, out: object) -> PendingRecord:
    return PendingRecord(name=f"Functional.call.{i}", step=3, inputs=snapshot((args, kwargs)),
                         output=snapshot(out) if out is not None else None, seq=i, module="M.layers.0",
                         source="train.py:12 (forward)", grad_enabled=True)


def _encode_with(walk, recs: list[PendingRecord]) -> list[tuple[bytes, bytes]]:
    """(the Record's bytes, its frames' bytes) of each record, encoded with `walk`."""
    out = []
    with records.walking(walk):
        for rec in recs:
            enc = encode_record(rec, "run-1", 2)
            out.append((enc.serialized, b"".join(bytes(f) for f in enc.wire_frames(CHUNK_BYTES))))
    return out


def test_the_compiled_walk_writes_the_python_walks_bytes(fast):
    cases = _values()
    python = _encode_with(records.PythonWalk, [_record(i, *c) for i, c in enumerate(cases)])
    c_walk = _encode_with(fast, [_record(i, *c) for i, c in enumerate(cases)])
    for i, (p, c) in enumerate(zip(python, c_walk)):
        assert c == p, f"case {i} ({cases[i][0]!r:.80}): the compiled walk wrote other bytes"
        if "deep" not in cases[i][1]:   # (protobuf's parser stops at 100 levels of nesting)
            pb.Record.FromString(p[0])   # and they parse
        if "deep" not in cases[i][1]:   # (protobuf's parser stops at 100 levels of nesting)
            pb.Record.FromString(p[0])   # and they parse
    assert len(python) == len(cases)


def test_each_walk_alone_gives_the_same_values(fast):
    """The three entry points, one value at a time, on fresh encoders: bytes, tensor table, places and size."""
    grads: set[int] = set()
    for args, kwargs, out in _values():
        for obj in (*args, out):
            got = []
            for walk in (records.PythonWalk, fast):
                enc = records._PayloadEncoder()
                b = walk.value(enc, obj, grads, lambda t: {"requires_grad": id(t) in grads})
                got.append((b, list(enc.metas), [(o, n, id(t)) for o, n, t in enc.places], enc.size))
            assert got[0] == got[1], repr(obj)[:80]
        for walk_args in ((args,), (kwargs,)):
            pair = []
            for walk in (records.PythonWalk, fast):
                enc = records._PayloadEncoder()
                fn = walk.sequence if walk_args[0] is args else walk.mapping
                pair.append((fn(enc, walk_args[0], None, lambda t: {"requires_grad": False}), enc.metas, enc.size))
            assert pair[0] == pair[1]


def test_records_encoded_together_are_the_same_frame(fast):
    def batch():
        x = torch.randn(16, 8)
        return [PendingRecord(name=f"Functional.relu.{i}", step=0, inputs=snapshot(((x * i,), {"inplace": False})),
                              output=snapshot(torch.relu(x)), seq=i) for i in range(6)]

    frames = []
    for walk in (records.PythonWalk, fast):
        with records.walking(walk):
            torch.manual_seed(0)
            recs = batch()
            assert encode_together(recs, "run-1", 0)
            frames.append(batch_frame([r.encoded for r in recs]))
    assert frames[0] == frames[1] and frames[0] is not None


def _training_records(seed: int) -> list[PendingRecord]:
    """Every record (forward and backward) of two steps of a small model, captured."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                                torch.nn.Linear(16, 4))
    sink = ListSink()
    cap = Capturer(sink.append, backward=BackwardTaps(sink.append))
    for step in range(2):
        with CaptureMode(cap):
            x = torch.randn(5, 8)
            loss = F.cross_entropy(model(x).view(5, 4), torch.tensor([0, 1, 2, 3, 0]))
            loss.backward()
        cap.backward.end_step()
        cap.next_step(step + 1)
    recs = list(sink)
    for i, rec in enumerate(recs):
        rec.seq = i
    return recs


def test_a_training_steps_records_are_the_same_bytes(fast):
    python = _encode_with(records.PythonWalk, _training_records(0))
    c_walk = _encode_with(fast, _training_records(0))
    assert len(python) == len(c_walk) > 20
    for p, c in zip(python, c_walk):
        assert c == p


def test_errors_raised_by_a_value_propagate_from_the_compiled_walk(fast):
    enc = records._PayloadEncoder()
    with pytest.raises(UnicodeEncodeError):
        fast.value(enc, ["\ud800"], None, lambda t: {"requires_grad": False})
    with pytest.raises(OverflowError):
        fast.value(enc, 1 << 2000, None, lambda t: {"requires_grad": False})
    with pytest.raises(TypeError, match="4 arguments"):
        fast.value(enc, 1)


def test_the_python_walk_without_the_module(monkeypatch, tmp_path):
    monkeypatch.setattr(records, "_WALK", [])
    monkeypatch.setattr(compiled.ENCODE, "loaded", [])
    monkeypatch.setenv(compiled.PURE_PYTHON_ENV, "1")
    assert records.walker() is records.PythonWalk
    monkeypatch.setattr(records, "_WALK", [])
    monkeypatch.setattr(compiled.ENCODE, "loaded", [])
    monkeypatch.delenv(compiled.PURE_PYTHON_ENV)
    monkeypatch.setattr(compiled.ENCODE, "source", tmp_path / "_fastencode.c")   # a changed source: not built
    (tmp_path / "_fastencode.c").write_text("/* another source */\n")
    assert records.walker() is records.PythonWalk


class _Shrinks(torch.Tensor):
    """A tensor subclass whose attribute reads (the encoder's Python method reads them) empty a list: the
    training's own code may run in the middle of a walk and change what is walked."""

    victim: list | None = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if cls.victim is not None:
            cls.victim.clear()
            cls.victim = None
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_list_emptied_during_its_walk_is_walked_as_python_walks_it(fast):
    got = []
    for walk in (records.PythonWalk, fast):
        items = [torch.ones(2).as_subclass(_Shrinks), torch.ones(3), 5, [torch.ones(4)] * 50]
        enc = records._PayloadEncoder()
        _Shrinks.victim = items
        got.append((walk.sequence(enc, [items], None, lambda t: {"requires_grad": False}), enc.metas, enc.size))
        assert _Shrinks.victim is None and items == []
    assert got[0] == got[1]


def _strided() -> list[torch.Tensor]:
    """Tensors that are not contiguous, of several dtypes: transposes, permutes, slices with steps, an expanded
    one (stride 0), a row of a transpose (one run of elements apart), a view with a storage offset."""
    out = []
    for dt in (torch.float32, torch.bfloat16, torch.float64, torch.bool, torch.int8, torch.complex64):
        base = (torch.randn(6, 7, 5, 4) * 10).to(dt)
        out += [base.transpose(1, 3), base[:, 2:5, ::2], base.permute(3, 0, 2, 1), base[..., 1],
                base[0, 0].expand(3, 5, 4), base.reshape(42, 20).t()[3:9], base.reshape(-1)[5::3]]
    return out


def test_the_compiled_gather_writes_what_contiguous_holds(fast):
    """`gather` of any bytes [skip, skip + count) of a strided tensor: exactly those bytes of `.contiguous()`, cuts
    inside an element included; False, with nothing written, for what it does not read."""
    import ctypes
    import random

    rnd = random.Random(5)
    for t in _strided():
        want = t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
        for skip, count in [(0, len(want)), (1, len(want) - 2), (0, 0)] + [
                (s, rnd.randrange(len(want) - s + 1)) for s in (rnd.randrange(len(want)) for _ in range(4))]:
            buf = ctypes.create_string_buffer(b"\xee" * (count + 1))
            assert fast.gather(t, len(want), ctypes.addressof(buf), skip, count) is True
            assert buf.raw[:count] == want[skip:skip + count], (t.shape, t.stride(), t.dtype, skip, count)
            assert buf.raw[count:count + 1] == b"\xee"   # nothing past count
    buf = ctypes.create_string_buffer(64)
    assert fast.gather(torch.randn(3), 11, ctypes.addressof(buf), 0, 11) is False           # not 3 float32s
    assert fast.gather(torch.randn(2, dtype=torch.complex64).conj(), 16, ctypes.addressof(buf), 0, 16) is False
    assert fast.gather(torch.randn(3).as_subclass(Tagged), 12, ctypes.addressof(buf), 0, 12) is False
    assert buf.raw == bytes(64)
    with pytest.raises(ValueError, match="within the tensor"):
        fast.gather(torch.randn(3), 12, ctypes.addressof(buf), 4, 12)


def test_strided_tensors_are_the_same_bytes_in_every_payload(fast, tmp_path, monkeypatch):
    """A record of strided tensors, from both walks: in its own buffer, in a Batch frame, in a large record's
    frames cut inside tensors and elements, and written into a record file piece by piece (a scratch buffer smaller
    than a tensor)."""
    from npu_agent import payload
    from npu_agent.records import write_file

    monkeypatch.setattr(payload, "GATHER_BYTES", 1000)

    def small(i: int) -> PendingRecord:
        torch.manual_seed(i)
        ts = _strided()
        return _record(i, tuple(ts[i::9]), {"w": ts[i + 1]}, ts[i + 2] * 1 if i % 2 else ts[i + 2])

    def large(i: int) -> PendingRecord:
        torch.manual_seed(i)
        x = torch.randn(300, 512)
        return _record(i, (x.t(), x[::3, 1::2].to(torch.bfloat16)), {}, x.t()[7:200])

    got = []
    for walk in (records.PythonWalk, fast):
        with records.walking(walk):
            one = [(e.serialized, bytes(e.buffers[0][1])) for e in (encode_record(small(i), "run-1", 2)
                                                                    for i in range(4))]
            recs = [small(i) for i in range(4)]
            assert encode_together(recs, "run-1", 2)
            together = batch_frame([r.encoded for r in recs])
            frames = [b"".join(bytes(f) for f in encode_record(large(i), "run-1", 2, 100_003).wire_frames(100_003))
                      for i in range(2)]
            files = []
            for i in range(2):
                rec = large(i)
                encode_record(rec, "run-1", 2, 100_003, defer=True)
                fd = os.open(tmp_path / f"{walk is fast}{i}.rec", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                try:
                    write_file(rec, fd)
                finally:
                    os.close(fd)
                files.append((tmp_path / f"{walk is fast}{i}.rec").read_bytes())
            got.append((one, together, frames, files))
    python, c_walk = got
    for part, p, c in zip(("own buffer", "Batch frame", "frames", "file"), python, c_walk):
        assert c == p, f"{part}: the compiled copy wrote other bytes"
    assert len(python[2][0]) > 600_000 and len(python[3][0]) > 600_000
