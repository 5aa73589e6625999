"""echo2.transport: the run certificate (made once, reused), fingerprints, pinning, join strings, proofs."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import ipaddress
import ssl
import stat

import pytest
from cryptography import x509

from echo2.errors import ConfigError
from echo2.transport import (
    CERT_FILE,
    KEY_FILE,
    PinError,
    client_context,
    fingerprint,
    join_string,
    make_identity,
    open_pinned,
    parse_join,
    run_identity,
    signed_by,
)


def test_the_run_certificate_is_made_once_and_reused(tmp_path):
    first = run_identity(tmp_path, ["203.0.113.7"])
    key_file = tmp_path / KEY_FILE
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600  # the key is the owner's alone
    cert = x509.load_pem_x509_certificate((tmp_path / CERT_FILE).read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("203.0.113.7")]
    days = (cert.not_valid_after_utc - datetime.datetime.now(datetime.UTC)).days
    assert 28 <= days <= 30  # the run's validity
    assert first.fingerprint == hashlib.sha256(first.cert_der).hexdigest() == fingerprint(first.cert_der)
    # a restarted learner on the same run directory presents the same certificate, whatever its host
    again = run_identity(tmp_path, ["198.51.100.1"])
    assert again == first
    # another run directory is another certificate
    assert run_identity(tmp_path / "other", ["203.0.113.7"]).fingerprint != first.fingerprint


def test_a_dns_name_goes_into_the_san():
    ident = make_identity(["learner.example.org"])
    cert = x509.load_der_x509_certificate(ident.cert_der)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["learner.example.org"]


async def _serve_once(ident, payload: bytes) -> tuple[asyncio.Server, int, list[bytes]]:
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            seen.append(await reader.read(100))
            writer.write(payload)
            await writer.drain()
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=ident.server_context())
    return server, server.sockets[0].getsockname()[1], seen


def test_the_pin_accepts_the_right_certificate_and_refuses_another():
    learner, impostor = make_identity(["127.0.0.1"]), make_identity(["127.0.0.1"])

    async def go() -> None:
        server, port, _ = await _serve_once(learner, b"hello")
        reader, writer = await open_pinned("127.0.0.1", port, learner.fingerprint)
        assert writer.get_extra_info("ssl_object").version() in ("TLSv1.2", "TLSv1.3")
        writer.write(b"hi")
        assert await reader.read() == b"hello"
        writer.close()
        server.close()

        # an impostor on the path with a certificate of its own: refused before a byte is sent
        server, port, seen = await _serve_once(impostor, b"evil")
        with pytest.raises(
            PinError, match=rf"sha256 {impostor.fingerprint}, not the pinned {learner.fingerprint}"
        ):
            await open_pinned("127.0.0.1", port, learner.fingerprint)
        await asyncio.sleep(0.1)
        assert seen in ([], [b""])  # the impostor read nothing from us
        server.close()

    asyncio.run(go())


def test_a_pinned_client_does_not_speak_plain_text_to_a_plain_server():
    async def go() -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"HTTP/1.0 200 OK\r\n\r\n")
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        with pytest.raises((ssl.SSLError, ConnectionError)):
            await open_pinned("127.0.0.1", port, "ab" * 32)
        server.close()

    asyncio.run(go())


def test_the_run_certificate_is_also_a_trust_anchor_by_itself():
    """Who has the certificate file (tests, a curl of the API) can trust exactly it as the only CA."""
    learner = make_identity(["127.0.0.1"])

    async def go() -> None:
        server, port, _ = await _serve_once(learner, b"ok")
        ctx = ssl.create_default_context(cadata=learner.cert_pem.decode())
        ctx.check_hostname = False
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname="")
        writer.write(b"x")
        assert await reader.read() == b"ok"
        writer.close()
        server.close()

    asyncio.run(go())


def test_client_context_needs_a_pin_because_it_trusts_nobody():
    ctx = client_context()
    assert ctx.verify_mode == ssl.CERT_NONE and not ctx.check_hostname
    assert ctx.minimum_version >= ssl.TLSVersion.TLSv1_2


def test_join_strings():
    pin = "ab" * 32
    text = join_string("https://203.0.113.7:8765/", pin)
    assert text == f"https://203.0.113.7:8765#sha256={pin}"
    join = parse_join(text)
    assert (join.url, join.pin) == ("https://203.0.113.7:8765", pin)
    assert str(join) == text
    # OpenSSL's AB:CD:... form is accepted
    assert parse_join("https://h:1#sha256=" + ":".join(["AB"] * 32)).pin == pin
    assert parse_join("http://127.0.0.1:8765") == parse_join("http://127.0.0.1:8765/")
    assert parse_join("http://127.0.0.1:8765").pin is None
    assert join_string("http://h:1", None) == "http://h:1"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("https://203.0.113.7:8765", "must end in #sha256="),  # https without a pin: refused
        ("https://203.0.113.7:8765#", "must end in #sha256="),
        ("https://203.0.113.7:8765#sha256=abc", "64 hex digits"),
        ("https://h:1#sha256=" + "zz" * 32, "64 hex digits"),
        ("http://h:1#sha256=" + "ab" * 32, "use https://"),
        ("ftp://h:1", "expected https://"),
        ("203.0.113.7:8765", "expected https://"),
    ],
)
def test_bad_join_strings_are_refused_with_a_clear_message(text, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_join(text)


def test_proofs_of_possession():
    me, other = make_identity(["127.0.0.1"]), make_identity(["127.0.0.1"])
    sig = me.sign(b"echo2-get\0server\0w1\0" + b"3")
    assert signed_by(me.cert_der, b"echo2-get\0server\0w1\0" + b"3", sig)
    assert not signed_by(me.cert_der, b"echo2-get\0server\0w1\0" + b"4", sig)  # other data
    assert not signed_by(other.cert_der, b"echo2-get\0server\0w1\0" + b"3", sig)  # other key
    assert not signed_by(b"not a certificate", b"x", sig)
    assert not signed_by(me.cert_der, b"x", b"not a signature")


def test_the_relay_binds_one_interface_never_every_one():
    from echo2.rollout.worker import _local_address

    assert _local_address("127.0.0.1", None) == ("127.0.0.1", "127.0.0.1")
    assert _local_address("localhost", "127.0.0.1") == ("127.0.0.1", "127.0.0.1")  # a local address: bound
    # behind NAT the advertised address is the router's: bind the interface that routes to the learner
    assert _local_address("127.0.0.1", "203.0.113.7") == ("127.0.0.1", "203.0.113.7")
