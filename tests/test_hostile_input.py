"""Hostile input a keyless client can send to a running server (issue 32, defect 9): each gets a
clear answer (a protocol error, a close code or an HTTP status with a reason), and the server
goes on serving.  Real servers on loopback sockets."""

from __future__ import annotations

import json
import socket
import wave

import pytest
import trio
import trio_websocket
from typer.testing import CliRunner

from conftest import INPUT_END, PATIENCE, ServeProcess
from duplexrt.config import ConfigError, load_config
from duplexrt.server import Server
from duplexrt_cli.app import app


async def _start(nursery: trio.Nursery, *overrides: str) -> int:
    server = Server(load_config(None, ["server.port=0", "runtime.slots=8", "runtime.resume_window_s=0", *overrides]))
    await nursery.start(server.run)
    return server.ports[0]


async def test_deeply_nested_json_on_the_duplex_route_is_a_protocol_error(nursery):
    """``json.loads`` raises RecursionError, not ValueError, for JSON nested deeper than the
    interpreter's stack: the session answers invalid_json and goes on."""
    port = await _start(nursery)
    async with trio_websocket.open_websocket_url(f"ws://127.0.0.1:{port}/v1/duplex") as ws:
        assert json.loads(await ws.get_message())["type"] == "session.created"
        with trio.fail_after(PATIENCE):
            await ws.send_message("[" * 100_000 + "]" * 100_000)
            error = json.loads(await ws.get_message())
            assert error == {"type": "error", "code": "invalid_json",
                             "message": "text messages must be JSON objects"}
            await ws.send_message('{"type": "ping"}')  # the session still answers
            assert json.loads(await ws.get_message()) == {"type": "pong"}
            await ws.send_message(INPUT_END)
            end = json.loads(await ws.get_message())
        assert end["type"] == "session.end" and end["reason"] == "stop"


# -- the API key as an operator gives it -------------------------------------------------------


def test_a_key_from_a_kubernetes_secret_keeps_working_with_its_trailing_newline(monkeypatch):
    """A ``secretKeyRef`` env keeps the newline a secret file ends with: the key is the text
    without its surrounding whitespace, and the log says that it was removed."""
    monkeypatch.setenv("DUPLEXRT_API_KEY", "s3cret\n")
    with ServeProcess() as served:
        served.wait_for_line("surrounding whitespace")
        for key, status in (("s3cret", b"101"), ("s3cret%0A", b"401"), ("wrong", b"401")):
            with socket.create_connection(("127.0.0.1", served.port), timeout=PATIENCE) as conn:
                conn.sendall(f"GET /v1/duplex?api_key={key} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                             "Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
                             "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n".encode())
                assert conn.recv(4096).split(b" ")[1] == status, key


def test_an_empty_api_key_is_refused_rather_than_meaning_no_auth():
    for key in ("", "  \n"):
        result = CliRunner().invoke(app, ["serve", "--port", "0", "--api-key", key])
        assert result.exit_code == 2, result.output
        assert "--api-key" in result.output and "empty" in result.output


# -- upgrades that are not what they say -------------------------------------------------------

_KEY = "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nConnection: Upgrade\r\n"


async def _status(port: int, request: bytes) -> int:
    with trio.fail_after(PATIENCE):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(request)
            answer = b""
            while b"\r\n" not in answer and (chunk := await stream.receive_some(4096)):
                answer += chunk
    return int(answer.split(b" ")[1])


async def test_only_an_http_1_1_request_naming_websocket_upgrades(nursery):
    """RFC 6455 4.2.1: a GET of HTTP/1.1 or later (so with a Host, which h11 requires of 1.1),
    whose Upgrade header holds the token ``websocket``, not merely those letters."""
    port = await _start(nursery)
    ok = f"GET /v1/duplex HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n{_KEY}\r\n".encode()
    assert await _status(port, ok) == 101
    assert await _status(port, f"GET /v1/duplex HTTP/1.1\r\nHost: x\r\nUpgrade: foo, WebSocket\r\n{_KEY}\r\n"
                         .encode()) == 101
    for bad in (f"GET /v1/duplex HTTP/1.0\r\nUpgrade: websocket\r\n{_KEY}\r\n",  # no Host either
                f"GET /v1/duplex HTTP/1.0\r\nHost: x\r\nUpgrade: websocket\r\n{_KEY}\r\n",
                f"GET /v1/duplex HTTP/1.1\r\nHost: x\r\nUpgrade: xwebsocketx\r\n{_KEY}\r\n"):
        assert await _status(port, bad.encode()) == 426, bad


