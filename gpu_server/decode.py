"""The one decoder of a record off the wire into a `Job` (gpu_server/job.py), for the intake and the replay
worker processes alike: every value decoded and checked (protos.codec), the call name parsed once, free-text
header fields kept printable (`wire_text`), a collective's Collective field validated."""
from __future__ import annotations

import re

import torch

from gpu_server.collective_info import from_wire
from gpu_server.compiled import DECODE
from gpu_server.job import Job
from protos import online_check_pb2 as pb
from protos.apis import COLLECTIVES, POINT_TO_POINT
from protos.codec import DTYPES, RecordDecoder, WireError
from protos.limits import DEFAULT_LIMITS, Limits, log_text, valid_call_name

MAX_WHERE = 1024   # characters kept of a record's module path and source location


def wire_text(value: str, limit: int = MAX_WHERE) -> str:
    """A free-text header field (module, source) as the reports keep it: as sent when short and printable, else cut
    to `limit` characters and escaped (protos.limits.log_text). Never a reason to reject the record."""
    if len(value) <= limit and value.isprintable():
        return value
    return log_text(value, limit)


def is_collective(record: pb.Record, category: str, api: str) -> bool:
    """A torch.distributed call the server checks across ranks: `Distributed.<api>` with api in COLLECTIVES or
    POINT_TO_POINT and a Collective field. Any other Distributed record keeps its SKIP row."""
    return (category == "Distributed" and (api in COLLECTIVES or api in POINT_TO_POINT)
            and record.HasField("collective"))


def decode_job(record: pb.Record, payload: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS,
               max_ranks: int | None = None, match: re.Match[str] | None = None, raw: bytes | None = None) -> Job:
    """The record's Job; a collective's Collective field validated into `Job.collective` (raises CollectiveError,
    member ranks at most `max_ranks`, default `limits.max_run_ranks`). `match`: `valid_call_name` of its name, where
    the caller has it. `raw`: the record's bytes (`record.SerializeToString()`), where the caller has them.

    Where gpu_server/_fastdecode.c is built, a record of the common kinds is read off its bytes in C (kept in
    `Job.wire` for the spool and the replay worker); any other, and every record without it, field by field in
    Python. Both give the same job, and the same error for a record they refuse (the C path leaves those to Python).
    """
    match = match or valid_call_name(record.header.name)
    fast = DECODE.load()
    if fast is not None:
        raw = record.SerializeToString() if raw is None else raw
        head = fast.head(raw)
        if head is not None:
            dec = RecordDecoder(record, payload, limits, head[8], head[9])
            values = fast.values(raw, head[17], dec.tensor, DTYPES, limits.max_values, limits.max_depth,
                                 limits.max_string_len)
            if values is not None:
                return _job(record, payload, raw, match, dec, head, values)
    dec = RecordDecoder(record, payload, limits)
    value = dec.value   # (a record's values are decoded in this order: the limits on their count apply across them)
    has = record.HasField
    h = record.header
    args = tuple([value(v) for v in record.args.items])
    kwargs = dec.mapping(record.kwargs) if has("kwargs") else {}
    output = value(record.output) if has("output") else None
    grad_output = value(record.grad_output) if has("grad_output") else None
    grad_input = value(record.grad_input) if has("grad_input") else None
    autocast = record.autocast
    head = (h.run_id, h.rank, h.step, h.seq, h.name, h.direction, h.module, h.source, None, None,
            record.grad_enabled, (autocast.enabled, autocast.dtype, autocast.device_type), record.inplace,
            record.backward_expected, record.skip_reason, tuple(record.grad_input_positions), record.intra_op_threads)
    job = _job(record, payload, raw, match, dec, head, (args, kwargs, output, grad_output, grad_input))
    if record.HasField("random"):
        r = record.random
        job.rng_state, job.rng_device = r.generator_state, r.device_type[:32]
        if r.has_mask:
            mask = dec.tensor(r.mask)
            if mask.dtype != torch.bool:
                raise WireError(f"dropout mask has dtype {mask.dtype}, expected bool")
            job.mask = mask
    if is_collective(record, job.category, job.api):
        job.collective = from_wire(record.collective, job.api, int(h.rank),
                                   limits.max_run_ranks if max_ranks is None else max_ranks)
    return job


def _job(record: pb.Record, payload: bytes | bytearray | memoryview, raw: bytes | None, match: re.Match[str] | None,
         dec: RecordDecoder, head: tuple, values: tuple) -> Job:
    """The Job of a record decoded by either path: `head` as gpu_server/_fastdecode.c's `head` gives it (its first 17
    fields), `values` its `values`."""
    (run_id, rank, step, seq, name, direction, module, source, _, _, grad_enabled, autocast, inplace,
     backward_expected, skip_reason, positions, threads) = head[:17]
    assert match is not None
    return Job(
        run_id=run_id, rank=rank, step=step, seq=seq, name=name, category=match.group(1), api=match.group(2),
        direction=direction, args=values[0], kwargs=values[1], output=values[2], grad_output=values[3],
        grad_input=values[4], grad_input_positions=positions,
        requires_grad=frozenset([id(dec.tensor(i)) for i in dec.requires_grad]), grad_enabled=grad_enabled,
        autocast=autocast, inplace=inplace, backward_expected=backward_expected, skip_reason=skip_reason[:1000],
        intra_op_threads=min(threads, 1024), nbytes=len(payload), module=wire_text(module),
        source=wire_text(source), wire=(record, payload, raw),
    )
