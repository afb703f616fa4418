"""The agent writes each Record's bytes itself (protos/record_bytes.py; docs/design.md §5): exactly the bytes
protobuf writes for the same record, built here with protobuf messages the way the agent built them before, for
every kind of value, a collective, a backward record, a dropout's mask and random state, and the text limits; and
encoding, framing and batching records builds no protobuf message at all (each one is an arena upb frees, and upb
trims the whole heap every 10,000 arena blocks freed)."""
from __future__ import annotations

import collections
import math

import pytest
import torch

from npu_agent.location import MAX_TEXT
from npu_agent.records import (
    BACKWARD,
    CollectiveCall,
    PendingRecord,
    _clone_stride,
    batch_frame,
    encode_record,
    encode_together,
)
from npu_agent.snapshot import snapshot
from protos import online_check_pb2 as pb
from protos import record_bytes as wire
from protos.codec import _ALIGN, _LAYOUT_NAMES, _MEMORY_FORMAT_NAMES, Opaque, dtype_name
from protos.framing import chunk_head, record_head

Point = collections.namedtuple("Point", "x y")


class _Reference:
    """A Record built with protobuf messages, field by field, as npu_agent/records.py did before it wrote bytes."""

    def __init__(self, out: pb.Record) -> None:
        self.out, self.size = out, 0

    def tensor(self, t: torch.Tensor, requires_grad: bool | None = None) -> int:
        meta = self.out.tensors.add()
        meta.dtype = dtype_name(t.dtype)
        meta.shape.extend(t.shape)
        meta.requires_grad = t.requires_grad if requires_grad is None else requires_grad
        meta.device = str(t.device)
        if not t.is_contiguous():
            meta.stride.extend(_clone_stride(t) or ())
        nbytes = t.numel() * t.element_size()
        self.size = (self.size + _ALIGN - 1) // _ALIGN * _ALIGN
        meta.offset, meta.nbytes = self.size, nbytes
        self.size += nbytes
        return len(self.out.tensors) - 1

    def fill(self, v: pb.Value, obj, hook) -> None:
        if obj is None:
            v.none = True
        elif isinstance(obj, torch.Tensor):
            v.tensor = self.tensor(obj, **hook(obj))
        elif isinstance(obj, bool):
            v.b = obj
        elif isinstance(obj, int):
            if -(1 << 63) <= obj < (1 << 63):
                v.i = obj
            else:
                v.f = float(obj)
        elif isinstance(obj, float):
            v.f = obj
        elif isinstance(obj, torch.Size):
            v.size.SetInParent()
            for n in obj:
                v.size.items.add().i = int(n)
        elif isinstance(obj, tuple):
            self.sequence(v.named_tuple if hasattr(obj, "_fields") else v.tuple, obj, hook)
        elif isinstance(obj, list):
            self.sequence(v.list, obj, hook)
        elif isinstance(obj, dict):
            if not all(isinstance(k, str) for k in obj):
                v.opaque = f"dict with {type(next(k for k in obj if not isinstance(k, str))).__name__} keys"
            else:
                self.mapping(v.dict, obj, hook)
        elif isinstance(obj, complex):
            v.c.real, v.c.imag = obj.real, obj.imag
        elif isinstance(obj, str):
            v.s = obj
        elif isinstance(obj, torch.dtype):
            v.dtype = dtype_name(obj)
        elif isinstance(obj, torch.device):
            v.device = str(obj)
        elif isinstance(obj, torch.memory_format):
            v.memory_format = _MEMORY_FORMAT_NAMES.get(obj, str(obj))
        elif isinstance(obj, torch.layout):
            v.layout = _LAYOUT_NAMES.get(obj, str(obj))
        elif obj is Ellipsis:
            v.ellipsis = True
        elif isinstance(obj, slice):
            v.slice.SetInParent()
            self.fill(v.slice.start, obj.start, hook)
            self.fill(v.slice.stop, obj.stop, hook)
            self.fill(v.slice.step, obj.step, hook)
        elif isinstance(obj, Opaque):
            v.opaque = obj.type_name
        else:
            v.opaque = type(obj).__qualname__[:200]

    def sequence(self, seq: pb.Sequence, items, hook) -> None:
        seq.SetInParent()
        for item in items:
            self.fill(seq.items.add(), item, hook)

    def mapping(self, m: pb.Mapping, obj, hook) -> None:
        m.SetInParent()
        for k, item in obj.items():
            m.keys.append(k)
            self.fill(m.values.add(), item, hook)


