"""Names both sides must agree on, taken from one place in protos/ (docs/design.md §5): the gRPC method (from the
generated descriptor) and what counts as a loopback host (protos/net.py)."""
from __future__ import annotations

import pytest

from gpu_server import cli as server_cli
from gpu_server.intake import grpc_service as service
from npu_agent import transport_grpc
from npu_agent.config import Endpoint
from protos import contract, net
from protos import online_check_pb2 as pb


def test_the_stream_method_comes_from_the_descriptor():
    method = pb.DESCRIPTOR.services_by_name["OnlineCheck"].methods_by_name["Stream"]
    assert method.full_name == f"{contract.SERVICE_NAME}.{contract.STREAM_METHOD_NAME}"
    assert method.client_streaming and method.server_streaming
    # pinned: a change here is a new protocol version, which old agents and servers will not speak
    assert contract.STREAM_METHOD == "/online_check.v1.OnlineCheck/Stream"
    assert contract.PACKAGE == "online_check.v1"


def test_agent_and_server_use_the_contract_names():
    assert transport_grpc.METHOD is contract.STREAM_METHOD
    assert service.SERVICE is contract.SERVICE_NAME


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("LOCALHOST", True), (" localhost ", True), ("10.0.0.1", False), ("0.0.0.0", False), ("::", False),
    ("example.com", False), ("localhost.example.com", False), ("", False), ("[10.0.0.1]", False),
])
def test_one_loopback_rule_for_both_sides(host, loopback):
    assert net.is_loopback(host) is loopback
    assert Endpoint(host, 1).is_loopback is loopback
    assert server_cli.is_loopback is net.is_loopback
