"""Hostile input a keyless client can send to a running server (issue 32, defect 9): each gets a
clear answer (a protocol error, a close code or an HTTP status with a reason), and the server
goes on serving.  Real servers on loopback sockets."""

from __future__ import annotations

import json

import trio
import trio_websocket

from conftest import PATIENCE, INPUT_END
from duplexrt.config import load_config
from duplexrt.server import Server


async def _start(nursery: trio.Nursery, *overrides: str) -> int:
    server = Server(load_config(None, ["server.port=0", "runtime.slots=2", *overrides]))
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
    import socket

    from conftest import ServeProcess

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
    from typer.testing import CliRunner

    from duplexrt_cli.app import app

    for key in ("", "  \n"):
        result = CliRunner().invoke(app, ["serve", "--port", "0", "--api-key", key])
        assert result.exit_code == 2, result.output
        assert "--api-key" in result.output and "empty" in result.output
