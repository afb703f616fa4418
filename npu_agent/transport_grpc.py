"""The agent's gRPC client: one bidirectional stream of Frames out and Acks back, kept alive across server restarts.

A connection thread (re)connects with back-off and reads acknowledgements; the sender thread writes frames.
When a stream breaks, what was not acknowledged is re-sent on the next one (the server drops duplicates).
Reaching no server is reported once, with what the agent does about it, not once per record.
"""
from __future__ import annotations

import logging
import queue
import threading
import time

import grpc
from grpc_health.v1 import health_pb2

from npu_agent.config import Endpoint
from npu_agent.records import PendingRecord, encode_record
from protos import online_check_pb2 as pb
from protos.codec import encode_frames
from protos.limits import CHUNK_BYTES

log = logging.getLogger("npu_agent")

METHOD = "/online_check.v1.OnlineCheck/Stream"
HEALTH = "/grpc.health.v1.Health/Check"
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.keepalive_time_ms", 20000),
    ("grpc.keepalive_timeout_ms", 10000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
]
_ACK_STATUS = {v.number: v.name for v in pb.Ack.Status.DESCRIPTOR.values}
_CLOSE = object()


class GrpcTransport:
    def __init__(self, endpoint: Endpoint, tls_dir: str, run_id: str, rank: int, world_size: int,
                 connect_timeout_s: float = 30.0, max_retry_s: float = 10.0, chunk_bytes: int = CHUNK_BYTES):
        self.endpoint = endpoint
        self.tls_dir = tls_dir
        self.run_id = run_id
        self.rank = rank
        self.world_size = world_size
        self.connect_timeout_s = connect_timeout_s
        self.max_retry_s = max_retry_s
        self.chunk_bytes = chunk_bytes
        self.on_ack = lambda seq, status, reason: None
        self.on_reconnect = lambda generation: None
        self._lock = threading.Condition()
        self._outq: queue.Queue | None = None
        self._generation = 0
        self._closed = False
        self._end_acked = threading.Event()
        self._state = "connecting"
        self._warned_down = False
        self._ever_connected = False
        self._channel = None
        self._call = None
        if not tls_dir and not endpoint.is_loopback:
            log.warning("online check: sending training data in plaintext to %s; set tensor.tls_path for mutual TLS "
                        "(see certs/README.md)", endpoint.target)
        self._thread = threading.Thread(target=self._maintain, name="online-check-grpc", daemon=True)

    def start(self) -> None:
        """Connect in the background. Called by the Sender once its callbacks are installed, so that the first
        stream's `on_reconnect` is never missed."""
        self._thread.start()

    @property
    def generation(self) -> int:
        """The number of the current stream (0: never connected). `send_record` sends only on the stream the
        sender names, so that after a reconnect nothing overtakes the in-order re-send of what was not acknowledged."""
        return self._generation

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
            tls.check_server_not_revoked(self.endpoint.host, self.endpoint.port, self.tls_dir, self.endpoint.host,
                                         self.connect_timeout_s)
            return grpc.secure_channel(self.endpoint.target, creds, options=options)
        return grpc.insecure_channel(self.endpoint.target, options=options)

    def _maintain(self) -> None:
        backoff = 0.2
        while True:
            with self._lock:
                if self._closed:
                    return
            try:
                self._channel = self._make_channel()
                problem = self._probe(self._channel)
            except Exception as exc:  # noqa: BLE001 - unreachable server, bad TLS files, timeouts: retry
                problem = f"cannot connect ({type(exc).__name__}: {exc})".replace("\n", " ")
            if problem:
                self._down(problem)
                self._close_channel()
                time.sleep(backoff)
                backoff = min(backoff * 2, self.max_retry_s)
                continue
            backoff = 0.2
            q: queue.Queue = queue.Queue(maxsize=8)
            stub = self._channel.stream_stream(METHOD, request_serializer=None,
                                               response_deserializer=pb.Ack.FromString)
            with self._lock:
                self._generation += 1
                generation = self._generation
                self._outq = q
                self._state = "connected"
                self._ever_connected = True
                self._lock.notify_all()
            if self._warned_down:
                log.warning("online check: connected to %s again; re-sending what was not acknowledged",
                            self.endpoint.target)
                self._warned_down = False
            try:
                self._call = stub(self._requests(q))
                self.on_reconnect(generation)
                for ack in self._call:
                    self._dispatch(ack)
                self._down("the server closed the stream")
            except grpc.RpcError as exc:
                detail = exc.details() if hasattr(exc, "details") else str(exc)
                self._down(f"stream broke ({exc.code().name if hasattr(exc, 'code') else ''}: {detail})")
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
            if self._closed:
                return
            time.sleep(backoff)

    def _requests(self, q: queue.Queue):
        hello = pb.Frame(hello=pb.Hello(run_id=self.run_id, rank=self.rank, world_size=self.world_size,
                                        agent_version="0.1.0"))
        yield hello.SerializeToString()
        while True:
            item = q.get()
            if item is _CLOSE:
                return
            yield item

    def _dispatch(self, ack: pb.Ack) -> None:
        status = _ACK_STATUS.get(ack.status, "UNKNOWN")
        if status == "END_ACCEPTED":
            self._end_acked.set()
            return
        self.on_ack(ack.seq, status, ack.reason)

    def _probe(self, channel: grpc.Channel) -> str | None:
        """One health check, failing fast: None when the server answers, else why not, in words a user can act on
        (gRPC reports TLS refusals only as transport errors, so the known ones get a hint)."""
        check = channel.unary_unary(HEALTH, request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                    response_deserializer=health_pb2.HealthCheckResponse.FromString)
        try:
            check(health_pb2.HealthCheckRequest(service=""), timeout=self.connect_timeout_s, wait_for_ready=False)
            return None
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            if code == grpc.StatusCode.UNIMPLEMENTED:
                return None   # a server without the health service still serves the stream
            detail = (exc.details() if hasattr(exc, "details") else str(exc)) or ""
            return f"{code.name if code else 'error'}: {detail}{self._hint(detail)}".replace("\n", " ")

    def _hint(self, detail: str) -> str:
        host = self.endpoint.host
        if "CERTIFICATE_VERIFY_FAILED" in detail:
            return f" (the server's certificate is not signed by {self.tls_dir}/ca.crt)"
        if "Hostname Verification" in detail or "hostname" in detail.lower() and "match" in detail.lower():
            return f" (the server's certificate does not name {host}; connect with one of its --server-name values)"
        if "Socket closed" in detail or "handshake" in detail.lower():
            if not self.tls_dir:
                return " (the server may require mutual TLS: set tensor.tls_path)"
            return " (the server refused this client certificate: is it signed by the server's ca.crt and not revoked?)"
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
                if self._closed:
                    return None
                if generation is not None and generation != self._generation:
                    return None
                q, gen = self._outq, self._generation
            try:
                q.put(frame, timeout=1.0)
                return gen
            except queue.Full:
                continue

    def send_record(self, rec: PendingRecord, generation: int | None = None) -> bool:
        """Queue all frames of `rec` on stream `generation` (None: any). False when that stream is gone (or the
        transport closed) before the last frame was queued: the record was not sent and goes again later."""
        record, enc = encode_record(rec, self.run_id, self.rank)
        gen = generation
        for frame in encode_frames(record, enc.buffers, enc.size, self.chunk_bytes):
            gen = self._put(frame, gen)
            if gen is None:
                return False
        return True

    def send_end(self, counts: dict, timeout: float) -> bool:
        end = pb.Frame(end=pb.End(run_id=self.run_id, rank=self.rank, captured=counts["captured"],
                                  sent=counts["sent"], acknowledged=counts["acknowledged"],
                                  dropped=counts["dropped"], last_seq=counts["last_seq"],
                                  world_size=self.world_size)).SerializeToString()
        deadline = time.monotonic() + timeout
        ok = False
        while time.monotonic() < deadline and self._state == "connected":
            if self._put(end, None) is None:
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
        if self._thread.ident is not None:
            self._thread.join(timeout=5)
