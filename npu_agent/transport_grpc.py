"""The agent's gRPC client: one bidirectional stream of Frames out and Acks back, kept alive across server restarts.

A connection thread (re)connects with back-off and reads acknowledgements; the sender thread writes frames.
When a stream breaks, what was not acknowledged is re-sent on the next one (the server drops duplicates).
Reaching no server is reported once, with what the agent does about it, not once per record. A server that can
never accept this agent (TLS or certificate mismatch, another protocol version: `npu_agent.refusal`) ends the
transport at once, with one ERROR that names the cause and the fix.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Iterable, Iterator

import grpc
from grpc_health.v1 import health_pb2

from npu_agent.config import Endpoint
from npu_agent.records import PendingRecord, batch_frame, encode_record
from npu_agent.refusal import classify, client_certificate_refusal, plaintext_refusal, tls_config_refusal
from npu_agent.transport import Refusal, StreamIdentity, TransportEvents
from protos import online_check_pb2 as pb
from protos.contract import STREAM_METHOD
from protos.framing import AckView, parse_ack
from protos.limits import CHUNK_BYTES

log = logging.getLogger("npu_agent")

METHOD = STREAM_METHOD
HEALTH = "/grpc.health.v1.Health/Check"
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.keepalive_time_ms", 20000),
    ("grpc.keepalive_timeout_ms", 10000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
]
_ACK_STATUS = {v.number: v.name for v in pb.Ack.Status.DESCRIPTOR.values}
_CLOSE = b""   # never a real frame (a serialized Frame is never empty): ends a stream's request iterator
# Frames queued for gRPC's request thread, at most. Two: one waits while gRPC sends the other. While the sender waits
# for room, the training's small records pile up in its own queue and go out together, in fewer and larger Batch
# frames; with 8 they went out in more, smaller ones (docs/performance.md, "A shallower queue to gRPC").
_QUEUED_FRAMES = 2
ASK_FRAME = pb.Frame(ask=pb.Ask()).SerializeToString()   # "answer what I sent" (`GrpcTransport.ask`)


class FrameQueue:
    """The frames the sender thread hands to gRPC's request thread: a bounded queue (`queue.Queue`'s `put`, `get`
    and `put_nowait`, raising `queue.Full` the same way) whose sender, once blocked on a full queue, is woken when
    the queue has drained to `low` frames, not at every frame taken. gRPC sends more slowly than the sender encodes
    large records, so the queue is full most of the time; `queue.Queue` woke the sender for each frame gRPC took, a
    thread hand-off per message that cost the sending process 30-120 us a 1 MiB message (docs/performance.md, "The
    hand-off to gRPC's request thread")."""

    def __init__(self, maxsize: int = _QUEUED_FRAMES, low: int | None = None):
        self.maxsize = maxsize
        self.low = maxsize // 2 if low is None else low
        self._frames: collections.deque[bytes] = collections.deque()
        lock = threading.Lock()
        self._not_empty = threading.Condition(lock)
        self._room = threading.Condition(lock)
        self._getting = self._putting = 0   # threads waiting in get / put

    def put(self, frame: bytes, timeout: float | None = None) -> None:
        with self._room:
            if len(self._frames) >= self.maxsize:
                deadline = None if timeout is None else time.monotonic() + timeout
                while len(self._frames) >= self.maxsize:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise queue.Full
                    self._putting += 1
                    try:
                        self._room.wait(left)
                    finally:
                        self._putting -= 1
            self._frames.append(frame)
            if self._getting:   # wake gRPC's request thread if it waits for one
                self._not_empty.notify()

    def put_nowait(self, frame: bytes) -> None:
        self.put(frame, timeout=0)

    def get(self) -> bytes:
        with self._not_empty:
            while not self._frames:
                self._getting += 1
                try:
                    self._not_empty.wait()
                finally:
                    self._getting -= 1
            frame = self._frames.popleft()
            if self._putting and len(self._frames) <= self.low:
                self._room.notify()
            return frame


class GrpcTransport:
    """Implements `npu_agent.transport.Transport` over one gRPC stream at a time."""

    copies_into_files = False

    def __init__(self, endpoint: Endpoint, tls_dir: str, run_id: str, rank: int, world_size: int,
                 connect_timeout_s: float = 30.0, max_retry_s: float = 10.0, chunk_bytes: int = CHUNK_BYTES):
        self.endpoint = endpoint
        self.tls_dir = tls_dir
        self.identity = StreamIdentity(run_id, rank, world_size)
        self.connect_timeout_s = connect_timeout_s
        self.max_retry_s = max_retry_s
        self.chunk_bytes = chunk_bytes
        self._events: TransportEvents | None = None
        self._lock = threading.Condition()
        self._outq: FrameQueue | None = None
        self._generation = 0
        self._closed = False
        self._end_acked = threading.Event()
        self._asked_on = 0   # the stream whose server answers when asked (ASKS_TAKEN); 0: none
        self._state = "connecting"
        self._warned_down = False
        self._reached = False
        self._refusal: Refusal | None = None
        self._channel: grpc.Channel | None = None
        self._call: grpc.Call | None = None
        if not tls_dir and not endpoint.is_loopback:
            log.warning("online check: sending training data in plaintext to %s; set tensor.tls_path for mutual TLS "
                        "(see certs/README.md)", endpoint.target)
        self._thread = threading.Thread(target=self._maintain, name="online-check-grpc", daemon=True)

    def start(self, events: TransportEvents) -> None:
        """Connect in the background, reporting to `events` (installed first, so the first stream's
        `on_reconnect` is never missed)."""
        self._events = events
        self._thread.start()

    @property
    def generation(self) -> int:
        """The number of the current stream (0: never connected). `send_records` sends only on the stream the
        sender names, so that after a reconnect nothing overtakes the in-order re-send of what was not acknowledged."""
        return self._generation

    @property
    def reached(self) -> bool:
        return self._reached

    def describe_state(self) -> str:
        return f"Server {self.endpoint.target}: {self._state}."

    # -- connection thread ---------------------------------------------------------------------------------
    def _make_channel(self) -> grpc.Channel:
        # gRPC's own reconnect back-off starts at 1 s and grows to 120 s; ours is the one that matters.
        retry_ms = int(max(0.1, self.max_retry_s) * 1000)
        options = CHANNEL_OPTIONS + [("grpc.initial_reconnect_backoff_ms", min(200, retry_ms)),
                                     ("grpc.min_reconnect_backoff_ms", min(200, retry_ms)),
                                     ("grpc.max_reconnect_backoff_ms", retry_ms)]
        if self.tls_dir:
            from protos import tls

            creds = tls.client_credentials(self.tls_dir)
            return grpc.secure_channel(self.endpoint.target, creds, options=options)
        return grpc.insecure_channel(self.endpoint.target, options=options)

    def _connect(self) -> tuple[str | None, Refusal | None]:
        """Open a channel and check that the server answers. (None, None) when it does; else (why, refusal), with
        a refusal only when retrying cannot help."""
        host = self.endpoint.host
        crl_problem: str | None = None
        try:
            self._channel = self._make_channel()
            if self.tls_dir:
                from protos import tls

                try:
                    tls.check_server_not_revoked(host, self.endpoint.port, self.tls_dir, host, self.connect_timeout_s)
                except tls.TlsConfigError as exc:
                    refusal = tls_config_refusal(str(exc), self.tls_dir, host)
                    if refusal is not None:
                        return str(exc), refusal
                    crl_problem = str(exc)   # an interrupted handshake: the health check below tells more
        except Exception as exc:  # noqa: BLE001 - bad TLS files (refused below), unreachable server: retry
            why = f"cannot connect ({type(exc).__name__}: {exc})".replace("\n", " ")
            from protos.tls import TlsConfigError

            if isinstance(exc, TlsConfigError):
                return why, tls_config_refusal(str(exc), self.tls_dir, host)
            return why, None
        problem, refusal = self._probe(self._channel)
        if problem is None and crl_problem is not None:
            return f"cannot check the server's certificate against crl.pem: {crl_problem}", None
        return problem, refusal

    def _maintain(self) -> None:
        backoff = 0.2
        while True:
            with self._lock:
                if self._closed:
                    return
            problem, refusal = self._connect()
            if refusal is not None:
                self._close_channel()
                self._refuse(refusal)
                return
            if problem:
                self._down(problem)
                self._close_channel()
                time.sleep(backoff)
                backoff = min(backoff * 2, self.max_retry_s)
                continue
            backoff = 0.2
            self._serve()
            if self._closed:
                return
            time.sleep(backoff)

    def _serve(self) -> None:
        """One stream, from open to broken: re-send notice, then acknowledgements until it ends."""
        assert self._channel is not None and self._events is not None
        q = FrameQueue()
        stub: grpc.StreamStreamMultiCallable[bytes, AckView | pb.Ack] = self._channel.stream_stream(
            METHOD, request_serializer=None, response_deserializer=parse_ack)
        with self._lock:
            self._generation += 1
            generation = self._generation
            self._outq = q
            self._state = "connected"
            self._lock.notify_all()
        if self._warned_down:
            log.warning("online check: connected to %s again; re-sending what was not acknowledged",
                        self.endpoint.target)
            self._warned_down = False
        refusal = None
        try:
            call = stub(self._requests(q))
            self._call = call
            self._events.on_reconnect(generation)
            for ack in call:
                self._reached = True
                if ack.status == pb.Ack.ASKS_TAKEN:
                    self._asks_taken(q, generation)
                else:
                    self._dispatch(ack)
            self._down("the server closed the stream")
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            detail = (exc.details() if isinstance(exc, grpc.Call) else str(exc)) or ""
            refusal = classify(code, detail, self.tls_dir, self.endpoint.host, stream=True)
            if refusal is None:
                self._down(f"stream broke ({code.name if code else ''}: {detail})")
        finally:
            with self._lock:
                if self._outq is q:
                    self._outq = None
                self._lock.notify_all()
            try:
                q.put_nowait(_CLOSE)
            except queue.Full:
                pass
            self._close_channel()
        if refusal is not None:
            self._refuse(refusal)

    def _requests(self, q: FrameQueue) -> Iterator[bytes]:
        who = self.identity
        hello = pb.Frame(hello=pb.Hello(run_id=who.run_id, rank=who.rank, world_size=who.world_size,
                                        agent_version="0.1.0", asks=True))
        yield hello.SerializeToString()
        while True:
            item = q.get()
            if not item:   # _CLOSE
                return
            yield item

    def _dispatch(self, ack: AckView | pb.Ack) -> None:
        assert self._events is not None
        status = _ACK_STATUS.get(ack.status, "UNKNOWN")
        if status == "END_ACCEPTED":
            self._end_acked.set()
            return
        self._events.on_ack(ack.seq, status, ack.reason, max(1, ack.count))   # one answer may cover a run

    def _probe(self, channel: grpc.Channel) -> tuple[str | None, Refusal | None]:
        """One health check, failing fast: (None, None) when the server answers, else why not, in words a user can
        act on, and a Refusal when the reason is permanent."""
        check = channel.unary_unary(HEALTH, request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                    response_deserializer=health_pb2.HealthCheckResponse.FromString)
        try:
            check(health_pb2.HealthCheckRequest(service=""), timeout=self.connect_timeout_s, wait_for_ready=False)
            self._reached = True
            return None, None
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            if code == grpc.StatusCode.UNIMPLEMENTED:
                self._reached = True
                return None, None   # a server without the health service still serves the stream
            detail = " ".join(((exc.details() if isinstance(exc, grpc.Call) else str(exc)) or "").split())
            refusal = classify(code, detail, self.tls_dir, self.endpoint.host, stream=False)
            if refusal is None and code == grpc.StatusCode.UNAVAILABLE and "Connection refused" not in detail:
                # closed before any answer: the server may be restarting, or refuse this agent's TLS setup
                host, port = self.endpoint.host, self.endpoint.port
                refusal = (client_certificate_refusal(host, port, self.tls_dir, self.connect_timeout_s) if self.tls_dir
                           else plaintext_refusal(detail, host, port, self.connect_timeout_s))
            return f"{code.name if code else 'error'}: {detail}{self._hint(detail)}", refusal

    def _hint(self, detail: str) -> str:
        if "Connection refused" in detail:
            return " (nothing listens there: is gpu-server running, with this host and port?)"
        return ""

    def _down(self, why: str) -> None:
        with self._lock:
            self._state = f"not connected: {why}"
            closed = self._closed
        if not self._warned_down and not closed:
            self._warned_down = True
            log.warning("online check: server %s unavailable: %s. Training continues; records are kept within the "
                        "memory budget and re-sent after reconnecting (retry up to every %g s).",
                        self.endpoint.target, why, self.max_retry_s)

    def _refuse(self, refusal: Refusal) -> None:
        with self._lock:
            if self._closed or self._refusal is not None:
                return
            self._refusal = refusal
            self._closed = True
            self._state = f"refused: {refusal.cause}"
            self._lock.notify_all()
        log.error("%s", refusal.message(f"the server {self.endpoint.target}"))
        assert self._events is not None
        self._events.on_refused(refusal)

    def _close_channel(self) -> None:
        ch, self._channel = self._channel, None
        if ch is not None:
            ch.close()

    # -- sender thread -------------------------------------------------------------------------------------
    def _put(self, frame: bytes, generation: int | None) -> int | None:
        """Queue a frame on the current stream; None when that stream broke meanwhile (the record is re-sent)."""
        while True:
            with self._lock:
                while self._outq is None and not self._closed:
                    self._lock.wait(1.0)
                if self._closed or self._outq is None:
                    return None
                if generation is not None and generation != self._generation:
                    return None
                q, gen = self._outq, self._generation
            try:
                q.put(frame, timeout=1.0)
                return gen
            except queue.Full:
                continue

    def send_records(self, recs: list[PendingRecord], generation: int) -> bool:
        """Queue the frames of `recs` on stream `generation`: several records in one Batch frame, a single one in
        its own frames. False when that stream is gone (or the transport closed) before the last frame was queued:
        the records were not sent and go again later."""
        who = self.identity
        encoded = [encode_record(rec, who.run_id, who.rank, self.chunk_bytes) for rec in recs]
        batch = batch_frame(encoded)
        frames: Iterable[bytes] = [batch] if batch is not None else (
            frame for enc in encoded for frame in enc.wire_frames(self.chunk_bytes))
        for frame in frames:
            if self._put(frame, generation) is None:
                return False
        return True

    def _asks_taken(self, q: FrameQueue, generation: int) -> None:
        """Stream `generation`'s server holds its answers until asked (`ask`). A first Ask goes at once, behind the
        frames queued, so that it holds them from now on (until then it answers every message); where the queue is
        full it is left to the sender's next ask, not waited for on this thread, which reads the answers."""
        try:
            q.put_nowait(ASK_FRAME)
        except queue.Full:
            pass
        self._asked_on = generation

    def ask(self, generation: int) -> bool:
        """Ask the server of stream `generation` for the answers to everything sent on it so far (an Ask frame), if
        it holds them until asked (it answered this agent's Hello with ASKS_TAKEN). False when no Ask went: the
        server answers without being asked, or that stream is gone (what it did not answer is re-sent)."""
        if generation != self._asked_on:
            return False
        return self._put(ASK_FRAME, generation) is not None

    def send_end(self, frame: bytes, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        ok = False
        while time.monotonic() < deadline and self._state == "connected":
            if self._put(frame, None) is None:
                break
            if self._end_acked.wait(min(5.0, max(0.1, deadline - time.monotonic()))):
                ok = True
                break
        self.close()
        return ok

    def close(self) -> None:
        with self._lock:
            self._closed = True
            q = self._outq
            self._lock.notify_all()
        if q is not None:
            try:
                q.put_nowait(_CLOSE)
            except queue.Full:
                pass
        call = self._call
        if call is not None:
            call.cancel()
        if self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
