"""Resume after a dropped connection, on a real server over loopback WebSockets (echo).

The client here speaks the wire contract by hand (docs/resume.md): it counts the session's
messages it received, keeps what it sent, and on a resume sends again whatever the server says it
did not take.  Echo with no delay hears each input frame back as it was, so "every frame exactly
once, in order" is one byte comparison of everything sent against everything heard.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import numpy as np
import pytest
import trio
import trio_websocket

from duplexrt.audio import make_encoder
from duplexrt.client.protocols import (AUDIO_TYPES, ClientProtocol, Ended, LiveClient, MoshiClient, Opened, Other,
                                       RealtimeClient)
from duplexrt.reasons import FinishReason
from conftest import http_get

PATIENCE = 10.0
FRAME = 1920  # the default model frame (80 ms at 24 kHz)


def frames(count: int, seed: int = 0) -> list[bytes]:
    """``count`` one-frame messages, each with its own content, as pcm_f32le."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(FRAME) * 0.1).astype(np.float32).tobytes() for _ in range(count)]


class DuplexPeer:
    """One /v1/duplex session over a TCP stream the test can cut without a Close frame."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.heard = bytearray()
        self.received = 0  # the session's messages received, over every connection
        self.events: list[dict] = []
        self.sent: list[bytes | str] = []
        self.token: str | None = None
        self.ws: trio_websocket.WebSocketConnection | None = None
        self.stream: trio.SocketStream | None = None
        self.resumes = 0

    async def open(self, nursery: trio.Nursery, query: str = "") -> None:
        self.stream = await trio.open_tcp_stream("127.0.0.1", self.port)
        self.ws = await trio_websocket.wrap_client_stream(nursery, self.stream, "127.0.0.1",
                                                         f"/v1/duplex{query}", message_queue_size=0)

    async def start(self, nursery: trio.Nursery) -> None:
        await self.open(nursery)
        created = await self.next()
        assert created["type"] == "session.created"
        self.token = created["resume_token"]

    async def next(self) -> dict:
        """The next message; audio is kept, control is decoded (and returned)."""
        while True:
            message = await self.ws.get_message()
            if isinstance(message, bytes):
                self.received += 1
                self.heard += message
                continue
            event = json.loads(message)
            if event["type"] != "session.resumed":
                self.received += 1
            self.events.append(event)
            return event

    async def next_audio(self) -> None:
        """Take one audio message (the test reads while it waits for output)."""
        message = await self.ws.get_message()
        assert isinstance(message, bytes)
        self.received += 1
        self.heard += message

    async def send(self, message: bytes | str) -> None:
        self.sent.append(message)
        await self.ws.send_message(message)

    def cut(self) -> None:
        """Drop the connection: the socket closes with no Close frame."""
        self.stream.socket.close()

    async def resume(self, nursery: trio.Nursery) -> dict:
        await self.open(nursery, f"?resume={self.token}&received={self.received}")
        notice = await self.next()
        assert notice["type"] == "session.resumed"
        self.token = notice["resume_token"]
        self.resumes += 1
        for message in self.sent[notice["received"]:]:
            await self.ws.send_message(message)
        return notice

    async def until_end(self) -> dict:
        while (event := await self.next())["type"] != "session.end":
            pass
        return event


async def wait_for(predicate, what: str) -> None:
    with trio.fail_after(PATIENCE):
        while not predicate():
            await trio.sleep(0.005)


async def test_a_duplex_session_resumes_after_a_drop_with_every_frame_once_and_in_order(start_server):
    running = await start_server()
    audio = frames(40)
    peer = DuplexPeer(running.port)
    async with trio.open_nursery() as connections:
        await peer.start(connections)
        for message in audio[:20]:
            await peer.send(message)
        # Some output heard, some still on its way: the cut loses whatever is in flight both ways.
        while len(peer.heard) < 5 * FRAME * 4:
            await peer.next_audio()
        peer.cut()
        (session,) = running.server.runtime.sessions
        await wait_for(lambda: session.state.value == "detached", "the server noticing the drop")
        _, _, ready = await http_get(running.port, "/readyz")
        _, _, metrics = await http_get(running.port, "/metrics")
        assert json.loads(ready)["detached"] == 1 and b"duplexrt_sessions_detached 1.0" in metrics
        notice = await peer.resume(connections)
        await wait_for(lambda: running.server.statistics().detached == 0, "the replay to finish")
        assert 0 < notice["received"] <= 20
        for message in audio[20:]:
            await peer.send(message)
        await peer.send(json.dumps({"type": "input.end"}))
        with trio.fail_after(PATIENCE):
            end = await peer.until_end()
            await peer.ws.aclose()
        connections.cancel_scope.cancel()
    assert end["reason"] == FinishReason.STOP
    assert end["usage"]["frames_in"] == end["usage"]["frames_out"] == 40
    assert bytes(peer.heard) == b"".join(audio)
    assert running.server.statistics().runtime.frames.sessions_resumed == 1


async def test_a_client_may_resume_before_the_server_notices_the_drop(start_server):
    """A phone that changed networks comes back before the server's pings find the old
    connection dead: the token wins, the old connection is given up."""
    running = await start_server()
    audio = frames(10, seed=1)
    peer = DuplexPeer(running.port)
    async with trio.open_nursery() as connections:
        await peer.start(connections)
        old_ws = peer.ws
        for message in audio[:5]:
            await peer.send(message)
        notice = await peer.resume(connections)  # the old connection is still open
        assert notice["received"] <= 5
        with trio.fail_after(PATIENCE):
            with pytest.raises(trio_websocket.ConnectionClosed):
                while True:
                    await old_ws.get_message()
        for message in audio[5:]:
            await peer.send(message)
        await peer.send(json.dumps({"type": "input.end"}))
        with trio.fail_after(PATIENCE):
            end = await peer.until_end()
            await peer.ws.aclose()
        connections.cancel_scope.cancel()
    assert end["usage"]["frames_out"] == 10
    assert bytes(peer.heard) == b"".join(audio)


async def _refusal(port: int, query: str) -> tuple[int, bytes]:
    status, _, body = await http_get(port, f"/v1/duplex{query}", headers=(
        "connection: upgrade\r\nupgrade: websocket\r\nsec-websocket-version: 13\r\n"
        "sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n"))
    return status, body


async def test_unknown_reused_and_other_replica_tokens_are_refused_before_the_upgrade(start_server):
    running = await start_server('server.replica_id="gpu-0"')
    peer = DuplexPeer(running.port)
    async with trio.open_nursery() as connections:
        await peer.start(connections)
        first = peer.token
        assert first.startswith("gpu-0.") and len(first.split(".")[-1]) >= 22  # >= 128 bits
        status, body = await _refusal(running.port, "?resume=gpu-0.not-a-token&received=0")
        assert status == 404 and body.startswith(b"unknown_token")
        status, body = await _refusal(running.port, f"?resume=gpu-1.{first.split('.')[-1]}&received=0")
        assert status == 421 and body.startswith(b"wrong_replica")
        status, body = await _refusal(running.port, f"?resume={first}&received=99")
        assert status == 400 and body.startswith(b"bad_received")
        await peer.send(frames(1)[0])  # a session that took nothing is not resumable
        await wait_for(lambda: next(iter(running.server.runtime.sessions)).credits.submitted == 1, "the frame")
        peer.cut()
        await peer.resume(connections)
        assert peer.token != first
        status, body = await _refusal(running.port, f"?resume={first}&received=1")  # used once already
        assert status == 404 and body.startswith(b"unknown_token")
        connections.cancel_scope.cancel()


async def test_a_session_nobody_resumes_ends_with_resume_expired_and_frees_its_slot(start_server):
    running = await start_server("runtime.resume_window_s=0.2")
    peer = DuplexPeer(running.port)
    async with trio.open_nursery() as connections:
        await peer.start(connections)
        await peer.send(frames(1)[0])
        (session,) = running.server.runtime.sessions
        peer.cut()
        await wait_for(lambda: not running.server.runtime.sessions and not running.server.admitted,
                       "the window to pass")
        connections.cancel_scope.cancel()
    assert session.summary().reason == FinishReason.RESUME_EXPIRED
    assert running.server.runtime.scheduler.free_slots == running.server.runtime.scheduler.slots
    status, body = await _refusal(running.port, f"?resume={peer.token}&received=1")
    assert status == 404


async def test_with_resume_off_a_drop_ends_the_session_and_no_token_is_given(nursery, start_server):
    running = await start_server("runtime.resume_window_s=0")
    async with trio_websocket.open_websocket_url(running.url("/v1/duplex")) as ws:
        created = json.loads(await ws.get_message())
    assert "resume_token" not in created


# -- the other routes: the same contract in each protocol's own messages ------------------------------


class RoutePeer:
    """A session on any route, spoken through the client's own protocol classes (sans-IO)."""

    def __init__(self, port: int, protocol: ClientProtocol, path: str) -> None:
        self.port = port
        self.protocol = protocol
        self.base = protocol.url(f"ws://127.0.0.1:{port}{path}").split(f":{port}", 1)[1]
        self.heard = bytearray()
        self.received = 0
        self.sent: list[bytes | str] = []
        self.token: str | None = None
        self.ended: Ended | None = None
        self.ws: trio_websocket.WebSocketConnection | None = None
        self.stream: trio.SocketStream | None = None

    async def open(self, nursery: trio.Nursery, extra: str = "") -> None:
        self.stream = await trio.open_tcp_stream("127.0.0.1", self.port)
        resource = self.base + (("&" if "?" in self.base else "?") + extra if extra else "")
        self.ws = await trio_websocket.wrap_client_stream(nursery, self.stream, "127.0.0.1", resource,
                                                         message_queue_size=0)

    async def start(self, nursery: trio.Nursery) -> None:
        await self.open(nursery)
        for message in self.protocol.hello():
            await self.send(message)
        while self.token is None:
            await self.take()

    async def take(self) -> None:
        """Read one of the session's messages."""
        message = await self.ws.get_message()
        self.received += 1
        event = self.protocol.parse(message)
        if isinstance(event, AUDIO_TYPES):
            self.heard += event
        elif isinstance(event, Ended):
            self.ended = event
        elif isinstance(event, (Opened, Other)) and isinstance(event.info, Mapping):
            self.token = event.info.get("resume_token", self.token)

    async def send(self, message: bytes | str) -> None:
        self.sent.append(message)
        await self.ws.send_message(message)

    async def resume(self, nursery: trio.Nursery, notices: int) -> dict:
        await self.open(nursery, f"resume={self.token}&received={self.received}")
        found: dict = {}
        for _ in range(notices):  # not the session's messages: not counted
            message = await self.ws.get_message()
            event = self.protocol.parse(message)
            if isinstance(event, Other) and isinstance(event.info, Mapping):
                found = dict(event.info)
        self.token = found["resume_token"]
        for message in self.sent[found["received"]:]:
            await self.ws.send_message(message)
        return found


