"""The gRPC side of the server: one bidirectional stream per agent connection (docs/security.md, "Who can reach
the port or the folder").

The server is `grpc.aio`: every stream is a coroutine on one event-loop thread, so an idle agent costs a socket and
a few kilobytes, not a thread, and thousands of agents share one server. At most `Limits.max_streams`
(`--max-streams`) streams are served at once; one more is refused with RESOURCE_EXHAUSTED and a message naming the
limit and the fix (the agent logs it), and the server logs the refusal.

Every byte is counted in the memory budget (`--memory-mb`, gpu_server/intake/budget.py `ByteBudget`): a message the
moment gRPC hands it over, before anything waits; a record's bytes as they arrive (never what its header announces),
and a complete record at its estimated peak until it is checked. A stream reads its next message only while the budget
is below its limit and its connection holds less than `--connection-memory-mb`; meanwhile gRPC buffers at most its
flow-control window (`stream_window`: at most one chunk, and all streams' windows together at most the budget; never
grown by bandwidth probing) for it. A record half received is cut (its stream closed, its bytes released, the reason
logged and sent) when nothing arrives for `--record-timeout-s`, when after that long it arrives slower than
`--min-record-rate-mb` (time spent waiting for the budget does not count), or when it has been half received for
`--record-max-s`, whatever its size. Frames come in as raw bytes and go through the stream's `RecordStream`
(gpu_server/intake/stream.py: parsed, never unpickled; large records validated off the event loop); every record gets
an acknowledgement, bad ones a REJECTED with the reason, and the stream goes on. An agent that asks for its answers
gets them when it asks, within a bound (`_Held`; docs/design.md §5, "Answers when asked"). This module is the I/O:
reading, waiting for room, cutting a stalled record, sending the answers.

End messages count only for a (run, rank) whose records came over the same connection (under mutual TLS: with the
same client certificate). Every wire string that reaches the log is escaped (`protos.limits.log_text`). With mutual
TLS, a client whose certificate is in the server's `crl.pem` (re-read when it changes) is refused with
UNAUTHENTICATED on every RPC before any handler runs, as `protos.tls.RevocationInterceptor` does for a synchronous
server.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import resource
import threading
import time
from concurrent import futures
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gpu_server.intake.admission import Intake
from gpu_server.intake.assembler import FrameAssembler
from gpu_server.intake.budget import HEADER_FACTOR, ByteBudget, ConnectionShare
from gpu_server.intake.stream import ASKED, RecordStream
from protos import online_check_pb2 as pb
from protos.contract import SERVICE_NAME
from protos.limits import CHUNK_BYTES, Limits, MiB, log_text

log = logging.getLogger("gpu_server")
SERVICE = SERVICE_NAME
# Bytes an agent may send on one stream before the server asks for more (HTTP/2's stream flow-control window): at
# most one chunk (`stream_window`). gRPC's 64 KiB default held a stream to a few windows a round trip: with 2 ms of
# round trip (python bench/transport.py --rtt-ms 2) 176-202 MB/s from 64 KiB to 16 MiB records, against 387-551 MB/s
# with one chunk (docs/design.md §5, "The gRPC stream's window").
STREAM_WINDOW = CHUNK_BYTES
GRPC_WINDOW = 64 * 1024   # gRPC's own initial window: the least a stream gets
_ACK_QUEUE = 256          # messages whose answers wait to be sent on one stream; then the stream stops reading
HELD_MESSAGES = 256       # messages whose answers a stream holds for its agent's Ask, at most (`_Held`)
HELD_ANSWERS = 4096       # ... and answers (records)
_TICKET_SLICE_S = 0.25    # a thread waits this long at most for one ticket before giving its place to another


class _Cut:
    """The reader's verdict that the stream must be closed with `code` and `reason` (after the acks before it)."""

    def __init__(self, code: grpc.StatusCode, reason: str):
        self.code, self.reason = code, reason


class _Held:
    """The answers a stream holds until its agent asks for them (docs/design.md §5, "Answers when asked"). Until the
    agent's first Ask, every message is answered at once, as for an agent that never asks; from then on a message's
    answers wait for the next Ask, an End's answer, the stream's end, or `HELD_MESSAGES` messages or `HELD_ANSWERS`
    answers held (an agent that asks too seldom, or never again, costs the server that much)."""

    __slots__ = ("answers", "messages", "asked")

    def __init__(self) -> None:
        self.answers: list = []
        self.messages = 0
        self.asked = False

    def flush(self, item) -> bool:
        """Take one message's answers (or the Ask); whether the answers held are to be sent now."""
        if item is ASKED:
            self.asked = True
            return True
        self.answers += item
        self.messages += 1
        return (not self.asked or self.messages >= HELD_MESSAGES or len(self.answers) >= HELD_ANSWERS
                or _ends(item))

    def take(self) -> list:
        answers, self.answers, self.messages = self.answers, [], 0
        return answers


