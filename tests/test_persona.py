"""A caller's persona (role prompt and voice), from every route to the model.

The model is ``PersonaEcho`` (tests/persona_backend.py): the echo model with the persona
interface, recording what it was asked and when.  The rest is real: the scheduler thread, the
sessions, the routes over loopback WebSockets.  What is checked, route by route: the persona
asked for reaches ``set_persona`` before the slot's first frame (defaults when nothing was
asked), refusals are clear and end nothing but what they must, a change after the first audio is
refused while the call goes on, hostile clients leave no slot held, and the caller's strings
reach the model's check untouched.  A model that takes no persona keeps every route as it was.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import urllib.parse

import numpy as np
import pytest
import trio
import trio_websocket

from conftest import (FRAME, PATIENCE, ClientLog, RecordingOwner, Served, frame_of, make_config, run_client,
                      serve_personaplex_tiny, wait_until)
from duplexrt.backends.base import Persona, PersonaError, PersonaRequest
from duplexrt.core.scheduler import BackendStepError, SlotClosedError
from duplexrt.protocols.moshi import HANDSHAKE_MESSAGE, MoshiTranslator
from duplexrt.protocols.options import MOSHI_IGNORED_PARAMETERS, moshi_persona
from duplexrt.protocols.base import PersonaChoice, PersonaLocked
from duplexrt.protocols.raw import RawTranslator
from duplexrt.protocols.realtime import RealtimeTranslator
from duplexrt.runtime import open_runtime
from duplexrt.server.app import persona_line
from duplexrt.wire.transport import memory_transport_pair
from persona_backend import DEFAULT_TEXT, DEFAULT_VOICE, VOICES, PersonaEcho
from realtime_schema import check_server_event

PCM_FRAME = FRAME * 2  # bytes of one 80 ms frame of pcm16 at 24 kHz
#: What no caller's string may lose on its way to the model: right-to-left text, emoji with a skin
#: tone, a combining accent, a NUL, a right-to-left override, a ligature, a zero-width joiner.
UNUSUAL = "مرحبا שלום 👋🏽 e\u0301 \x00 \u202eevil\u202c ﷽ \u200d end"


def check(text: str | None = None, voice: str | None = None) -> PersonaRequest:
    return PersonaRequest(text, voice)


def _check(request: PersonaRequest) -> Persona:
    voice = request.voice or DEFAULT_VOICE
    if voice not in VOICES:
        raise PersonaError(f"unknown voice {voice!r}; the voices are {', '.join(VOICES)}")
    text = DEFAULT_TEXT if request.text is None else request.text
    return Persona(voice, text, tuple(map(ord, text)))


def pcm_frames(count: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(count * FRAME) * 3000).clip(-32000, 32000).astype("<i2").tobytes()


# -- PersonaChoice: what a translator and its session share ------------------------------------------


def test_a_choice_merges_what_is_asked_checks_it_and_locks_once_fixed():
    choice = PersonaChoice()
    assert not choice.taken and choice.current() is None and choice.fix() is None
    with pytest.raises(PersonaError):
        choice.ask("x")  # a model that takes none: nothing to ask
    choice = PersonaChoice()
    choice.check = _check
    assert choice.current() == Persona(DEFAULT_VOICE, DEFAULT_TEXT, tuple(map(ord, DEFAULT_TEXT)))
    assert choice.ask(voice="NATF2").voice == "NATF2"
    assert choice.ask(text="be brief") == Persona("NATF2", "be brief", tuple(map(ord, "be brief")))  # voice kept
    with pytest.raises(PersonaError, match="NATF0, NATF2"):
        choice.ask(voice="nobody")
    assert choice.current().voice == "NATF2"  # a refused ask leaves the persona in effect
    fixed = choice.fix()
    assert choice.fixed and fixed == choice.current()
    assert choice.ask(text="be brief", voice="NATF2") is fixed  # asked again as it is: no change
    assert choice.ask() is fixed
    with pytest.raises(PersonaLocked, match="fixed"):
        choice.ask(voice="NATM1")
    with pytest.raises(PersonaLocked):
        choice.ask(voice="nobody")  # after the lock, even a bad one is simply "locked"
    assert choice.current() is fixed


def test_an_openai_stock_voice_the_model_lacks_is_its_default_voice():
    choice = PersonaChoice()
    choice.check = _check
    assert choice.ask(voice="alloy").voice == DEFAULT_VOICE  # what LiveKit and pipecat send by default
    assert choice.ask(voice="Shimmer").voice == DEFAULT_VOICE
    assert choice.ask(voice="NATF2").voice == "NATF2"
    with pytest.raises(PersonaError, match="nobody"):
        choice.ask(voice="nobody")


def test_after_the_lock_the_default_voice_by_its_name_is_no_change():
    choice = PersonaChoice()
    choice.check = _check
    choice.fix()
    assert choice.ask(voice=DEFAULT_VOICE).voice == DEFAULT_VOICE


def test_the_moshi_route_reads_nvidias_query_as_it_is():
    assert moshi_persona({"text_prompt": "hi", "voice_prompt": "NATF2.pt"}) == check("hi", "NATF2.pt")
    assert moshi_persona({"text_prompt": "", "voice_prompt": "../x.pt"}) == check("", "../x.pt")
    assert moshi_persona({}) == check()
    assert "text_temperature" in MOSHI_IGNORED_PARAMETERS and "email" in MOSHI_IGNORED_PARAMETERS


def test_the_moshi_handshake_waits_for_the_persona_only_where_the_model_takes_one():
    plain = MoshiTranslator()
    assert plain.start() == [HANDSHAKE_MESSAGE] and plain.persona_ready() == []
    persona = MoshiTranslator()
    persona.persona.check = _check
    assert persona.start() == []
    assert persona.persona_ready() == [HANDSHAKE_MESSAGE]
    assert persona.persona_ready() == []  # once


def test_the_realtime_session_object_shows_the_persona_in_either_naming():
    for beta in (False, True):
        protocol = RealtimeTranslator(beta=beta)
        protocol.persona.check = _check
        [created] = map(json.loads, protocol.start())
        check_server_event(created, beta=beta)
        session = created["session"]
        voice = session["voice"] if beta else session["audio"]["output"]["voice"]
        assert (session["instructions"], voice) == (DEFAULT_TEXT, DEFAULT_VOICE)
        reply = protocol.parse(json.dumps({"type": "session.update", "session": {
            "instructions": "be brief", **({"voice": "NATM1"} if beta else {"audio": {"output": {"voice": "NATM1"}}})}}))
        [updated] = map(json.loads, reply.messages)
        check_server_event(updated, beta=beta)
        session = updated["session"]
        assert session["instructions"] == "be brief"
        assert (session["voice"] if beta else session["audio"]["output"]["voice"]) == "NATM1"


@pytest.mark.parametrize("session, message", [
    ({"instructions": 5}, "session.instructions must be a string"),
    ({"voice": ["NATF2"]}, "session.voice must be a voice's name"),
    ({"voice": "NATF2", "audio": {"output": {"voice": "NATM1"}}}, "disagree"),
])
def test_a_malformed_persona_refuses_the_whole_update(session, message):
    protocol = RealtimeTranslator()
    protocol.persona.check = _check
    event = protocol.parse(json.dumps({"type": "session.update", "event_id": "e1", "session": session}))
    assert event.code == "invalid_value" and message in event.message and event.event_id == "e1"


def test_the_ga_voice_object_names_the_voice_by_its_id():
    protocol = RealtimeTranslator()
    protocol.persona.check = _check
    protocol.parse(json.dumps({"type": "session.update", "session": {"audio": {"output": {"voice": {"id": "VARF3"}}}}}))
    assert protocol.persona.current().voice == "VARF3"


def test_a_model_without_persona_still_ignores_malformed_instructions_and_voices():
    protocol = RealtimeTranslator()
    event = protocol.parse(json.dumps({"type": "session.update", "session": {"instructions": 5, "voice": ["x"]}}))
    [updated] = map(json.loads, event.messages)
    assert updated["type"] == "session.updated" and "instructions" not in updated["session"]


def test_the_start_line_names_the_voices():
    line = persona_line(PersonaEcho.persona_info(None))  # type: ignore[arg-type]
    assert "NATF0, NATF2, NATM1, VARF3" in line and f"default {DEFAULT_VOICE}" in line and "/api/chat" in line


# -- the scheduler: the control, and its failures ---------------------------------------------------------


class PersonaOwner(RecordingOwner):
    def __init__(self) -> None:
        super().__init__()
        self.persona_acks = 0

    def persona_set(self) -> None:
        self.persona_acks += 1
        self._lot.unpark_all()

    async def wait_for_ack(self) -> None:
        with trio.fail_after(PATIENCE):
            while not self.persona_acks:
                await self._lot.park()


async def test_the_persona_reaches_the_backend_before_the_first_frame_and_is_acknowledged():
    config = make_config("runtime.slots=2", "backend.options.delay_frames=0")
    backend = PersonaEcho(config)
    async with open_runtime(config, backend=backend) as runtime:
        owner = PersonaOwner()
        lease = runtime.scheduler.open_slot(owner)
        persona = _check(check("be brief", "NATF2"))
        lease.set_persona(persona)
        assert lease.submit_nowait(frame_of(0.25))  # queued right behind it: applied first all the same
        await owner.wait_for(outputs=1)
        assert owner.persona_acks == 1 and owner.failures == []
        assert backend.set_calls == [(lease.slot, persona, 0)] and backend.unprompted == []
        with pytest.raises(RuntimeError, match="once"):
            lease.set_persona(persona)
        lease.release()
        with pytest.raises(SlotClosedError):
            lease.set_persona(persona)


@pytest.mark.parametrize("voice, error", [("NATM1", PersonaError), ("VARF3", BackendStepError)])
async def test_a_refused_persona_fails_that_session_alone_and_none_of_its_frames_is_stepped(voice, error):
    config = make_config("runtime.slots=3", "backend.options.delay_frames=0")
    backend = PersonaEcho(config, refuse_voices=("NATM1",), break_voices=("VARF3",))
    async with open_runtime(config, backend=backend) as runtime:
        scheduler = runtime.scheduler
        bad, good = PersonaOwner(), PersonaOwner()
        bad_lease, good_lease = scheduler.open_slot(bad), scheduler.open_slot(good)
        bad_lease.set_persona(_check(check(voice=voice)))
        good_lease.set_persona(_check(check(voice="NATF2")))
        for value in (0.1, 0.2, 0.3):
            assert bad_lease.submit_nowait(frame_of(value))
            assert good_lease.submit_nowait(frame_of(-value))
        await bad.wait_for(failures=1)
        await good.wait_for(outputs=3)
        [failure] = bad.failures
        assert isinstance(failure, error) and bad.outputs == [] and bad.persona_acks == 0
        if error is PersonaError:
            assert "cannot be loaded" in str(failure)  # the caller's to read
            assert scheduler.statistics().failed_steps == 0  # the model is not failing
        else:
            assert "CUDA" not in str(failure) and "error id" in str(failure)  # generic; the details are logged
            assert scheduler.statistics().failed_steps == 1
        assert bad_lease.slot not in backend.stepped_slots and backend.unprompted == []
        assert good.failures == [] and good.persona_acks == 1
        bad_lease.release()
        # The slot is whole again for the next session.
        again = PersonaOwner()
        lease = scheduler.open_slot(again)
        assert lease.slot == bad_lease.slot
        lease.set_persona(_check(check()))
        assert lease.submit_nowait(frame_of(0.5))
        await again.wait_for(outputs=1)
        assert again.failures == [] and backend.unprompted == []
        assert scheduler.ready and not scheduler.failing
        for lease in (good_lease, lease):
            lease.release()



async def test_a_persona_handed_to_runtime_serve_unchecked_is_refused_before_any_frame():
    config = make_config("runtime.slots=2", "backend.options.delay_frames=0")
    backend = PersonaEcho(config)
    async with open_runtime(config, backend=backend) as runtime:
        protocol = RawTranslator(runtime.audio_spec("pcm_s16le"))
        protocol.persona.request = PersonaRequest("hi", "nobody")
        client, server = memory_transport_pair()
        outcome: dict = {}

        async def serve() -> None:
            outcome["end"] = await runtime.serve(server, protocol)

        with trio.fail_after(PATIENCE):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve)
                log = await run_client(client, [pcm_frames(3)], ClientLog())
    end = outcome["end"]
    assert end.reason == "error" and "refused the persona" in end.error and "nobody" in end.error
    assert log.close_code == 1008 and log.end["reason"] == "error"
    assert backend.set_calls == [] and backend.stepped_slots == set()

# -- over the wire: helpers ----------------------------------------------------------------------------------

#: One open response from the start, every output frame in it: the audio that comes back says
#: which frames the model has stepped.
REALTIME = "/v1/realtime?duplex=1&continuous=1"
LIVE = "/v1/live/sessions"


async def persona_server(start_server, *overrides: str, **options) -> tuple:
    running = await start_server(*overrides, backend=lambda config: PersonaEcho(config, **options))
    return running, running.server.runtime.backend


def set_personas(backend: PersonaEcho) -> list[tuple[str, str, int]]:
    """``(voice, text, frames stepped before)`` of each ``set_persona``, in order."""
    return [(persona.voice, persona.text, stepped) for _, persona, stepped in backend.set_calls]


class JsonCall:
    """A Realtime or Live client over a real WebSocket: every event it read, in order, and the
    model audio among them."""

    def __init__(self, ws: trio_websocket.WebSocketConnection, *, live: bool = False) -> None:
        self.ws = ws
        self.live = live
        self.events: list[dict] = []
        self.audio = bytearray()
        self.closed: trio_websocket.ConnectionClosed | None = None

    async def send(self, kind: str, **fields) -> None:
        await self.ws.send_message(json.dumps({"type": kind, **fields}))

    async def append(self, pcm: bytes) -> None:
        kind = "session.input_audio.append" if self.live else "input_audio_buffer.append"
        for start in range(0, len(pcm), PCM_FRAME):
            await self.send(kind, audio=base64.b64encode(pcm[start:start + PCM_FRAME]).decode())

    async def _read(self) -> dict:
        with trio.fail_after(PATIENCE):
            event = json.loads(await self.ws.get_message())
        self.events.append(event)
        if event["type"] in ("response.output_audio.delta", "response.audio.delta", "session.output_audio.delta"):
            self.audio += base64.b64decode(event["delta"])
        return event

    async def next(self, *kinds: str) -> dict:
        """The next event of one of ``kinds`` (the others are kept in ``events``)."""
        while (event := await self._read())["type"] not in kinds:
            pass
        return event

    async def wait_audio(self, frames: int) -> None:
        while len(self.audio) < frames * PCM_FRAME:
            await self._read()

    async def read_to_close(self) -> None:
        try:
            while True:
                await self._read()
        except trio_websocket.ConnectionClosed as closed:
            self.closed = closed

    def errors(self) -> list[dict]:
        return [event["error"] for event in self.events if event["type"] == "error"]


def voice_of(session: dict) -> str:
    return session["voice"] if "voice" in session else session["audio"]["output"]["voice"]


async def free_slots_come_back(running, slots: int = 4) -> None:
    scheduler = running.server.runtime.scheduler
    await wait_until(lambda: scheduler.free_slots == slots and running.server.admitted == 0, "every slot is free")


# -- /v1/realtime ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("beta", [False, True], ids=["ga", "beta"])
async def test_realtime_session_update_sets_the_persona_before_the_first_frame(start_server, beta):
    running, backend = await persona_server(start_server)
    headers = [(b"openai-beta", b"realtime=v1")] if beta else []
    voice = {"voice": "NATF2"} if beta else {"audio": {"output": {"voice": "NATF2"}}}
    async with trio_websocket.open_websocket_url(running.url(REALTIME), extra_headers=headers) as ws:
        call = JsonCall(ws)
        created = await call.next("session.created")
        assert (created["session"]["instructions"], voice_of(created["session"])) == (DEFAULT_TEXT, DEFAULT_VOICE)
        await call.send("session.update", session={"instructions": "You are a pirate.", **voice})
        updated = await call.next("session.updated")
        assert (updated["session"]["instructions"], voice_of(updated["session"])) == ("You are a pirate.", "NATF2")
        await call.append(pcm_frames(3))
        await call.wait_audio(3)
        assert call.errors() == []
    assert set_personas(backend) == [("NATF2", "You are a pirate.", 0)]
    assert backend.unprompted == []


async def test_realtime_defaults_when_the_caller_sets_nothing(start_server):
    running, backend = await persona_server(start_server)
    async with trio_websocket.open_websocket_url(running.url(REALTIME)) as ws:
        call = JsonCall(ws)
        await call.next("session.created")
        await call.send("session.update", session={"type": "realtime"})  # pipecat's, with nothing of a persona
        await call.next("session.updated")
        await call.append(pcm_frames(2))
        await call.wait_audio(2)
    assert set_personas(backend) == [(DEFAULT_VOICE, DEFAULT_TEXT, 0)]


@pytest.mark.parametrize("voice, said", [("nobody", "unknown voice 'nobody'"), ("../x.pt", "not a path"),
                                         ("/etc/passwd", "not a path")])
async def test_realtime_refused_voice_is_a_non_fatal_error_naming_the_voices(start_server, voice, said):
    running, backend = await persona_server(start_server)
    async with trio_websocket.open_websocket_url(running.url(REALTIME)) as ws:
        call = JsonCall(ws)
        await call.next("session.created")
        # The rest of the update (here the input format) is applied all the same.
        await call.send("session.update", event_id="u1", session={
            "instructions": "be brief", "audio": {"output": {"voice": voice}, "input": {"format": {"type": "audio/pcmu"}}}})
        updated = await call.next("session.updated")
        error = (await call.next("error"))["error"]
        assert updated["session"]["audio"]["input"]["format"]["type"] == "audio/pcmu"
        assert (updated["session"]["instructions"], voice_of(updated["session"])) == (DEFAULT_TEXT, DEFAULT_VOICE)
        assert error["code"] == "invalid_persona" and error["event_id"] == "u1"
        assert said in error["message"] and ", ".join(VOICES) in error["message"]
        await call.send("session.update", session={"audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}}}})
        await call.next("session.updated")
        await call.append(pcm_frames(2))
        await call.wait_audio(2)  # the call goes on
    assert set_personas(backend) == [(DEFAULT_VOICE, DEFAULT_TEXT, 0)]


async def test_realtime_persona_change_after_audio_is_locked_and_the_call_goes_on(start_server):
    running, backend = await persona_server(start_server)
    persona = {"instructions": "You are a pirate.", "audio": {"output": {"voice": "NATF2"}}}
    async with trio_websocket.open_websocket_url(running.url(REALTIME)) as ws:
        call = JsonCall(ws)
        await call.next("session.created")
        await call.send("session.update", session=persona)
        await call.next("session.updated")
        await call.append(pcm_frames(2))
        await call.wait_audio(2)  # the first frame was stepped: the persona is fixed
        # A framework re-sending its whole session, persona as it is: no change, no error.
        await call.send("session.update", event_id="same", session={**persona, "tools": []})
        await call.send("session.update", event_id="change", session={"audio": {"output": {"voice": "NATM1"}}})
        await call.send("session.update", event_id="text", session={"instructions": "You are a robot."})
        updates = [await call.next("session.updated") for _ in range(3)]
        await call.append(pcm_frames(2, seed=1))
        await call.wait_audio(4)  # the call goes on
        assert all((u["session"]["instructions"], voice_of(u["session"])) == ("You are a pirate.", "NATF2")
                   for u in updates)
        errors = call.errors()
        assert [(e["code"], e["event_id"]) for e in errors] == [("persona_locked", "change"), ("persona_locked", "text")]
        assert "fixed" in errors[0]["message"] and "goes on" in errors[0]["message"]
    assert set_personas(backend) == [("NATF2", "You are a pirate.", 0)]


async def test_realtime_a_flood_of_session_updates_keeps_the_last_persona_and_answers_each(start_server):
    running, backend = await persona_server(start_server)
    count = 300
    async with trio_websocket.open_websocket_url(running.url(REALTIME)) as ws:
        call = JsonCall(ws)
        await call.next("session.created")

        async def flood() -> None:
            for i in range(count):
                await call.send("session.update", session={"instructions": f"prompt {i} " + "x" * 1000,
                                                           "voice": VOICES[i % len(VOICES)]})
            await call.append(pcm_frames(1))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(flood)
            updates = [await call.next("session.updated") for _ in range(count)]
        await call.wait_audio(1)
        assert call.errors() == []
        assert voice_of(updates[-1]["session"]) == VOICES[(count - 1) % len(VOICES)]
    assert set_personas(backend) == [(VOICES[(count - 1) % len(VOICES)], f"prompt {count - 1} " + "x" * 1000, 0)]


async def test_realtime_unusual_and_empty_strings_reach_the_check_untouched(start_server):
    running, backend = await persona_server(start_server)
    async with trio_websocket.open_websocket_url(running.url(REALTIME)) as ws:
        call = JsonCall(ws)
        await call.next("session.created")
        await call.send("session.update", session={"instructions": UNUSUAL})
        updated = await call.next("session.updated")
        assert updated["session"]["instructions"] == UNUSUAL
        await call.send("session.update", session={"instructions": ""})
        updated = await call.next("session.updated")
        assert updated["session"]["instructions"] == ""
        await call.append(pcm_frames(1))
        await call.wait_audio(1)
    assert PersonaRequest(UNUSUAL, None) in backend.requests and PersonaRequest("", None) in backend.requests
    assert set_personas(backend) == [(DEFAULT_VOICE, "", 0)]


async def test_realtime_hanging_up_right_after_setting_a_persona_holds_no_slot(start_server):
    running, backend = await persona_server(start_server)
    for frames in (0, 1):  # before any audio, and right behind the first frame
        async with trio_websocket.open_websocket_url(running.url(REALTIME)) as ws:
            call = JsonCall(ws)
            await call.next("session.created")
            await call.send("session.update", session={"instructions": "hang up", "voice": "NATM1"})
            if frames:
                await call.append(pcm_frames(frames))
        await free_slots_come_back(running)
    assert [voice for voice, _, _ in set_personas(backend)] in ([], ["NATM1"])
    assert backend.unprompted == []


# -- /v1/live/sessions ----------------------------------------------------------------------------------------


async def test_live_session_start_sets_the_persona_and_a_change_after_audio_is_locked(start_server):
    running, backend = await persona_server(start_server)
    async with trio_websocket.open_websocket_url(running.url(LIVE)) as ws:
        call = JsonCall(ws, live=True)
        await call.send("session.start", session={"model": "gpt-live-1", "instructions": UNUSUAL, "audio": {
            "format": {"type": "audio/pcm", "rate": 24000}, "output": {"voice": "VARF3"}}})
        started = await call.next("session.started")
        assert started["session"]["instructions"] == UNUSUAL
        assert started["session"]["audio"]["output"] == {"voice": "VARF3"}
        await call.append(pcm_frames(2))
        await call.wait_audio(2)
        await call.send("session.update", event_id="u1", session={"audio": {"output": {"voice": "NATF0"}}})
        updated = await call.next("session.updated")
        error = (await call.next("error"))["error"]
        assert updated["session"]["audio"]["output"] == {"voice": "VARF3"}
        assert (error["code"], error["client_event_id"]) == ("persona_locked", "u1")
        await call.append(pcm_frames(1, seed=2))
        await call.wait_audio(3)  # the call goes on
        await call.send("session.close")
        await call.next("session.closed")
    assert set_personas(backend) == [("VARF3", UNUSUAL, 0)]
    assert PersonaRequest(UNUSUAL, "VARF3") in backend.requests


async def test_live_defaults_and_a_refused_voice_at_start_is_fatal_with_the_voices(start_server):
    running, backend = await persona_server(start_server)
    async with trio_websocket.open_websocket_url(running.url(LIVE)) as ws:
        call = JsonCall(ws, live=True)
        await call.send("session.start", session={"audio": {"output": {"voice": "nobody"}}})
        await call.read_to_close()
    [error] = call.errors()
    assert error["code"] == "invalid_persona" and "unknown voice 'nobody'" in error["message"]
    assert ", ".join(VOICES) in error["message"] and "cannot start" in error["message"]
    assert call.closed.reason.code == 1008
    async with trio_websocket.open_websocket_url(running.url(LIVE)) as ws:
        call = JsonCall(ws, live=True)
        await call.send("session.start", session={})
        started = await call.next("session.started")
        assert started["session"]["instructions"] == DEFAULT_TEXT
        await call.append(pcm_frames(1))
        await call.wait_audio(1)
    assert set_personas(backend) == [(DEFAULT_VOICE, DEFAULT_TEXT, 0)]
    await free_slots_come_back(running)


# -- /v1/duplex ----------------------------------------------------------------------------------------------------


def duplex_url(running, **query: str) -> str:
    return running.url("/v1/duplex?" + urllib.parse.urlencode({"format": "pcm_s16le", **query}))


async def duplex_call(url: str, frames: int) -> tuple[dict, bytes, dict]:
    """session.created, the audio back, and session.end, for ``frames`` frames of pcm16 in."""
    async with trio_websocket.open_websocket_url(url) as ws:
        created = json.loads(await ws.get_message())
        await ws.send_message(pcm_frames(frames))
        await ws.send_message(json.dumps({"type": "input.end"}))
        audio = b""
        with trio.fail_after(PATIENCE):
            while isinstance(message := await ws.get_message(), bytes):
                audio += message
    return created, audio, json.loads(message)


async def test_duplex_query_sets_the_persona_at_start_and_created_shows_it(start_server):
    running, backend = await persona_server(start_server)
    created, audio, end = await duplex_call(duplex_url(running, instructions=UNUSUAL, voice="NATM1"), 3)
    assert created["persona"] == {"voice": "NATM1", "instructions": UNUSUAL, "prompt_tokens": len(UNUSUAL)}
    assert len(audio) == 3 * PCM_FRAME and end["reason"] == "stop"
    created, _, _ = await duplex_call(duplex_url(running), 1)  # nothing asked: the defaults
    assert created["persona"]["voice"] == DEFAULT_VOICE
    created, _, _ = await duplex_call(duplex_url(running, instructions=""), 1)  # empty is not absent
    assert created["persona"]["instructions"] == ""
    assert set_personas(backend) == [("NATM1", UNUSUAL, 0), (DEFAULT_VOICE, DEFAULT_TEXT, 0), (DEFAULT_VOICE, "", 0)]
    assert PersonaRequest(UNUSUAL, "NATM1") in backend.requests and PersonaRequest("", None) in backend.requests
    assert backend.unprompted == []


@pytest.mark.parametrize("voice, said", [("nobody", b"unknown voice 'nobody'"), ("../x.pt", b"not a path"),
                                         ("/etc/passwd", b"not a path")])
async def test_duplex_refused_persona_is_a_400_before_the_upgrade(start_server, voice, said):
    running, backend = await persona_server(start_server)
    with pytest.raises(trio_websocket.ConnectionRejected) as refused:
        async with trio_websocket.open_websocket_url(duplex_url(running, voice=voice)):
            pass
    assert refused.value.status_code == 400
    assert b"persona refused" in refused.value.body and said in refused.value.body
    assert ", ".join(VOICES).encode() in refused.value.body
    assert running.server.refused["bad_persona"] == 1 and backend.set_calls == []
    await free_slots_come_back(running)


async def test_duplex_a_persona_the_model_fails_to_take_ends_that_session_alone(start_server):
    running, backend = await persona_server(start_server, refuse_voices=("NATM1",))
    async with trio_websocket.open_websocket_url(duplex_url(running)) as healthy:
        await healthy.get_message()
        async with trio_websocket.open_websocket_url(duplex_url(running, voice="NATM1")) as doomed:
            assert json.loads(await doomed.get_message())["persona"]["voice"] == "NATM1"  # it passed the check
            with trio.fail_after(PATIENCE):
                end = json.loads(await doomed.get_message())
                with pytest.raises(trio_websocket.ConnectionClosed) as closed:
                    await doomed.get_message()
        assert end["reason"] == "error" and "refused the persona" in end["error"] and "cannot be loaded" in end["error"]
        assert closed.value.reason.code == 1008
        await healthy.send_message(pcm_frames(2))  # the other session goes on
        audio = b""
        with trio.fail_after(PATIENCE):
            while len(audio) < 2 * PCM_FRAME:
                audio += await healthy.get_message()
    assert backend.unprompted == [] and not running.server.runtime.scheduler.failing
    await free_slots_come_back(running)


# -- /api/chat (Kyutai's protocol, NVIDIA's PersonaPlex client) ---------------------------------------------


#: What NVIDIA's web client sends (client/src/pages/Conversation/Conversation.tsx), persona aside.
NVIDIA_QUERY = {"worker_auth_id": "abc", "email": "a@b.c", "text_temperature": "0.7", "text_topk": "25",
                "audio_temperature": "0.8", "audio_topk": "250", "pad_mult": "0", "text_seed": "123456",
                "audio_seed": "654321", "repetition_penalty_context": "64", "repetition_penalty": "1"}


def chat_url(running, **persona: str) -> str:
    return running.url("/api/chat?" + urllib.parse.urlencode({**NVIDIA_QUERY, **persona}))


async def test_api_chat_takes_nvidias_query_and_the_handshake_waits_for_the_persona(start_server):
    running, backend = await persona_server(start_server)
    backend.gate.clear()  # the model is still taking the persona (its prompt running)
    try:
        async with trio_websocket.open_websocket_url(
                chat_url(running, text_prompt=UNUSUAL, voice_prompt="NATF2.pt")) as ws:
            with trio.fail_after(PATIENCE):
                await backend.entered.wait()
            # An empty message is answered with an error at once: had the handshake gone before
            # the persona was in, it would come first.
            await ws.send_message(b"")
            with trio.fail_after(PATIENCE):
                assert (await ws.get_message())[:1] == b"\x05"
            backend.gate.set()
            with trio.fail_after(PATIENCE):
                assert await ws.get_message() == HANDSHAKE_MESSAGE
    finally:
        backend.gate.set()
    assert set_personas(backend) == [("NATF2", UNUSUAL, 0)]
    await free_slots_come_back(running)


@pytest.mark.parametrize("voice, said", [("alloy.pt", b"unknown voice 'alloy.pt'"), ("../x.pt", b"not a path"),
                                         ("/etc/passwd", b"not a path")])
async def test_api_chat_refused_persona_is_a_400_naming_the_voices(start_server, voice, said):
    running, backend = await persona_server(start_server)
    with pytest.raises(trio_websocket.ConnectionRejected) as refused:
        async with trio_websocket.open_websocket_url(chat_url(running, text_prompt="hi", voice_prompt=voice)):
            pass
    assert refused.value.status_code == 400 and said in refused.value.body
    assert ", ".join(VOICES).encode() in refused.value.body and backend.set_calls == []


async def test_api_chat_hanging_up_while_the_persona_is_taken_holds_no_slot(start_server):
    running, backend = await persona_server(start_server)
    backend.gate.clear()
    try:
        async with trio_websocket.open_websocket_url(chat_url(running, text_prompt="", voice_prompt="NATM1.pt")):
            with trio.fail_after(PATIENCE):
                await backend.entered.wait()
        await free_slots_come_back(running)  # the session ended while its persona was in the scheduler
    finally:
        backend.gate.set()
    await wait_until(lambda: len(backend.set_calls) == 1, "the persona control was applied")
    assert set_personas(backend) == [("NATM1", "", 0)]
    async with trio_websocket.open_websocket_url(chat_url(running)) as ws:  # the slot serves again
        with trio.fail_after(PATIENCE):
            assert await ws.get_message() == HANDSHAKE_MESSAGE
    await free_slots_come_back(running)


async def test_api_chat_on_a_model_without_persona_accepts_nvidias_query_and_shakes_hands_at_once(start_server):
    running = await start_server()
    async with trio_websocket.open_websocket_url(chat_url(running, text_prompt="hi", voice_prompt="NATF2.pt")) as ws:
        with trio.fail_after(PATIENCE):
            assert await ws.get_message() == HANDSHAKE_MESSAGE


# -- a model that takes no persona: every route as before ---------------------------------------------------


async def test_without_persona_instructions_and_voices_are_accepted_and_not_echoed(start_server):
    running = await start_server()
    async with trio_websocket.open_websocket_url(running.url(REALTIME)) as ws:
        call = JsonCall(ws)
        created = await call.next("session.created")
        await call.send("session.update", session={"instructions": "be brief", "voice": "alloy",
                                                   "audio": {"output": {"voice": "marin"}}})
        updated = await call.next("session.updated")
        await call.append(pcm_frames(1))
        await call.wait_audio(1)
        await call.send("session.update", session={"instructions": "changed", "voice": "ash"})  # after audio
        await call.next("session.updated")
        assert call.errors() == []
        assert updated["session"] == created["session"] and "instructions" not in updated["session"]
    async with trio_websocket.open_websocket_url(running.url(LIVE)) as ws:
        call = JsonCall(ws, live=True)
        await call.send("session.start", session={"instructions": "be brief", "audio": {"output": {"voice": "marin"}}})
        started = await call.next("session.started")
        assert "instructions" not in started["session"] and "output" not in started["session"]["audio"]
    created, _, _ = await duplex_call(duplex_url(running, instructions="x", voice="alloy"), 1)
    assert "persona" not in created


# -- /readyz and /stats -----------------------------------------------------------------------------------------


async def test_readyz_and_stats_say_what_persona_a_caller_may_set(start_server):
    running, _ = await persona_server(start_server)
    _, ready = await running.readyz()
    assert ready["persona"]["voices"] == list(VOICES) and ready["persona"]["default_voice"] == DEFAULT_VOICE
    status, _, body = await running.get("/stats")
    assert status == 200 and json.loads(body)["persona"]["max_prompt_tokens"] > 0


async def test_readyz_and_stats_say_null_for_a_model_without_persona(start_server):
    running = await start_server()
    _, ready = await running.readyz()
    assert ready["persona"] is None
    assert json.loads((await running.get("/stats"))[2])["persona"] is None


# -- the real PersonaPlex (the tiny preset) -------------------------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("moshi") is None or importlib.util.find_spec("torch") is None,
                    reason="the personaplex-tiny preset needs torch and moshi")
async def test_personaplex_tiny_takes_the_persona_from_each_route(nursery):
    """The routes against the real moshi backend's persona (``personaplex-tiny``): NVIDIA's query on
    ``/api/chat`` (its handshake once the prompt is in), a Realtime ``session.update``, and the
    backend's own refusals passed on as they are."""
    served = await serve_personaplex_tiny(nursery)
    server = served.server
    _, ready = await served.readyz()
    voices = ready["persona"]["voices"]
    assert "NATF2" in voices and ready["persona"]["default_voice"] == "NATF2"

    async with trio_websocket.open_websocket_url(
            chat_url(served, text_prompt="You enjoy having a good conversation.", voice_prompt="NATM1.pt")) as ws:
        with trio.fail_after(60):
            assert await ws.get_message() == HANDSHAKE_MESSAGE
    for voice, said in (("alloy.pt", b"alloy"), ("../x.pt", b"path"), ("/etc/passwd", b"path")):
        with pytest.raises(trio_websocket.ConnectionRejected) as refused:
            async with trio_websocket.open_websocket_url(chat_url(served, text_prompt="hi", voice_prompt=voice)):
                pass
        assert refused.value.status_code == 400 and said in refused.value.body and b"NATF2" in refused.value.body

    async with trio_websocket.open_websocket_url(served.url(REALTIME)) as ws:
        call = JsonCall(ws)
        created = await call.next("session.created")
        assert voice_of(created["session"]) == "NATF2"
        await call.send("session.update", session={"instructions": UNUSUAL.replace("\x00", "").replace("\u202e", "")
                                                   .replace("\u202c", ""), "voice": "VARF1"})
        updated = await call.next("session.updated")
        assert voice_of(updated["session"]) == "VARF1"
        await call.send("session.update", event_id="bad", session={"voice": "Nobody"})
        await call.next("session.updated")
        error = (await call.next("error"))["error"]
        assert error["code"] == "invalid_persona" and "NATF2" in error["message"]
        # OpenAI's stock voice (what SDKs send unasked) is the model's default voice, no error.
        await call.send("session.update", session={"voice": "alloy"})
        assert voice_of((await call.next("session.updated"))["session"]) == "NATF2"
        await call.send("session.update", session={"voice": "VARF1"})
        assert voice_of((await call.next("session.updated"))["session"]) == "VARF1"
        await call.append(pcm_frames(2))
        with trio.fail_after(60):
            await call.wait_audio(2)
        await call.send("session.update", event_id="late", session={"voice": "NATF0"})
        await call.next("session.updated")
        assert (await call.next("error"))["error"]["code"] == "persona_locked"
    await free_slots_come_back(served, 2)


