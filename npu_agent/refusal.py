"""Which connection failures are permanent, and what to tell the user about them.

A server that is down, restarting or unreachable is a transient outage: the agent keeps its records and retries.
A server that answers but can never accept this agent is a refusal: retrying would only hold the training (or its
exit) for nothing. gRPC reports TLS failures as text inside UNAVAILABLE errors, so they are recognised here by the
TLS library's own error names. Where gRPC's text names no cause (a connection the server closed before any answer,
with or without TLS on the agent's side), a TLS handshake of our own tells a refusal from an outage.
"""
from __future__ import annotations

import os
import socket
import ssl

import grpc

from npu_agent.transport import Refusal
from protos.contract import PACKAGE
from protos.tls import ONLINE_CHECK_KEY_PASSPHRASE

MAKE_CERTS = "certs/make_certs.py (see certs/README.md)"

# Error names of BoringSSL (gRPC) and OpenSSL (Python's ssl) that a retry cannot change.
_SERVER_CERT = ("CERTIFICATE_VERIFY_FAILED", "certificate verify failed", "failed certificate verification")
_PLAINTEXT_SERVER = ("WRONG_VERSION_NUMBER", "PACKET_LENGTH_TOO_LONG", "HTTP_REQUEST", "record layer failure")
_CLIENT_CERT_ALERTS = ("ALERT_BAD_CERTIFICATE", "ALERT_UNKNOWN_CA", "ALERT_CERTIFICATE_EXPIRED",
                       "ALERT_CERTIFICATE_REVOKED", "ALERT_CERTIFICATE_UNKNOWN", "CERTIFICATE_REQUIRED",
                       "ALERT_UNSUPPORTED_CERTIFICATE", "ALERT_ACCESS_DENIED", "ALERT_HANDSHAKE_FAILURE")
_TLS_VERSION = ("UNSUPPORTED_PROTOCOL", "ALERT_PROTOCOL_VERSION", "NO_SUPPORTED_VERSIONS")


def _has(detail: str, names: tuple[str, ...]) -> bool:
    upper = detail.upper()
    return any(n.upper() in upper for n in names)


def _server_cert_refusal(detail: str, tls_dir: str, host: str) -> Refusal:
    low = detail.lower()
    if "expired" in low:
        return Refusal(f"the server's certificate has expired ({detail})",
                       f"issue a new server certificate with {MAKE_CERTS} and restart gpu-server with it")
    if "hostname" in low or "host name" in low or "not valid for" in low or "peer name" in low:
        return Refusal(f"the server's certificate does not name {host!r} ({detail})",
                       "connect with a host name or address the certificate names (its --server-name values), or "
                       f"issue the server a certificate for {host!r} with {MAKE_CERTS}")
    return Refusal(f"the server's certificate does not verify against {tls_dir}/ca.crt ({detail})",
                   "put the ca.crt of the CA that issued the server's certificate into tensor.tls_path (the agent "
                   f"and gpu-server must use certificates of one CA, made with {MAKE_CERTS})")


def _plaintext_server(detail: str, tls_dir: str) -> Refusal:
    return Refusal(f"it does not use TLS, and this agent does (tensor.tls_path={tls_dir!r}); the handshake got a "
                   f"plaintext answer ({detail})",
                   "start gpu-server with run_ut.tls_path (mutual TLS), or, on a trusted network only, leave "
                   "tensor.tls_path empty")


def classify(code: grpc.StatusCode | None, detail: str, tls_dir: str, host: str, stream: bool) -> Refusal | None:
    """A Refusal when a failed health check (`stream` False) or a broken stream (`stream` True) can never succeed
    on retry; None for what may pass (the server is down, restarting, overloaded)."""
    detail = " ".join(detail.split())
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return Refusal(f"it refused this agent's client certificate ({code.name}: {detail})",
                       "use a client certificate issued by the server's CA that is not revoked (a new one: "
                       f"{MAKE_CERTS} --client NAME), in tensor.tls_path")
    if stream and code == grpc.StatusCode.UNIMPLEMENTED:
        return Refusal(f"it does not serve this agent's protocol {PACKAGE} ({detail or code.name}); it is "
                       "another version of gpu-server, or not gpu-server",
                       "run gpu-server and npu_agent of the same release")
    if stream and code == grpc.StatusCode.FAILED_PRECONDITION:
        return Refusal(f"it refused this agent's protocol version ({detail})",
                       "run gpu-server and npu_agent of the same release")
    if not tls_dir:
        return None   # a plaintext agent that cannot connect: see `plaintext_refusal`
    if _has(detail, _PLAINTEXT_SERVER):
        return _plaintext_server(detail, tls_dir)
    if _has(detail, _SERVER_CERT):
        return _server_cert_refusal(detail, tls_dir, host)
    if _has(detail, _CLIENT_CERT_ALERTS):
        return Refusal(f"it refused this agent's client certificate during the TLS handshake ({detail})",
                       f"use a client certificate issued by the server's CA, current and not revoked ({MAKE_CERTS})")
    if _has(detail, _TLS_VERSION):
        return Refusal(f"the agent and the server share no TLS protocol version ({detail})",
                       "both sides need TLS 1.2 or 1.3: update the TLS library (grpcio) on the older side")
    return None


