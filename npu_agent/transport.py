"""The contract between the Sender and a transport (gRPC stream or shared folder), declared once.

The Sender owns the records until they are acknowledged; a transport only delivers them. Both transports
(`transport_grpc.GrpcTransport`, `transport_folder.FolderTransport`) implement `Transport`, and the Sender
implements `TransportEvents`; mypy checks both (`mypy --strict`, see pyproject.toml). How to add a transport:
docs/design.md, "Transports".

Streams and generations: a transport numbers the streams it opens (1, 2, ...; 0 before the first). When a stream
opens, it calls `on_reconnect(generation)`, and the Sender re-sends everything not acknowledged, in order, on that
stream. `send_records(recs, generation)` sends only on that stream and returns False when it is gone, so nothing new
overtakes the re-send. The folder has a single stream, generation 1, for its whole life.

Answers when asked: a transport whose server may hold its answers until the agent asks for them (the gRPC stream,
docs/design.md §5) also has `ask(generation) -> bool`, which the Sender calls (npu_agent/sender.py, "Answers when
asked"); a transport without it (the folder) answers what it writes without being asked.

Refusals: a transport that learns it can never deliver (a TLS or certificate mismatch, another protocol version, a
rank folder that is a symbolic link) calls `on_refused` once with the cause and the fix; it then delivers nothing
more, and the Sender stops holding records for it.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol

from npu_agent.records import PendingRecord
from protos import online_check_pb2 as pb


@dataclasses.dataclass(frozen=True)
class StreamIdentity:
    """Who sends: one training process (run) on one rank of a job."""

    run_id: str
    rank: int
    world_size: int


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A permanent reason why records cannot be delivered, in words a user can act on."""

    cause: str   # what is wrong, as observed
    fix: str     # what to change

    def message(self, where: str) -> str:
        return (f"online check: {where} can never receive this training's records: {self.cause}. Fix: {self.fix}. "
                f"Capturing is stopped for this run; the training continues unchecked.")


@dataclasses.dataclass
class Counts:
    """What happened to the records of one run and rank; the end-of-stream message carries them to the server."""

    captured: int = 0
    sent: int = 0
    acknowledged: int = 0
    rejected: int = 0
    dropped: int = 0
    duplicates: int = 0
    sampling: dict[str, int] = dataclasses.field(default_factory=dict)   # what the sampling policies skipped


class TransportEvents(Protocol):
    """What a transport reports to the Sender, from the transport's own threads."""

    def on_ack(self, seq: int, status: str, reason: str, count: int = 1) -> None:
        """Records seq .. seq+count-1 reached the server: status is ACCEPTED, DUPLICATE or REJECTED (then `reason`
        says why). One call covers a run of records answered together (one lock, one wake-up for all)."""

    def on_reconnect(self, generation: int) -> None:
        """Stream `generation` is open: send everything not acknowledged again, in order, on it."""

    def on_refused(self, refusal: Refusal) -> None:
        """Nothing can ever be delivered (logged once by the transport): drop what is held, stop capturing."""


class Transport(Protocol):
    identity: StreamIdentity
    connect_timeout_s: float   # how long `close()` waits for a server (or folder) that was never reached
    chunk_bytes: int           # the most payload bytes one frame carries
    copies_into_files: bool    # large records come to send_records laid out only (encode_record(defer=True)): their
                               # tensors are copied straight into the files written (records.write_file)

    def start(self, events: TransportEvents) -> None:
        """Begin connecting in the background; events go to `events` from now on (so none is ever missed)."""

    @property
    def generation(self) -> int:
        """The current stream (0: none yet)."""

    @property
    def reached(self) -> bool:
        """True once the server (or the folder) has accepted a stream or a write."""

    def send_records(self, recs: list[PendingRecord], generation: int) -> bool:
        """Deliver `recs` (encoded, in sequence order; several small ones may share one message) on stream
        `generation`; False when that stream is gone or the transport closed first (they were not delivered and go
        again on the next stream). Acknowledgements come via `on_ack`, one per record."""

    def send_end(self, frame: bytes, timeout: float) -> bool:
        """Deliver the end-of-stream frame (`end_frame`) within `timeout` s, then close. True when delivered."""

    def close(self) -> None:
        """Stop delivering and release the connection; idempotent."""

    def describe_state(self) -> str:
        """One sentence for log messages: where the records go and whether that works now."""


def end_frame(identity: StreamIdentity, counts: Counts, last_seq: int, job: str = "") -> bytes:
    """The serialized End frame: the one place it is built, for both transports. `job`: the training's id shared by
    its ranks (npu_agent.collectives.job_id), "" before torch.distributed is initialised."""
    return pb.Frame(end=pb.End(run_id=identity.run_id, rank=identity.rank, captured=counts.captured,
                               sent=counts.sent, acknowledged=counts.acknowledged, dropped=counts.dropped,
                               last_seq=last_seq, world_size=identity.world_size,
                               sampling=counts.sampling, job=job)).SerializeToString()