def _ends(answers: list) -> bool:
    """Whether these are the answer to an End (answered at once: the agent waits for it)."""
    return len(answers) == 1 and isinstance(answers[0], pb.Ack) and answers[0].status == pb.Ack.END_ACCEPTED


class _Connection:
    """The streams of one client connection: what they hold together (`share`), and who they are (`origin`: the
    connection, or the client certificate under mutual TLS)."""

    __slots__ = ("share", "origin", "streams")

    def __init__(self, share: ConnectionShare, origin: str):
        self.share, self.origin, self.streams = share, origin, 0


def origin_of(context, peer: str) -> str:
    """Who a stream's records come from, for `Intake.end_backed`: the client certificate under mutual TLS (a
    reconnecting agent keeps it), else the connection."""
    try:
        pem = (context.auth_context() or {}).get("x509_pem_cert")
    except Exception:  # noqa: BLE001 - no auth context: plaintext
        pem = None
    if pem:
        value = pem[0] if isinstance(pem[0], bytes) else str(pem[0]).encode()
        return "cert:" + hashlib.sha256(value).hexdigest()[:32]
    return "conn:" + peer


class StreamHandler:
    """Serves the agent streams: a reader task per stream assembles and submits records while the stream's
    coroutine answers with acknowledgements, each once its record is durable, in arrival order. Records arriving
    together share one spool commit."""

    def __init__(self, intake: Intake, limits: Limits, on_end: Callable[[pb.End], None],
                 budget: ByteBudget | None = None, intake_threads: int = 8, ack_threads: int = 16):
        self.intake = intake
        self.limits = limits
        self.on_end = on_end
        self.budget = budget
        self.active = 0             # streams being served (event-loop thread only)
        self.peak = 0
        self.refused = 0
        self.cut = 0
        self._connections: dict[str, _Connection] = {}
        self._refusal_logged = 0.0
        self._refusals_unlogged = 0
        self._work = futures.ThreadPoolExecutor(intake_threads, thread_name_prefix="gpu-server-intake")
        self._waits = futures.ThreadPoolExecutor(ack_threads, thread_name_prefix="gpu-server-ack")

    def close(self) -> None:
        self._work.shutdown(wait=False, cancel_futures=True)
        self._waits.shutdown(wait=False, cancel_futures=True)

    # -- one stream ----------------------------------------------------------------------------------------------
    async def stream(self, request_iterator, context):
        peer = log_text(context.peer(), 120)
        if self.active >= self.limits.max_streams:
            self._refuse(peer)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"this gpu-server already serves {self.active} agent streams, its limit "
                                f"(--max-streams {self.limits.max_streams}); restart it with a larger --max-streams "
                                "(and open-file limit), or spread the ranks over several servers (tensor.host as a "
                                "list of host:port). The agent retries.")
        self.active += 1
        self.peak = max(self.peak, self.active)
        conn = self._connections.get(peer)
        if conn is None:
            conn = self._connections[peer] = _Connection(ConnectionShare(self.limits.connection_bytes),
                                                         origin_of(context, peer))
        conn.streams += 1
        self.intake.origin_opened(conn.origin)
        acks: asyncio.Queue = asyncio.Queue(maxsize=_ACK_QUEUE)
        reader = asyncio.get_running_loop().create_task(self._read(request_iterator, acks, peer, conn))
        held = _Held()
        try:
            while True:
                item = await acks.get()
                if item is None or isinstance(item, _Cut) or held.flush(item):
                    for ack in await self._acks(held.take()):
                        yield ack
                    if item is None:
                        return
                    if isinstance(item, _Cut):
                        await context.abort(item.code, item.reason)
        finally:
            self.active -= 1
            reader.cancel()
            conn.streams -= 1
            if not conn.streams:
                self._connections.pop(peer, None)
            self.intake.origin_closed(conn.origin)

    def _refuse(self, peer: str) -> None:
        self.refused += 1
        now = time.monotonic()
        if now - self._refusal_logged < 10:
            self._refusals_unlogged += 1
            return
        more = f" ({self._refusals_unlogged} more refused since the last line)" if self._refusals_unlogged else ""
        self._refusal_logged, self._refusals_unlogged = now, 0
        log.warning("refused a stream from %s: %d agent streams are open, the limit (--max-streams) is %d%s", peer,
                    self.active, self.limits.max_streams, more)

    async def _ticket(self, ticket) -> tuple[int, str]:
        loop = asyncio.get_running_loop()
        while not ticket.ready():
            await loop.run_in_executor(self._waits, ticket.wait, _TICKET_SLICE_S)
        return ticket.status, ticket.reason

    async def _acks(self, answers: list) -> list[pb.Ack]:
        """The answers to one message, once each record is durable: a run of consecutive records with the same
        answer and no reason in one Ack (`count`: a batch's), any other record in its own. A ticket that is ready
        already (most are) is read at once, without a thread."""
        runs: list[list] = []   # [seq, status, reason, count]
        for item in answers:
            if not isinstance(item, pb.Ack) and not item.ready():
                await self._ticket(item)
            seq, status, reason = item.seq, item.status, item.reason
            last = runs[-1] if runs else None
            if (last is not None and not reason and not last[2] and last[1] == status
                    and seq == last[0] + last[3]):
                last[3] += 1
            else:
                runs.append([seq, status, reason, 1])
        return [pb.Ack(seq=seq, status=status, reason=reason, count=n) if n > 1
                else pb.Ack(seq=seq, status=status, reason=reason) for seq, status, reason, n in runs]

    async def _read(self, request_iterator, acks: asyncio.Queue, peer: str, conn: _Connection) -> None:
        door = RecordStream(self.intake, self.limits, self.budget, conn.origin, self.on_end,
                            peer=peer, share=conn.share, takes_asks=True)
        asm = door.asm
        messages = request_iterator.__aiter__()
        cut = False
        try:
            while True:
                why = await self._room(asm, conn.share)
                if why:
                    cut = True
                    self._cut(asm, acks, peer, why)
                    return
                deadline = asm.deadline()
                try:
                    if deadline is None:
                        raw = await messages.__anext__()
                    else:
                        raw = await asyncio.wait_for(messages.__anext__(), max(0.0, deadline - time.monotonic()))
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:
                    cut = True
                    self._cut(asm, acks, peer, asm.late())
                    return
                asm.arrived(len(raw))   # counted before anything waits
                try:
                    answers = await door.run_async(door.message(raw), self._work)
                finally:
                    asm.drop_loose()   # what no record keeps of the message
                del raw
                if not answers:
                    continue
                deadline = asm.deadline()
                if deadline is None:
                    await acks.put(answers)
                    continue
                try:   # a client that reads no answers must not keep a half-received record forever either
                    await asyncio.wait_for(acks.put(answers), max(0.0, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    cut = True
                    self._cut(asm, acks, peer, f"{asm.late()}, while the client read no answers")
                    return
        except asyncio.CancelledError:
            raise
        except grpc.RpcError:
            pass  # the agent went away; what it did not get acknowledged it re-sends
        except Exception:  # noqa: BLE001
            log.exception("stream from %s: internal error", peer)
        finally:
            asm.close()
            if not cut:
                _put_last(acks, None)

    async def _room(self, asm: FrameAssembler, share: ConnectionShare) -> str:
        """Wait, reading nothing, until this stream may read its next message: its connection holds less than its
        share and the budget is below its limit. '' then; else why the record it is receiving is cut meanwhile."""
        token = id(asm)
        if not share.may_read(token):
            deadline = asm.deadline()   # the connection's own records fill its share: its time runs
            since = time.monotonic()
            stuck = asm.holding
            if self.budget is not None:
                self.budget.stuck(stuck)   # for the budget's deadlock rule: these bytes wait too
            try:
                await asyncio.wait_for(share.wait_room(token), None if deadline is None
                                       else max(0.0, deadline - time.monotonic()))
                timed_out = False
            except asyncio.TimeoutError:
                timed_out = True
            finally:
                if self.budget is not None:
                    self.budget.unstuck(stuck)
            if asm.record is not None:
                asm.share_waited += time.monotonic() - since
            if timed_out:
                return asm.late()
        budget = self.budget
        if budget is None or budget.has_room(asm.holding):
            return ""
        cap = asm.cap_deadline()   # waiting for the budget is not the stream's fault: only the cap runs
        asm.pause()
        try:
            await asyncio.wait_for(budget.acquire_async(0, own=asm.holding, order=asm.started or None),
                                   None if cap is None else max(0.0, cap - time.monotonic()))
        except asyncio.TimeoutError:
            return asm.late()
        finally:
            asm.resume()
        return ""

    def _cut(self, asm: FrameAssembler, acks: asyncio.Queue, peer: str, why: str) -> None:
        """Close a stream whose half-received record ran past its deadline, releasing the record's memory now."""
        self.cut += 1
        reason = f"{why}: the stream is closed and the record's memory released; the agent re-sends it"
        log.warning("stream from %s: %s", peer, reason)
        asm.close()
        _put_last(acks, _Cut(grpc.StatusCode.DEADLINE_EXCEEDED, reason))


def _put_last(acks: asyncio.Queue, item) -> None:
    """Queue the stream's last item without waiting; a client that reads no answers loses the ones still queued
    (what they acknowledged it re-sends, and gets DUPLICATE)."""
    try:
        acks.put_nowait(item)
    except asyncio.QueueFull:
        while not acks.empty():
            acks.get_nowait()
        acks.put_nowait(item)


class _RevocationCheck(grpc.aio.ServerInterceptor):
    """Refuses every RPC of a client whose certificate is revoked, before its handler runs (aio server)."""

    def __init__(self, current_revoked: Callable):
        self._current = current_revoked

    def _reason(self, context) -> str | None:
        from protos import tls

        return tls.peer_certificate_revoked(context.auth_context(), self._current())

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        kw = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
        check = self._reason

        async def refuse(context) -> None:
            reason = check(context)
            if reason is not None:
                log.warning("refused %s: %s", log_text(context.peer(), 120), reason)
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request, context):
                await refuse(context)
                return await inner(request, context)

            return grpc.unary_unary_rpc_method_handler(unary, **kw)
        behavior = handler.stream_stream or handler.unary_stream
        if behavior is not None:
            async def streaming(request, context):
                await refuse(context)
                async for item in behavior(request, context):
                    yield item

            make = (grpc.stream_stream_rpc_method_handler if handler.stream_stream is not None
                    else grpc.unary_stream_rpc_method_handler)
            return make(streaming, **kw)
        return handler


class GrpcServer:
    """The `grpc.aio` server on its own event-loop thread, driven from ordinary threads (a `RecordSource`):
    `start()`, and `stop(grace)` returning an event that is set once every stream is closed."""

    def __init__(self, handler: StreamHandler, bind: str, limits: Limits, tls_path: str = ""):
        self.handler = handler
        self._bind = bind
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="gpu-server-grpc", daemon=True)
        self._thread.start()
        self._stopped = threading.Event()
        try:
            self.port = self._call(self._build(bind, limits, tls_path))
        except BaseException:
            self._close_loop()
            raise

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _build(self, bind: str, limits: Limits, tls_path: str) -> int:
        options = [("grpc.max_receive_message_length", largest_message(limits, self.handler.budget)),
                   ("grpc.max_send_message_length", 16 << 20),
                   ("grpc.so_reuseport", 0),
                   ("grpc.keepalive_permit_without_calls", 1),
                   # a stream not reading (its budget or its connection's share is full) gets no more than its
                   # flow-control window buffered: a fixed `stream_window`, never grown by bandwidth probing (which
                   # would grow it without a bound we set)
                   ("grpc.http2.bdp_probe", 0),
                   ("grpc.http2.lookahead_bytes", stream_window(limits, self.handler.budget)),
                   # ping idle agents: a connection gone half-open frees its stream slot within ~80 s
                   ("grpc.keepalive_time_ms", 60_000),
                   ("grpc.keepalive_timeout_ms", 20_000),
                   ("grpc.http2.min_ping_interval_without_data_ms", 5000)]
        interceptors = []
        creds = None
        if tls_path:
            from protos import tls

            creds = tls.server_credentials(tls_path)
            interceptors.append(_RevocationCheck(tls.CrlReloader(tls_path)))
        self._server = grpc.aio.server(options=options, interceptors=interceptors)
        rpc = grpc.stream_stream_rpc_method_handler(self.handler.stream, request_deserializer=None,
                                                    response_serializer=pb.Ack.SerializeToString)
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Stream": rpc}),))
        health_servicer = health.aio.HealthServicer()
        await health_servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self._server)
        try:
            port = self._server.add_secure_port(bind, creds) if creds else self._server.add_insecure_port(bind)
        except RuntimeError:
            port = 0
        if port == 0:
            raise OSError(f"cannot bind {bind}: the address is in use or not available on this host")
        return port

    def start(self) -> str:
        self._call(self._server.start())
        return f"{self._bind.rsplit(':', 1)[0]}:{self.port}"

    def shutdown(self) -> None:
        self.stop(grace=2.0).wait()

    def counts(self) -> dict[str, int]:
        return {}

    def stop(self, grace: float | None = None) -> threading.Event:
        if not self._stopped.is_set():
            try:
                self._call(self._server.stop(grace))
                self._call(_settle_tasks(self._loop))
            finally:
                self.handler.close()
                self._close_loop()
            h = self.handler
            log.info("agent streams: at most %d at once (--max-streams %d), %d refused above the limit, %d cut for a "
                     "stalled or slow record", h.peak, h.limits.max_streams, h.refused, h.cut)
        return self._stopped

    def _close_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()
        self._stopped.set()


