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
