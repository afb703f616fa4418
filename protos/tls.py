"""TLS credentials for the agent (client) and gpu_server (server): mutual TLS with a private CA and an optional CRL.

A ``tls_path`` folder holds (made by ``certs/make_certs.py``):

* server (``run_ut.tls_path``): ``server.key``, ``server.crt``, ``ca.crt``, optional ``crl.pem``
* client (``tensor.tls_path``): ``client.key``, ``client.crt``, ``ca.crt``, optional ``crl.pem``

Private keys are read without prompting. An encrypted key (PKCS#8 ``ENCRYPTED PRIVATE KEY`` or a traditional
OpenSSL PEM with ``Proc-Type: 4,ENCRYPTED``) is decrypted in memory with ``cryptography``, using the passphrase in
the environment variable :data:`ONLINE_CHECK_KEY_PASSPHRASE`; the decrypted key is handed to gRPC as bytes and never
written to disk.

What is enforced, and by whom:

* Protocol version: gRPC's TLS stack (BoringSSL in the ``grpcio`` wheel) negotiates TLS 1.2 or TLS 1.3 only; its
  ``ssl_server_credentials``/``ssl_channel_credentials`` use a minimum of TLS 1.2 and a maximum of TLS 1.3 by default.
  gRPC Python exposes no option to pin the version (the C core's ``min_tls_version`` is not reachable from
  Python), so the default is relied on; ``tests/test_certs.py`` checks that a TLS 1.1 client is refused. The
  ``ssl`` handshake in :func:`check_server_not_revoked` sets ``minimum_version = TLSv1_2`` itself.
* Mutual authentication: the server requires a client certificate that chains to ``ca.crt``
  (``require_client_auth=True``); the client verifies the server certificate against ``ca.crt`` and checks the
  host name (or IP address) it dials, or the name given by :func:`channel_options`, against the certificate's
  subjectAltName.
* Revocation: gRPC Python has no CRL option, so ``crl.pem`` is enforced by this module around gRPC:

  - server: :func:`load_crl` + :func:`peer_certificate_revoked` on ``context.auth_context()`` in each RPC, or
    :class:`RevocationInterceptor` (pass it to ``grpc.server(..., interceptors=[...])``), which aborts every RPC of
    a revoked client with ``UNAUTHENTICATED`` before the handler runs. The TLS handshake itself still succeeds
    for a revoked client (gRPC Python cannot refuse it there); no RPC is served. A stream that is already open
    when a certificate is revoked is not cut; the check runs at the start of each RPC.
  - client: :func:`check_server_not_revoked` makes one extra TLS handshake with Python's ``ssl`` module before the
    channel is used, and raises if the server certificate's serial is in the client's ``crl.pem``. It is a
    separate connection from the gRPC channel (gRPC Python does not show the client the server's certificate).

  A CRL is only accepted if it is signed by a certificate in ``ca.crt`` and is current (``last_update`` not in the
  future, ``next_update`` not passed); otherwise :class:`TlsConfigError`. Serial numbers are matched alone, which
  is exact as long as ``ca.crt`` holds one CA (the make_certs.py layout).
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import socket
import ssl
import stat
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes, PublicKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID

from protos.net import is_loopback, strip_brackets

__all__ = [
    "ONLINE_CHECK_KEY_PASSPHRASE",
    "CRL_FILE",
    "TlsConfigError",
    "TlsMaterial",
    "load_server_material",
    "load_client_material",
    "server_credentials",
    "client_credentials",
    "channel_options",
    "load_crl",
    "CrlReloader",
    "peer_certificate_revoked",
    "RevocationInterceptor",
    "check_server_not_revoked",
    "is_loopback",
]

log = logging.getLogger(__name__)

#: Name of the environment variable holding the passphrase of encrypted private keys (never prompted for).
ONLINE_CHECK_KEY_PASSPHRASE = "ONLINE_CHECK_KEY_PASSPHRASE"
CRL_FILE = "crl.pem"
#: Tolerated clock difference between the host that signed a CRL and this host.
CLOCK_SKEW = _dt.timedelta(minutes=5)
_MAX_PEM_BYTES = 1 << 20

_MAKE = "create them with certs/make_certs.py (see certs/README.md)"
_ROLE = {
    "server": ("server.key", "server.crt", "run_ut.tls_path", ExtendedKeyUsageOID.SERVER_AUTH, "serverAuth"),
    "client": ("client.key", "client.crt", "tensor.tls_path", ExtendedKeyUsageOID.CLIENT_AUTH, "clientAuth"),
}


class TlsConfigError(ValueError):
    """A TLS folder, file, key, certificate or CRL cannot be used; the message says which file and what to do."""


@dataclass(frozen=True)
class TlsMaterial:
    """Checked key material from one tls_path. ``private_key_pem`` is unencrypted PKCS#8 (memory only)."""

    tls_dir: Path
    private_key_pem: bytes = field(repr=False)
    certificate_chain_pem: bytes
    root_certificates_pem: bytes
    certificate: x509.Certificate
    ca_certificates: tuple[x509.Certificate, ...]


