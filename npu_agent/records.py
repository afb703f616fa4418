"""A captured call as it waits on the agent (snapshots, not yet encoded), and its encoding into wire frames.

Encoding runs on the sender thread. It copies each tensor once, straight from the training's memory into the
record's payload (the layout the codec defines: 64-byte aligned, contiguous, padding zeroed), with the copy-on-write
handshake of npu_agent.snapshot: a tensor changed without a copy is never sent; its record goes out skipped, with
the reason. The encoding is kept on the record (a re-send after a reconnect sends the same bytes) and the
references to the training's tensors are dropped.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable

import torch

from npu_agent.snapshot import HELD, Snapshot
from protos import online_check_pb2 as pb
from protos.codec import _ALIGN, RecordEncoder, dtype_name, tensor_bytes
from protos.torch_compat import disable_torch_function

FORWARD, BACKWARD = pb.FORWARD, pb.BACKWARD
log = logging.getLogger("npu_agent")

CHANGED_REASON = ("a captured tensor was changed in place by code the capture mode did not see before the agent "
                  "could send it; the record is not sent with the changed value")


@dataclasses.dataclass(slots=True)
class PendingRecord:
    name: str                         # "Functional.linear.0"
    step: int
    direction: pb.Direction = FORWARD
    inputs: Snapshot | None = None    # forward: (args, kwargs) before the call
    output: Snapshot | None = None    # forward: the result after the call
    grad_output: Snapshot | None = None
    grad_input: Snapshot | None = None
    grad_input_positions: tuple[int, ...] = ()
    grad_enabled: bool = False
    autocast: tuple[bool, str, str] = (False, "", "")
    inplace: bool = False
    backward_expected: bool = False
    rng_state: bytes = b""
    rng_device: str = ""
    mask: Any = None                  # dropout family: the true keep-mask (bool tensor)
    skip_reason: str = ""
    seq: int = -1                     # assigned when the sender accepts it
    encoded: Any = None               # (pb.Record, buffers, size) once encoded

    @property
    def nbytes(self) -> int:
        total = sum(s.nbytes for s in (self.inputs, self.output, self.grad_output, self.grad_input) if s)
        if self.mask is not None:
            total += self.mask.numel()
        return total + len(self.rng_state)


class _Encoded:
    __slots__ = ("buffers", "size")

    def __init__(self, buffers: list[tuple[int, memoryview]], size: int) -> None:
        self.buffers, self.size = buffers, size


class _PayloadEncoder(RecordEncoder):
    """RecordEncoder that only lays tensors out (meta, offset); `fill()` copies them into one payload."""

    def __init__(self) -> None:
        super().__init__()
        self.places: list[tuple[int, int, torch.Tensor]] = []   # (offset, nbytes, tensor as referenced)

    def tensor(self, t: torch.Tensor, requires_grad: bool | None = None, device: str | None = None) -> int:
        if t.layout != torch.strided:
            raise TypeError(f"{t.layout} tensors are not supported on the wire")
        meta = pb.TensorMeta(dtype=dtype_name(t.dtype), shape=list(t.shape),
                             requires_grad=t.requires_grad if requires_grad is None else requires_grad,
                             device=device or str(t.device))
        if not t.is_contiguous():
            stride = _clone_stride(t)
            if stride is not None:
                meta.stride.extend(stride)
        nbytes = t.numel() * t.element_size()
        self.size = (self.size + _ALIGN - 1) // _ALIGN * _ALIGN
        meta.offset, meta.nbytes = self.size, nbytes
        self.places.append((self.size, nbytes, t))
        self.size += nbytes
        self.metas.append(meta)
        return len(self.metas) - 1

    def fill(self, snaps: list[Snapshot]) -> list[int]:
        """Copy every tensor into the payload; returns the ids of tensors found changed (not sendable)."""
        small = self.size <= _SMALL
        # small records: a zeroed bytearray and one memcpy per tensor; large: torch copies (any layout, device)
        small_payload: bytearray | None = None
        large_payload: torch.Tensor | None = None
        copy_into: Callable[[int, int, torch.Tensor], None]
        if small:
            small_payload = bytearray(self.size)
            copy_into = functools.partial(_copy_small, small_payload)
        else:
            large_payload = torch.empty(self.size, dtype=torch.uint8)
            copy_into = functools.partial(_copy_large, large_payload)
        reads = [(s, HELD.begin(s)) for s in snaps]
        source = {tid: src for _, read in reads for tid, src in read}
        with torch.no_grad(), disable_torch_function():
            for off, nbytes, t in self.places:
                if nbytes:
                    copy_into(off, nbytes, source.get(id(t), t))
            changed: list[int] = []
            again: dict[int, torch.Tensor] = {}
            for s, read in reads:
                a, c = HELD.finish(s, read)
                again.update(a)
                changed += c
            if again:
                for off, nbytes, t in self.places:
                    if id(t) in again and nbytes:
                        copy_into(off, nbytes, again[id(t)])
            if large_payload is not None:
                pos = 0
                for off, nbytes, _ in self.places:   # alignment padding goes out as zeros
                    if off > pos:
                        large_payload[pos:off].zero_()
                    pos = max(pos, off + nbytes)
        if not self.size:
            self.buffers = []
        elif small_payload is not None:
            self.buffers = [(0, memoryview(small_payload))]
        elif large_payload is not None:
            self.buffers = [(0, large_payload.numpy().data.cast("B"))]
        return changed


_SMALL = 256 << 10


def _copy_large(payload: torch.Tensor, off: int, nbytes: int, t: torch.Tensor) -> None:
    payload[off:off + nbytes].view(t.dtype).view(t.shape).copy_(t)


def _copy_small(payload: bytearray, off: int, nbytes: int, t: torch.Tensor) -> None:
    if t.device.type != "cpu":
        t = t.to("cpu")
    payload[off:off + nbytes] = tensor_bytes(t.detach().contiguous())


def _clone_stride(t: torch.Tensor) -> tuple[int, ...] | None:
    """The strides a private clone of non-contiguous `t` has: t's own when t is dense (a transpose, channels last),
    None (row-major) when it is a view into a larger storage (a slice)."""
    if t.dim() in (4, 5):   # clone may pick channels-last for a non-dense view: ask torch
        layout = torch.empty_like(t, device="meta")
        return None if layout.is_contiguous() else layout.stride()
    expect = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expect:
            return None
        expect *= size
    return t.stride()


def encode_record(rec: PendingRecord, run_id: str, rank: int) -> tuple[pb.Record, _Encoded]:
    """Build the protobuf Record and its payload (each tensor copied once from the training's memory). A record
    is encoded once; later calls (re-sends) return the same encoding."""
    if rec.encoded is not None:
        out, buffers, size = rec.encoded
        return out, _Encoded(buffers, size)
    out, enc, changed = _encode(rec, run_id, rank)
    if changed:
        with HELD.lock:
            first = HELD.changed == len(changed)
        if first:
            log.warning("online check: %s (%s, step %d); further such records are counted", CHANGED_REASON,
                        rec.name, rec.step)
        rec.skip_reason = CHANGED_REASON
        for s in (rec.inputs, rec.output, rec.grad_output, rec.grad_input):
            if s is not None:
                s.tree = None
        out, enc, _ = _encode(rec, run_id, rank, with_tensors=False)
    rec.encoded = (out, enc.buffers, enc.size)
    for s in (rec.inputs, rec.output, rec.grad_output, rec.grad_input):
        if s is not None:   # the payload holds the values now: let the training's tensors go
            s.tree = None
            s.held = {}
    return out, _Encoded(enc.buffers, enc.size)


def _encode(rec: PendingRecord, run_id: str, rank: int,
            with_tensors: bool = True) -> tuple[pb.Record, _PayloadEncoder, list[int]]:
    enc = _PayloadEncoder()
    out = pb.Record(
        header=pb.RecordHeader(run_id=run_id, rank=rank, step=rec.step, seq=rec.seq, name=rec.name,
                               direction=rec.direction),
        grad_enabled=rec.grad_enabled, inplace=rec.inplace, backward_expected=rec.backward_expected,
        skip_reason=rec.skip_reason,
        autocast=pb.Autocast(enabled=rec.autocast[0], dtype=rec.autocast[1], device_type=rec.autocast[2]),
        intra_op_threads=torch.get_num_threads() if rec.autocast[2] in ("cpu", "") else 0,
    )
    snaps: list[Snapshot] = []
    no_grad = {"requires_grad": False}

    if with_tensors:
        if rec.inputs is not None and rec.inputs.tree is not None:
            grads = rec.inputs.requires_grad
            hook = lambda t: {"requires_grad": id(t) in grads}  # noqa: E731
            args, kwargs = rec.inputs.tree
            out.args.CopyFrom(enc.value(tuple(args), hook).tuple)
            out.kwargs.CopyFrom(enc.mapping(dict(kwargs), hook))
            snaps.append(rec.inputs)
        for field, snap in (("output", rec.output), ("grad_output", rec.grad_output),
                            ("grad_input", rec.grad_input)):
            if snap is not None and snap.tree is not None:
                getattr(out, field).CopyFrom(enc.value(snap.tree, lambda t: no_grad))
                snaps.append(snap)
        if rec.grad_input is not None:
            out.grad_input_positions.extend(rec.grad_input_positions)
    if rec.rng_state or rec.mask is not None:
        out.random.generator_state = rec.rng_state
        out.random.device_type = rec.rng_device
        if rec.mask is not None and with_tensors:
            out.random.mask = enc.tensor(rec.mask, requires_grad=False)
            out.random.has_mask = True
    changed = enc.fill(snaps)
    out.tensors.extend(enc.metas)
    out.payload_bytes = enc.size
    return out, enc, changed


def end_frame(run_id: str, rank: int, world_size: int, counts: dict[str, Any]) -> bytes:
    """The end-of-stream Frame with the agent's counts (and its sampling counts, when a policy is set)."""
    sampling = {k: int(v) for k, v in (counts.get("sampling") or {}).items()}
    return pb.Frame(end=pb.End(run_id=run_id, rank=rank, captured=counts["captured"], sent=counts["sent"],
                               acknowledged=counts["acknowledged"], dropped=counts["dropped"],
                               last_seq=counts["last_seq"], world_size=world_size,
                               sampling=sampling)).SerializeToString()