def _pcm16_frames(count: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(FRAME) * 3000).astype("<i2").tobytes() for _ in range(count)]


@pytest.mark.parametrize("route", ["realtime", "live"])
async def test_realtime_and_live_sessions_resume_with_every_frame_once(route, start_server):
    running = await start_server()
    protocol = RealtimeClient(duplex=True) if route == "realtime" else LiveClient()
    path = "/v1/realtime" if route == "realtime" else "/v1/live/sessions"
    audio = _pcm16_frames(30, seed=3)
    peer = RoutePeer(running.port, protocol, path)
    async with trio.open_nursery() as connections:
        with trio.fail_after(PATIENCE):
            await peer.start(connections)
            for payload in audio[:15]:
                await peer.send(protocol.audio(payload))
            while len(peer.heard) < 5 * FRAME * 2:
                await peer.take()
        peer.stream.socket.close()  # no Close frame
        (session,) = running.server.runtime.sessions
        await wait_for(lambda: session.state.value == "detached", "the server noticing the drop")
        with trio.fail_after(PATIENCE):
            notice = await peer.resume(connections, 1)
            assert notice["type"] == "session.resumed" and 0 < notice["received"]
            for payload in audio[15:]:
                await peer.send(protocol.audio(payload))
            while len(peer.heard) < 30 * FRAME * 2:
                await peer.take()
        connections.cancel_scope.cancel()
    assert bytes(peer.heard) == b"".join(audio)
    assert session.frames_in == 30


