"""Records read off their bytes in C (gpu_server/_fastdecode.c, issue 25): gpu_server.decode.decode_job gives the
same job with the compiled module and without it, and the same error for a record it refuses, for every kind of
value the wire carries, every record of a real training step, records beyond each limit, hostile records made by
hand and records with random bytes changed; the compiled path reads the common records itself (it does not hand
them all back to Python), and the server decodes in Python where the module is not built."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from google.protobuf.message import DecodeError

from gpu_server import compiled, decode
from gpu_server.decode import decode_job
from gpu_server.intake import budget
from gpu_server.intake.budget import check_peak
from npu_agent.records import PendingRecord, encode_record
from npu_agent.snapshot import snapshot
from protos import online_check_pb2 as pb
from protos.codec import DTYPES, Opaque, RecordDecoder
from protos.compiled import PURE_PYTHON_ENV
from protos.limits import DEFAULT_LIMITS
from tests.support import built
from tests.test_fastencode import _record, _training_records, _values


@pytest.fixture(scope="module")
def fast():
    """The compiled module, built here if the set-up did not build it (scripts/setup.sh does)."""
    return built(compiled.DECODE)


def _wire(rec: PendingRecord, run_id: str = "run-1", rank: int = 2) -> tuple[pb.Record, bytes]:
    enc = encode_record(rec, run_id, rank)
    return pb.Record.FromString(enc.serialized), b"".join(bytes(view) for _, view in enc.buffers)


def _canon(job) -> dict:
    """The job as plain data: each tensor by its dtype, layout and bytes, and by the order it first appears in (so
    that the same tensor twice is seen as such); floats by their bits; each container and scalar with its type."""
    order: dict[int, int] = {}

    def walk(v):
        if isinstance(v, torch.Tensor):
            flat = v.detach().reshape(-1).contiguous()
            return ("tensor", order.setdefault(id(v), len(order)), v.dtype, tuple(v.shape), v.stride(),
                    bytes(flat.view(torch.uint8).numpy()) if flat.numel() else b"")
        if isinstance(v, float):
            return ("float", v.hex())
        if isinstance(v, complex):
            return ("complex", v.real.hex(), v.imag.hex())
        if isinstance(v, (tuple, list)):
            return (type(v).__name__, [walk(x) for x in v])
        if isinstance(v, dict):
            return ("dict", [(walk(k), walk(x)) for k, x in v.items()])
        if isinstance(v, slice):
            return ("slice", walk(v.start), walk(v.stop), walk(v.step))
        if isinstance(v, Opaque):
            return ("opaque", v.type_name)
        return (type(v).__name__, v)

    out = {}
    for field in dataclasses.fields(job):
        if field.name not in ("wire", "requires_grad"):
            out[field.name] = walk(getattr(job, field.name))
    out["requires_grad"] = sorted(order.get(i, -1) for i in job.requires_grad)
    out["wire"] = (job.wire[0], len(job.wire[1]))
    return out


def _outcome(record: pb.Record, payload: bytes, module, limits=DEFAULT_LIMITS):
    """decode_job's job (as _canon gives it) or its error (type and message), with `module` as the compiled one."""
    saved = compiled.DECODE.loaded[:]
    compiled.DECODE.loaded[:] = [module]
    try:
        return _canon(decode_job(record, payload, limits))
    except Exception as exc:  # noqa: BLE001 - the error is the outcome compared
        return (type(exc).__name__, str(exc))
    finally:
        compiled.DECODE.loaded[:] = saved


def _same(record: pb.Record, payload: bytes, fast, limits=DEFAULT_LIMITS):
    """Both paths' job or error, and both estimates of the record's checking peak (budget.check_peak), the same."""
    python = _outcome(record, payload, None, limits)
    assert _outcome(record, payload, fast, limits) == python, str(record)[:400]
    raw = record.SerializeToString()
    for base in (len(payload) + len(raw), 0):
        assert _peak(record, base, raw, fast) == _peak(record, base, raw, None), str(record)[:400]
    return python


def _peak(record: pb.Record, base: int, raw: bytes, module) -> int:
    saved = compiled.DECODE.loaded[:]
    compiled.DECODE.loaded[:] = [module]
    try:
        return check_peak(record, base, raw)
    finally:
        compiled.DECODE.loaded[:] = saved


