#!/usr/bin/env python3
"""Revoke certificates issued by the CA made with make_certs.py, by writing a CRL signed by that CA.

Usage::

    python certs/revoke_cert.py --ca-dir DIR --cert DIR/clients/NAME/client.crt [--cert ...] \\
        [--serial HEX ...] [--reason key_compromise] [--next-update-days N] [--key-passphrase-env VAR]

It creates ``DIR/crl.pem`` or extends the one there (entries already revoked are kept), and copies it to
``DIR/server/crl.pem`` (the server's tls_path) and to every ``DIR/clients/*/crl.pem`` (a client uses it to refuse
a revoked *server* certificate). Run it with no --cert/--serial to re-sign the CRL with a new next_update before the
old one runs out: a CRL past its next_update is refused by the agent and the server. Then copy the new crl.pem to
the hosts (``run_ut.tls_path`` on the benchmark host, ``tensor.tls_path`` on training hosts).

The CA key is decrypted with the passphrase from --key-passphrase-env VAR, else from $ONLINE_CHECK_KEY_PASSPHRASE.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_certs import (  # noqa: E402
    CLOCK_SKEW,
    DEFAULT_PASSPHRASE_ENV,
    CertToolError,
    load_ca,
    now_utc,
    passphrase_from_env,
    write_public,
)

REASONS = {flag.name: flag for flag in x509.ReasonFlags if flag.name not in ("unspecified", "remove_from_crl")}


def parse_serial(text: str) -> int:
    """A serial number in hex as openssl and make_certs.py print it: '3f1a...', '0x3F1A...' or '3F:1A:...'."""
    s = text.strip().lower().replace(":", "")
    if s.startswith("0x"):
        s = s[2:]
    try:
        value = int(s, 16)
    except ValueError:
        raise CertToolError(f"--serial {text!r}: not a hexadecimal serial number") from None
    if value <= 0:
        raise CertToolError(f"--serial {text!r}: serial numbers are positive")
    return value


def load_existing_crl(path: Path, ca_cert: x509.Certificate) -> x509.CertificateRevocationList | None:
    if not path.exists():
        return None
    data = path.read_bytes()
    try:
        crl = x509.load_pem_x509_crl(data)
    except ValueError:
        try:
            crl = x509.load_der_x509_crl(data)
        except ValueError:
            raise CertToolError(f"{path}: not a CRL; move it away to start a new one") from None
    if crl.issuer != ca_cert.subject or not crl.is_signature_valid(ca_cert.public_key()):
        raise CertToolError(f"{path} was not signed by {path.parent / 'ca.crt'}; move it away to start a new one")
    return crl


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="revoke_cert.py",
                                description="Revoke certificates into DIR/crl.pem (signed by DIR/ca.key) and copy "
                                            "it to DIR/server/ and DIR/clients/*/.")
    p.add_argument("--ca-dir", required=True, type=Path, help="the folder made by make_certs.py --out")
    p.add_argument("--cert", action="append", default=[], type=Path, help="certificate file to revoke (repeatable)")
    p.add_argument("--serial", action="append", default=[], help="serial number (hex) to revoke (repeatable)")
    p.add_argument("--reason", choices=sorted(REASONS), help="revocation reason recorded in the CRL entries")
    p.add_argument("--next-update-days", type=int, default=30,
                   help="days until the CRL must be re-signed (default 30; after that it is refused)")
    p.add_argument("--key-passphrase-env", metavar="VAR",
                   help=f"environment variable holding the CA key passphrase (default {DEFAULT_PASSPHRASE_ENV})")
    args = p.parse_args(argv)
    if not 1 <= args.next_update_days <= 3650:
        p.error(f"--next-update-days {args.next_update_days}: must be between 1 and 3650")
    return args


def run(args: argparse.Namespace) -> None:
    ca_dir: Path = args.ca_dir
    if not (ca_dir / "ca.crt").is_file() or not (ca_dir / "ca.key").is_file():
        raise CertToolError(f"{ca_dir} has no ca.crt and ca.key (the folder given to make_certs.py --out)")
    env_name = args.key_passphrase_env or DEFAULT_PASSPHRASE_ENV
    passphrase = passphrase_from_env(env_name, required=bool(args.key_passphrase_env))
    ca_cert, ca_key = load_ca(ca_dir, passphrase, env_name)

    to_revoke: list[tuple[int, str]] = []
    for path in args.cert:
        try:
            cert = x509.load_pem_x509_certificate(path.read_bytes())
        except FileNotFoundError:
            raise CertToolError(f"--cert {path}: no such file") from None
        except ValueError:
            raise CertToolError(f"--cert {path}: not a PEM certificate") from None
        try:
            cert.verify_directly_issued_by(ca_cert)
        except (ValueError, TypeError, InvalidSignature):
            raise CertToolError(f"--cert {path} was not issued by {ca_dir / 'ca.crt'}; a CRL of this CA cannot "
                                f"revoke it") from None
        to_revoke.append((cert.serial_number, f"{path} ({cert.subject.rfc4514_string()})"))
    to_revoke += [(parse_serial(s), f"serial {s}") for s in args.serial]

    crl_path = ca_dir / "crl.pem"
    old = load_existing_crl(crl_path, ca_cert)
    now = now_utc()
    builder = (x509.CertificateRevocationListBuilder()
               .issuer_name(ca_cert.subject)
               .last_update(now - CLOCK_SKEW)
               .next_update(now + _dt.timedelta(days=args.next_update_days)))
    number = 1
    known: set[int] = set()
    if old is not None:
        try:
            number = old.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number + 1
        except x509.ExtensionNotFound:
            number = 1
        for entry in old:
            known.add(entry.serial_number)
            builder = builder.add_revoked_certificate(entry)
    added = 0
    for serial, what in to_revoke:
        if serial in known:
            print(f"already revoked     {serial:x}  {what}")
            continue
        known.add(serial)
        entry = x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now)
        if args.reason:
            entry = entry.add_extension(x509.CRLReason(REASONS[args.reason]), critical=False)
        builder = builder.add_revoked_certificate(entry.build())
        added += 1
        print(f"revoked             {serial:x}  {what}")
    builder = builder.add_extension(x509.CRLNumber(number), critical=False)
    try:
        ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        builder = builder.add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski),
                                        critical=False)
    except x509.ExtensionNotFound:
        pass
    crl = builder.sign(ca_key, hashes.SHA256())
    pem = crl.public_bytes(serialization.Encoding.PEM)

    write_public(crl_path, pem)
    targets = [ca_dir / "server"] + sorted(p for p in (ca_dir / "clients").glob("*") if p.is_dir())
    copies = []
    for folder in targets:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_public(folder / "crl.pem", pem)
        copies.append(str(folder / "crl.pem"))
    print(f"wrote CRL #{number}      {crl_path}: {len(known)} revoked ({added} new), "
          f"next update {crl.next_update_utc:%Y-%m-%d %H:%M} UTC")
    print("copied to           " + ", ".join(copies))
    print("now copy crl.pem into run_ut.tls_path on the benchmark host (and tensor.tls_path on training hosts), "
          f"and re-run this command before {crl.next_update_utc:%Y-%m-%d}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except (CertToolError, OSError) as exc:
        print(f"revoke_cert.py: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
