"""A captured call as it waits on the agent (snapshots, not yet encoded), and its encoding into wire frames."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from npu_agent.snapshot import Snapshot
from protos import online_check_pb2 as pb
from protos.codec import RecordEncoder, TensorHook

FORWARD, BACKWARD = pb.FORWARD, pb.BACKWARD


@dataclasses.dataclass
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

    @property
    def nbytes(self) -> int:
        total = sum(s.nbytes for s in (self.inputs, self.output, self.grad_output, self.grad_input) if s)
        if self.mask is not None:
            total += self.mask.numel()
        return total + len(self.rng_state)


def encode_record(rec: PendingRecord, run_id: str, rank: int) -> tuple[pb.Record, RecordEncoder]:
    """Build the protobuf Record and the encoder holding the tensor bytes (zero-copy views of the snapshots)."""
    enc = RecordEncoder()
    out = pb.Record(
        header=pb.RecordHeader(run_id=run_id, rank=rank, step=rec.step, seq=rec.seq, name=rec.name,
                               direction=rec.direction),
        grad_enabled=rec.grad_enabled, inplace=rec.inplace, backward_expected=rec.backward_expected,
        skip_reason=rec.skip_reason,
        autocast=pb.Autocast(enabled=rec.autocast[0], dtype=rec.autocast[1], device_type=rec.autocast[2]),
        intra_op_threads=torch.get_num_threads() if rec.autocast[2] in ("cpu", "") else 0,
    )

    def hook_for(snap: Snapshot) -> TensorHook:
        return lambda t: {"requires_grad": id(t) in snap.requires_grad}

    if rec.inputs is not None:
        args, kwargs = rec.inputs.tree
        out.args.CopyFrom(enc.value(tuple(args), hook_for(rec.inputs)).tuple)
        out.kwargs.CopyFrom(enc.mapping(dict(kwargs), hook_for(rec.inputs)))
    if rec.output is not None:
        out.output.CopyFrom(enc.value(rec.output.tree))
    if rec.grad_output is not None:
        out.grad_output.CopyFrom(enc.value(rec.grad_output.tree))
    if rec.grad_input is not None:
        out.grad_input.CopyFrom(enc.value(rec.grad_input.tree))
        out.grad_input_positions.extend(rec.grad_input_positions)
    if rec.rng_state or rec.mask is not None:
        out.random.generator_state = rec.rng_state
        out.random.device_type = rec.rng_device
        if rec.mask is not None:
            out.random.mask = enc.tensor(rec.mask)
            out.random.has_mask = True
    out.tensors.extend(enc.metas)
    out.payload_bytes = enc.size
    return out, enc