async def test_frames_sent_with_the_head_are_taken_from_where_the_head_really_ends(nursery):
    """A head may end in a bare LF blank line (h11 reads it so); the frames behind it start
    there, even when they hold a CRLF CRLF themselves."""
    port = await _start(nursery, "backend.options.delay_frames=0")
    payload = b"\r\n\r\n" * 960  # 3840 bytes of pcm_s16le: 80 ms
    frame = bytes((0x82, 0x80 | 126)) + len(payload).to_bytes(2, "big") + b"\x00\x00\x00\x00" + payload
    with trio.fail_after(PATIENCE):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(f"GET /v1/duplex?format=pcm_s16le HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                                  f"{_KEY}\n".encode() + frame)
            answer = b""
            while payload not in answer:  # the audio echoed back: the frame was read whole
                chunk = await stream.receive_some(65536)
                assert chunk, answer[-200:]
                answer += chunk


def test_the_client_sends_a_key_from_a_secret_without_its_newline(monkeypatch, tmp_path):
    """The same secret may feed ``serve`` and ``client`` (DUPLEXRT_API_KEY with a newline)."""
    source = tmp_path / "in.wav"
    with wave.open(str(source), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(24000)
        out.writeframes(b"\x10\x00" * 12000)  # half a second
    monkeypatch.setenv("DUPLEXRT_API_KEY", "s3cret\n")
    with ServeProcess() as served:
        result = CliRunner().invoke(app, ["client", str(source), "--url", f"ws://127.0.0.1:{served.port}/v1/duplex",
                                          "--out", str(tmp_path / "out.wav"), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out.wav").stat().st_size > 44


def test_a_config_key_of_whitespace_only_is_refused():
    assert load_config(None, ['server.api_key=" k3y\\n"']).server.api_key == "k3y"
    assert load_config(None, ['server.api_key=""']).server.api_key == ""  # the default: no key
    with pytest.raises(ConfigError, match="only whitespace"):
        load_config(None, ['server.api_key=" \\n"'])


# -- JSON that costs more to parse than its size says --------------------------------------------

MANY_VALUES = json.dumps({"type": "session.update", "session": {"x": [0] * 700_000}})  # 2 MiB


@pytest.mark.parametrize("path", ["/v1/duplex", "/v1/realtime", "/v1/live/sessions"])
def test_an_event_of_too_many_values_is_refused_unparsed(path, monkeypatch):
    """2 MiB of tiny values cost ``json.loads`` many times what 2 MiB of audio text does, on the
    thread every session shares: refused from a count of separators, never parsed."""
    from duplexrt.protocols import events, raw
    from duplexrt.server.http import RequestHead
    from duplexrt.server.routes import ROUTES

    translator = ROUTES[path].translator(RequestHead("GET", path, {}, {"host": "x"}), load_config(None, []))
    translator.start()
    parsed: list[int] = []
    loads = json.loads

    def counted(text, *args, **kwargs):
        parsed.append(len(text))
        return loads(text, *args, **kwargs)

    monkeypatch.setattr(events.json, "loads", counted)
    monkeypatch.setattr(raw.json, "loads", counted)
    event = translator.parse(MANY_VALUES)
    assert isinstance(event, events.ProtocolError) and event.code == "invalid_event", event
    assert "at most 32768 JSON values" in event.message
    assert parsed == []
    # An event of many values, but not too many, is parsed as before.
    translator.parse(json.dumps({"type": "session.update", "session": {"x": [0] * 10_000}}))
    assert parsed
