"""One decoded record, as every layer of the server sees it (`Job`), and the keys that name records and calls.

A record is identified by a `RecordKey` (run, rank, seq), a call by a `CallKey` (run, rank, step, name). The intake
(gpu_server/decode.py) decodes records into jobs; the workers, the checker, the replays, the collectives, the
sandbox
and the error data take them from here. This module sits below all of them: it imports only torch and
gpu_server/collective_info.py (tests/test_import_graph.py keeps it so).
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch

from gpu_server.collective_info import CollectiveInfo


@dataclasses.dataclass
class Job:
    run_id: str
    rank: int
    step: int
    seq: int
    name: str                  # Functional.linear.0
    category: str
    api: str
    direction: int
    args: tuple = ()
    kwargs: dict = dataclasses.field(default_factory=dict)
    output: Any = None
    grad_output: Any = None
    grad_input: Any = None
    grad_input_positions: tuple[int, ...] = ()
    requires_grad: frozenset[int] = frozenset()   # ids of decoded input tensors that required grad
    grad_enabled: bool = False
    autocast: tuple[bool, str, str] = (False, "", "")
    inplace: bool = False
    backward_expected: bool = False
    rng_state: bytes = b""
    rng_device: str = ""
    mask: torch.Tensor | None = None
    skip_reason: str = ""      # set: the call is reported SKIP with this reason
    intra_op_threads: int = 0  # CPU training's thread count (0: unknown / not a CPU device)
    nbytes: int = 0
    reserved: int = 0          # bytes of the server's memory budget this job holds until it is checked
    module: str = ""           # where the call was made (the header's, through wire_text): "TinyLM.blocks.0.attn"
    source: str = ""           # "train.py:42 (forward)"
    collective: CollectiveInfo | None = None   # a torch.distributed call: matched across ranks, never replayed
    inputs_finite: bool | None = None   # every float input finite, once a check measured it (its backward reads it)
    wire: tuple[Any, Any, bytes | None] | None = None   # (pb.Record, payload, the Record's bytes where the decoder
    # read them) it was decoded from: the spool keeps them, a replay worker process decodes them again
    # (gpu_server/replay/sandbox.py)


class RecordKey(NamedTuple):
    run_id: str
    rank: int
    seq: int


class CallKey(NamedTuple):
    run_id: str
    rank: int
    step: int
    name: str


def record_key(job) -> RecordKey:
    return RecordKey(job.run_id, int(job.rank), int(job.seq))


def call_key(job) -> CallKey:
    return CallKey(job.run_id, int(job.rank), int(job.step), job.name)