async def test_a_moshi_session_gets_its_token_in_the_handshake_metadata_and_resumes(start_server):
    running = await start_server()
    protocol = MoshiClient()
    peer = RoutePeer(running.port, protocol, "/api/chat")
    encoder = make_encoder(protocol.input_spec, 24000)
    pcm = np.random.default_rng(5).standard_normal(FRAME * 20).astype(np.float32) * 0.1
    pages = [encoder.encode(pcm[i * FRAME:(i + 1) * FRAME]) for i in range(20)]
    pages[-1] += encoder.flush()
    async with trio.open_nursery() as connections:
        with trio.fail_after(PATIENCE):
            await peer.start(connections)  # handshake, then metadata with the token
            assert peer.received == 2
            for page in pages[:10]:
                await peer.send(protocol.audio(page))
        (session,) = running.server.runtime.sessions
        await wait_for(lambda: session.frames_in >= 4, "some input stepped")
        peer.stream.socket.close()
        await wait_for(lambda: session.state.value == "detached", "the server noticing the drop")
        with trio.fail_after(PATIENCE):
            notice = await peer.resume(connections, 2)  # a handshake, then the metadata
            assert notice["resumed"] is True
            for page in pages[10:]:
                await peer.send(protocol.audio(page))
        await wait_for(lambda: session.frames_in >= 19, "the rest of the input stepped")
        connections.cancel_scope.cancel()
    assert session.frames_in in (19, 20)  # every page once: Opus holds back a partial frame
    assert running.server.statistics().runtime.frames.sessions_resumed == 1


