"""The Origin check (duplexrt.server.origin): with no API key, a browser page on another site may
not open a session; the server's own pages, loopback pages, listed origins and every client that
is not a browser (no Origin header) may.  Real servers on loopback sockets."""

from __future__ import annotations

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import PATIENCE
from duplexrt.config import ConfigError, load_config
from duplexrt.server import Server
from duplexrt.server.origin import normalized_origin, origin_refusal


async def _start(nursery: trio.Nursery, *overrides: str) -> Server:
    server = Server(load_config(None, ["server.port=0", "runtime.slots=8", "runtime.resume_window_s=0", *overrides]))
    await nursery.start(server.run)
    return server


async def _upgrade(port: int, *headers: str, path: str = "/v1/duplex") -> tuple[int, bytes]:
    """The status and body of an upgrade request with these extra header lines."""
    extra = "".join(f"{line}\r\n" for line in headers)
    if not any(line.lower().startswith("host:") for line in headers):
        extra += f"Host: 127.0.0.1:{port}\r\n"
    with trio.fail_after(PATIENCE):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(f"GET {path} HTTP/1.1\r\n{extra}Upgrade: websocket\r\nConnection: Upgrade\r\n"
                                  "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
                                  .encode())
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = await stream.receive_some(65536)
                assert chunk, data
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 101"):
                while chunk := await stream.receive_some(65536):
                    body += chunk
    return int(head.split(b" ")[1]), body


async def test_a_foreign_page_is_refused_with_403_and_a_reason_when_there_is_no_key(nursery):
    server = await _start(nursery)
    port = server.ports[0]
    status, body = await _upgrade(port, "Origin: https://evil.example")
    assert status == 403
    assert b"https://evil.example" in body and b"server.allowed_origins" in body
    for route in ("/v1/realtime", "/api/chat", "/v1/live/sessions"):  # every WebSocket route
        assert (await _upgrade(port, "Origin: http://evil.example:8000", path=route))[0] == 403
    assert (await _upgrade(port, "Origin: null"))[0] == 403  # a page opened from a file
    assert (await _upgrade(port, "Origin: http://127.0.0.1.evil.example"))[0] == 403
    assert server.refused["foreign_origin"] == 6


async def test_non_browsers_own_pages_and_loopback_pages_are_let_through(nursery):
    server = await _start(nursery)
    port = server.ports[0]
    assert (await _upgrade(port))[0] == 101  # no Origin: not a browser
    assert (await _upgrade(port, f"Origin: http://127.0.0.1:{port}"))[0] == 101  # the talk page
    assert (await _upgrade(port, "Host: gpu-box:8000", "Origin: http://gpu-box:8000"))[0] == 101
    assert (await _upgrade(port, "Host: duplex.example.com", "Origin: https://duplex.example.com"))[0] == 101
    assert (await _upgrade(port, "Origin: http://localhost:3000"))[0] == 101  # a developer's front end
    assert (await _upgrade(port, "Origin: http://[::1]:5173"))[0] == 101
    # The same host on another port is another site's page.
    assert (await _upgrade(port, "Host: gpu-box:8000", "Origin: http://gpu-box:9000"))[0] == 403
    assert server.refused["foreign_origin"] == 1


async def test_listed_origins_and_a_key_let_a_page_in(nursery):
    listed = await _start(nursery, 'server.allowed_origins=["https://App.Example.com/", "null"]')
    assert (await _upgrade(listed.ports[0], "Origin: https://app.example.com"))[0] == 101
    assert (await _upgrade(listed.ports[0], "Origin: https://app.example.com:443"))[0] == 101
    assert (await _upgrade(listed.ports[0], "Origin: null"))[0] == 101
    assert (await _upgrade(listed.ports[0], "Origin: http://app.example.com"))[0] == 403  # not https
    anyone = await _start(nursery, 'server.allowed_origins=["*"]')
    assert (await _upgrade(anyone.ports[0], "Origin: https://evil.example"))[0] == 101
    keyed = await _start(nursery, 'server.api_key="s3cret"')
    # With a key, the key decides: a page that holds it gets in, one without it gets 401.
    assert (await _upgrade(keyed.ports[0], "Origin: https://evil.example", "Authorization: Bearer s3cret"))[0] == 101
    assert (await _upgrade(keyed.ports[0], "Origin: https://evil.example"))[0] == 401


def test_allowed_origins_must_be_origins():
    assert load_config(None, ['server.allowed_origins=["http://a.example:8080", "*"]']).server.allowed_origins == (
        "http://a.example:8080", "*")
    for bad in ('"https://a.example"', '["https://a.example/page"]', '["a.example"]', "[1]",
                '["ftp://a.example"]'):
        with pytest.raises(ConfigError, match="server.allowed_origins"):
            load_config(None, [f"server.allowed_origins={bad}"])


@pytest.mark.parametrize(("text", "normal"), [
    ("HTTPS://Example.COM:443", "https://example.com"),
    ("http://example.com:8080/", "http://example.com:8080"),
    ("http://[::1]:80", "http://[::1]"),
    ("null", "null"),
    ("http://example.com/path", None),
    ("http://user@example.com", None),
    ("http://example.com:99999", None),
    ("example.com", None),
    ("", None),
])
def test_origins_are_compared_as_browsers_write_them(text, normal):
    assert normalized_origin(text) == normal


async def test_a_foreign_page_cannot_drain_a_server_without_a_key(nursery):
    """A plain HTML form on any site may POST to 127.0.0.1: with no key, its Origin decides."""
    server = await _start(nursery)
    port = server.ports[0]

    async def post_drain(*headers: str) -> bytes:
        with trio.fail_after(PATIENCE):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                extra = "".join(f"{line}\r\n" for line in headers)
                await stream.send_all(f"POST /drain HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{extra}"
                                      "Content-Length: 0\r\n\r\n".encode())
                answer = b""
                while chunk := await stream.receive_some(65536):
                    answer += chunk
        return answer

    refused = await post_drain("Origin: https://evil.example")
    assert refused.startswith(b"HTTP/1.1 403") and b"drain" in refused
    assert not server.draining
    assert (await post_drain()).startswith(b"HTTP/1.1 202")  # curl, a preStop hook: no Origin
    assert server.draining


@settings(derandomize=True, database=None, deadline=None, max_examples=300)
@given(st.text(max_size=60) | st.sampled_from(["http://[::1", "http://[", "https://a:b", "http://:80", "ws://[::1]:x"]),
       st.text(max_size=30))
def test_any_origin_and_host_get_an_answer_never_an_exception(origin, host):
    settings_ = load_config(None, ['server.allowed_origins=["https://a.example"]']).server
    answer = origin_refusal({"origin": origin, "host": host}, settings_)
    assert answer is None or "server.allowed_origins" in answer
    assert normalized_origin(origin) is None or normalized_origin(origin).startswith(("http", "ws", "null"))


async def test_a_broken_origin_is_refused_with_403_not_dropped(nursery):
    server = await _start(nursery)
    assert (await _upgrade(server.ports[0], "Origin: http://[::1"))[0] == 403
