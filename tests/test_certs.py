"""Certificate tooling (certs/make_certs.py, certs/revoke_cert.py) and the TLS credential layer (protos/tls.py).

Everything is real: the commands run as subprocesses into tmp_path, and the handshakes are real gRPC mutual TLS
on loopback. Private keys only ever live under tmp_path.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import shutil
import socket
import ssl
import stat
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509 import verification
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from protos import tls

ROOT = Path(__file__).resolve().parents[1]
MAKE = ROOT / "certs" / "make_certs.py"
REVOKE = ROOT / "certs" / "revoke_cert.py"
METHOD = "/test.Echo/Ping"
STREAM_METHOD = "/test.Echo/Chat"
OPENSSL = shutil.which("openssl")


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


HAVE_IPV6 = _ipv6_loopback()


def run_tool(script: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != tls.ONLINE_CHECK_KEY_PASSPHRASE}
    full_env.update(env or {})
    return subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True,
                          env=full_env, timeout=60)


def make(out: Path, *args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    proc = run_tool(MAKE, "--out", str(out), *args, env=env)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def revoke(ca_dir: Path, *args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    proc = run_tool(REVOKE, "--ca-dir", str(ca_dir), *args, env=env)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pki") / "ca"
    args = ["--server-name", "localhost", "--server-name", "127.0.0.1", "--client", "rank0", "--client", "rank1"]
    if HAVE_IPV6:
        args += ["--server-name", "[::1]"]
    make(out, *args)
    return out


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("other") / "ca"
    make(out, "--server-name", "localhost", "--server-name", "127.0.0.1", "--client", "intruder",
         "--ca-name", "another CA")
    return out


@pytest.fixture
def pki_copy(pki, tmp_path) -> Path:
    dst = tmp_path / "ca"
    shutil.copytree(pki, dst)
    return dst


# ----------------------------------------------------------------------------------------------- gRPC helpers


def _ping(request, context):
    cn = context.auth_context().get("x509_common_name", [b"?"])[0]
    return request + b"|" + cn


def _chat(request_iterator, context):
    for item in request_iterator:
        yield item.upper()


def _revocation_checking_ping(revoked):
    def handler(request, context):
        reason = tls.peer_certificate_revoked(context.auth_context(), revoked)
        if reason:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
        return _ping(request, context)

    return handler


class Server:
    def __init__(self, creds, ping=_ping, interceptors=(), host="127.0.0.1"):
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=list(interceptors))
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", {
            "Ping": grpc.unary_unary_rpc_method_handler(ping),
            "Chat": grpc.stream_stream_rpc_method_handler(_chat),
        }),))
        bind = f"[{host}]" if ":" in host else host
        self.port = self.server.add_secure_port(f"{bind}:0", creds)
        assert self.port
        self.server.start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.server.stop(None)


def call(port, creds, host="127.0.0.1", options=(), method=METHOD, payload=b"hi"):
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    opts = [("grpc.use_local_subchannel_pool", 1), *options]
    with grpc.secure_channel(target, creds, options=opts) as channel:
        if method == STREAM_METHOD:
            return list(channel.stream_stream(method)(iter([payload, payload]), timeout=10))
        return channel.unary_unary(method)(payload, timeout=10)


def call_fails(port, creds, **kw) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(port, creds, **kw)
    return info.value


# ----------------------------------------------------------------------------------------------- make_certs.py


def test_layout_and_private_key_modes(pki):
    for rel in ("ca.crt", "ca.key", "server.crt", "server.key", "server/server.key", "server/server.crt",
                "server/ca.crt", "clients/rank0/client.key", "clients/rank0/client.crt", "clients/rank0/ca.crt",
                "clients/rank1/client.key"):
        assert (pki / rel).is_file(), rel
    for key in ("ca.key", "server.key", "server/server.key", "clients/rank0/client.key", "clients/rank1/client.key"):
        assert mode(pki / key) == 0o600, key
        assert b"-----BEGIN PRIVATE KEY-----" in (pki / key).read_bytes()
    for folder in ("", "server", "clients", "clients/rank0"):
        assert mode(pki / folder) == 0o700, folder
    assert (pki / "server" / "ca.crt").read_bytes() == (pki / "ca.crt").read_bytes()
    assert (pki / "server" / "server.key").read_bytes() == (pki / "server.key").read_bytes()
    assert (pki / "clients" / "rank0" / "ca.crt").read_bytes() == (pki / "ca.crt").read_bytes()


def test_server_certificate_sans_and_usages(pki):
    server = cert(pki / "server.crt")
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    ips = san.get_values_for_type(x509.IPAddress)
    assert ipaddress.ip_address("127.0.0.1") in ips
    if HAVE_IPV6:
        assert ipaddress.ip_address("::1") in ips
    assert server.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "localhost"
    ku = server.extensions.get_extension_for_class(x509.KeyUsage)
    assert ku.critical and ku.value.digital_signature and not ku.value.key_cert_sign and not ku.value.crl_sign
    assert list(server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.SERVER_AUTH]
    assert server.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    assert isinstance(server.public_key(), ec.EllipticCurvePublicKey)
    assert server.public_key().curve.name == "secp256r1"
    assert server.signature_hash_algorithm.name == "sha256"

    ca = cert(pki / "ca.crt")
    bc = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and bc.value.ca
    ca_ku = ca.extensions.get_extension_for_class(x509.KeyUsage).value
    assert ca_ku.key_cert_sign and ca_ku.crl_sign
    # random serials: large, distinct
    serials = {c.serial_number for c in (ca, server, cert(pki / "clients/rank0/client.crt"),
                                        cert(pki / "clients/rank1/client.crt"))}
    assert len(serials) == 4 and min(serials) > 2 ** 64


def test_client_certificate_usages(pki):
    client = cert(pki / "clients/rank0/client.crt")
    assert client.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "rank0"
    assert list(client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.CLIENT_AUTH]
    ku = client.extensions.get_extension_for_class(x509.KeyUsage).value
    assert ku.digital_signature and not ku.key_cert_sign
    assert client.issuer == cert(pki / "ca.crt").subject
    san = client.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["urn:online-check:client:rank0"]


def test_certificates_verify_against_the_ca(pki, other_pki):
    store = verification.Store([cert(pki / "ca.crt")])
    server = cert(pki / "server.crt")
    for subject in (verification.DNSName("localhost"), verification.IPAddress(ipaddress.ip_address("127.0.0.1"))):
        verification.PolicyBuilder().store(store).build_server_verifier(subject).verify(server, [])
    with pytest.raises(verification.VerificationError):
        verification.PolicyBuilder().store(store).build_server_verifier(
            verification.DNSName("evil.example")).verify(server, [])
    if hasattr(verification.PolicyBuilder, "build_client_verifier"):  # cryptography >= 43
        client_verifier = verification.PolicyBuilder().store(store).build_client_verifier()
        client_verifier.verify(cert(pki / "clients/rank0/client.crt"), [])
        with pytest.raises(verification.VerificationError):  # a server cert is no client cert
            client_verifier.verify(server, [])
        with pytest.raises(verification.VerificationError):  # another CA's client is not trusted
            client_verifier.verify(cert(other_pki / "clients/intruder/client.crt"), [])
    if OPENSSL:
        def ossl(purpose, path):
            return subprocess.run([OPENSSL, "verify", "-CAfile", str(pki / "ca.crt"), "-purpose", purpose,
                                   str(path)], capture_output=True, text=True).returncode

        assert ossl("sslserver", pki / "server.crt") == 0
        assert ossl("sslclient", pki / "clients/rank0/client.crt") == 0
        assert ossl("sslserver", pki / "clients/rank0/client.crt") != 0
        assert ossl("sslclient", other_pki / "clients/intruder/client.crt") != 0


def test_never_overwrites_a_key_without_force(tmp_path):
    out = tmp_path / "ca"
    make(out, "--server-name", "localhost", "--client", "a")
    ca_before = (out / "ca.crt").read_bytes()
    key_before = (out / "clients/a/client.key").read_bytes()

    proc = make(out, "--client", "b", "--client", "a", check=False)
    assert proc.returncode == 2 and "refusing to overwrite" in proc.stderr and "clients/a/client.key" in proc.stderr
    assert not (out / "clients/b").exists(), "nothing is written when any key would be overwritten"
    assert (out / "clients/a/client.key").read_bytes() == key_before

    make(out, "--client", "b")  # the existing CA is reused to add a client
    assert (out / "ca.crt").read_bytes() == ca_before
    assert cert(out / "clients/b/client.crt").issuer == cert(out / "ca.crt").subject

    assert make(out, "--new-ca", check=False).returncode == 2
    make(out, "--client", "a", "--force")
    assert (out / "clients/a/client.key").read_bytes() != key_before
    assert mode(out / "clients/a/client.key") == 0o600
    assert (out / "ca.crt").read_bytes() == ca_before
    assert not list(out.rglob("*.tmp"))


@pytest.mark.parametrize("args, words", [
    (["--server-name", "bad name!"], "--server-name"),
    (["--server-name", "fe80::1%eth0"], "scope"),
    (["--client", "../escape"], "--client"),
    (["--days", "0"], "--days"),
    (["--client", "a", "--key-passphrase-env", "NO_SUCH_VARIABLE_SET"], "NO_SUCH_VARIABLE_SET"),
])
def test_make_certs_rejects_bad_arguments(tmp_path, args, words):
    proc = make(tmp_path / "ca", *args, check=False)
    assert proc.returncode == 2 and words in proc.stderr
    assert not list(tmp_path.rglob("*.key"))


def test_rsa_option(tmp_path):
    out = tmp_path / "ca"
    make(out, "--rsa", "--server-name", "localhost", "--client", "r", "--days", "30")
    server = cert(out / "server.crt")
    assert isinstance(server.public_key(), rsa.RSAPublicKey) and server.public_key().key_size == 3072
    assert server.extensions.get_extension_for_class(x509.KeyUsage).value.key_encipherment
    assert (server.not_valid_after_utc - server.not_valid_before_utc) <= dt.timedelta(days=30, minutes=6)
    creds_ok = Server(tls.server_credentials(out / "server"))
    with creds_ok as srv:
        assert call(srv.port, tls.client_credentials(out / "clients/r"), options=tls.channel_options("localhost"))


# ----------------------------------------------------------------------------------------------- encrypted keys


def test_encrypted_keys_need_the_passphrase_variable(tmp_path, monkeypatch):
    out = tmp_path / "ca"
    make(out, "--server-name", "127.0.0.1", "--client", "enc", "--key-passphrase-env", "MY_PASS",
         env={"MY_PASS": "correct horse"})
    for key in ("ca.key", "server/server.key", "clients/enc/client.key"):
        assert b"ENCRYPTED PRIVATE KEY" in (out / key).read_bytes()
        assert mode(out / key) == 0o600

    monkeypatch.delenv(tls.ONLINE_CHECK_KEY_PASSPHRASE, raising=False)
    with pytest.raises(tls.TlsConfigError) as info:
        tls.server_credentials(out / "server")
    assert "server.key" in str(info.value) and "ONLINE_CHECK_KEY_PASSPHRASE" in str(info.value)
    assert isinstance(info.value, ValueError)

    monkeypatch.setenv(tls.ONLINE_CHECK_KEY_PASSPHRASE, "wrong")
    with pytest.raises(tls.TlsConfigError, match=r"client\.key.*ONLINE_CHECK_KEY_PASSPHRASE"):
        tls.client_credentials(out / "clients/enc")

    monkeypatch.setenv(tls.ONLINE_CHECK_KEY_PASSPHRASE, "correct horse")
    assert b"ENCRYPTED" not in tls.load_client_material(out / "clients/enc").private_key_pem
    with Server(tls.server_credentials(out / "server")) as srv:
        assert call(srv.port, tls.client_credentials(out / "clients/enc")) == b"hi|enc"

    # the CA key is encrypted too: revoke_cert.py needs the passphrase, from the default variable or a named one
    proc = revoke(out, "--cert", str(out / "clients/enc/client.crt"), check=False)
    assert proc.returncode == 2 and "ONLINE_CHECK_KEY_PASSPHRASE" in proc.stderr
    revoke(out, "--cert", str(out / "clients/enc/client.crt"), env={"ONLINE_CHECK_KEY_PASSPHRASE": "correct horse"})
    # and make_certs.py reuses the encrypted CA with it
    make(out, "--client", "enc2", "--key-passphrase-env", "MY_PASS", env={"MY_PASS": "correct horse"})
    assert make(out, "--client", "enc3", check=False).returncode == 2


# ----------------------------------------------------------------------------------------------- revoke_cert.py


def test_revoke_writes_a_signed_crl_and_copies_it(pki_copy):
    ca = cert(pki_copy / "ca.crt")
    rank1 = cert(pki_copy / "clients/rank1/client.crt")
    proc = revoke(pki_copy, "--cert", str(pki_copy / "clients/rank1/client.crt"), "--next-update-days", "7",
                  "--reason", "key_compromise")
    assert f"{rank1.serial_number:x}" in proc.stdout
    crl = x509.load_pem_x509_crl((pki_copy / "crl.pem").read_bytes())
    assert [e.serial_number for e in crl] == [rank1.serial_number]
    assert crl.issuer == ca.subject and crl.is_signature_valid(ca.public_key())
    assert not crl.is_signature_valid(cert(pki_copy / "server.crt").public_key())
    assert abs(crl.next_update_utc - (dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=7))) < dt.timedelta(
        minutes=2)
    assert crl.get_revoked_certificate_by_serial_number(rank1.serial_number).extensions.get_extension_for_class(
        x509.CRLReason).value.reason == x509.ReasonFlags.key_compromise
    for copy in ("server/crl.pem", "clients/rank0/crl.pem", "clients/rank1/crl.pem"):
        assert (pki_copy / copy).read_bytes() == (pki_copy / "crl.pem").read_bytes()
    assert tls.load_crl(pki_copy / "server") == {rank1.serial_number}
    assert tls.load_crl(pki_copy / "clients/rank0") == {rank1.serial_number}
    if OPENSSL:
        def crl_check(path):
            return subprocess.run([OPENSSL, "verify", "-crl_check", "-CRLfile", str(pki_copy / "crl.pem"),
                                   "-CAfile", str(pki_copy / "ca.crt"), str(path)], capture_output=True,
                                  text=True).returncode

        assert crl_check(pki_copy / "clients/rank1/client.crt") != 0
        assert crl_check(pki_copy / "clients/rank0/client.crt") == 0

    # extending: the old entry is kept, a duplicate is not added, a serial can be given in hex, the number grows
    rank0 = cert(pki_copy / "clients/rank0/client.crt")
    revoke(pki_copy, "--cert", str(pki_copy / "clients/rank1/client.crt"), "--serial", f"0x{rank0.serial_number:X}")
    crl2 = x509.load_pem_x509_crl((pki_copy / "crl.pem").read_bytes())
    assert sorted(e.serial_number for e in crl2) == sorted([rank0.serial_number, rank1.serial_number])
    number = crl2.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number
    assert number == crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number + 1


def test_revoke_refuses_a_certificate_of_another_ca(pki_copy, other_pki):
    proc = revoke(pki_copy, "--cert", str(other_pki / "clients/intruder/client.crt"), check=False)
    assert proc.returncode == 2 and "not issued by" in proc.stderr
    assert not (pki_copy / "crl.pem").exists()
    assert revoke(pki_copy, "--cert", str(pki_copy / "nope.crt"), check=False).returncode == 2


# ----------------------------------------------------------------------------------------------- protos/tls.py errors


def test_config_errors_name_the_file(pki, pki_copy, other_pki, tmp_path):
    with pytest.raises(tls.TlsConfigError, match="tensor.tls_path is empty"):
        tls.client_credentials("")
    with pytest.raises(tls.TlsConfigError, match="not a folder"):
        tls.server_credentials(tmp_path / "missing")
    (pki_copy / "server/ca.crt").unlink()
    with pytest.raises(tls.TlsConfigError, match=r"ca\.crt: missing CA certificate.*make_certs"):
        tls.server_credentials(pki_copy / "server")
    (pki_copy / "server/ca.crt").write_text("garbage")
    with pytest.raises(tls.TlsConfigError, match=r"ca\.crt: not a PEM CA certificate"):
        tls.server_credentials(pki_copy / "server")
    shutil.copy(other_pki / "ca.crt", pki_copy / "server/ca.crt")
    with pytest.raises(tls.TlsConfigError, match=r"server\.crt was not issued by the CA"):
        tls.server_credentials(pki_copy / "server")
    # a key that does not belong to the certificate
    mixed = tmp_path / "mixed"
    shutil.copytree(pki / "clients/rank0", mixed)
    shutil.copy(pki / "clients/rank1/client.key", mixed / "client.key")
    with pytest.raises(tls.TlsConfigError, match=r"client\.key does not belong to .*client\.crt"):
        tls.client_credentials(mixed)
    (mixed / "client.key").write_text("not a key")
    with pytest.raises(tls.TlsConfigError, match=r"client\.key: not a usable PEM private key"):
        tls.client_credentials(mixed)


def _write_crl(path: Path, ca_dir: Path, serials, next_update: dt.datetime, last_update: dt.datetime | None = None):
    ca = cert(ca_dir / "ca.crt")
    key = serialization.load_pem_private_key((ca_dir / "ca.key").read_bytes(), password=None)
    now = dt.datetime.now(dt.timezone.utc)
    builder = (x509.CertificateRevocationListBuilder().issuer_name(ca.subject)
               .last_update(last_update or now - dt.timedelta(days=2)).next_update(next_update))
    for s in serials:
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(s).revocation_date(now - dt.timedelta(days=2)).build())
    path.write_bytes(builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))


def test_load_crl_checks_signature_and_dates(pki_copy, other_pki):
    server_dir = pki_copy / "server"
    assert tls.load_crl(server_dir) is None
    now = dt.datetime.now(dt.timezone.utc)
    _write_crl(server_dir / "crl.pem", pki_copy, [5, 7], now + dt.timedelta(days=1))
    assert tls.load_crl(server_dir) == {5, 7}
    _write_crl(server_dir / "crl.pem", pki_copy, [5], now - dt.timedelta(days=1))
    with pytest.raises(tls.TlsConfigError, match=r"crl\.pem is out of date.*revoke_cert"):
        tls.load_crl(server_dir)
    _write_crl(server_dir / "crl.pem", pki_copy, [5], now + dt.timedelta(days=3), now + dt.timedelta(days=1))
    with pytest.raises(tls.TlsConfigError, match="future"):
        tls.load_crl(server_dir)
    _write_crl(server_dir / "crl.pem", other_pki, [5], now + dt.timedelta(days=1))
    with pytest.raises(tls.TlsConfigError, match=r"crl\.pem is not signed by the CA"):
        tls.load_crl(server_dir)
    (server_dir / "crl.pem").write_text("junk")
    with pytest.raises(tls.TlsConfigError, match=r"crl\.pem: not a CRL"):
        tls.load_crl(server_dir)


# ----------------------------------------------------------------------------------------------- real mutual TLS


def test_mutual_tls_handshake_succeeds_with_a_valid_client(pki):
    with Server(tls.server_credentials(pki / "server")) as srv:
        client = tls.client_credentials(pki / "clients/rank0")
        assert call(srv.port, client) == b"hi|rank0"
        assert call(srv.port, client, options=tls.channel_options("localhost")) == b"hi|rank0"
        assert call(srv.port, client, method=STREAM_METHOD, payload=b"ab") == [b"AB", b"AB"]


@pytest.mark.skipif(not HAVE_IPV6, reason="no IPv6 loopback")
def test_mutual_tls_over_ipv6(pki):
    with Server(tls.server_credentials(pki / "server"), host="::1") as srv:
        assert call(srv.port, tls.client_credentials(pki / "clients/rank1"), host="::1") == b"hi|rank1"


def test_mutual_tls_handshake_fails_for_bad_peers(pki, other_pki):
    ca = (pki / "ca.crt").read_bytes()
    intruder = other_pki / "clients/intruder"
    with Server(tls.server_credentials(pki / "server")) as srv:
        # no client certificate
        err = call_fails(srv.port, grpc.ssl_channel_credentials(root_certificates=ca))
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        # a client certificate from another CA (the client itself trusts our server)
        foreign = grpc.ssl_channel_credentials(root_certificates=ca, private_key=(intruder / "client.key").read_bytes(),
                                               certificate_chain=(intruder / "client.crt").read_bytes())
        assert call_fails(srv.port, foreign).code() == grpc.StatusCode.UNAVAILABLE
        # the client expects another server name than the certificate holds
        good = tls.client_credentials(pki / "clients/rank0")
        err = call_fails(srv.port, good, options=tls.channel_options("wrong.example"))
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        # a client that trusts only another CA does not accept our server
        assert call_fails(srv.port, tls.client_credentials(intruder)).code() == grpc.StatusCode.UNAVAILABLE
        # and the valid client still works on the same server
        assert call(srv.port, good) == b"hi|rank0"
    # a server with another CA's certificate is refused by our client
    with Server(tls.server_credentials(other_pki / "server")) as srv:
        assert call_fails(srv.port, tls.client_credentials(pki / "clients/rank0")).code() == \
            grpc.StatusCode.UNAVAILABLE


def _ssl_client(pki, max_version):
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cafile=str(pki / "ca.crt"))
    ctx.load_cert_chain(str(pki / "clients/rank0/client.crt"), str(pki / "clients/rank0/client.key"))
    ctx.set_alpn_protocols(["h2"])
    ctx.minimum_version = ssl.TLSVersion.MINIMUM_SUPPORTED
    ctx.maximum_version = max_version
    if max_version < ssl.TLSVersion.TLSv1_2:
        ctx.set_ciphers("DEFAULT:@SECLEVEL=0")
    return ctx


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_grpc_refuses_tls_below_1_2(pki):
    with Server(tls.server_credentials(pki / "server")) as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock, \
                _ssl_client(pki, ssl.TLSVersion.TLSv1_2).wrap_socket(sock, server_hostname="localhost") as conn:
            assert conn.version() == "TLSv1.2"
        try:
            ctx = _ssl_client(pki, ssl.TLSVersion.TLSv1_1)
        except (ssl.SSLError, ValueError) as exc:
            pytest.skip(f"this OpenSSL cannot offer TLS 1.1: {exc}")
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
            with pytest.raises(ssl.SSLError) as info:
                ctx.wrap_socket(sock, server_hostname="localhost")
        if "NO_PROTOCOLS_AVAILABLE" in str(info.value).upper():
            pytest.skip("this OpenSSL build cannot offer TLS 1.1 at all")
        # BoringSSL answers UNSUPPORTED_PROTOCOL and gRPC closes the socket: a protocol-version alert or an EOF
        assert "VERSION" in str(info.value).upper() or isinstance(info.value, ssl.SSLEOFError)


# ----------------------------------------------------------------------------------------------- revocation


def test_peer_certificate_revoked_in_a_handler(pki):
    rank1 = cert(pki / "clients/rank1/client.crt")
    revoked = frozenset({rank1.serial_number})
    with Server(tls.server_credentials(pki / "server"), ping=_revocation_checking_ping(revoked)) as srv:
        assert call(srv.port, tls.client_credentials(pki / "clients/rank0")) == b"hi|rank0"
        err = call_fails(srv.port, tls.client_credentials(pki / "clients/rank1"))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "revoked" in err.details() and f"{rank1.serial_number:x}" in err.details()
    assert tls.peer_certificate_revoked({}, None) is None
    assert tls.peer_certificate_revoked({}, frozenset()) is None
    assert "no client certificate" in tls.peer_certificate_revoked({}, revoked)
    pem = (pki / "clients/rank1/client.crt").read_bytes()
    assert tls.peer_certificate_revoked({"x509_pem_cert": [pem]}, revoked)
    assert tls.peer_certificate_revoked({"x509_pem_cert": [pem.decode()]}, {1}) is None


def test_revocation_interceptor_picks_up_a_new_crl(pki_copy):
    server_dir = pki_copy / "server"
    reloader = tls.CrlReloader(server_dir, interval=0)
    assert reloader() is None
    interceptor = tls.RevocationInterceptor(reloader)
    with Server(tls.server_credentials(server_dir), interceptors=[interceptor]) as srv:
        rank1 = tls.client_credentials(pki_copy / "clients/rank1")
        assert call(srv.port, rank1) == b"hi|rank1"
        revoke(pki_copy, "--cert", str(pki_copy / "clients/rank1/client.crt"))  # copies crl.pem into server/
        for method in (METHOD, STREAM_METHOD):
            err = call_fails(srv.port, rank1, method=method)
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "revoked" in err.details()
        assert call(srv.port, tls.client_credentials(pki_copy / "clients/rank0"), method=STREAM_METHOD) == [
            b"HI", b"HI"]
        # a broken CRL update does not reopen the door
        (server_dir / "crl.pem").write_text("half-copied")
        assert call_fails(srv.port, rank1).code() == grpc.StatusCode.UNAUTHENTICATED


def test_client_refuses_a_revoked_server(pki_copy):
    client_dir = pki_copy / "clients/rank0"
    with Server(tls.server_credentials(pki_copy / "server")) as srv:
        # no crl.pem: nothing to check, no connection made
        tls.check_server_not_revoked("127.0.0.1", 1, client_dir)
        revoke(pki_copy, "--cert", str(pki_copy / "clients/rank1/client.crt"))
        tls.check_server_not_revoked("127.0.0.1", srv.port, client_dir)
        tls.check_server_not_revoked("localhost", srv.port, client_dir)
        with pytest.raises(tls.TlsConfigError, match="wrong.example"):
            tls.check_server_not_revoked("127.0.0.1", srv.port, client_dir, server_name="wrong.example")
        revoke(pki_copy, "--cert", str(pki_copy / "server.crt"))
        with pytest.raises(tls.TlsConfigError, match=r"revoked by .*crl\.pem"):
            tls.check_server_not_revoked("127.0.0.1", srv.port, client_dir, timeout=5)
    with pytest.raises(OSError):
        tls.check_server_not_revoked("127.0.0.1", srv.port, pki_copy / "clients/rank1", timeout=2)


def test_is_loopback():
    assert tls.is_loopback("127.0.0.1") and tls.is_loopback("[::1]") and tls.is_loopback("localhost")
    assert not tls.is_loopback("10.0.0.1") and not tls.is_loopback("example.com")
