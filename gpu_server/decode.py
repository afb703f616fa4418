"""The one decoder of a record off the wire into a `Job` (gpu_server/job.py), for the intake and the replay
worker processes alike: every value decoded and checked (protos.codec), the call name parsed once, free-text
header fields kept printable (`wire_text`), a collective's Collective field validated."""
from __future__ import annotations

import re

import torch

from gpu_server.collective_info import from_wire
from gpu_server.job import Job
from protos import online_check_pb2 as pb
from protos.apis import COLLECTIVES, POINT_TO_POINT
from protos.codec import RecordDecoder, WireError
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
               max_ranks: int | None = None, match: re.Match[str] | None = None) -> Job:
    """The record's Job; a collective's Collective field validated into `Job.collective` (raises CollectiveError,
    member ranks at most `max_ranks`, default `limits.max_run_ranks`). `match`: `valid_call_name` of its name, where
    the caller has it."""
    h = record.header
    match = match or valid_call_name(h.name)
    dec = RecordDecoder(record, payload, limits)
    value = dec.value   # (a record's values are decoded in this order: the limits on their count apply across them)
    has = record.HasField
    args = tuple([value(v) for v in record.args.items])
    kwargs = dec.mapping(record.kwargs) if has("kwargs") else {}
    requires_grad = frozenset([id(dec.tensor(i)) for i in dec.requires_grad])
    autocast = record.autocast
    job = Job(
        run_id=h.run_id, rank=h.rank, step=h.step, seq=h.seq, name=h.name, category=match.group(1),
        api=match.group(2), direction=h.direction, args=args, kwargs=kwargs,
        output=value(record.output) if has("output") else None,
        grad_output=value(record.grad_output) if has("grad_output") else None,
        grad_input=value(record.grad_input) if has("grad_input") else None,
        grad_input_positions=tuple(positions) if len(positions := record.grad_input_positions) else (),
        requires_grad=requires_grad,
        grad_enabled=record.grad_enabled,
        autocast=(autocast.enabled, autocast.dtype, autocast.device_type),
        inplace=record.inplace, backward_expected=record.backward_expected, skip_reason=record.skip_reason[:1000],
        intra_op_threads=min(record.intra_op_threads, 1024),
        nbytes=len(payload), module=wire_text(h.module), source=wire_text(h.source), wire=(record, payload),
    )
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
