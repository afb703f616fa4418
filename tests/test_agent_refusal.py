"""An agent that cannot be served stops costing the training (issue 11, finding 6).

Every case is a real training process with the agent's default timeouts (connect 30 s, close 600 s) against a real
server process: gpu-server with mutual TLS, gpu-server in plaintext, or a small gRPC server of another protocol
version (`OTHER_SERVER`). Certificates come from certs/make_certs.py; the expired ones are re-signed by the same CA
in the test. Each refused training finishes and exits within 60 s of its start (once torch is imported: the
interpreter's start-up is not the agent's), with one ERROR that names the cause and the fix, its numerics unchanged,
also when the script never calls close() (the atexit hook). A transient outage (a
server started late, then restarted) still loses nothing and logs no ERROR.
"""
from __future__ import annotations

import concurrent.futures
import datetime as dt
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

from tests import support, zygote
from tests.test_durability import TRAIN as DURABLE_TRAIN
from tests.test_durability import check_exactly_once, counts_of

MAKE = os.path.join(support.ROOT, "certs", "make_certs.py")
REVOKE = os.path.join(support.ROOT, "certs", "revoke_cert.py")
AGENT_LINE = "online check:"   # how the agent's lines start (Python's last-resort handler prints the message only)

# A seeded training under the agent, then the same training without it: the final weights must be equal.
# argv: config, "close" or "atexit". Prints "STARTED <monotonic clock>" once imported, "WEIGHTS <checked> <reference>".
TRAIN = r'''
import sys, time, torch, torch.nn as nn, torch.nn.functional as F
from npu_agent import PrecisionDebugger
print("STARTED", time.monotonic(), flush=True)

def train(dbg):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
        if dbg: dbg.start()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if dbg: dbg.stop()
        opt.step(); opt.zero_grad()
        if dbg: dbg.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])

dbg = PrecisionDebugger(config_path=sys.argv[1])
checked = train(dbg)
if sys.argv[2] == "close":
    dbg.close()
reference = train(None)
print("WEIGHTS", checked.double().sum().item(), reference.double().sum().item(), bool(torch.equal(checked, reference)))
'''

# A gRPC server that is not this release's gpu-server: it has the health service, and either no
# online_check.v1 stream at all ("v2": only online_check.v2) or one that refuses the agent's version ("old").
OTHER_SERVER = r'''
import sys, grpc
from concurrent import futures
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
mode, port = sys.argv[1], int(sys.argv[2])
server = grpc.server(futures.ThreadPoolExecutor(4))
h = health.HealthServicer()
h.set("", health_pb2.HealthCheckResponse.SERVING)
health_pb2_grpc.add_HealthServicer_to_server(h, server)
def refuse(requests, context):
    next(requests, None)
    context.abort(grpc.StatusCode.FAILED_PRECONDITION, "agent protocol 0.1.0 is not supported; this server needs 2.x")
from protos.contract import SERVICE_NAME   # this release's service; "v2" stands for a later release
service = SERVICE_NAME.replace(".v1.", ".v2.") if mode == "v2" else SERVICE_NAME
assert mode != "v2" or service != SERVICE_NAME
server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, {
    "Stream": grpc.stream_stream_rpc_method_handler(refuse)}),))
if len(sys.argv) > 3:   # mutual TLS with the files of a run_ut.tls_path folder (not checked: may be expired)
    d = sys.argv[3]
    read = lambda name: open(f"{d}/{name}", "rb").read()
    creds = grpc.ssl_server_credentials([(read("server.key"), read("server.crt"))], root_certificates=read("ca.crt"),
                                        require_client_auth=True)
    server.add_secure_port(f"127.0.0.1:{port}", creds)
else:
    server.add_insecure_port(f"127.0.0.1:{port}")
server.start()
server.wait_for_termination()
'''


