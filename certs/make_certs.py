#!/usr/bin/env python3
"""Create a private CA, a server certificate and client certificates for the online accuracy checker.

Usage::

    python certs/make_certs.py --out DIR --server-name HOST [--server-name IP ...] \\
        --client NAME [--client NAME ...] [--days N] [--ca-days N] [--rsa] \\
        [--key-passphrase-env VAR] [--new-ca] [--force]

Layout written under DIR::

    ca.crt  ca.key                      the CA (ca.key stays on the machine that issues certificates)
    server.crt  server.key              the server certificate (every --server-name as a SAN)
    server/{server.key,server.crt,ca.crt}          a ready run_ut.tls_path for gpu_server
    clients/NAME/{client.key,client.crt,ca.crt}     a ready tensor.tls_path for the agent

Keys are EC P-256 (``--rsa``: RSA 3072). Private keys are created with mode 0600 and never overwritten unless
``--force`` is given. With ``--key-passphrase-env VAR`` every private key written is encrypted with the passphrase
held in the environment variable VAR (never a prompt). An existing CA in DIR is reused (so adding a client later is
the same command); ``--new-ca`` makes a new one (replacing an existing ca.key also needs ``--force``).

Only the ``cryptography`` package is needed; this script does not import the rest of the project.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import ipaddress
import os
import re
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_PASSPHRASE_ENV = "ONLINE_CHECK_KEY_PASSPHRASE"
CLOCK_SKEW = _dt.timedelta(minutes=5)
#: Client certificates carry their name as a URI subjectAltName too (RFC 5280 profiles expect a SAN).
CLIENT_URI_PREFIX = "urn:online-check:client:"
MAX_DAYS = 36500
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_DNS_RE = re.compile(rf"^(?:\*\.)?{_LABEL}(?:\.{_LABEL})*\.?$")
_CLIENT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class CertToolError(Exception):
    """A user-facing error: printed without a traceback, exit status 2."""


# ----------------------------------------------------------------------------------------------- helpers


def now_utc() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def passphrase_from_env(var: str | None, required: bool) -> bytes | None:
    """Read a passphrase from the environment variable ``var`` (None: no variable named)."""
    if not var:
        return None
    value = os.environ.get(var)
    if not value:
        if required:
            raise CertToolError(f"--key-passphrase-env {var}: the environment variable {var} is not set or empty; "
                                f"export it with the passphrase first (it is never prompted for)")
        return None
    return value.encode("utf-8")


def parse_server_name(name: str) -> x509.GeneralName:
    """One --server-name: an IPv4/IPv6 address (brackets allowed) or a DNS name."""
    raw = name.strip()
    candidate = raw[1:-1] if raw.startswith("[") and raw.endswith("]") else raw
    try:
        addr = ipaddress.ip_address(candidate)
    except ValueError:
        addr = None
    if addr is not None:
        if getattr(addr, "scope_id", None):
            raise CertToolError(f"--server-name {name!r}: an IPv6 scope id (%...) cannot be put in a certificate")
        return x509.IPAddress(addr)
    if len(raw) > 253 or not _DNS_RE.match(raw):
        raise CertToolError(f"--server-name {name!r}: not an IPv4/IPv6 address nor a valid DNS host name "
                            f"(letters, digits, '-' and '.', optionally a leading '*.')")
    return x509.DNSName(raw.rstrip(".").lower())


def check_client_name(name: str) -> str:
    if not _CLIENT_RE.match(name) or name in (".", ".."):
        raise CertToolError(f"--client {name!r}: use 1-64 characters from A-Z a-z 0-9 . _ - "
                            f"(it becomes a folder name and the certificate's common name)")
    return name


def new_private_key(use_rsa: bool):
    if use_rsa:
        return rsa.generate_private_key(public_exponent=65537, key_size=3072)
    return ec.generate_private_key(ec.SECP256R1())


def private_key_pem(key, passphrase: bytes | None) -> bytes:
    enc = (serialization.BestAvailableEncryption(passphrase) if passphrase
           else serialization.NoEncryption())
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, enc)


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def make_private_dir(path: Path) -> None:
    """Create a folder (and any missing parents) with mode 0700; existing folders are left as they are."""
    if not path.is_dir():
        make_private_dir(path.parent)
        path.mkdir(mode=0o700, exist_ok=True)


def _write_new_file(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes, mode: int, replace: bool) -> None:
    """Write ``data`` to ``path``; the file is *created* with ``mode`` (never chmod-ed after the write).

    ``replace=False`` fails if ``path`` exists; ``replace=True`` writes a fresh temporary file next to it and renames
    it over ``path`` (atomic; the old file's mode is not inherited).
    """
    if not replace:
        try:
            _write_new_file(path, data, mode)
        except FileExistsError:
            raise CertToolError(f"{path} exists; refusing to overwrite it (use --force to replace it)") from None
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        _write_new_file(tmp, data, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_key(path: Path, key, passphrase: bytes | None, force: bool) -> None:
    write_file(path, private_key_pem(key, passphrase), 0o600, replace=force)


def write_public(path: Path, data: bytes) -> None:
    write_file(path, data, 0o644, replace=True)


def load_private_key_file(path: Path, passphrase: bytes | None, env_name: str | None):
    data = path.read_bytes()
    try:
        return serialization.load_pem_private_key(data, password=None)
    except TypeError:
        pass  # encrypted
    except ValueError as exc:
        raise CertToolError(f"{path}: not a PEM private key ({exc})") from None
    if not passphrase:
        raise CertToolError(f"{path} is encrypted; set the passphrase in the environment variable "
                            f"{env_name or DEFAULT_PASSPHRASE_ENV} (or name another with --key-passphrase-env)")
    try:
        return serialization.load_pem_private_key(data, password=passphrase)
    except (ValueError, TypeError):
        raise CertToolError(f"{path}: wrong passphrase (from ${env_name or DEFAULT_PASSPHRASE_ENV}) "
                            f"or damaged key") from None


def load_ca(out: Path, passphrase: bytes | None, env_name: str | None):
    """Load DIR/ca.crt and DIR/ca.key (checking that they belong together)."""
    crt_path, key_path = out / "ca.crt", out / "ca.key"
    try:
        ca_cert = x509.load_pem_x509_certificate(crt_path.read_bytes())
    except ValueError as exc:
        raise CertToolError(f"{crt_path}: not a PEM certificate ({exc})") from None
    ca_key = load_private_key_file(key_path, passphrase, env_name)
    der = serialization.Encoding.DER
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    if ca_key.public_key().public_bytes(der, spki) != ca_cert.public_key().public_bytes(der, spki):
        raise CertToolError(f"{key_path} does not belong to {crt_path}")
    return ca_cert, ca_key


def _sig_hash(key):
    return hashes.SHA256()


# ----------------------------------------------------------------------------------------------- certificates


def build_ca(key, common_name: str, days: int) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64]),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, "online accuracy checker")])
    start = now_utc() - CLOCK_SKEW
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    return (x509.CertificateBuilder()
            .subject_name(name).issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(start + _dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(ski, critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
            .sign(key, _sig_hash(key)))


def build_leaf(key, ca_cert: x509.Certificate, ca_key, common_name: str, days: int, server: bool,
               sans: list[x509.GeneralName]) -> x509.Certificate:
    start = now_utc() - CLOCK_SKEW
    end = start + _dt.timedelta(days=days)
    if end > ca_cert.not_valid_after_utc:
        print(f"note: {common_name}: validity shortened to the CA's end ({ca_cert.not_valid_after_utc:%Y-%m-%d})",
              file=sys.stderr)
        end = ca_cert.not_valid_after_utc
    is_rsa = isinstance(key, rsa.RSAPrivateKey)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64])]))
               .issuer_name(ca_cert.subject)
               .public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                            key_encipherment=is_rsa and server, data_encipherment=False,
                                            key_agreement=False, key_cert_sign=False, crl_sign=False,
                                            encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server
                                                     else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False))
    try:
        ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        aki = x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski)
    except x509.ExtensionNotFound:
        aki = x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key())
    builder = builder.add_extension(aki, critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(ca_key, _sig_hash(ca_key))


# ----------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="make_certs.py",
        description="Create a CA, a server certificate and client certificates (mutual TLS) for the online "
                    "accuracy checker. Copy DIR/server/ to the benchmark host (run_ut.tls_path) and "
                    "DIR/clients/NAME/ to the training host (tensor.tls_path). Never commit private keys.")
    p.add_argument("--out", required=True, type=Path, help="output folder (created with mode 0700)")
    p.add_argument("--server-name", action="append", default=[], metavar="HOST",
                   help="host name or IPv4/IPv6 address the agents use to reach gpu_server (repeatable; each "
                        "becomes a subjectAltName; the first is also the common name)")
    p.add_argument("--client", action="append", default=[], metavar="NAME",
                   help="client certificate to issue into DIR/clients/NAME/ (repeatable)")
    p.add_argument("--days", type=int, default=365, help="validity of server and client certificates (365)")
    p.add_argument("--ca-days", type=int, default=3650, help="validity of a new CA (3650)")
    p.add_argument("--ca-name", default="online-check CA", help="common name of a new CA")
    p.add_argument("--rsa", action="store_true", help="RSA 3072 keys instead of EC P-256")
    p.add_argument("--key-passphrase-env", metavar="VAR",
                   help="encrypt the private keys written with the passphrase in environment variable VAR "
                        f"(the agent and server read it from ${DEFAULT_PASSPHRASE_ENV})")
    p.add_argument("--new-ca", action="store_true", help="create a new CA even if DIR/ca.key exists (with --force)")
    p.add_argument("--force", action="store_true", help="replace existing private keys and certificates")
    args = p.parse_args(argv)
    for opt in ("days", "ca_days"):
        value = getattr(args, opt)
        if not 1 <= value <= MAX_DAYS:
            p.error(f"--{opt.replace('_', '-')} {value}: must be between 1 and {MAX_DAYS}")
    return args


def run(args: argparse.Namespace) -> None:
    out: Path = args.out
    sans: list[x509.GeneralName] = []
    for name in args.server_name:
        san = parse_server_name(name)
        if san not in sans:
            sans.append(san)
    clients: list[str] = []
    for name in args.client:
        if check_client_name(name) not in clients:
            clients.append(name)
    passphrase = passphrase_from_env(args.key_passphrase_env, required=True)

    ca_crt, ca_key_path = out / "ca.crt", out / "ca.key"
    have_ca = ca_key_path.exists() or ca_crt.exists()
    if have_ca and not (ca_key_path.exists() and ca_crt.exists()):
        raise CertToolError(f"{out} has only one of ca.crt / ca.key; restore the other or start again with "
                            f"--new-ca --force")
    new_ca = args.new_ca or not have_ca

    # Pre-flight: refuse before writing anything if a key would be overwritten.
    key_paths: list[Path] = []
    if new_ca:
        key_paths.append(ca_key_path)
    if sans:
        key_paths += [out / "server.key", out / "server" / "server.key"]
    key_paths += [out / "clients" / c / "client.key" for c in clients]
    existing = [str(k) for k in key_paths if k.exists() or k.is_symlink()]
    if existing and not args.force:
        raise CertToolError("refusing to overwrite existing private key(s): " + ", ".join(existing)
                            + " (use --force to replace them)")

    make_private_dir(out)
    if new_ca:
        ca_key = new_private_key(args.rsa)
        ca_cert = build_ca(ca_key, args.ca_name, args.ca_days)
        write_key(ca_key_path, ca_key, passphrase, args.force)
        write_public(ca_crt, cert_pem(ca_cert))
        print(f"created CA          {ca_crt} (key {ca_key_path})")
        if have_ca:
            stale = sorted(p.name for p in (out / "clients").glob("*") if p.is_dir() and p.name not in clients)
            if stale:
                print(f"warning: client folders {', '.join(stale)} were issued by the old CA; reissue them",
                      file=sys.stderr)
    else:
        ca_pass = passphrase or passphrase_from_env(DEFAULT_PASSPHRASE_ENV, required=False)
        ca_cert, ca_key = load_ca(out, ca_pass, args.key_passphrase_env or DEFAULT_PASSPHRASE_ENV)
        if ca_cert.not_valid_after_utc <= now_utc():
            raise CertToolError(f"{ca_crt} expired on {ca_cert.not_valid_after_utc:%Y-%m-%d}; create a new CA "
                                f"with --new-ca --force and reissue every certificate")
        print(f"using existing CA   {ca_crt}")
    ca_bytes = ca_crt.read_bytes()

    if sans:
        key = new_private_key(args.rsa)
        cn = sans[0].value if isinstance(sans[0], x509.DNSName) else str(sans[0].value)
        cert = build_leaf(key, ca_cert, ca_key, cn, args.days, server=True, sans=sans)
        server_dir = out / "server"
        make_private_dir(server_dir)
        for folder in (out, server_dir):
            write_key(folder / "server.key", key, passphrase, args.force)
            write_public(folder / "server.crt", cert_pem(cert))
        write_public(server_dir / "ca.crt", ca_bytes)
        names = ", ".join(str(s.value) for s in sans)
        print(f"created server cert {out / 'server.crt'} serial {cert.serial_number:x} for {names}")
        print(f"  server tls_path   {server_dir}  (copy to the benchmark host: run_ut.tls_path)")

    for client in clients:
        key = new_private_key(args.rsa)
        cert = build_leaf(key, ca_cert, ca_key, client, args.days, server=False,
                          sans=[x509.UniformResourceIdentifier(f"{CLIENT_URI_PREFIX}{client}")])
        client_dir = out / "clients" / client
        make_private_dir(client_dir)
        write_key(client_dir / "client.key", key, passphrase, args.force)
        write_public(client_dir / "client.crt", cert_pem(cert))
        write_public(client_dir / "ca.crt", ca_bytes)
        crl = out / "crl.pem"
        if crl.exists():
            write_public(client_dir / "crl.pem", crl.read_bytes())
        print(f"created client cert {client_dir / 'client.crt'} serial {cert.serial_number:x}")
        print(f"  client tls_path   {client_dir}  (copy to the training host: tensor.tls_path)")
    if passphrase:
        print(f"private keys are encrypted; set {DEFAULT_PASSPHRASE_ENV} to the passphrase where they are used")
    print(f"keep {ca_key_path} on this machine only; never commit private keys")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except CertToolError as exc:
        print(f"make_certs.py: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"make_certs.py: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