# ----------------------------------------------------------------------------------------------- loading


def _now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def _tls_dir(tls_dir: str | os.PathLike[str], key_name: str) -> Path:
    if tls_dir is None or str(tls_dir).strip() == "":
        raise TlsConfigError(f"{key_name} is empty: give the folder with the TLS files ({_MAKE})")
    path = Path(tls_dir).expanduser()
    if not path.is_dir():
        raise TlsConfigError(f"{key_name} {str(tls_dir)!r} is not a folder: give the folder with the TLS files "
                             f"({_MAKE})")
    return path


def _read(path: Path, what: str, key_name: str) -> bytes:
    if not path.exists():
        raise TlsConfigError(f"{path}: missing {what}; {key_name} must hold it ({_MAKE})")
    if not path.is_file():
        raise TlsConfigError(f"{path}: {what} must be a regular file")
    try:
        size = path.stat().st_size
        if size > _MAX_PEM_BYTES:
            raise TlsConfigError(f"{path}: {size} bytes is too large for a {what}")
        return path.read_bytes()
    except PermissionError:
        raise TlsConfigError(f"{path}: cannot read the {what} (permission denied); the user running this process "
                             f"must be able to read it") from None
    except OSError as exc:
        raise TlsConfigError(f"{path}: cannot read the {what}: {exc}") from None


def _load_certs(path: Path, data: bytes, what: str) -> list[x509.Certificate]:
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError:
        certs = []
    if not certs:
        raise TlsConfigError(f"{path}: not a PEM {what} (expected '-----BEGIN CERTIFICATE-----'); {_MAKE}")
    return certs


def _check_validity(path: Path, cert: x509.Certificate, what: str) -> None:
    now = _now()
    if cert.not_valid_before_utc > now + CLOCK_SKEW:
        raise TlsConfigError(f"{path}: the {what} is not valid before {cert.not_valid_before_utc:%Y-%m-%d %H:%M} "
                             f"UTC; check this host's clock")
    if cert.not_valid_after_utc < now:
        raise TlsConfigError(f"{path}: the {what} expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC; "
                             f"issue a new one with certs/make_certs.py")


def _passphrase() -> bytes | None:
    value = os.environ.get(ONLINE_CHECK_KEY_PASSPHRASE)
    return value.encode("utf-8") if value else None


def load_private_key(path: Path, data: bytes | None = None) -> PrivateKeyTypes:
    """Load a PEM private key, decrypting it with ``$ONLINE_CHECK_KEY_PASSPHRASE`` when it is encrypted."""
    if data is None:
        data = _read(path, "private key", "the TLS folder")
    try:
        return serialization.load_pem_private_key(data, password=None)
    except TypeError:
        pass  # encrypted: needs the passphrase
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise TlsConfigError(f"{path}: not a usable PEM private key ({exc}); {_MAKE}") from None
    passphrase = _passphrase()
    if passphrase is None:
        raise TlsConfigError(f"{path} is encrypted: set the environment variable {ONLINE_CHECK_KEY_PASSPHRASE} to "
                             f"its passphrase in the environment of this process (keys are never prompted for)")
    try:
        return serialization.load_pem_private_key(data, password=passphrase)
    except (ValueError, TypeError):
        raise TlsConfigError(f"{path}: cannot decrypt the private key with the passphrase in "
                             f"{ONLINE_CHECK_KEY_PASSPHRASE} (wrong passphrase or damaged key)") from None