def _read_in_c(fast, record: pb.Record, payload: bytes, limits=DEFAULT_LIMITS) -> bool:
    """Whether the compiled path reads this record itself (else it hands it to Python); one it reads, it estimates
    too (budget.check_peak)."""
    raw = record.SerializeToString()
    head = fast.head(raw)
    if head is None:
        return False
    dec = RecordDecoder(record, payload, limits, head[8], head[9])
    if fast.values(raw, head[17], dec.tensor, DTYPES, limits.max_values, limits.max_depth,
                   limits.max_string_len) is None:
        return False
    assert fast.peak(raw, len(raw) + len(payload), budget.PEAK_FACTORS, budget.HEADER_FACTOR) is not None
    return True


def _backward_records() -> list[PendingRecord]:
    x, g = torch.randn(3, 4), torch.randn(3, 4)
    return [
        PendingRecord(name="Functional.gelu.0", step=1, direction=pb.BACKWARD, grad_output=snapshot((g,)),
                      grad_input=snapshot((x, None)), grad_input_positions=(0, 7, 1 << 31), grad_enabled=True,
                      autocast=(True, "bfloat16", "cpu"), module="M.\x00odd\nname" + "é" * 2000, source="t.py:1",
                      seq=5),
        PendingRecord(name="Tensor.add_.3", step=1 << 40, inputs=snapshot(((x, 2.0), {"alpha": -3})),
                      output=snapshot(x), inplace=True, backward_expected=True, skip_reason="r" * 3000, seq=1 << 50),
        PendingRecord(name="Functional.dropout.0", step=0, inputs=snapshot(((x,), {"p": 0.5})), output=snapshot(x),
                      rng_state=b"\x01" * 16, rng_device="cpu", mask=torch.rand(3, 4) > 0.5, seq=0),   # a Random
    ]


def test_both_paths_give_the_same_job_for_every_kind_of_value(fast):
    recs = [_record(i, *case) for i, case in enumerate(_values())] + _backward_records()
    in_c = 0
    for rec in recs:
        try:
            record, payload = _wire(rec)
        except DecodeError:   # (protobuf's parser stops at 100 levels of nesting: _values' deepest)
            continue
        outcome = _same(record, payload, fast)
        in_c += _read_in_c(fast, record, payload) if isinstance(outcome, dict) else 0
    # the plain ones are read in C: tensors, numbers, None, strings, dtypes, nesting within the limits, backward
    # records; a Random (dropout), slices, devices, Size and the like go to Python
    assert in_c >= 8, in_c


def test_every_record_of_a_training_step_is_read_in_c_and_gives_the_same_job(fast):
    recs = _training_records(1)
    assert len(recs) > 20
    compared = 0
    for rec in recs:
        record, payload = _wire(rec)
        assert isinstance(_same(record, payload, fast), dict)
        if not record.HasField("random"):
            assert _read_in_c(fast, record, payload), rec.name
        raw = record.SerializeToString()
        peak = fast.peak(raw, len(raw) + len(payload), budget.PEAK_FACTORS, budget.HEADER_FACTOR)
        assert peak is not None, rec.name   # estimated in C too
        compared += peak > 16 * len(raw) + 11 * len(payload)   # an output's tensors count at their larger factor
    assert compared > 5, compared


def test_each_tensor_meta_is_keyed_by_its_own_bytes(fast):
    record, _ = _wire(_record(0, *_values()[0]))
    assert fast.head(record.SerializeToString())[8] == [m.SerializeToString() for m in record.tensors]


def test_records_at_and_beyond_each_limit_get_the_same_answer(fast):
    """Each limit swept across the record's own count, depth and string length, so that both paths meet it at the
    same value: the last one they take and the first they refuse."""
    x = torch.randn(4)
    deep: object = x
    for i in range(4):
        deep = [deep, {"k": (i, "s" * i)}]
    calls = [((deep, x, "longer"), {"n": [1, {"m": 2}], "t": "ab"}),   # the deepest value an argument
             ((x, "s"), {"deep": deep})]                                 # a keyword argument
    sweeps = {"max_values": range(1, 40), "max_depth": range(0, 14), "max_string_len": range(0, 8),
              "max_tensors": range(0, 6)}
    for inputs in calls:
        record, payload = _wire(PendingRecord(name="Functional.call.0", step=0, inputs=snapshot(inputs),
                                              output=snapshot((x, x)), seq=0))
        answers: dict[str, set] = {}
        for name, sweep in sweeps.items():
            for n in sweep:
                outcome = _same(record, payload, fast, DEFAULT_LIMITS.replace(**{name: n}))
                answers.setdefault(name, set()).add("job" if isinstance(outcome, dict) else outcome[1].split(" ")[0])
        for name, seen in answers.items():   # every sweep reaches both sides of its limit
            assert "job" in seen and len(seen) >= 2, (name, seen)