async def _settle_tasks(loop: asyncio.AbstractEventLoop, timeout: float = 10.0) -> None:
    """Once `server.stop(grace)` has returned, gRPC has cancelled every stream, but their tasks may still be
    finishing (a handler's clean-up waiting on an intake or ack thread). Stopping the loop then would destroy them
    mid-flight, and gRPC logs a `GeneratorExit` traceback per stream. Let them finish, at most `timeout` seconds;
    cancel what is still left after that."""
    me = asyncio.current_task(loop)
    left = {t for t in asyncio.all_tasks(loop) if t is not me and not t.done()}
    if left:
        _, left = await asyncio.wait(left, timeout=timeout)
    for t in left:
        t.cancel()
    if left:
        await asyncio.wait(left, timeout=1.0)


def raise_open_file_limit(streams: int) -> None:
    """Each stream holds a socket: lift the soft open-file limit towards the hard one, and say so when the hard
    limit is too low for `streams` (reports, spool and the interpreter need some too)."""
    want = streams + 512
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < want:
            new = want if hard == resource.RLIM_INFINITY else min(hard, want)
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
    except (ValueError, OSError):
        return
    if soft != resource.RLIM_INFINITY and soft < want:
        log.warning("the open-file limit is %d: fewer than --max-streams %d agents may connect; raise it "
                    "(ulimit -n) or lower --max-streams", soft, streams)