class OtherServer:
    def __init__(self, mode: str, tls_dir: str = ""):
        self.port = support.free_port()
        args = [mode, str(self.port)] + ([tls_dir] if tls_dir else [])
        self.proc = subprocess.Popen([sys.executable, "-c", OTHER_SERVER, *args], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.time() + 60
        import socket
        while time.time() < deadline:
            assert self.proc.poll() is None, "the test server died"
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.1)
        raise RuntimeError("the test server did not start")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def make_pki(out: Path, *args: str) -> Path:
    subprocess.run([sys.executable, MAKE, "--out", str(out), *args], check=True, capture_output=True, text=True)
    return out


def expired_copy(folder: Path, leaf: str, ca_dir: Path, dst: Path) -> Path:
    """A copy of a tls_path folder whose certificate `leaf` (client.crt or server.crt) is re-signed by the CA in
    `ca_dir` with the same key and extensions, but valid only until yesterday."""
    shutil.copytree(folder, dst)
    old = x509.load_pem_x509_certificate((folder / leaf).read_bytes())
    ca_cert = x509.load_pem_x509_certificate((ca_dir / "ca.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((ca_dir / "ca.key").read_bytes(), password=None)
    now = dt.datetime.now(dt.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(old.subject).issuer_name(ca_cert.subject)
               .public_key(old.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - dt.timedelta(days=30)).not_valid_after(now - dt.timedelta(days=1)))
    for ext in old.extensions:
        if ext.oid != x509.oid.ExtensionOID.AUTHORITY_KEY_IDENTIFIER:
            builder = builder.add_extension(ext.value, ext.critical)
    cert = builder.sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    (dst / leaf).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return dst


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("pki")
    ours = make_pki(base / "ours", "--server-name", "127.0.0.1", "--client", "good")
    other = make_pki(base / "other", "--server-name", "127.0.0.1", "--client", "intruder")
    # a client of another CA that trusts ours too (a ca.crt with both): only the server can refuse it
    foreign = base / "foreign_client"
    shutil.copytree(other / "clients" / "intruder", foreign)
    (foreign / "ca.crt").write_bytes((ours / "ca.crt").read_bytes() + (other / "ca.crt").read_bytes())
    return {"ours": ours, "good": ours / "clients" / "good", "foreign_client": foreign,
            "expired_client": expired_copy(ours / "clients" / "good", "client.crt", ours, base / "expired_client"),
            "expired_server": expired_copy(ours / "server", "server.crt", ours, base / "expired_server")}


def run_agent(work: Path, name: str, port: int, ending: str = "close", **tensor) -> tuple[subprocess.CompletedProcess,
                                                                                          float]:
    cfg = support.agent_config(str(work / f"agent_{name}.json"), port=port, **tensor)
    env = dict(os.environ, PYTHONPATH=support.ROOT, OMP_NUM_THREADS="1")
    proc = zygote.run(TRAIN, (cfg, ending), env, None, 300)   # its own process, forked once torch is imported
    exited = time.monotonic()   # CLOCK_MONOTONIC: one clock for all processes of this host
    started = [float(x.split()[1]) for x in proc.stdout.splitlines() if x.startswith("STARTED ")]
    return proc, exited - started[0] if started else float("inf")


def test_each_permanent_refusal_ends_capture_with_one_error(pki, tmp_path):
    tls_server = support.Server(str(tmp_path), out=str(tmp_path / "out_tls"), tls_path=str(pki["ours"] / "server"))
    plain_server = support.Server(str(tmp_path), out=str(tmp_path / "out_plain"))
    tls_server.start()
    plain_server.start()
    others = {"v2": OtherServer("v2"), "old": OtherServer("old"),
              "expired": OtherServer("v2", str(pki["expired_server"]))}
    good = str(pki["good"])
    cases = {   # name: (port, agent settings, how the script ends, words of the cause in the ERROR)
        "plaintext_agent": (tls_server.port, {}, "atexit", "requires TLS"),
        "expired_client_certificate": (tls_server.port, {"tls_path": str(pki["expired_client"])}, "close",
                                       "expired"),
        "foreign_ca_client_certificate": (tls_server.port, {"tls_path": str(pki["foreign_client"])}, "atexit",
                                          "refused this agent's client certificate"),
        "expired_server_certificate": (others["expired"].port, {"tls_path": good}, "close",
                                       "the server's certificate has expired"),
        "tls_agent_plaintext_server": (plain_server.port, {"tls_path": good}, "atexit", "does not use TLS"),
        "other_protocol_version": (others["v2"].port, {}, "close", "does not serve this agent's protocol"),
        "refused_protocol_version": (others["old"].port, {}, "atexit", "refused this agent's protocol version"),
    }
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            futures = {name: pool.submit(run_agent, tmp_path, name, port, ending, **kw)
                       for name, (port, kw, ending, _) in cases.items()}
            results = {name: f.result() for name, f in futures.items()}
    finally:
        tls_server.stop()
        plain_server.stop()
        for s in others.values():
            s.stop()
    for name, (proc, seconds) in results.items():
        print(f"{name}: {seconds:.1f} s from the training's start (torch imported) to its exit")  # pytest -s
        cause = cases[name][3]
        assert proc.returncode == 0, f"{name}:\n{proc.stderr[-3000:]}"
        assert seconds < 60, f"{name}: the training took {seconds:.0f} s to finish and exit"
        weights = [line for line in proc.stdout.splitlines() if line.startswith("WEIGHTS")]
        assert weights and weights[0].endswith(" True"), f"{name}: numerics changed: {proc.stdout}"
        lines = [x for x in proc.stderr.splitlines() if x.startswith(AGENT_LINE)]
        errors = [x for x in lines if "can never receive this training's records" in x]
        assert len(errors) == 1, f"{name}: {lines}"
        assert cause in errors[0] and "Fix: " in errors[0], f"{name}: {errors[0]}"
        assert not [x for x in lines if "unavailable" in x or "are lost" in x], f"{name}: {lines}"
        assert "Traceback" not in proc.stderr, f"{name}:\n{proc.stderr[-3000:]}"


def test_a_plaintext_server_is_known_by_the_agents_own_handshake(pki, tmp_path):
    """A TLS agent's health check against a plaintext gpu-server may fail before the server's answer arrives
    (gRPC's "Handshake write failed": the server closed first, under load), so that its text names no plaintext
    answer. The handshake of the agent's own that follows (`client_certificate_refusal`) gets the server's plaintext
    answer and says so at once: one refusal, never an outage warning first."""
    from npu_agent.refusal import client_certificate_refusal

    server = support.Server(str(tmp_path)).start()
    try:
        refusal = client_certificate_refusal("127.0.0.1", server.port, str(pki["good"]), 10.0)
    finally:
        server.stop()
    assert refusal is not None and "does not use TLS" in refusal.cause, refusal
    assert "WRONG_VERSION_NUMBER" in refusal.cause or "record layer" in refusal.cause.lower(), refusal.cause


def test_transient_outages_lose_nothing_and_are_no_refusal(tmp_path):
    """No server at first, then a server, then the server restarted mid-training: every record is checked once."""
    port = support.free_port()
    cfg = support.agent_config(str(tmp_path / "agent.json"), port, online_max_retry_s=0.3,
                               online_memory_mb=0.05, online_close_timeout_s=90)
    steps = 24
    train = support.Training(DURABLE_TRAIN, cfg, str(steps), "0.05", "1", "32", env={"OMP_NUM_THREADS": "1"},
                             timeout=150)
    time.sleep(2.0)                       # the training starts with no server at all
    server = support.Server(str(tmp_path), port=port).start()
    deadline = time.time() + 60
    while "agent connected" not in server.log() and time.time() < deadline:
        time.sleep(0.05)
    server.stop()                         # a clean restart on the same port and spool, mid-training
    server = support.Server(str(tmp_path), port=port).start()
    try:
        proc = train.result(160)          # fails the test if the training failed
    finally:
        server.stop()
    err = proc.stderr
    counts = counts_of(proc)
    assert counts["captured"] == counts["acknowledged"] and counts["dropped"] == 0, counts
    per_step = check_exactly_once(server.out, 0, steps)
    assert sum(map(len, per_step.values())) == counts["forward_calls"] == steps * 4
    lines = [x for x in err.splitlines() if x.startswith(AGENT_LINE)]
    assert not [x for x in lines if "can never receive" in x], lines
    assert any("unavailable" in x for x in lines), lines


def test_close_waits_at_most_the_connect_timeout_when_no_server_was_reached(monkeypatch, caplog):
    """In process, real gRPC to a port where nothing listens: close(600) returns after about the connect timeout,
    and says while it waits (here every 0.2 s instead of every 30 s)."""
    from npu_agent import sender as sender_module
    from npu_agent.config import Endpoint
    from npu_agent.sender import Sender
    from npu_agent.transport_grpc import GrpcTransport
    from tests.test_folder import make_record

    monkeypatch.setattr(sender_module, "WAIT_LOG_S", 0.2)
    transport = GrpcTransport(Endpoint("127.0.0.1", support.free_port()), "", "nowhere", 0, 1,
                              connect_timeout_s=1.5, max_retry_s=0.2)
    sender = Sender(transport, budget_bytes=64 << 20)
    with caplog.at_level(logging.INFO, logger="npu_agent"):
        for i in range(3):
            assert sender.submit(make_record(i))
        t0 = time.monotonic()
        counts = sender.close(timeout=600)
        waited = time.monotonic() - t0
    assert counts["unacknowledged"] == 3 and counts["acknowledged"] == 0, counts
    assert 1.0 < waited < 15, waited     # the connect timeout (1.5 s), not the close timeout (600 s)
    assert "close() is waiting for the server to acknowledge 3 records" in caplog.text
    assert "nothing listens there" in caplog.text and "ERROR" not in caplog.text
    assert not transport.reached and sender.refusal is None


def test_importing_the_agent_configures_no_logging():
    """The agent logs through the "npu_agent" logger only: no handler, no level, propagation kept, so that the
    application's logging configuration (or, without one, Python's last-resort handler) decides."""
    import npu_agent.debugger  # noqa: F401

    agent = logging.getLogger("npu_agent")
    assert agent.handlers == [] and agent.level == logging.NOTSET and agent.propagate


def test_only_permanent_failures_are_refusals():
    """The error texts gRPC and Python's ssl gave on this host (see the end-to-end test above): outages are not
    refusals, mismatches are. A false refusal would drop records that a restarted server could still take."""
    import grpc

    from npu_agent.refusal import classify, tls_config_refusal

    unavailable, tls = grpc.StatusCode.UNAVAILABLE, "/certs/agent"
    transient = [
        (unavailable, "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: Connection "
                      "refused", tls),
        (unavailable, "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: Socket closed",
         tls),
        (unavailable, "Socket closed", ""),        # plaintext: confirmed by a handshake of our own, not here
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "too many streams; retry later", tls),
        (grpc.StatusCode.CANCELLED, "Cancelled", tls),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", ""),
    ]
    for code, detail, tls_dir in transient:
        assert classify(code, detail, tls_dir, "127.0.0.1", stream=True) is None, detail
    assert classify(grpc.StatusCode.UNIMPLEMENTED, "", "", "h", stream=False) is None  # a server without health
    permanent = [
        (unavailable, "Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:100000f7:SSL "
                      "routines:OPENSSL_internal:WRONG_VERSION_NUMBER", "does not use TLS"),
        (unavailable, "Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL "
                      "routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: unable to get local issuer certificate",
         "does not verify against /certs/agent/ca.crt"),
        (grpc.StatusCode.UNAUTHENTICATED, "client certificate CN=x is revoked by the server's crl.pem",
         "refused this agent's client certificate"),
    ]
    for code, detail, cause in permanent:
        refusal = classify(code, detail, tls, "127.0.0.1", stream=False)
        assert refusal is not None and cause in refusal.cause, (detail, refusal)
    assert tls_config_refusal("TLS handshake with h:1 failed: EOF occurred in violation of protocol", tls, "h") is None
    expired = tls_config_refusal("/certs/agent/client.crt: the client certificate expired on 2026-01-01 00:00 UTC; "
                                 "issue a new one with certs/make_certs.py", tls, "h")
    assert expired is not None and "expired" in expired.cause
