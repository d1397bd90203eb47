"""A client's own Close ends its session at once, however much of its audio waits for the model.

A model slower than real time leaves a caller's audio queued ahead of it: in the socket, read and
not yet taken, and in the slot's inbox.  A full-duplex caller who hangs up must free the slot at
once (docs/resume.md: "a client's own Close ends the session at once"): the queued audio is for a
call that no longer exists, and nobody hears its answer.  Here the model is stalled outright (the
synthetic model behind a test gate, ``ControlledBackend``): no queued frame can be stepped while
the gate is closed, so a session that ends before the gate opens did not wait for them, and
nothing depends on how fast this machine is.  The one bound on real time is ``PATIENCE``, far
above the milliseconds it takes.

An end of input that is not a Close (``input.end``) is a caller still listening: it waits for its
frames.  A drop without a Close keeps the session for its resume (docs/resume.md); with resume
off, or on Twilio's route (which cannot resume), a drop ends it at once like a Close.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import trio
import trio_websocket

from duplexrt.audio import make_encoder
from duplexrt.client.protocols import ClientProtocol, DuplexClient, LiveClient, MoshiClient, RealtimeClient, TwilioClient
from duplexrt.audio import AudioFormat, AudioSpec
from conftest import FRAME, PATIENCE, ControlledBackend, Served, wait_until

#: ``runtime.inbox_depth``'s default: frames a session submits ahead of the model.
INBOX = 8
#: Seconds of audio each caller sends at once: far more than the inbox holds.
SECONDS = 6


def _client(route: str) -> tuple[ClientProtocol, str]:
    if route == "duplex":
        return DuplexClient(AudioSpec(AudioFormat.PCM_F32LE, 24000)), "/v1/duplex"
    if route == "realtime":
        return RealtimeClient(), "/v1/realtime"
    if route == "live":
        return LiveClient(), "/v1/live/sessions"
    if route == "moshi":
        return MoshiClient(), "/api/chat"
    assert route == "twilio"
    return TwilioClient(), "/twilio/media"


def _audio_messages(protocol: ClientProtocol, seconds: float) -> list[bytes | str]:
    """``seconds`` of noise as the route's audio messages, one 80 ms frame each."""
    frames = int(seconds / 0.08)
    pcm = (np.random.default_rng(7).standard_normal(frames * FRAME) * 0.1).astype(np.float32)
    encoder = make_encoder(protocol.input_spec, 24000)
    payloads = [encoder.encode(pcm[i * FRAME:(i + 1) * FRAME]) for i in range(frames)]
    return [protocol.audio(payload) for payload in payloads if len(payload)]


class Caller:
    """One caller on ``route``: it opens the session, sends its audio at once, and hangs up."""

    def __init__(self, running: Served, route: str) -> None:
        self.running = running
        self.route = route
        self.protocol, path = _client(route)
        self.url = self.protocol.url(running.url(path))
        self.stream: trio.SocketStream | None = None
        self.ws: trio_websocket.WebSocketConnection | None = None

    async def open(self, nursery: trio.Nursery) -> None:
        host, _, resource = self.url.removeprefix("ws://").partition("/")
        self.stream = await trio.open_tcp_stream("127.0.0.1", self.running.port)
        self.ws = await trio_websocket.wrap_client_stream(nursery, self.stream, "127.0.0.1", "/" + resource,
                                                         message_queue_size=0)
        for message in self.protocol.hello():
            await self.ws.send_message(message)
        if self.protocol.greets:
            await self.ws.get_message()

    async def send_audio(self, seconds: float = SECONDS) -> None:
        for message in _audio_messages(self.protocol, seconds):
            await self.ws.send_message(message)


async def _serve_stalled(start_server, *overrides: str) -> tuple[Served, ControlledBackend]:
    backend: ControlledBackend | None = None

    def make(config) -> ControlledBackend:
        nonlocal backend
        backend = ControlledBackend(config, stalled=True)
        return backend

    running = await start_server("backend.name=synthetic", *overrides, backend=make)
    assert backend is not None
    return running, backend


async def _queued_behind_the_model(running: Served, backend: ControlledBackend):
    """The model holds the session's first frame in a step that cannot end, the slot's inbox is
    full behind it, and the rest of the audio waits in the connection: the session's reader waits
    for the model.  Returns the session."""
    await backend.wait_stalled()
    (session,) = running.server.runtime.sessions
    await wait_until(lambda: session.frames_in == INBOX, "the inbox full behind the stalled step")
    return session


def _ended(running: Served, route_path: str) -> dict[str, int]:
    frames = running.server.statistics().runtime.frames
    return frames.sessions_ended.get(route_path, {})