def _edits() -> list:
    """Hostile changes to a record, each a function of (record, payload) -> (record, payload)."""
    def tensor_index(r, p):
        r.args.items[0].tensor = 99
        return r, p

    def keys_without_values(r, p):
        r.kwargs.keys.append("extra")
        return r, p

    def unknown_dtype(r, p):
        r.args.items.add().dtype = "float128"
        return r, p

    def unknown_field(r, p):
        return pb.Record.FromString(r.SerializeToString() + b"\xf8\x06\x01"), p   # field 111, a varint

    def header_twice(r, p):
        extra = pb.Record(header=pb.RecordHeader(seq=9, name="Functional.relu.9")).SerializeToString()
        return pb.Record.FromString(r.SerializeToString() + extra), p

    def negative_direction(r, p):
        r.header.direction = -5
        return r, p

    def short_payload(r, p):
        return r, p[:-4]

    def meta_out_of_payload(r, p):
        r.tensors[0].offset = len(p)
        return r, p

    def bad_meta_dtype(r, p):
        r.tensors[0].dtype = "float99"
        return r, p

    def empty_value(r, p):
        r.args.items.add()
        r.output.Clear()
        return r, p

    def collective(r, p):
        r.header.name = "Distributed.all_reduce.0"
        r.collective.job, r.collective.group = "j", "0"
        r.collective.ranks.extend([0, 1])
        return r, p

    def many_threads(r, p):
        r.intra_op_threads = 65537   # kept as sent up to 1,024
        r.header.rank = (1 << 32) - 1
        return r, p

    def random_mask_only(r, p):
        r.random.mask = 2   # a Random field holding one varint, as a Value's tensor index is written
        return r, p

    def size_value(r, p):
        r.args.items.add().size.items.add().i = 3
        return r, p

    return [tensor_index, keys_without_values, unknown_dtype, unknown_field, header_twice, negative_direction,
            short_payload, meta_out_of_payload, bad_meta_dtype, empty_value, collective, many_threads, random_mask_only,
            size_value]


def test_hostile_records_get_the_same_answer(fast):
    x = torch.randn(2, 3)
    base = PendingRecord(name="Functional.linear.0", step=0, inputs=snapshot(((x, x.t()), {"bias": None})),
                         output=snapshot(x), seq=0)
    for edit in _edits():
        record, payload = _wire(base)
        record, payload = edit(record, payload)
        _same(record, payload, fast)


def test_records_with_random_bytes_changed_get_the_same_answer(fast):
    """Bytes changed at random in the Record's bytes (the ones protobuf still parses) and in its payload."""
    rng = random.Random(25)
    sources = [_wire(rec) for rec in _training_records(2)[:12]]
    sources += [_wire(_record(i, *case)) for i, case in enumerate(_values()[:9])]
    tried = 0
    for _ in range(3000):
        record, payload = rng.choice(sources)
        raw = bytearray(record.SerializeToString())
        for _ in range(rng.randint(1, 3)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        try:
            changed = pb.Record.FromString(bytes(raw))
        except DecodeError:
            continue
        tried += 1
        _same(changed, payload, fast)
    assert tried > 500, tried


def test_without_the_module_records_are_decoded_in_python(monkeypatch, tmp_path):
    record, payload = _wire(_record(0, *_values()[0]))
    monkeypatch.setattr(compiled.DECODE, "loaded", [])
    monkeypatch.setenv(PURE_PYTHON_ENV, "1")
    assert compiled.DECODE.load() is None
    job = decode_job(record, payload)
    assert job.wire is not None and job.wire[2] is None and job.name == "Functional.call.0"
    monkeypatch.setattr(compiled.DECODE, "loaded", [])
    monkeypatch.delenv(PURE_PYTHON_ENV)
    monkeypatch.setattr(compiled.DECODE, "source", tmp_path / "_fastdecode.c")   # a changed source: not built
    (tmp_path / "_fastdecode.c").write_text("/* another source */\n")
    assert compiled.DECODE.load() is None and decode.DECODE is compiled.DECODE
