"""Names of the gRPC contract, derived from the generated descriptor of ``online_check.proto`` (never typed by hand).

The agent dials :data:`STREAM_METHOD`; the server registers :data:`STREAM_METHOD_NAME` under :data:`SERVICE_NAME`.
Renaming the package, the service or the method in the .proto (and regenerating: ``python -m protos.regen``) changes
both sides together.
"""
from __future__ import annotations

from protos import online_check_pb2 as _pb

__all__ = ["PACKAGE", "SERVICE_NAME", "STREAM_METHOD_NAME", "STREAM_METHOD"]

_SERVICE = _pb.DESCRIPTOR.services_by_name["OnlineCheck"]
_STREAM = _SERVICE.methods_by_name["Stream"]

#: The protobuf package, which carries the protocol's major version ("online_check.v1").
PACKAGE: str = _pb.DESCRIPTOR.package
#: The fully qualified service name ("online_check.v1.OnlineCheck"), as gRPC and the health service know it.
SERVICE_NAME: str = _SERVICE.full_name
#: The bidirectional stream's method name within the service ("Stream").
STREAM_METHOD_NAME: str = _STREAM.name
#: The gRPC path the agent calls ("/online_check.v1.OnlineCheck/Stream"): "/{service}/{method}".
STREAM_METHOD: str = f"/{SERVICE_NAME}/{STREAM_METHOD_NAME}"

if not (_STREAM.client_streaming and _STREAM.server_streaming):   # the transports rely on a bidirectional stream
    raise ImportError(f"{_STREAM.full_name} in online_check.proto is no longer a bidirectional stream; the agent "
                      "and gpu-server need `rpc Stream(stream Frame) returns (stream Ack)`")