def _reference(rec: PendingRecord, run_id: str, rank: int) -> bytes:
    out = pb.Record()
    h = out.header
    h.run_id, h.rank, h.step, h.seq, h.name, h.direction = run_id, rank, rec.step, rec.seq, rec.name, rec.direction
    if rec.module:
        h.module = rec.module[:MAX_TEXT]
    if rec.source:
        h.source = rec.source[:MAX_TEXT]
    out.grad_enabled, out.inplace, out.backward_expected = rec.grad_enabled, rec.inplace, rec.backward_expected
    out.skip_reason = rec.skip_reason
    out.autocast.SetInParent()
    out.autocast.enabled, out.autocast.dtype, out.autocast.device_type = rec.autocast
    out.intra_op_threads = torch.get_num_threads() if rec.autocast[2] in ("cpu", "") else 0
    if rec.collective is not None:
        c, w = rec.collective, out.collective
        w.job, w.group, w.seq, w.op, w.root = c.job, c.group, c.seq, c.op, c.root
        w.ranks.extend(c.ranks)
        w.async_op, w.error, w.unfinished = c.async_op, c.error[:MAX_TEXT], c.unfinished
    ref = _Reference(out)
    if rec.inputs is not None and rec.inputs.tree is not None:
        grads = rec.inputs.requires_grad
        args, kwargs = rec.inputs.tree
        ref.sequence(out.args, args, lambda t: {"requires_grad": id(t) in grads})
        ref.mapping(out.kwargs, kwargs, lambda t: {"requires_grad": id(t) in grads})
    for field, snap in (("output", rec.output), ("grad_output", rec.grad_output), ("grad_input", rec.grad_input)):
        if snap is not None and snap.tree is not None:
            ref.fill(getattr(out, field), snap.tree, lambda t: {"requires_grad": False})
    if rec.grad_input is not None:
        out.grad_input_positions.extend(rec.grad_input_positions)
    if rec.rng_state or rec.mask is not None:
        out.random.generator_state = rec.rng_state
        out.random.device_type = rec.rng_device
        if rec.mask is not None:
            out.random.mask = ref.tensor(rec.mask, requires_grad=False)
            out.random.has_mask = True
    out.payload_bytes = ref.size
    return out.SerializeToString()


class _Thing:
    pass


def _every_value() -> list:
    w = torch.randn(4, 3, requires_grad=True)
    return [None, True, False, 0, 1, -1, 7, -(1 << 63), (1 << 63) - 1, 1 << 63, -(1 << 70), 0.0, -0.0, 1.5, -2.25,
            math.inf, -math.inf, math.nan, 1e-310, "", "x", "naïve ✓", torch.Size([]), torch.Size([2, 0, 3]), (), [],
            {}, (1, (2, [3.0])), [w, None], {"a": 1, "": w.detach()}, {1: "int key"}, 0j, -0.0 + 0j, 1 - 2j,
            complex(0.0, -0.0), torch.float32, torch.bfloat16, torch.device("cpu"), torch.channels_last,
            torch.contiguous_format, torch.strided, ..., slice(None), slice(1, -2, 3), slice(w, None),
            Opaque("Generator"), _Thing(), Point(1, torch.ones(2)),
            torch.return_types.max((torch.ones(2), torch.zeros(2, dtype=torch.int64)))]


def _records() -> list[PendingRecord]:
    x = torch.randn(8, 16)
    recs = [
        PendingRecord(name="Functional.linear.0", step=3, seq=0, inputs=snapshot(((x, torch.randn(4, 16)), {})),
                      output=snapshot(torch.randn(8, 4)), grad_enabled=True, backward_expected=True,
                      autocast=(True, "bfloat16", "cpu"), module="TinyLM.blocks.0.attn",
                      source="train.py:42 (forward)"),
        PendingRecord(name="Torch.everything.1", step=0, seq=1, output=snapshot(_every_value()),
                      inputs=snapshot((tuple(_every_value()), {
                          "k": 2, "t": x.t(), "empty": torch.empty(0), "zero_d": torch.tensor(3.5)}))),
        PendingRecord(name="Tensor.add_.2", step=(1 << 40), seq=(1 << 35), inplace=True,
                      autocast=(False, "", "cuda"), output=snapshot(x[:, 2:5]),
                      inputs=snapshot(((x[:, 2:5], x.t().contiguous().t(), torch.ones(2, 3, 4, 5).permute(0, 2, 3, 1)),
                                       {"alpha": 2}))),
        PendingRecord(name="Functional.linear.0", step=3, seq=3, direction=BACKWARD,
                      grad_output=snapshot((torch.randn(8, 4),)), grad_input=snapshot((torch.randn(8, 16), None)),
                      grad_input_positions=(0, 2, 300)),
        PendingRecord(name="Functional.dropout.4", step=1, seq=4, inputs=snapshot(((x,), {"p": 0.1})),
                      output=snapshot(x * 2), rng_state=bytes(range(256)) * 3, rng_device="cpu",
                      mask=torch.rand(8, 16) > 0.1),
        PendingRecord(name="Functional.dropout.5", step=1, seq=5, rng_state=b"\x00state", rng_device=""),
        PendingRecord(name="Functional.dropout.6", step=1, seq=6, mask=torch.zeros(0, dtype=torch.bool)),
        PendingRecord(name="Distributed.all_reduce.7", step=2, seq=7, inputs=snapshot(((x,), {})),
                      output=snapshot(x), collective=CollectiveCall(job="job-1", group="0", ranks=(0, 1, 5), seq=9,
                                                                    op="sum", root=-1, async_op=True,
                                                                    error="e" * 3000, unfinished=True)),
        PendingRecord(name="Distributed.send.8", step=2, seq=8, inputs=snapshot(((x,), {})),
                      collective=CollectiveCall(job="", group="p2p", ranks=(3, 0), seq=0, root=0)),
        PendingRecord(name="Torch.relu.9", step=0, seq=9, skip_reason="why " * 10, module="m" * 2000,
                      source="s" * 600, inputs=snapshot(((torch.tensor(1.0, dtype=torch.float64),), {}))),
        PendingRecord(name="Torch.nothing.10", step=0, seq=10),
    ]
    return recs