@pytest.mark.skipif(importlib.util.find_spec("moshi") is None or importlib.util.find_spec("torch") is None,
                    reason="the personaplex-tiny preset needs torch and moshi")
async def test_personaplex_tiny_join_storm_leaves_nothing_held(nursery):
    """64 callers in one second on 8 slots, each with its own uncached persona, half of them
    hanging up at once (mid-prefill or before): the ones admitted are prompted and answered,
    the rest refused, and afterwards every slot is free, the prompt cache within its bound and
    a new caller served as on a fresh server."""
    served = await serve_personaplex_tiny(nursery, "runtime.slots=8", "backend.options.prompt_cache_mb=1")
    server = served.server
    outcomes: dict[str, int] = {}

    async def caller(i: int) -> None:
        await trio.sleep(i / 64)
        url = duplex_url(served, instructions=f"You are caller {'ka lo mi ne ru sa'.split()[i % 6]} " * (1 + i % 9),
                         voice=["NATF0", "NATM1", "VARF2", "VARM3"][i % 4])
        try:
            async with trio_websocket.open_websocket_url(url) as ws:
                created = json.loads(await ws.get_message())
                assert created["type"] == "session.created"
                if i % 2:  # hangs up at once: its prompt may still be running
                    outcomes["hung up"] = outcomes.get("hung up", 0) + 1
                    return
                await ws.send_message(pcm_frames(2, seed=i))
                await ws.send_message(json.dumps({"type": "input.end"}))
                heard = 0
                with trio.fail_after(120):
                    while True:
                        message = await ws.get_message()
                        if isinstance(message, bytes):
                            heard += len(message)
                        elif json.loads(message)["type"] == "session.end":
                            break  # the model's text comes as "text" events before it
                assert heard == 2 * PCM_FRAME
                outcomes["answered"] = outcomes.get("answered", 0) + 1
        except trio_websocket.ConnectionRejected as exc:
            assert exc.status_code == 503
            outcomes["refused"] = outcomes.get("refused", 0) + 1

    async with trio.open_nursery() as storm:
        for i in range(64):
            storm.start_soon(caller, i)
    print("join storm:", outcomes)
    assert sum(outcomes.values()) == 64 and outcomes.get("answered", 0) >= 1, outcomes
    await free_slots_come_back(served, 8)
    info = server.statistics().runtime.persona
    assert info is not None and info["prompt_cache"]["bytes"] <= info["prompt_cache"]["max_bytes"]
    async with trio_websocket.open_websocket_url(duplex_url(served, instructions="You are calm.", voice="NATF2")) as ws:
        assert json.loads(await ws.get_message())["persona"]["voice"] == "NATF2"
        await ws.send_message(pcm_frames(3))
        await ws.send_message(json.dumps({"type": "input.end"}))
        heard = 0
        with trio.fail_after(120):
            while isinstance(message := await ws.get_message(), bytes) or json.loads(message)["type"] != "session.end":
                heard += len(message) if isinstance(message, bytes) else 0
    assert heard == 3 * PCM_FRAME and json.loads(message)["reason"] == "stop"
