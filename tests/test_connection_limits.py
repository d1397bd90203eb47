"""How long a connection may hold the server's resources without doing its part: closing
handshakes a peer never answers, a first message that never comes, peers that stop answering
pings or go quiet, request heads that trickle in, and the finish reason each of those ends with.

Real sockets on loopback throughout.  The misbehaving peers are ``RawPeer``: a WebSocket client
on a bare socket (wsproto) that answers nothing — no pong, no Close — unless told to.  The server
runs a real scheduler thread, so no test here uses ``autojump_clock`` (see tests/conftest.py):
the limits are set to a few tenths of a second instead, and only waits that would be forever on
the unfixed code are bounded (``fail_after``), with no tight upper bounds.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import trio
import trio_websocket
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, BytesMessage, CloseConnection, Message, Request, TextMessage

from conftest import INPUT_END, PATIENCE, http_get
from duplexrt.config import ConfigError, load_config
from duplexrt.server import Server

FRAME = 1920


def _url(server: Server, path: str = "/v1/duplex") -> str:
    return f"ws://127.0.0.1:{server.ports[0]}{path}"


def _audio(frames: int = 1, seed: int = 0) -> bytes:
    return (np.random.default_rng(seed).standard_normal(frames * FRAME) * 0.2).astype(np.float32).tobytes()


class RawPeer:
    """A WebSocket client that does only what the test says: it never answers a ping or a Close."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.events: list = []

    @classmethod
    async def connect(cls, port: int, path: str = "/v1/duplex") -> RawPeer:
        peer = cls(await trio.open_tcp_stream("127.0.0.1", port))
        await peer.stream.send_all(peer.ws.send(Request(host="127.0.0.1", target=path)))
        with trio.fail_after(PATIENCE):
            while not any(isinstance(e, AcceptConnection) for e in peer.events):
                data = await peer.stream.receive_some(65536)
                assert data, "the server closed during the handshake"
                peer._take(data)
        return peer

    def _take(self, data: bytes) -> None:
        self.ws.receive_data(data)
        self.events.extend(self.ws.events())

    async def send(self, message: bytes | str) -> None:
        await self.stream.send_all(self.ws.send(Message(data=message)))

    async def read_until_dropped(self) -> float:
        """Read (answering nothing) until the server drops the connection; returns when."""
        with trio.fail_after(PATIENCE):
            while True:
                try:
                    data = await self.stream.receive_some(65536)
                except trio.BrokenResourceError:  # reset by the server
                    data = b""
                if not data:
                    return trio.current_time()
                self._take(data)

    def texts(self) -> list[dict]:
        return [json.loads(e.data) for e in self.events if isinstance(e, TextMessage)]

    def close_frame(self) -> CloseConnection | None:
        return next((e for e in self.events if isinstance(e, CloseConnection)), None)


async def _new_session_is_admitted(server: Server) -> None:
    async with trio_websocket.open_websocket_url(_url(server)) as ws:
        assert json.loads(await ws.get_message())["type"] == "session.created"


