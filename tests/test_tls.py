"""TLS on ``serve`` (``server.ssl_certfile``/``ssl_keyfile``): https:// pages, wss:// sessions,
clear start-up errors, and TLS handshakes under the request head's limits.

The certificates are made at test time with the ``openssl`` command (skipped without it)."""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess

import numpy as np
import pytest
import trio

from attack import paced_victim
from conftest import PATIENCE
from duplexrt.config import ConfigError, load_config
from duplexrt.server import Server
from duplexrt.server.tls import server_context

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def _make_cert(directory, name: str) -> tuple[str, str]:
    cert, key = str(directory / f"{name}.pem"), str(directory / f"{name}.key")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", key, "-out", cert, "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    return cert, key


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tls")
    return _make_cert(directory, "server"), _make_cert(directory, "other")


@pytest.fixture
def client_context(certs):
    context = ssl.create_default_context(cafile=certs[0][0])
    return context


def _tls_overrides(cert: str, key: str) -> list[str]:
    return [f"server.ssl_certfile={cert!r}".replace("'", '"'), f"server.ssl_keyfile={key!r}".replace("'", '"')]


async def _https(port: int, context: ssl.SSLContext, request: bytes) -> bytes:
    stream = trio.SSLStream(await trio.open_tcp_stream("127.0.0.1", port), context, server_hostname="127.0.0.1",
                            https_compatible=True)
    answer = b""
    async with stream:
        await stream.send_all(request)
        with trio.fail_after(PATIENCE):
            while chunk := await stream.receive_some(65536):
                answer += chunk
    return answer


# -- start-up -----------------------------------------------------------------------------------


def test_a_certificate_needs_its_key_and_the_reverse():
    with pytest.raises(ConfigError, match="server.ssl_certfile is set but server.ssl_keyfile is not"):
        load_config(None, ['server.ssl_certfile="cert.pem"'])
    with pytest.raises(ConfigError, match="server.ssl_keyfile is set but server.ssl_certfile is not"):
        load_config(None, ['server.ssl_keyfile="key.pem"'])


def test_bad_files_are_named(certs, tmp_path):
    (cert, key), (_, other_key) = certs
    with pytest.raises(ConfigError, match=r"server.ssl_certfile \(--ssl-certfile\): no such file: .*nope.pem"):
        server_context(str(tmp_path / "nope.pem"), key)
    with pytest.raises(ConfigError, match=r"server.ssl_keyfile \(--ssl-keyfile\): no such file"):
        server_context(cert, str(tmp_path / "nope.key"))
    with pytest.raises(ConfigError, match="is not the key of the certificate"):
        server_context(cert, other_key)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match="cannot load the TLS certificate"):
        server_context(str(garbage), key)
    if os.geteuid() != 0:  # root reads whatever the mode says
        locked = tmp_path / "locked.key"
        shutil.copy(key, locked)
        locked.chmod(0)
        with pytest.raises(ConfigError, match="cannot read"):
            server_context(cert, str(locked))


async def test_a_bad_key_stops_the_start_before_the_model_loads(certs):
    (cert, _), (_, other_key) = certs
    server = Server(load_config(None, ["server.port=0", *_tls_overrides(cert, other_key)]))
    with pytest.raises(ConfigError, match="is not the key"):
        await server.run()
    assert server.runtime is None


# -- serving ------------------------------------------------------------------------------------


async def test_pages_and_sessions_over_tls_and_plain_http_refused(certs, client_context, start_server, monkeypatch):
    from duplexrt.client.connection import open_connection
    from duplexrt.client.protocols import client_for_url

    (cert, key), _ = certs
    served = await start_server(*_tls_overrides(cert, key))
    port = served.port
    answer = await _https(port, client_context, b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200"), answer
    page = await _https(port, client_context, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    assert page.startswith(b"HTTP/1.1 200")

    # The project's client over wss://, trusting the certificate as any OpenSSL client does.
    monkeypatch.setenv("SSL_CERT_FILE", cert)
    url = f"wss://127.0.0.1:{port}/v1/duplex"
    frame = (np.random.default_rng(3).standard_normal(1920) * 0.2).astype(np.float32).tobytes()
    with trio.fail_after(PATIENCE):
        async with open_connection(url, client_for_url(url)) as (transport, opened):
            assert opened is not None
            await transport.send(frame)
            assert await transport.receive() == frame

    # Plain HTTP to the TLS port: told so in plain HTTP.
    status, _, body = await served.get("/healthz")
    assert status == 400 and b"this port speaks TLS: use https://" in body
    assert served.server.refused["plain_http_on_tls"] == 1

    # A client that does not trust the certificate: its handshake fails, the server goes on.
    with pytest.raises(trio.BrokenResourceError):
        await _https(port, ssl.create_default_context(cafile=certs[1][0]), b"GET /healthz HTTP/1.1\r\n\r\n")
    with trio.fail_after(PATIENCE):
        while served.server.refused["tls_handshake"] < 1:
            await trio.sleep(0.01)
    assert (await _https(port, client_context, b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")).startswith(b"HTTP/1.1 200")


async def test_a_silent_tls_client_is_dropped_beside_a_paced_wss_call(certs, client_context, start_server):
    (cert, key), _ = certs
    served = await start_server(*_tls_overrides(cert, key), "server.handshake_timeout_s=0.5")
    port, server = served.port, served.server
    silent = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(3)]
    half = await trio.open_tcp_stream("127.0.0.1", port)
    await half.send_all(b"\x16\x03\x01\x00\xc8\x01")  # the start of a ClientHello, and no more
    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        ended: list[float] = []

        async def wait_for_the_end(stream: trio.SocketStream) -> None:
            with trio.fail_after(PATIENCE):
                assert await stream.receive_some(100) == b""  # dropped without a word
            ended.append(trio.current_time() - started)

        for stream in [*silent, half]:
            nursery.start_soon(wait_for_the_end, stream)
        victim = await paced_victim(port, 1.2, ssl_context=client_context)
    assert victim.exact and len(victim.lags) == 15, victim
    assert victim.p99_ms < 250, victim.p99_ms
    assert len(ended) == 4 and all(0.4 < seconds < 3.0 for seconds in ended), ended
    assert server.pending_handshakes == 0 and server.refused["handshake_timeout"] == 4
    for stream in [*silent, half]:
        await stream.aclose()


def test_serve_names_a_missing_certificate_and_exits(tmp_path):
    from typer.testing import CliRunner

    from cli.app import app

    result = CliRunner().invoke(app, ["serve", "--port", "0", "--no-log-stats", "--ssl-certfile",
                                      str(tmp_path / "cert.pem"), "--ssl-keyfile", str(tmp_path / "key.pem")])
    assert result.exit_code == 2
    assert "server.ssl_certfile (--ssl-certfile): no such file" in result.output