async def test_a_peer_lost_to_pings_is_kept_for_its_resume_then_expires(start_server):
    """A phone that lost its network sends no FIN: the server's pings find it gone, and that is a
    drop like any other (not the end), until the window passes."""
    running = await start_server("server.ping_interval_s=0.1", "server.ping_timeout_s=0.2",
                           "runtime.resume_window_s=0.3")
    peer = DuplexPeer(running.port)
    async with trio.open_nursery() as connections:
        await peer.start(connections)
        await peer.send(frames(1)[0])  # its echo waits unread: the peer's reader stops, no pongs
        (session,) = running.server.runtime.sessions
        await wait_for(lambda: session.state.value == "detached", "the pings to find the peer gone")
        await wait_for(lambda: not running.server.runtime.sessions, "the window to pass")
        connections.cancel_scope.cancel()
    assert session.summary().reason == FinishReason.RESUME_EXPIRED


async def test_a_resumed_connection_owes_no_first_message(start_server):
    """A client that resumes with all its input sent (waiting for output) sends nothing: the
    first-message limit, meant for new sessions, must not end it."""
    running = await start_server("server.first_message_timeout_s=0.1")
    peer = DuplexPeer(running.port)
    async with trio.open_nursery() as connections:
        await peer.start(connections)
        await peer.send(frames(1)[0])
        (session,) = running.server.runtime.sessions
        await wait_for(lambda: session.frames_in == 1, "the frame taken")
        peer.cut()
        await wait_for(lambda: session.state.value == "detached", "the server noticing the drop")
        await peer.resume(connections)
        await trio.sleep(0.3)  # three first-message limits, with nothing sent: nothing to wait on
        assert session.state.value == "open"
        await peer.send(json.dumps({"type": "input.end"}))
        with trio.fail_after(PATIENCE):
            end = await peer.until_end()
            await peer.ws.aclose()
        connections.cancel_scope.cancel()
    assert end["reason"] == FinishReason.STOP and end["usage"]["frames_out"] == 1


async def test_with_late_input_fill_the_model_keeps_its_clock_while_detached(start_server):
    """``late_input = "fill"``: while nobody is connected the session steps silence, its output
    goes to the journal, and the client that comes back hears all of it, once."""
    running = await start_server('runtime.late_input="fill"', "runtime.fill_after_ms=40")
    peer = DuplexPeer(running.port)
    async with trio.open_nursery() as connections:
        await peer.start(connections)
        for message in frames(3, seed=9):
            await peer.send(message)
        (session,) = running.server.runtime.sessions
        peer.cut()
        await wait_for(lambda: session.state.value == "detached", "the server noticing the drop")
        filled = session.summary().frames_filled
        await wait_for(lambda: session.summary().frames_filled >= filled + 5, "silence stepped while away")
        await peer.resume(connections)
        await peer.send(json.dumps({"type": "input.end"}))
        with trio.fail_after(PATIENCE):
            end = await peer.until_end()
            await peer.ws.aclose()
        connections.cancel_scope.cancel()
    usage = end["usage"]
    assert usage["frames_filled"] >= 5 and usage["frames_out"] == usage["frames_in"]
    assert len(peer.heard) == usage["frames_out"] * FRAME * 4  # every output frame heard once
    assert bytes(peer.heard[:3 * FRAME * 4]) == b"".join(frames(3, seed=9))
