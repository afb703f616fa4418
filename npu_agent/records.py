"""A captured call as it waits on the agent (snapshots, not yet encoded), and its encoding into wire frames.

Encoding runs on the sender thread. It copies each tensor once, straight from the training's memory into the
record's payload (the layout the codec defines: 64-byte aligned, contiguous, padding zeroed), with the copy-on-write
handshake of npu_agent.snapshot: a tensor changed without a copy is never sent; its record goes out skipped, with
the reason. The encoding is kept on the record (a re-send after a reconnect sends the same bytes) and the
references to the training's tensors are dropped.
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
from typing import Any

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
    """RecordEncoder that only lays tensors out (their TensorMeta, built in place in the Record's table, and their
    offset); `copy_payload()` copies them into one payload."""

    def __init__(self, table: Any) -> None:   # table: the Record's repeated TensorMeta field
        super().__init__()
        self.table = table
        self.places: list[tuple[int, int, torch.Tensor]] = []   # (offset, nbytes, tensor as referenced)

    def tensor(self, t: torch.Tensor, requires_grad: bool | None = None, device: str | None = None) -> int:
        if t.layout != torch.strided:
            raise TypeError(f"{t.layout} tensors are not supported on the wire")
        meta = self.table.add()
        meta.dtype = dtype_name(t.dtype)
        meta.shape.extend(t.shape)
        meta.requires_grad = t.requires_grad if requires_grad is None else requires_grad
        meta.device = device or _device_name(t.device)
        if not t.is_contiguous():
            stride = _clone_stride(t)
            if stride is not None:
                meta.stride.extend(stride)
        nbytes = t.numel() * t.element_size()
        self.size = (self.size + _ALIGN - 1) // _ALIGN * _ALIGN
        meta.offset, meta.nbytes = self.size, nbytes
        self.places.append((self.size, nbytes, t))
        self.size += nbytes
        return len(self.table) - 1

    def copy_payload(self, snaps: list[Snapshot]) -> list[int]:
        """Copy every tensor into the payload; returns the ids of tensors found changed (not sendable)."""
        # Small records: a zeroed bytearray. Large ones: an uninitialised tensor, its alignment gaps zeroed below.
        payload: bytearray | torch.Tensor = bytearray(self.size) if self.size <= _SMALL else \
            torch.empty(self.size, dtype=torch.uint8)
        target = _Target(payload)
        reads = [(s, HELD.begin(s)) for s in snaps]
        source = {tid: src for _, read in reads for tid, src in read}
        with torch.no_grad(), disable_torch_function():
            for off, nbytes, t in self.places:
                if nbytes:
                    target.copy(off, nbytes, source.get(id(t), t))
            changed: list[int] = []
            again: dict[int, torch.Tensor] = {}
            for s, read in reads:
                a, c = HELD.finish(s, read)
                again.update(a)
                changed += c
            if again:
                for off, nbytes, t in self.places:
                    if id(t) in again and nbytes:
                        target.copy(off, nbytes, again[id(t)])
            if isinstance(payload, torch.Tensor):
                pos = 0
                for off, nbytes, _ in self.places:   # alignment padding goes out as zeros
                    if off > pos:
                        payload[pos:off].zero_()
                    pos = max(pos, off + nbytes)
        target.close()
        if not self.size:
            self.buffers = []
        elif isinstance(payload, bytearray):
            self.buffers = [(0, memoryview(payload))]
        else:
            self.buffers = [(0, payload.numpy().data.cast("B"))]
        return changed


class _Target:
    """A payload being filled. A dense CPU tensor is copied with one memmove from its memory: no torch call, no
    OpenMP team started from this (non-main) thread on top of the training's, the GIL released. Anything else
    (a strided view, a lazily conjugated or negated tensor, another device, a tensor without storage) is copied by
    torch."""

    def __init__(self, payload: bytearray | torch.Tensor):
        self.payload = payload
        self._view: Any = None
        if isinstance(payload, torch.Tensor):
            self.base = payload.data_ptr()
        elif payload:
            self._view = (ctypes.c_char * len(payload)).from_buffer(payload)   # pins the bytearray while it lives
            self.base = ctypes.addressof(self._view)
        else:
            self.base = 0

    def copy(self, off: int, nbytes: int, t: torch.Tensor) -> None:
        if (t.device.type == "cpu" and t.is_contiguous() and not (t.is_conj() or t.is_neg())
                and t.numel() * t.element_size() == nbytes):   # (resized since the layout: torch's copy raises)
            try:
                src = t.data_ptr()
            except RuntimeError:   # a wrapper subclass without storage
                src = 0
            if src:
                ctypes.memmove(self.base + off, src, nbytes)
                return
        if isinstance(self.payload, torch.Tensor):
            self.payload[off:off + nbytes].view(t.dtype).view(t.shape).copy_(t)
            return
        if t.device.type != "cpu":
            t = t.to("cpu")
        self.payload[off:off + nbytes] = tensor_bytes(t.detach().resolve_conj().resolve_neg().contiguous())

    def close(self) -> None:
        self._view = None   # the bytearray may be handed on now


_SMALL = 256 << 10
_DEVICE_NAMES: dict[torch.device, str] = {}


def _device_name(device: torch.device) -> str:
    name = _DEVICE_NAMES.get(device)
    if name is None:
        name = _DEVICE_NAMES[device] = str(device)
    return name


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
    # Every message is built where it lives in the Record (no temporary messages, no CopyFrom).
    out = pb.Record()
    h = out.header
    h.run_id, h.rank, h.step, h.seq, h.name, h.direction = run_id, rank, rec.step, rec.seq, rec.name, rec.direction
    out.grad_enabled, out.inplace, out.backward_expected = rec.grad_enabled, rec.inplace, rec.backward_expected
    out.skip_reason = rec.skip_reason
    out.autocast.SetInParent()
    out.autocast.enabled, out.autocast.dtype, out.autocast.device_type = rec.autocast
    out.intra_op_threads = torch.get_num_threads() if rec.autocast[2] in ("cpu", "") else 0
    enc = _PayloadEncoder(out.tensors)
    snaps: list[Snapshot] = []

    if with_tensors:
        if rec.inputs is not None and rec.inputs.tree is not None:
            grads = rec.inputs.requires_grad
            hook = lambda t: {"requires_grad": id(t) in grads}  # noqa: E731
            args, kwargs = rec.inputs.tree
            enc.fill_sequence(out.args, args, hook)
            enc.fill_mapping(out.kwargs, kwargs, hook)
            snaps.append(rec.inputs)
        for field, snap in (("output", rec.output), ("grad_output", rec.grad_output),
                            ("grad_input", rec.grad_input)):
            if snap is not None and snap.tree is not None:
                enc.fill(getattr(out, field), snap.tree, _NO_GRAD)
                snaps.append(snap)
        if rec.grad_input is not None:
            out.grad_input_positions.extend(rec.grad_input_positions)
    if rec.rng_state or rec.mask is not None:
        out.random.generator_state = rec.rng_state
        out.random.device_type = rec.rng_device
        if rec.mask is not None and with_tensors:
            out.random.mask = enc.tensor(rec.mask, requires_grad=False)
            out.random.has_mask = True
    changed = enc.copy_payload(snaps)
    out.payload_bytes = enc.size
    return out, enc, changed


def _NO_GRAD(t: torch.Tensor) -> dict[str, Any]:
    return {"requires_grad": False}


def end_frame(run_id: str, rank: int, world_size: int, counts: dict[str, Any]) -> bytes:
    """The end-of-stream Frame with the agent's counts (and its sampling counts, when a policy is set)."""
    sampling = {k: int(v) for k, v in (counts.get("sampling") or {}).items()}
    return pb.Frame(end=pb.End(run_id=run_id, rank=rank, captured=counts["captured"], sent=counts["sent"],
                               acknowledged=counts["acknowledged"], dropped=counts["dropped"],
                               last_seq=counts["last_seq"], world_size=world_size,
                               sampling=sampling)).SerializeToString()
