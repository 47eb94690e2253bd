"""S3Store over https:// (a TLS relay in front of the session's moto server, with a CA made
here): the CA given as ``S3Config.ca_bundle`` works; a certificate the client cannot verify
(no CA given, another CA, another host name), a plain-HTTP server behind an https:// URL and
a CA bundle that cannot be read are a StoreError at once, naming the endpoint and what to
do, never retried for the whole retry budget (no retry changes a certificate), and nothing is
written."""

from __future__ import annotations

import datetime
import ipaddress
import re
import socket
import ssl
import threading
import time

import pytest

from deltasync.errors import StoreError
from deltasync.store import RetryPolicy, S3Store

# Long enough that a retried certificate error shows: 8 attempts back off for seconds.
PATIENT = RetryPolicy(max_attempts=8, base_delay_s=0.2, max_delay_s=2.0, deadline_s=30.0)


def _issue(common_name, *, issuer=None, san=None):
    """(PEM certificate, PEM key): a CA when ``issuer`` is None, else a leaf it signs."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer[0].subject if issuer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), True)
    )
    if san is not None:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), False)
    cert = builder.sign(issuer[1] if issuer else key, hashes.SHA256())
    pem = serialization.Encoding.PEM
    key_pem = key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return (cert, key), cert.public_bytes(pem), key_pem


class _TLSRelay:
    """Accepts TLS with ``cert``/``key`` and relays the plain bytes to 127.0.0.1:``upstream``."""

    def __init__(self, upstream: int, cert_path, key_path) -> None:
        self._ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._ctx.load_cert_chain(cert_path, key_path)
        self._upstream = upstream
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                raw, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(raw,), daemon=True).start()

    def _handle(self, raw) -> None:
        try:
            raw.settimeout(10)
            tls = self._ctx.wrap_socket(raw, server_side=True)
            tls.settimeout(None)
        except OSError:
            raw.close()
            return
        up = socket.create_connection(("127.0.0.1", self._upstream))
        threading.Thread(target=_pipe, args=(tls, up), daemon=True).start()
        _pipe(up, tls)

    def close(self) -> None:
        self._sock.close()


def _pipe(src, dst) -> None:
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@pytest.fixture(scope="module")
def tls(s3_server, tmp_path_factory):
    from cryptography import x509

    d = tmp_path_factory.mktemp("tls")
    ca, ca_pem, _ = _issue("deltasync test CA")
    _, other_pem, _ = _issue("another CA")
    right = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    _, leaf_pem, leaf_key = _issue("127.0.0.1", issuer=ca, san=right)
    _, wrong_pem, wrong_key = _issue("s3.other", issuer=ca, san=[x509.DNSName("s3.other")])
    for name, data in [
        ("ca.pem", ca_pem),
        ("other.pem", other_pem),
        ("leaf.pem", leaf_pem),
        ("leaf.key", leaf_key),
        ("wrong.pem", wrong_pem),
        ("wrong.key", wrong_key),
    ]:
        (d / name).write_bytes(data)
    relays = {
        "right": _TLSRelay(s3_server.port, d / "leaf.pem", d / "leaf.key"),
        "wrong-host": _TLSRelay(s3_server.port, d / "wrong.pem", d / "wrong.key"),
    }
    yield d, relays
    for relay in relays.values():
        relay.close()


def test_an_https_endpoint_works_with_its_ca_given_as_ca_bundle(s3_server, tls):
    d, relays = tls
    bucket = s3_server.new_bucket()
    for host in ("127.0.0.1", "localhost"):
        config = s3_server.config(
            endpoint_url=f"https://{host}:{relays['right'].port}", ca_bundle=str(d / "ca.pem")
        )
        store = S3Store(bucket, "run", config=config)
        store.put_stream("v00000001/tp0/w00000.blob", [b"a" * 10, b"b" * 5])
        assert store.get("v00000001/tp0/w00000.blob") == b"a" * 10 + b"b" * 5
        store.close()


@pytest.mark.parametrize(
    "case",
    ["no CA given", "another CA", "another host name", "plain HTTP", "unreadable CA bundle"],
)
def test_a_tls_connection_no_retry_can_make_is_a_store_error_at_once_naming_the_remedy(
    s3_server, tls, case
):
    # these were retried as transient for the whole retry budget (8 attempts, seconds to the
    # deadline), then reported as "Is the server reachable? Raise ... deadline_s"
    d, relays = tls
    port, ca, remedy = {
        "no CA given": (relays["right"].port, None, r"S3Config\.ca_bundle"),
        "another CA": (relays["right"].port, d / "other.pem", r"S3Config\.ca_bundle"),
        "another host name": (relays["wrong-host"].port, d / "ca.pem", "certificate names"),
        "plain HTTP": (s3_server.port, None, r"Use http:// for a plain-HTTP server"),
        "unreadable CA bundle": (relays["right"].port, d / "missing.pem", "readable PEM file"),
    }[case]
    bucket = s3_server.new_bucket()
    endpoint = f"https://127.0.0.1:{port}"
    given = {} if ca is None else {"ca_bundle": str(ca)}
    config = s3_server.config(endpoint_url=endpoint, retry=PATIENT, **given)
    store = S3Store(bucket, "run", config=config)
    began = time.monotonic()
    with pytest.raises(StoreError) as info:
        store.put("v00000001/MANIFEST.json", b"m")
    assert time.monotonic() - began < 1.5
    message = str(info.value)
    assert f"no TLS connection to {endpoint}" in message
    assert "s3://" in message and "v00000001/MANIFEST.json" in message
    assert "not retried" in message and "Is the server reachable" not in message
    assert re.search(remedy, message), message
    plain = S3Store(bucket, "run", config=s3_server.config())
    assert not plain.exists("v00000001/MANIFEST.json")
    store.close()
    plain.close()


def test_ca_bundle_must_be_a_path(s3_server):
    from deltasync.errors import ConfigError

    for bad in ("", "  ", 7):
        with pytest.raises(ConfigError, match=r"S3Config\.ca_bundle must be the path"):
            s3_server.config(ca_bundle=bad)


def test_a_handshake_cut_short_is_still_retried_as_transient():
    # a server restarting resets connections mid-handshake: that is no certificate verdict
    from botocore.exceptions import SSLError
    from urllib3.exceptions import SSLError as URLLib3SSLError

    from deltasync.store.s3 import is_transient, tls_refusal

    cut = SSLError(
        endpoint_url="https://127.0.0.1:1/b",
        error=URLLib3SSLError(ssl.SSLEOFError(8, "EOF occurred in violation of protocol")),
    )
    assert tls_refusal(cut) is None and is_transient(cut)
    verdict = SSLError(
        endpoint_url="https://127.0.0.1:1/b",
        error=URLLib3SSLError(ssl.SSLCertVerificationError(1, "certificate verify failed")),
    )
    assert tls_refusal(verdict) is not None and not is_transient(verdict)


def test_the_cli_passes_s3_ca_bundle_and_refuses_it_for_a_local_store(tmp_path):
    import argparse

    from deltasync.commands.inspect_store import add_store_arguments, open_store_from_args
    from deltasync.errors import ConfigError

    parser = argparse.ArgumentParser()
    add_store_arguments(parser)
    args = parser.parse_args(
        ["s3://bkt/run", "--s3-endpoint", "https://127.0.0.1:9", "--s3-ca-bundle", "/ca.pem"]
    )
    store = open_store_from_args(args)
    assert store.config.ca_bundle == "/ca.pem"
    store.close()
    local = parser.parse_args([str(tmp_path), "--s3-ca-bundle", "/ca.pem"])
    with pytest.raises(ConfigError, match="--s3-ca-bundle only appl"):
        open_store_from_args(local)
