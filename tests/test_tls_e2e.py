"""Mutual TLS end to end (docs/security.md, TLS): certificates made by certs/make_certs.py in the test, a real
gpu-server process with run_ut.tls_path, real training processes with tensor.tls_path.

A valid client's records become report rows. A client without a certificate, with a certificate of another CA, with
a revoked certificate, or expecting another server name, and a plaintext client, are all refused; the agent says why
and what to do in one ERROR, stops capturing, and the training completes within 60 s with the agent's default
timeouts; the server's log says why. (More refusals: tests/test_agent_refusal.py.)"""
from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import time

import grpc
import pytest

from npu_agent.config import ConfigError, parse_config
from protos import online_check_pb2 as pb
from tests import support

MAKE = os.path.join(support.ROOT, "certs", "make_certs.py")
REVOKE = os.path.join(support.ROOT, "certs", "revoke_cert.py")


def make_pki(out, *args) -> str:
    subprocess.run([sys.executable, MAKE, "--out", str(out), *args], check=True, capture_output=True, text=True)
    return str(out)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    base = tmp_path_factory.mktemp("pki")
    ours = make_pki(base / "ours", "--server-name", "127.0.0.1", "--client", "good", "--client", "revoked")
    other = make_pki(base / "other", "--server-name", "127.0.0.1", "--client", "intruder")
    subprocess.run([sys.executable, REVOKE, "--ca-dir", ours, "--cert", f"{ours}/clients/revoked/client.crt"],
                   check=True, capture_output=True, text=True)
    return {"ours": ours, "other": other}


@pytest.fixture(scope="module")
def server(pki, tmp_path_factory):
    work = tmp_path_factory.mktemp("tls_server")
    srv = support.Server(str(work), tls_path=f"{pki['ours']}/server").start()
    yield srv
    srv.stop()


def train(work, name: str, port: int, **tensor) -> subprocess.CompletedProcess:
    cfg = support.agent_config(os.path.join(work, f"agent_{name}.json"), port=port, **tensor)
    t0 = time.monotonic()
    proc = support.run_training(support.SMALL_TRAIN, cfg, "1", "info")  # fails the test if it fails
    proc.seconds = time.monotonic() - t0  # type: ignore[attr-defined]
    assert "TRAINING DONE" in proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc


def agent_warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("WARNING:npu_agent:")]


def agent_errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("ERROR:npu_agent:")]


def test_a_valid_client_is_checked_end_to_end(server, pki, tmp_path):
    proc = train(str(tmp_path), "good", server.port, tls_path=f"{pki['ours']}/clients/good")
    assert agent_warnings(proc.stderr) == [], proc.stderr
    assert "unacknowledged 0" in proc.stderr
    assert "(mutual TLS)" in server.log()
    deadline = time.time() + 60
    rows = []
    while time.time() < deadline:
        rows = support.read_csv(server.out, "accuracy_checking_result")
        if len(rows) >= 4:
            break
        time.sleep(0.2)
    names = sorted(r["API name"] for r in rows)
    assert names == ["Functional.cross_entropy.0", "Functional.linear.0", "Functional.linear.1",
                     "Functional.relu.0"], names
    assert all(r["Forward Test Success"] == "pass" for r in rows), rows


def test_refused_agents_say_why_and_the_training_completes(server, pki, tmp_path):
    ours, other = pki["ours"], pki["other"]
    cases = {
        "other_ca": dict(tls_path=f"{other}/clients/intruder"),
        "revoked": dict(tls_path=f"{ours}/clients/revoked"),
        "wrong_name": dict(tls_path=f"{ours}/clients/good", host="localhost"),
        "plaintext": dict(tls_path=""),
    }
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        futures = {name: pool.submit(train, str(tmp_path), name, server.port, **kw)
                   for name, kw in cases.items()}
        procs = {name: f.result() for name, f in futures.items()}
    expect_agent = {
        "other_ca": "CERTIFICATE_VERIFY_FAILED",             # the server is not of the agent's CA
        "revoked": "is revoked by the server's crl.pem",   # from the server's UNAUTHENTICATED
        "wrong_name": "Hostname mismatch, certificate is not valid for 'localhost'",
        "plaintext": "requires TLS, and this agent connects in plaintext",
    }
    for name, proc in procs.items():
        assert proc.seconds < 60, f"{name}: the training took {proc.seconds:.0f} s"
        errors = agent_errors(proc.stderr)
        assert len(errors) == 1, f"{name}: not one ERROR:\n{proc.stderr[-3000:]}"
        assert expect_agent[name] in errors[0] and "Fix: " in errors[0], f"{name}: {errors[0]}"
        assert agent_warnings(proc.stderr) == [], f"{name}: a refusal is no outage to wait for"
        assert "are lost" not in proc.stderr and "unacknowledged 0" in proc.stderr, name
    log = server.log()
    for why in ("is revoked by the server's crl.pem",   # gpu_server's own warning ("refused <peer>: ...")
                "No match found for server name: localhost",
                "WRONG_VERSION_NUMBER"):                # gRPC's handshake log: a plaintext client
        assert why in log, why
    assert "refused ipv4:127.0.0.1" in log
    assert log.count(") ended:") <= 1, "no refused agent's run reached the server"


def _raw_call(port: int, creds: grpc.ChannelCredentials | None) -> grpc.RpcError:
    hello = pb.Frame(hello=pb.Hello(run_id="probe", rank=0)).SerializeToString()
    with pytest.raises(grpc.RpcError) as info:
        support.stream_acks(port, [hello], lambda acks: True, timeout=10, credentials=creds)
    return info.value


def test_a_client_without_certificate_is_refused(server, pki):
    with open(f"{pki['ours']}/ca.crt", "rb") as fh:
        ca = fh.read()
    err = _raw_call(server.port, grpc.ssl_channel_credentials(root_certificates=ca))
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    err = _raw_call(server.port, None)
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    log = server.log()
    assert "PEER_DID_NOT_RETURN_A_CERTIFICATE" in log
    # the agent cannot even be configured without one: the config names the key and the missing file
    folder = os.path.dirname(f"{pki['ours']}/ca.crt")
    with pytest.raises(ConfigError, match=r"tensor.tls_path: .* has no client.key"):
        parse_config({"tensor": {"online_run_ut": True, "tls_path": folder}})