def largest_message(limits: Limits, budget: ByteBudget | None) -> int:
    """The largest gRPC message this server reads: one chunk of payload plus the largest record header it could
    accept (a header costs `HEADER_FACTOR` times its size to check, so one above 1/HEADER_FACTOR of the budget is
    refused anyway), at most `Limits.max_frame_bytes`. gRPC refuses a larger message from its length prefix, before
    buffering any of it (the stream ends with RESOURCE_EXHAUSTED): every stream reading costs at most this much
    outside the budget."""
    if budget is None:
        return limits.max_frame_bytes
    return min(limits.max_frame_bytes, CHUNK_BYTES + max(1 << 20, budget.limit // HEADER_FACTOR))


def stream_window(limits: Limits, budget: ByteBudget | None) -> int:
    """Each stream's flow-control window: one chunk (`STREAM_WINDOW`), less where the memory budget shared out over
    `--max-streams` is less, never below gRPC's 64 KiB. A stream that stops reading has at most this much buffered by
    gRPC, so all streams together hold at most the budget's worth (or 64 KiB each) this way (docs/security.md)."""
    if budget is None:
        return GRPC_WINDOW
    return min(STREAM_WINDOW, max(GRPC_WINDOW, budget.limit // max(1, limits.max_streams)))


def make_server(handler: StreamHandler, bind: str, limits: Limits, tls_path: str = "") -> GrpcServer:
    """A gRPC server bound to `bind` only, with the health service; `server.start()`."""
    raise_open_file_limit(limits.max_streams)
    server = GrpcServer(handler, bind, limits, tls_path)
    if handler.budget is not None:
        largest = largest_message(limits, handler.budget)
        log.info("memory: a budget of %.0f MiB (--memory-mb) for everything received; each stream reading may "
                 "also have one message of at most %.1f MiB in gRPC's hands (%d streams at most, --max-streams)",
                 handler.budget.limit / MiB, largest / MiB, limits.max_streams)
    return server