@pytest.mark.parametrize("index", range(len(_records())))
def test_the_record_bytes_are_protobufs_own(index):
    rec, ref = _records()[index], _records()[index]
    want = _reference(ref, "run-ü", 3)
    got = encode_record(rec, "run-ü", 3).serialized
    assert got == want
    assert pb.Record.FromString(got).SerializeToString() == got   # the canonical form protobuf writes back


def test_each_value_kind_alone():
    for obj in _every_value():
        rec, ref = (PendingRecord(name="Torch.x.0", step=0, seq=0, output=snapshot(obj)) for _ in range(2))
        got = encode_record(rec, "r", 0).serialized
        assert got == _reference(ref, "r", 0), repr(obj)


def test_field_writers_match_protobuf_at_the_edges():
    for n in (0, 1, 127, 128, 300, (1 << 32) - 1, (1 << 64) - 1):
        assert wire.uint(4, n) == pb.Collective(seq=n).SerializeToString()
    assert wire.uint(4, -1) == wire.uint(4, (1 << 64) - 1)   # not a varint that never ends
    for n in (0, -1, 1, -(1 << 31), (1 << 31) - 1):
        assert wire.sint32(6, n) == pb.Collective(root=n).SerializeToString()
    for shape in ([], [0], [1, -1, 1 << 40], [-(1 << 63)]):
        assert wire.packed(2, shape) == pb.TensorMeta(shape=shape).SerializeToString()
    for seq, offset in ((0, 0), (0, 4 << 20), (5, 0), ((1 << 64) - 1, 1 << 63)):
        assert chunk_head(seq, offset) == pb.Frame(chunk=pb.Chunk(seq=seq, offset=offset)).SerializeToString()
    r = pb.Record(payload_bytes=9)
    assert record_head(r.SerializeToString()) == pb.Frame(record=r).SerializeToString()
    assert record_head(b"") == pb.Frame(record=pb.Record()).SerializeToString()


@pytest.fixture
def no_protobuf_messages(monkeypatch):
    """Every protobuf message class the agent's records could use raises while the test runs."""
    def forbidden(*args, **kwargs):
        raise AssertionError("a protobuf message was built")
    for name in ("Record", "RecordHeader", "TensorMeta", "Value", "Sequence", "Mapping", "Frame", "Chunk", "Batch",
                 "Random", "Autocast", "Collective", "Slice", "Complex"):
        monkeypatch.setattr(pb, name, forbidden)


def test_encoding_framing_and_batching_build_no_protobuf_message(no_protobuf_messages):
    recs = _records()
    for rec in recs[:3]:
        enc = encode_record(rec, "r", 0, chunk_bytes=256)
        assert len(list(enc.wire_frames(256))) >= 1
    big = PendingRecord(name="Torch.relu.20", step=0, seq=20, output=snapshot(torch.randn(300_000)))
    assert len(list(encode_record(big, "r", 0, chunk_bytes=1 << 18).wire_frames(1 << 18))) == 5
    small = [PendingRecord(name=f"Torch.relu.{i}", step=0, seq=i, output=snapshot(torch.randn(4))) for i in (30, 31)]
    assert encode_together(small, "r", 0)
    assert batch_frame([rec.encoded for rec in small]) is not None
    alone = [encode_record(PendingRecord(name=f"Torch.relu.{i}", step=0, seq=i, output=snapshot(torch.randn(4))),
                           "r", 0) for i in (32, 33)]
    assert batch_frame(alone) is not None