def tls_config_refusal(message: str, tls_dir: str, host: str) -> Refusal | None:
    """A Refusal for a `protos.tls.TlsConfigError` (the agent's own TLS files, or the handshake that checks the
    server against the client's crl.pem); None when it is an interrupted handshake, which may pass."""
    if "handshake" in message and ("EOF" in message or "reset" in message.lower()):
        return None
    if "handshake" in message:
        found = classify(None, message, tls_dir, host, stream=False)
        return found or Refusal(message, f"check the TLS files in tensor.tls_path and gpu-server's run_ut.tls_path "
                                         f"({MAKE_CERTS})")
    if "failed certificate verification" in message:
        return _server_cert_refusal(message, tls_dir, host)
    if "revoked by" in message:
        return Refusal(message, "point the agent at a server whose certificate is current (the server needs a new "
                                f"certificate from {MAKE_CERTS}), or update crl.pem in tensor.tls_path")
    return Refusal(message, "fix the files in tensor.tls_path as the message says (see certs/README.md)")


def server_speaks_tls(host: str, port: int, timeout: float) -> bool:
    """True when the server answers a TLS handshake (completed, or ended with a TLS alert): it requires TLS."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        ctx.set_alpn_protocols(["h2"])
    except NotImplementedError:
        pass
    addr = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        with socket.create_connection((addr, port), timeout=timeout) as sock:
            with ctx.wrap_socket(sock):
                return True
    except ssl.SSLError as exc:
        return "ALERT" in str(exc).upper()
    except OSError:
        return False


def plaintext_refusal(detail: str, host: str, port: int, timeout: float) -> Refusal | None:
    """A plaintext agent whose connection was closed before any answer: a refusal when the server speaks TLS."""
    if "Connection refused" in detail or not server_speaks_tls(host, port, min(timeout, 5.0)):
        return None
    return Refusal("it requires TLS, and this agent connects in plaintext (tensor.tls_path is empty)",
                   "set tensor.tls_path to a folder with client.key, client.crt and ca.crt for this agent, made "
                   f"with {MAKE_CERTS} by the CA of the server")


_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + empty SETTINGS


def _closed_after_handshake(ctx: ssl.SSLContext, addr: str, port: int, timeout: float) -> str | None:
    """One TLS handshake and the HTTP/2 preface: why the server dropped us (a TLS alert, a plaintext answer to the
    handshake, or closing without a word), or None when it answered or could not be reached."""
    try:
        with socket.create_connection((addr, port), timeout=timeout) as sock:
            with ctx.wrap_socket(sock) as tls:
                tls.sendall(_H2_PREFACE)
                if tls.recv(1):
                    return None
                return "the server closed the connection right after the TLS handshake, without an answer"
    except ssl.SSLError as exc:
        reason = str(exc.reason or exc)
        return reason if "ALERT" in reason.upper() or _has(reason, _PLAINTEXT_SERVER) else None
    except OSError:
        return None


def client_certificate_refusal(host: str, port: int, tls_dir: str, timeout: float) -> Refusal | None:
    """A TLS agent whose connection was closed before any answer: a handshake of our own with the agent's client
    certificate, then the HTTP/2 preface. gpu-server answers the preface of a client it accepts; one whose
    certificate it refuses gets a TLS alert, or (TLS 1.3) a closed connection. Twice in a row is a refusal; an
    answer, or no connection at all, is not (the server may be restarting). A plaintext answer to the handshake is a
    server without TLS, at once: gRPC's own handshake may have failed before the server's answer came ("Handshake
    write failed", when the server closed first). The server's own certificate is not checked here (gRPC checks it),
    and nothing but the preface is sent."""
    folder = tls_dir.rstrip("/")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    addr = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        passphrase = os.environ.get(ONLINE_CHECK_KEY_PASSPHRASE, "").encode("utf-8")
        ctx.load_cert_chain(f"{folder}/client.crt", f"{folder}/client.key", password=lambda: passphrase)
        ctx.set_alpn_protocols(["h2"])
    except (OSError, ValueError, NotImplementedError):
        return None
    why = None
    for _ in range(2):
        why = _closed_after_handshake(ctx, addr, port, min(timeout, 5.0))
        if why is None:
            return None
        if _has(why, _PLAINTEXT_SERVER):
            return _plaintext_server(why, tls_dir)
    return Refusal(f"it refused this agent's client certificate {folder}/client.crt ({why})",
                   "use a client certificate issued by the CA in gpu-server's run_ut.tls_path/ca.crt, current and "
                   f"not revoked ({MAKE_CERTS} --client NAME with that CA)")
