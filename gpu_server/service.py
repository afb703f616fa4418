"""The gRPC side of the server: one bidirectional stream per agent connection (SPEC §4).

Frames come in as raw bytes and are parsed here (never unpickled); records are assembled, validated and handed to
the intake; every record gets an acknowledgement, bad ones a REJECTED with the reason, and the stream goes on.
"""
from __future__ import annotations

import logging
import queue
import threading
from concurrent import futures
from typing import Callable

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gpu_server.intake import ByteBudget, FrameAssembler, Intake
from protos import online_check_pb2 as pb
from protos.codec import WireError
from protos.contract import SERVICE_NAME
from protos.limits import RUN_ID, Limits

log = logging.getLogger("gpu_server")
SERVICE = SERVICE_NAME


class StreamHandler:
    """One stream: a reader thread assembles and submits records while this thread answers with acknowledgements,
    each once its record is durable, in arrival order. Records arriving together share one spool commit."""

    def __init__(self, intake: Intake, limits: Limits, on_end: Callable[[pb.End], None],
                 budget: ByteBudget | None = None):
        self.intake = intake
        self.limits = limits
        self.on_end = on_end
        self.budget = budget

    def stream(self, request_iterator, context):
        acks: queue.Queue = queue.Queue()
        reader = threading.Thread(target=self._read, args=(request_iterator, context, acks),
                                  name="gpu-server-stream", daemon=True)
        reader.start()
        while True:
            item = acks.get()
            if item is None:
                return
            if isinstance(item, pb.Ack):
                yield item
                continue
            status, reason = item.wait()
            yield pb.Ack(seq=item.seq, status=status, reason=reason)

    def _read(self, request_iterator, context, acks: queue.Queue) -> None:
        asm = FrameAssembler(self.limits, self.budget, cancelled=lambda: not context.is_active())
        peer = context.peer()
        try:
            for raw in request_iterator:
                ack = self._frame(raw, asm, peer)
                if ack is not None:
                    acks.put(ack)
        except grpc.RpcError:
            pass  # the agent went away; what it did not get acknowledged it re-sends
        except Exception:  # noqa: BLE001
            log.exception("stream from %s: internal error", peer)
        finally:
            asm.reset()
            acks.put(None)

    def _frame(self, raw: bytes, asm: FrameAssembler, peer: str):
        try:
            frame = pb.Frame.FromString(raw)
        except DecodeError:
            asm.reset()
            self.intake.rejected += 1
            return pb.Ack(status=pb.Ack.REJECTED, reason=f"a {len(raw)}-byte message is not a valid Frame; "
                                                         "this server speaks online_check.v1 protobuf only")
        body = frame.WhichOneof("body")
        if body == "hello":
            log.info("agent connected from %s: run %s rank %d", peer, frame.hello.run_id[:64], frame.hello.rank)
            return None
        if body == "end":
            end = frame.end
            if not RUN_ID.match(end.run_id):
                return pb.Ack(status=pb.Ack.REJECTED, reason="end message with an invalid run id")
            self.on_end(end)
            return pb.Ack(seq=end.last_seq, status=pb.Ack.END_ACCEPTED)
        try:
            done = asm.feed(frame)
        except WireError as exc:
            self.intake.rejected += 1
            seq = frame.record.header.seq if body == "record" else frame.chunk.seq if body == "chunk" else 0
            return pb.Ack(seq=seq, status=pb.Ack.REJECTED, reason=str(exc))
        del frame
        if done is None:
            return None
        record, payload = done
        return self.intake.submit(record, payload, asm.take_reserved())


def make_server(handler: StreamHandler, bind: str, limits: Limits, tls_path: str = "") -> tuple[grpc.Server, int]:
    """A gRPC server bound to `bind` only, with the health service. Returns (server, port)."""
    options = [("grpc.max_receive_message_length", limits.max_frame_bytes),
               ("grpc.max_send_message_length", 16 << 20),
               ("grpc.so_reuseport", 0),
               ("grpc.keepalive_permit_without_calls", 1),
               ("grpc.http2.min_ping_interval_without_data_ms", 5000)]
    interceptors = []
    creds = None
    if tls_path:
        from protos import tls

        creds = tls.server_credentials(tls_path)
        interceptors.append(tls.RevocationInterceptor(tls.CrlReloader(tls_path)))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="gpu-server-rpc"),
                         options=options, interceptors=interceptors, maximum_concurrent_rpcs=1024)
    rpc = grpc.stream_stream_rpc_method_handler(handler.stream, request_deserializer=None,
                                                response_serializer=pb.Ack.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Stream": rpc}),))
    health_servicer = health.HealthServicer()
    health_servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_secure_port(bind, creds) if creds else server.add_insecure_port(bind)
    if port == 0:
        raise OSError(f"cannot bind {bind}: the address is in use or not available on this host")
    return server, port
