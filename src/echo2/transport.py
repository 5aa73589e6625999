"""Transport security: the run's certificate, its fingerprint, and TLS that trusts only a pinned peer.

The learner makes a self-signed certificate for the run (EC P-256, SAN = the advertised host, valid
:data:`CERT_DAYS` days) and keeps it in the run directory (:data:`CERT_FILE`, and :data:`KEY_FILE` owner-
only), so a learner restarted on the same run directory presents the certificate its workers pinned.
No certificate authority is involved: a worker gets the certificate's SHA-256 fingerprint out of band,
in the **join string** ``https://host:port#sha256=<hex>`` (a URL fragment never goes on the wire), and
accepts a TLS peer only if the certificate it presents has that fingerprint. The check runs right
after the handshake, before the first byte of the application is sent (:func:`open_pinned` for
asyncio streams; the HTTP client hands the same pin to ``aiohttp.Fingerprint``). Host names and dates
are not checked: the pin is the whole of the trust, so an expired run certificate keeps working and a
restarted learner never renews it (that would break every worker's pin).

Each worker makes an ephemeral certificate of its own (:func:`make_identity`) for its chunk relay and
tells the learner its fingerprint when it joins the broadcast; the learner tells every member the
fingerprints of the peers it pulls from. The identity's key also signs the proofs of possession a
worker attaches to its pull requests (:meth:`TlsIdentity.sign`, :func:`signed_by`), which bind a
learner-issued credential to the certificate it names (``broadcast/access.py``).

Everything here is the standard library's ``ssl`` (TLS 1.2 or newer; 1.3 when both ends have it) and
``cryptography``; no cryptography of our own.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import ipaddress
import logging
import os
import ssl
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from echo2.errors import ConfigError, Echo2Error

log = logging.getLogger(__name__)

CERT_FILE = "tls_cert.pem"  # the run certificate, in the run directory
KEY_FILE = "tls_key.pem"  # its private key (mode 0600)
CERT_DAYS = 30  # validity written into a new certificate (informational: peers pin, they do not check dates)
JOIN_TOKEN_ENV = "ECHO2_JOIN_TOKEN"  # the environment variable a worker reads its join token from
PIN_PREFIX = "sha256="  # the join string's fragment: ``#sha256=<64 hex digits>``
HANDSHAKE_TIMEOUT_S = 15.0  # a TLS handshake that takes longer than this is abandoned


class PinError(Echo2Error):
    """A TLS peer presented a certificate other than the pinned one (or none): nothing was sent to it."""


@dataclass(frozen=True)
class TlsIdentity:
    """A certificate and its private key (PEM), and the certificate's SHA-256 fingerprint."""

    cert_pem: bytes  # the self-signed certificate
    key_pem: bytes  # its private key (PKCS#8, unencrypted: the run directory is the owner's)
    fingerprint: str  # lowercase hex SHA-256 of the certificate's DER encoding: what peers pin

    @cached_property
    def cert_der(self) -> bytes:
        return ssl.PEM_cert_to_DER_cert(self.cert_pem.decode())

    @cached_property
    def _private(self) -> Any:
        from cryptography.hazmat.primitives.serialization import load_pem_private_key

        return load_pem_private_key(self.key_pem, password=None)

    def sign(self, data: bytes) -> bytes:
        """ECDSA-SHA256 signature of ``data`` by this identity's key (checked with :func:`signed_by`)."""
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec

        return bytes(self._private.sign(data, ec.ECDSA(hashes.SHA256())))

    def server_context(self) -> ssl.SSLContext:
        """A TLS server context presenting this certificate (clients are not asked for one)."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        # the standard library loads a key pair only from files: a private directory, gone at once
        with tempfile.TemporaryDirectory(prefix="echo2-tls-") as tmp:
            cert, key = Path(tmp) / "cert.pem", Path(tmp) / "key.pem"
            cert.write_bytes(self.cert_pem)
            key.touch(mode=0o600)
            key.write_bytes(self.key_pem)
            ctx.load_cert_chain(cert, key)
        return ctx


def fingerprint(der: bytes) -> str:
    """Lowercase hex SHA-256 of a certificate's DER encoding."""
    return hashlib.sha256(der).hexdigest()