def _ended(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The finish reasons in the sessions' end lines, in order."""
    return [r.getMessage().split("ended: ")[1].split(",")[0] for r in caplog.records
            if r.name == "duplexrt.session" and "ended: " in r.getMessage()]


# -- closing handshakes ----------------------------------------------------------------------------


async def test_peers_that_never_answer_close_give_their_slots_back(start_server):
    server = (await start_server("runtime.slots=2", "server.close_timeout_s=0.3")).server
    peers = [await RawPeer.connect(server.ports[0]) for _ in range(2)]  # every slot
    started = trio.current_time()
    for peer in peers:
        await peer.send(INPUT_END)
    for peer in peers:
        dropped = await peer.read_until_dropped()
        assert dropped - started >= 0.25  # it did wait for the peer's Close, for a while
        assert peer.texts()[-1]["type"] == "session.end" and peer.close_frame().code == 1000
    with trio.fail_after(PATIENCE):
        while server._admitted:
            await trio.sleep(0.01)
    await _new_session_is_admitted(server)


async def test_first_message_timeout_frees_the_slot(caplog, start_server):
    caplog.set_level(logging.INFO, logger="duplexrt.session")
    server = (await start_server("runtime.slots=1", "server.first_message_timeout_s=0.2",
                          "server.close_timeout_s=0.3")).server
    peer = await RawPeer.connect(server.ports[0])
    await peer.read_until_dropped()  # it never sends, and never answers the Close
    assert peer.close_frame().code == 1008 and "no message" in peer.close_frame().reason
    with trio.fail_after(PATIENCE):
        while server._admitted:
            await trio.sleep(0.01)
    await _new_session_is_admitted(server)
    assert _ended(caplog)[0] == "first_message_timeout"


# -- keepalive and idle limit ------------------------------------------------------------------------


async def test_peer_that_stops_answering_pings_is_dropped_and_a_live_one_stays(caplog, start_server):
    caplog.set_level(logging.INFO, logger="duplexrt.session")
    # A pong may be late by up to half a second on a loaded machine before the live one is lost.
    # Resume off: with it, a peer lost to pings is kept for its resume (tests/test_resume.py).
    server = (await start_server("runtime.slots=2", "server.ping_interval_s=0.2", "server.ping_timeout_s=0.5",
                          "server.idle_timeout_s=0", "runtime.resume_window_s=0")).server
    result = {}

    async def live() -> None:  # trio-websocket's reader answers every ping
        async with trio_websocket.open_websocket_url(_url(server)) as ws:
            await ws.get_message()
            await ws.send_message(_audio())
            await trio.sleep(1.2)  # six pings
            await ws.send_message(INPUT_END)
            messages = []
            while isinstance(message := await ws.get_message(), bytes):
                messages.append(message)
            result["live"] = (b"".join(messages), json.loads(message)["reason"])

    async with trio.open_nursery() as clients:
        clients.start_soon(live)
        peer = await RawPeer.connect(server.ports[0])
        await peer.send(_audio())
        started = trio.current_time()
        dropped = await peer.read_until_dropped()
        assert dropped - started >= 0.65  # one interval and one timeout
    assert result["live"] == (_audio(), "stop")
    assert sorted(_ended(caplog)) == ["ping_timeout", "stop"]
    with trio.fail_after(PATIENCE):
        while server._admitted:
            await trio.sleep(0.01)
    await _new_session_is_admitted(server)


async def test_idle_client_is_told_idle_timeout_and_a_busy_one_is_not(caplog, start_server):
    caplog.set_level(logging.INFO, logger="duplexrt.session")
    server = (await start_server("runtime.slots=2", "server.idle_timeout_s=0.6", "server.ping_interval_s=0")).server
    result = {}

    async def busy() -> None:
        async with trio_websocket.open_websocket_url(_url(server)) as ws:
            await ws.get_message()
            for k in range(12):  # 1.2 s in all, never near 0.6 s apart
                await ws.send_message(_audio(seed=k))
                await trio.sleep(0.1)
            await ws.send_message(INPUT_END)
            while isinstance(message := await ws.get_message(), bytes):
                pass
            result["busy"] = json.loads(message)["reason"]

    async with trio.open_nursery() as clients:
        clients.start_soon(busy)
        async with trio_websocket.open_websocket_url(_url(server)) as ws:
            await ws.get_message()
            started = trio.current_time()
            await ws.send_message(_audio())
            with trio.fail_after(PATIENCE), pytest.raises(trio_websocket.ConnectionClosed) as closed:
                while True:
                    message = await ws.get_message()
                    if isinstance(message, str):
                        end = json.loads(message)
        assert trio.current_time() - started >= 0.6
    assert end["type"] == "session.end" and end["reason"] == "idle_timeout"
    assert end["usage"]["frames_in"] == end["usage"]["frames_out"] == 1  # what was taken is answered
    assert closed.value.reason.code == 1008 and closed.value.reason.reason == "idle_timeout"
    assert result["busy"] == "stop"
    assert sorted(_ended(caplog)) == ["idle_timeout", "stop"]


async def test_accepted_sockets_have_tcp_keepalive(start_server):
    server = (await start_server("runtime.slots=2")).server
    async with trio_websocket.open_websocket_url(_url(server)) as ws:
        await ws.get_message()
        (stream,) = server._streams
        assert stream.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1


# -- finish reasons of server-side closes ----------------------------------------------------------


async def test_oversized_message_ends_with_message_too_big(caplog, start_server):
    caplog.set_level(logging.INFO, logger="duplexrt.session")
    server = (await start_server("runtime.slots=2", "server.max_message_bytes=4096")).server
    async with trio_websocket.open_websocket_url(_url(server)) as ws:
        await ws.get_message()
        await ws.send_message(b"\x00" * 8192)
        with pytest.raises(trio_websocket.ConnectionClosed):
            while True:
                await ws.get_message()
    with trio.fail_after(PATIENCE):
        while not _ended(caplog):
            await trio.sleep(0.01)
    assert _ended(caplog) == ["message_too_big"]


async def test_broken_frame_ends_with_protocol_error_and_a_close_is_client_closed(caplog, start_server):
    caplog.set_level(logging.INFO, logger="duplexrt.session")
    server = (await start_server("runtime.slots=2")).server
    peer = await RawPeer.connect(server.ports[0])
    await peer.send(_audio())
    await peer.stream.send_all(b"\x82\x03abc")  # a client frame without a mask
    await peer.read_until_dropped()
    with trio.fail_after(PATIENCE):
        while not _ended(caplog):
            await trio.sleep(0.01)
    async with trio_websocket.open_websocket_url(_url(server)) as ws:
        await ws.get_message()
    with trio.fail_after(PATIENCE):
        while len(_ended(caplog)) < 2:
            await trio.sleep(0.01)
    assert _ended(caplog) == ["protocol_error", "client_closed"]


# -- before admission --------------------------------------------------------------------------------


async def test_pending_handshakes_are_capped_oldest_first_while_metrics_and_sessions_go_on(start_server):
    """At the cap, a new connection lets the oldest half-sent head go (503): a client that sends
    its head whole is served whatever the number of tricklers."""
    server = (await start_server("runtime.slots=2", "server.max_pending_handshakes=2")).server
    port = server.ports[0]
    async with trio_websocket.open_websocket_url(_url(server)) as session:
        await session.get_message()
        tricklers = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(2)]
        for stream in tricklers:
            await stream.send_all(b"GET /v1/duplex HTTP/1.1\r\n")  # and the rest never comes
            with trio.fail_after(PATIENCE):  # in order: the first is the oldest
                while server.pending_handshakes < tricklers.index(stream) + 1:
                    await trio.sleep(0.01)
        async with trio_websocket.open_websocket_url(_url(server)) as second:
            assert json.loads(await second.get_message())["type"] == "session.created"
        with trio.fail_after(PATIENCE):
            answer = await tricklers[0].receive_some(4096)
        assert answer.startswith(b"HTTP/1.1 503") and b"waiting to be served" in answer
        status, _, body = await http_get(port, "/metrics")
        assert status == 200 and b'duplexrt_connections_refused_total{reason="too_many_pending"}' in body
        assert server.pending_handshakes <= 2  # the second trickler, let go when /metrics came, or not yet
        await session.send_message(_audio())
        assert await session.get_message() == _audio()  # the admitted session never noticed
        for stream in tricklers:
            await stream.aclose()