def _spki(public_key: PublicKeyTypes) -> bytes:
    return public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _issued_by(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(issuer)
        return True
    except (ValueError, TypeError, InvalidSignature):
        return False


def _load_material(tls_dir: str | os.PathLike[str], role: str) -> TlsMaterial:
    key_file, crt_file, key_name, eku, eku_name = _ROLE[role]
    folder = _tls_dir(tls_dir, key_name)
    key_path, crt_path, ca_path = folder / key_file, folder / crt_file, folder / "ca.crt"
    key_data = _read(key_path, f"{role} private key", key_name)
    crt_data = _read(crt_path, f"{role} certificate", key_name)
    ca_data = _read(ca_path, "CA certificate", key_name)

    chain = _load_certs(crt_path, crt_data, f"{role} certificate")
    cas = _load_certs(ca_path, ca_data, "CA certificate")
    key = load_private_key(key_path, key_data)
    leaf = chain[0]
    if _spki(key.public_key()) != _spki(leaf.public_key()):
        raise TlsConfigError(f"{key_path} does not belong to {crt_path} (the public keys differ); copy the matching "
                             f"pair from the folder make_certs.py wrote")
    _check_validity(crt_path, leaf, f"{role} certificate")
    for ca in cas:
        _check_validity(ca_path, ca, "CA certificate")
    for child, parent in zip(chain, chain[1:], strict=False):
        if not _issued_by(child, parent):
            raise TlsConfigError(f"{crt_path}: the certificate chain is out of order or broken")
    top = chain[-1]
    if not any(_issued_by(top, ca) or top == ca for ca in cas):
        raise TlsConfigError(f"{crt_path} was not issued by the CA in {ca_path} (its issuer is "
                             f"{top.issuer.rfc4514_string()}); copy the ca.crt of the CA that issued it")
    try:
        usages = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        if eku not in usages and ExtendedKeyUsageOID.ANY_EXTENDED_KEY_USAGE not in usages:
            log.warning("%s has no %s extended key usage; reissue it with certs/make_certs.py", crt_path, eku_name)
    except x509.ExtensionNotFound:
        pass
    try:
        mode = key_path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("%s is accessible by group/others (mode %03o); run: chmod 600 %s", key_path,
                        stat.S_IMODE(mode), key_path)
    except OSError:
        pass
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    pem = serialization.Encoding.PEM
    return TlsMaterial(tls_dir=folder, private_key_pem=key_pem,
                       certificate_chain_pem=b"".join(c.public_bytes(pem) for c in chain),
                       root_certificates_pem=b"".join(c.public_bytes(pem) for c in cas),
                       certificate=leaf, ca_certificates=tuple(cas))


def load_server_material(tls_dir: str | os.PathLike[str]) -> TlsMaterial:
    """Read and check ``server.key``, ``server.crt`` and ``ca.crt`` in ``tls_dir``."""
    return _load_material(tls_dir, "server")


def load_client_material(tls_dir: str | os.PathLike[str]) -> TlsMaterial:
    """Read and check ``client.key``, ``client.crt`` and ``ca.crt`` in ``tls_dir``."""
    return _load_material(tls_dir, "client")


# ----------------------------------------------------------------------------------------------- credentials


def server_credentials(tls_dir: str | os.PathLike[str]) -> grpc.ServerCredentials:
    """Server credentials for ``grpc.Server.add_secure_port``: presents server.crt and *requires* a client
    certificate that verifies against ca.crt (TLS 1.2 minimum, gRPC's default; see the module docstring).

    ``crl.pem`` is not enforced by gRPC; use :class:`RevocationInterceptor` (or :func:`peer_certificate_revoked`).
    """
    m = load_server_material(tls_dir)
    return grpc.ssl_server_credentials([(m.private_key_pem, m.certificate_chain_pem)],
                                       root_certificates=m.root_certificates_pem, require_client_auth=True)


def client_credentials(tls_dir: str | os.PathLike[str]) -> grpc.ChannelCredentials:
    """Channel credentials for ``grpc.secure_channel``: presents client.crt and verifies the server's certificate
    against ca.crt, including its name (the dialled host, or the override from :func:`channel_options`)."""
    m = load_client_material(tls_dir)
    return grpc.ssl_channel_credentials(root_certificates=m.root_certificates_pem, private_key=m.private_key_pem,
                                        certificate_chain=m.certificate_chain_pem)


def channel_options(server_name: str | None = None) -> list[tuple[str, str]]:
    """Channel options that make the client check the server certificate for ``server_name`` instead of the
    dialled host (for example dialling an IP address whose certificate names only a host name)."""
    if not server_name:
        return []
    return [("grpc.ssl_target_name_override", strip_brackets(server_name))]


# ----------------------------------------------------------------------------------------------- CRL


def load_crl(tls_dir: str | os.PathLike[str]) -> frozenset[int] | None:
    """Serial numbers revoked by ``tls_dir/crl.pem``; None when there is no crl.pem.

    The CRL must be signed by a certificate in ``tls_dir/ca.crt`` and be current, else :class:`TlsConfigError`.
    """
    folder = _tls_dir(tls_dir, "tls_path")
    path = folder / CRL_FILE
    if not path.exists():
        return None
    data = _read(path, "certificate revocation list", "tls_path")
    try:
        crl = x509.load_pem_x509_crl(data)
    except ValueError:
        try:
            crl = x509.load_der_x509_crl(data)
        except ValueError:
            raise TlsConfigError(f"{path}: not a CRL (expected '-----BEGIN X509 CRL-----'); make it with "
                                 f"certs/revoke_cert.py or remove it") from None
    ca_path = folder / "ca.crt"
    cas = _load_certs(ca_path, _read(ca_path, "CA certificate", "tls_path"), "CA certificate")
    signed = False
    for ca in cas:
        if ca.subject == crl.issuer:
            try:
                signed = crl.is_signature_valid(ca.public_key())  # type: ignore[arg-type]  # raises if unfit
            except (TypeError, ValueError):
                signed = False
            if signed:
                break
    if not signed:
        raise TlsConfigError(f"{path} is not signed by the CA in {ca_path}; make it with certs/revoke_cert.py "
                             f"using that CA, or remove it")
    now = _now()
    if crl.last_update_utc > now + CLOCK_SKEW:
        raise TlsConfigError(f"{path} was issued in the future ({crl.last_update_utc:%Y-%m-%d %H:%M} UTC); "
                             f"check this host's clock")
    if crl.next_update_utc is not None and crl.next_update_utc < now:
        raise TlsConfigError(f"{path} is out of date (next update was due {crl.next_update_utc:%Y-%m-%d %H:%M} "
                             f"UTC): re-sign it with certs/revoke_cert.py --ca-dir DIR and copy the new crl.pem")
    return frozenset(entry.serial_number for entry in crl)


class CrlReloader:
    """A callable returning the current revoked serials of ``tls_dir/crl.pem``, re-read when the file changes
    (checked at most every ``interval`` seconds), so a long-running server picks up a new CRL.

    A CRL that fails to load after a change (bad signature, out of date, half-copied) is logged; the reloader then
    keeps refusing the serials it knew and retries on the next check (fail closed, never open).
    """

    def __init__(self, tls_dir: str | os.PathLike[str], interval: float = 5.0):
        self._path = Path(tls_dir) / CRL_FILE
        self._dir = tls_dir
        self._interval = interval
        self._lock = threading.Lock()
        self._stamp = self._stat()
        self._revoked = load_crl(tls_dir)
        self._checked = time.monotonic()

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = self._path.stat()
            return (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            return None

    def __call__(self) -> frozenset[int] | None:
        if time.monotonic() - self._checked < self._interval:
            return self._revoked
        with self._lock:
            self._checked = time.monotonic()
            stamp = self._stat()
            if stamp != self._stamp:
                try:
                    revoked = load_crl(self._dir)
                except TlsConfigError as exc:
                    log.error("keeping the previous CRL: %s", exc)
                    return self._revoked
                if revoked is None and self._revoked:
                    log.warning("%s was removed; keeping the %d revoked serials already known", self._path,
                                len(self._revoked))
                else:
                    self._revoked = revoked
                self._stamp = stamp
            return self._revoked


def _auth_value(auth_context: Mapping[str, Any], key: str) -> bytes | None:
    values = auth_context.get(key) if auth_context else None
    if not values:
        return None
    value = values[0]
    return value.encode("ascii") if isinstance(value, str) else bytes(value)


def peer_certificate_revoked(auth_context: Mapping[str, Any], revoked: Collection[int] | None) -> str | None:
    """A reason string when the client certificate in ``auth_context`` (``context.auth_context()`` in a gRPC
    handler, key ``x509_pem_cert``) has a revoked serial number; None when it is not revoked or there is no CRL.

    With a non-empty ``revoked`` a call without a readable client certificate also gets a reason (fail closed).
    """
    if not revoked:
        return None
    pem = _auth_value(auth_context, "x509_pem_cert")
    if pem is None:
        return "no client certificate was presented, and a certificate revocation list is in force"
    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError:
        return "the client certificate cannot be parsed"
    if cert.serial_number in revoked:
        return (f"client certificate {cert.subject.rfc4514_string()} (serial {cert.serial_number:x}) is revoked "
                f"by the server's {CRL_FILE}")
    return None


def _guard(behavior: Callable[[Any, grpc.ServicerContext], Any],
           current_revoked: Callable[[], Collection[int] | None]) -> Callable[[Any, grpc.ServicerContext], Any]:
    def guarded(request_or_iterator: Any, context: grpc.ServicerContext) -> Any:
        reason = peer_certificate_revoked(context.auth_context(), current_revoked())
        if reason is not None:
            log.warning("refused %s: %s", context.peer(), reason)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
        return behavior(request_or_iterator, context)

    return guarded


if TYPE_CHECKING:
    _Handler = grpc.RpcMethodHandler[Any, Any]


class RevocationInterceptor(grpc.ServerInterceptor):
    """Aborts every RPC whose client certificate is revoked with ``UNAUTHENTICATED``, before the handler runs.

    ``revoked`` is a collection of serials (``load_crl(tls_dir)``) or a callable returning one
    (``CrlReloader(tls_dir)``). For ``grpc.server(...)``, the synchronous server.
    """

    def __init__(self, revoked: Collection[int] | Callable[[], Collection[int] | None] | None):
        self._current = revoked if callable(revoked) else (lambda: revoked)

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], _Handler | None],
                          handler_call_details: grpc.HandlerCallDetails) -> _Handler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        kw = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(_guard(handler.unary_unary, self._current), **kw)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(_guard(handler.unary_stream, self._current), **kw)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(_guard(handler.stream_unary, self._current), **kw)
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(_guard(handler.stream_stream, self._current), **kw)
        return handler