def make_identity(hosts: Sequence[str], days: int = CERT_DAYS) -> TlsIdentity:
    """A fresh self-signed EC P-256 certificate naming ``hosts`` (IP addresses or DNS names) in its
    subjectAltName, valid from now for ``days`` days."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    names = [h for h in dict.fromkeys(hosts) if h] or ["localhost"]
    alt: list[x509.GeneralName] = []
    for h in names:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            alt.append(x509.DNSName(h))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"echo2 {names[0]}"[:64])])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    der = cert.public_bytes(serialization.Encoding.DER)
    return TlsIdentity(cert.public_bytes(serialization.Encoding.PEM), key_pem, fingerprint(der))


def run_identity(run_dir: Path, hosts: Sequence[str], days: int = CERT_DAYS) -> TlsIdentity:
    """The run's certificate: the one in ``run_dir`` if there is one (a restarted learner keeps the
    fingerprint its workers pinned, whatever its dates or names), else a new one written there (the
    key owner-only)."""
    cert_path, key_path = run_dir / CERT_FILE, run_dir / KEY_FILE
    if cert_path.is_file() and key_path.is_file():
        cert_pem, key_pem = cert_path.read_bytes(), key_path.read_bytes()
        try:
            der = ssl.PEM_cert_to_DER_cert(cert_pem.decode())
        except ValueError as exc:
            why = f"{cert_path} is not a PEM certificate ({exc}); remove it to make a new one"
            raise ConfigError(why) from None
        return TlsIdentity(cert_pem, key_pem, fingerprint(der))
    ident = make_identity(hosts, days)
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(ident.key_pem)
    os.chmod(key_path, 0o600)  # also when the file existed alone, with looser bits
    cert_path.write_bytes(ident.cert_pem)
    log.info("made the run's TLS certificate %s (sha256 %s)", cert_path, ident.fingerprint)
    return ident


def client_context() -> ssl.SSLContext:
    """A TLS client context that trusts no authority: the caller checks the peer's certificate against
    a pin (:func:`check_pin`) before it sends anything."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def normalize_pin(text: str) -> str:
    """A SHA-256 fingerprint as 64 lowercase hex digits (``AB:CD:...`` as OpenSSL prints it is accepted);
    ConfigError naming the value otherwise."""
    pin = text.strip().lower().replace(":", "")
    if len(pin) != 64 or any(c not in "0123456789abcdef" for c in pin):
        raise ConfigError(f"a certificate fingerprint is 64 hex digits of SHA-256, got {text!r}")
    return pin


def check_pin(ssl_object: Any, pin: str, where: str) -> None:
    """Raise PinError unless the TLS peer's certificate (``ssl_object.getpeercert(binary_form=True)``)
    has SHA-256 fingerprint ``pin``."""
    der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    if not der:
        raise PinError(f"{where} presented no TLS certificate; expected sha256 {pin}")
    got = fingerprint(der)
    if got != pin:
        raise PinError(
            f"{where} presented a TLS certificate with sha256 {got}, not the pinned {pin}: "
            "refusing to talk to it (an impostor on the path, or a different learner/run)"
        )


async def open_pinned(
    host: str, port: int, pin: str | None, ctx: ssl.SSLContext | None = None, limit: int = 1 << 16
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """``asyncio.open_connection`` over TLS, closed again with PinError unless the peer's certificate
    has fingerprint ``pin``; ``pin`` None means plain TCP (``security.tls = false``)."""
    if pin is None:
        return await asyncio.open_connection(host, port, limit=limit)
    reader, writer = await asyncio.open_connection(
        host,
        port,
        limit=limit,
        ssl=ctx or client_context(),
        server_hostname="",  # no SNI, no name check: the pin is the check
        ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S,
    )
    try:
        check_pin(writer.get_extra_info("ssl_object"), pin, f"{host}:{port}")
    except PinError:
        writer.close()
        raise
    return reader, writer


def signed_by(cert_der: bytes, data: bytes, signature: bytes) -> bool:
    """True iff ``signature`` is an ECDSA-SHA256 signature of ``data`` by the key of the certificate
    ``cert_der`` (False for anything malformed)."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    try:
        public = x509.load_der_x509_certificate(cert_der).public_key()
        if not isinstance(public, ec.EllipticCurvePublicKey):
            return False
        public.verify(signature, data, ec.ECDSA(hashes.SHA256()))
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


@dataclass(frozen=True)
class JoinString:
    """What a worker is given to join a run: the API base URL and the pinned certificate fingerprint."""

    url: str  # the learner's API base, e.g. https://203.0.113.7:8765 (no fragment)
    pin: str | None  # SHA-256 fingerprint of the learner's certificate; None for a plain http URL

    def __str__(self) -> str:
        return f"{self.url}#{PIN_PREFIX}{self.pin}" if self.pin else self.url


def join_string(url: str, pin: str | None) -> str:
    """``url`` with the pin in its fragment (``https://host:port#sha256=<hex>``); ``url`` when None."""
    return str(JoinString(url.rstrip("/"), normalize_pin(pin) if pin else None))


def parse_join(text: str) -> JoinString:
    """Parse a join string. An ``https`` URL must carry ``#sha256=<fingerprint>`` (a worker never
    trusts a certificate the network hands it); ``http`` is plain text, for trusted networks."""
    parts = urlsplit(text.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"--join {text!r}: expected https://host:port#sha256=<fingerprint> (or http://...)")
    url = f"{parts.scheme}://{parts.netloc}{parts.path}".rstrip("/")
    if parts.scheme == "http":
        if parts.fragment:
            raise ConfigError(f"--join {text!r}: a fingerprint pins TLS; use https:// with it")
        return JoinString(url, None)
    if not parts.fragment.startswith(PIN_PREFIX):
        raise ConfigError(
            f"--join {text!r}: an https join string must end in #sha256=<fingerprint of the learner's "
            "certificate>, exactly as `echo2 learner` printed it; without it the worker cannot tell the "
            "learner from an impostor, so it refuses to connect"
        )
    return JoinString(url, normalize_pin(parts.fragment[len(PIN_PREFIX) :]))