async def test_websocket_request_wsproto_refuses_does_not_hold_a_slot(start_server):
    server = (await start_server("runtime.slots=1", "server.handshake_timeout_s=0.3")).server
    stream = await trio.open_tcp_stream("127.0.0.1", server.ports[0])
    await stream.send_all(b"GET /v1/duplex HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\n"
                          b"connection: upgrade\r\n\r\n")  # no Sec-WebSocket-Key
    with trio.fail_after(PATIENCE):
        while await stream.receive_some(4096):
            pass
        while server._admitted:
            await trio.sleep(0.01)
    await _new_session_is_admitted(server)


async def test_an_upgrade_in_a_version_the_server_does_not_speak_is_refused_and_holds_no_slot(start_server):
    server = (await start_server("runtime.slots=1", "server.handshake_timeout_s=0.3")).server
    stream = await trio.open_tcp_stream("127.0.0.1", server.ports[0])
    async with stream:
        await stream.send_all(b"GET /v1/duplex HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\nconnection: upgrade\r\n"
                              b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 8\r\n\r\n")
        data = b""
        with trio.fail_after(PATIENCE):
            while chunk := await stream.receive_some(65536):
                data += chunk
    head = data.partition(b"\r\n\r\n")[0].lower()
    # RFC 6455 4.4: 426, naming the version it speaks
    assert head.startswith(b"http/1.1 426") and b"sec-websocket-version: 13" in head
    with trio.fail_after(PATIENCE):
        while server.admitted:  # the refused request's handler is finishing
            await trio.sleep(0.01)
    await _new_session_is_admitted(server)


async def test_permessage_deflate_offered_is_not_negotiated_and_plain_frames_follow(start_server):
    server = (await start_server("runtime.slots=2")).server
    stream = await trio.open_tcp_stream("127.0.0.1", server.ports[0])
    async with stream:
        await stream.send_all(b"GET /v1/duplex HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\nconnection: upgrade\r\n"
                              b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n"
                              b"sec-websocket-extensions: permessage-deflate; client_max_window_bits\r\n\r\n")
        data = b""
        with trio.fail_after(PATIENCE):
            while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < 2:
                data += await stream.receive_some(65536)
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.lower().startswith(b"http/1.1 101") and b"sec-websocket-extensions" not in head.lower()
    assert rest[0] == 0x81, "the greeting is a plain final text frame: RSV1 (compressed) clear"


# -- the API key ------------------------------------------------------------------------------------


async def test_api_key_from_a_file_with_a_newline_still_matches(start_server):
    server = (await start_server("runtime.slots=2", 'server.api_key="s3cret\\n"')).server
    assert server.config.server.api_key == "s3cret"
    async with trio_websocket.open_websocket_url(_url(server), extra_headers=[(b"authorization",
                                                                              b"Bearer s3cret")]) as ws:
        assert json.loads(await ws.get_message())["type"] == "session.created"


@pytest.mark.parametrize("key", ["two words", "clé", "tab\tinside", "nul\x00inside"])
def test_api_key_no_client_could_send_is_refused_at_start_up(key):
    with pytest.raises(ConfigError) as error:
        load_config(None, [f"server.api_key={json.dumps(key)}"])
    assert "server.api_key" in str(error.value) and key not in str(error.value)


# -- shutdown with peers that never answer Close ---------------------------------------------------


def _serve_process(*settings: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "duplexrt_cli.app", "serve", "--port", "0", "--log-level", "info",
         "--no-log-stats", *[arg for s in settings for arg in ("--set", s)]],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    for line in proc.stderr:
        if "port(s)" in line:
            return proc, int(line.split("port(s) ")[1].split()[0])
    proc.kill()
    raise AssertionError("the server never said where it listens")


def _stubborn_peer(port: int) -> socket.socket:
    """A blocking-socket client that completes the handshake, sends one message, then neither
    reads nor answers anything."""
    ws = WSConnection(ConnectionType.CLIENT)
    sock = socket.create_connection(("127.0.0.1", port), timeout=PATIENCE)
    sock.sendall(ws.send(Request(host="127.0.0.1", target="/v1/duplex")))
    while not any(isinstance(e, AcceptConnection) for e in ws.events()):
        ws.receive_data(sock.recv(65536))
    sock.sendall(ws.send(BytesMessage(data=_audio())))
    return sock


def _exits_within(proc: subprocess.Popen, seconds: float) -> float:
    started = time.monotonic()
    try:
        assert proc.wait(timeout=seconds) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    return time.monotonic() - started


def test_sigterm_exits_after_grace_and_close_timeout_with_peers_that_never_answer_close():
    proc, port = _serve_process("server.shutdown_grace_s=0.5", "server.close_timeout_s=0.5",
                                "server.ping_interval_s=0")
    peers = [_stubborn_peer(port) for _ in range(2)]
    time.sleep(0.3)  # the sessions take their message
    proc.send_signal(signal.SIGTERM)
    took = _exits_within(proc, 15)
    assert took >= 0.5  # it did give the peers their close timeout
    for sock in peers:
        sock.close()


def test_a_second_signal_stops_at_once_even_in_a_closing_handshake():
    proc, port = _serve_process("server.shutdown_grace_s=60", "server.close_timeout_s=60",
                                "server.ping_interval_s=0")
    peers = [_stubborn_peer(port) for _ in range(2)]
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)  # the sessions have said goodbye and wait for Close frames that never come
    proc.send_signal(signal.SIGTERM)
    assert _exits_within(proc, 10) < 10
    for sock in peers:
        sock.close()