# ----------------------------------------------------------------------------------------------- client-side check


def check_server_not_revoked(host: str, port: int, tls_dir: str | os.PathLike[str], server_name: str | None = None,
                             timeout: float = 10.0) -> None:
    """Refuse a server whose certificate is revoked by the client's ``tls_dir/crl.pem``.

    Does one TLS handshake (TLS >= 1.2, ALPN h2) with Python's ``ssl`` module to ``host:port``, presenting
    client.crt, verifying the server certificate against ca.crt and its name (``server_name``, default ``host``;
    an IP address is matched against IP subjectAltNames), then compares the server certificate's serial with the
    CRL. Returns None when the server is acceptable or when there is no crl.pem (then it does not connect).

    Raises :class:`TlsConfigError` when the server certificate is revoked, fails verification or the handshake is
    refused at the TLS level; ``OSError`` (for example ``ConnectionRefusedError``, ``TimeoutError``) when the server
    cannot be reached, so a caller can retry that.
    """
    revoked = load_crl(tls_dir)
    if revoked is None:
        return
    material = load_client_material(tls_dir)
    name = strip_brackets(server_name or host)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.check_hostname = True
    ctx.load_verify_locations(cadata=material.root_certificates_pem.decode("ascii"))
    folder = material.tls_dir
    ctx.load_cert_chain(str(folder / "client.crt"), str(folder / "client.key"),
                        password=lambda: _passphrase() or b"")
    try:
        ctx.set_alpn_protocols(["h2"])
    except NotImplementedError:
        pass
    addr = strip_brackets(host)
    where = f"{host}:{port}"
    with socket.create_connection((addr, int(port)), timeout=timeout) as sock:
        try:
            with ctx.wrap_socket(sock, server_hostname=name) as tls:
                der = tls.getpeercert(binary_form=True)
        except ssl.SSLCertVerificationError as exc:
            raise TlsConfigError(f"the server at {where} failed certificate verification against "
                                 f"{folder / 'ca.crt'} for name {name!r}: {exc.verify_message}") from None
        except ssl.SSLError as exc:
            raise TlsConfigError(f"TLS handshake with {where} failed: {exc.reason or exc}") from None
    if der is None:
        raise TlsConfigError(f"the server at {where} presented no certificate")
    cert = x509.load_der_x509_certificate(der)
    if cert.serial_number in revoked:
        raise TlsConfigError(f"the server at {where} presents certificate {cert.subject.rfc4514_string()} "
                             f"(serial {cert.serial_number:x}), which is revoked by {folder / CRL_FILE}; refusing "
                             f"to send to it")
