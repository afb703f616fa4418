"""`gpu-server health --host H --port P [--tls-path DIR]`: ask a running server's gRPC health service whether it
serves (exit 0) or not (exit 1). The container image's HEALTHCHECK and Kubernetes probes run it; no separate
grpc_health_probe binary is needed.

With mutual TLS the probe needs a client certificate folder (`client.key`, `client.crt`, `ca.crt`) as the agent
does; `--server-name` overrides the name checked against the server certificate (default: the host).
"""
from __future__ import annotations

import argparse
import sys


def check(host: str, port: int, tls_path: str = "", timeout: float = 5.0, server_name: str | None = None) -> str:
    """The serving status name of the checker's service ("SERVING", ...); raises grpc.RpcError when unreachable."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from protos import online_check_pb2 as pb

    target = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    if tls_path:
        from protos import tls

        channel = grpc.secure_channel(target, tls.client_credentials(tls_path),
                                      options=tls.channel_options(server_name or host.strip("[]")))
    else:
        channel = grpc.insecure_channel(target)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        service = pb.DESCRIPTOR.services_by_name["OnlineCheck"].full_name
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gpu-server health", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--tls-path", default="", help="client certificate folder for a mutual-TLS server ('' plaintext)")
    p.add_argument("--server-name", default="", help="name to check the server certificate against (default: --host)")
    p.add_argument("--timeout", type=float, default=5.0)
    ns = p.parse_args(argv)
    try:
        status = check(ns.host, ns.port, ns.tls_path, ns.timeout, ns.server_name)
    except Exception as exc:  # noqa: BLE001 - any failure is "not healthy", with the reason
        detail = getattr(exc, "details", lambda: None)() or str(exc)
        print(f"gpu-server health: {ns.host}:{ns.port} not reachable: {detail}", file=sys.stderr)
        return 1
    print(f"gpu-server health: {ns.host}:{ns.port} {status}")
    return 0 if status == "SERVING" else 1