ROUTES = ["duplex", "realtime", "live", "moshi", "twilio"]


@pytest.mark.parametrize("route", ROUTES)
async def test_a_close_ends_the_session_at_once_and_drops_the_audio_queued_for_the_model(route, start_server):
    running, backend = await _serve_stalled(start_server)
    scheduler = running.server.runtime.scheduler
    caller = Caller(running, route)
    try:
        async with trio.open_nursery() as connection:
            with trio.fail_after(PATIENCE):
                await caller.open(connection)
                await caller.send_audio()
                session = await _queued_behind_the_model(running, backend)
                assert scheduler.free_slots == 3
                await caller.ws.aclose(1000)  # the server answers the Close: it read past the audio
                await wait_until(lambda: scheduler.free_slots == 4, "the slot freed")
            # Freed while the model still held the first frame: nothing queued was stepped.
            assert backend.gate.is_set() is False and len(backend.step_rows) == 1
            assert running.server.runtime.sessions == set()
            assert session.lifecycle.finish_reason == "client_closed"
            assert session.frames_dropped == INBOX - 1  # the inbox behind the step that holds the first
            path = caller.url.split(str(running.port), 1)[1].split("?", 1)[0]
            assert _ended(running, path).get("client_closed") == 1
            connection.cancel_scope.cancel()
    finally:
        backend.release()


@pytest.mark.parametrize("route", ["duplex", "twilio"])
async def test_with_resume_off_a_drop_with_no_close_also_ends_the_session_at_once(route, start_server):
    """Twilio's route cannot resume; with ``runtime.resume_window_s = 0`` no route can: a lost
    connection is a caller gone, as a Close is."""
    running, backend = await _serve_stalled(start_server, "runtime.resume_window_s=0")
    scheduler = running.server.runtime.scheduler
    caller = Caller(running, route)
    try:
        async with trio.open_nursery() as connection:
            with trio.fail_after(PATIENCE):
                await caller.open(connection)
                await caller.send_audio()
                session = await _queued_behind_the_model(running, backend)
                caller.stream.socket.close()  # no Close frame
                await wait_until(lambda: scheduler.free_slots == 4, "the slot freed")
            assert len(backend.step_rows) == 1
            assert session.lifecycle.finish_reason == "client_closed"
            assert session.frames_dropped == INBOX - 1
            connection.cancel_scope.cancel()
    finally:
        backend.release()


async def test_a_drop_with_no_close_keeps_the_session_for_its_resume(start_server):
    """docs/resume.md: a connection lost without a Close does not end the session: it keeps its
    slot for the resume window, even once the server has read to the end of the connection."""
    running, backend = await _serve_stalled(start_server)
    scheduler = running.server.runtime.scheduler
    caller = Caller(running, "duplex")
    async with trio.open_nursery() as connection:
        with trio.fail_after(PATIENCE):
            await caller.open(connection)
            await caller.send_audio(2)
            session = await _queued_behind_the_model(running, backend)
            wire = session._transport._current._connection
            caller.stream.socket.close()  # no Close frame
            await wait_until(lambda: wire.gone is not None, "the server reading to the end of the connection")
            assert scheduler.free_slots == 3 and session.lifecycle.finish_reason is None
            backend.release()  # the model goes on: the session notices the drop and waits for a resume
            await wait_until(lambda: session.state.value == "detached", "the server noticing the drop")
        assert scheduler.free_slots == 3 and session.lifecycle.finish_reason is None
        assert session.frames_dropped == 0
        connection.cancel_scope.cancel()


async def test_input_end_is_no_close_and_every_queued_frame_is_answered(start_server):
    """``input.end`` (like a Realtime commit, or a model's flush) is a caller still listening:
    the session answers every frame queued before it, then ends with ``stop``."""
    running, backend = await _serve_stalled(start_server)
    caller = Caller(running, "duplex")
    heard = 0
    async with trio.open_nursery() as connection:
        with trio.fail_after(PATIENCE):
            await caller.open(connection)
            await caller.send_audio(2)
            await caller.ws.send_message(json.dumps({"type": "input.end"}))
            await _queued_behind_the_model(running, backend)
            backend.release()
            while True:
                message = await caller.ws.get_message()
                if isinstance(message, str):
                    end = json.loads(message)
                    if end["type"] == "session.end":
                        break
                else:
                    heard += len(message)
        connection.cancel_scope.cancel()
    assert end["reason"] == "stop"
    assert end["usage"]["frames_in"] == end["usage"]["frames_out"] == 25
    assert heard == 25 * FRAME * 4
