"""Fault injection against `duplexrt serve` on real loopback sockets.

Each test lets one kind of bad peer (or a failing model) loose beside well-behaved sessions and then
checks the same invariants: every slot and every admission comes back, the healthy sessions' audio
is exact, and the server still serves.  The bad peers are built on wsproto by hand
(tests/faulty_peer.py) so that they can stop at any byte.

Real time runs here (sockets and the scheduler thread do not follow a fake clock); the server's
timeouts are set to a fraction of a second, and no test bounds how fast anything happens, only that
it does within a generous patience.
"""

from __future__ import annotations

import json

import numpy as np
import trio

from conftest import PATIENCE, ControlledBackend, duplex_session
from duplexrt.config import load_config
from duplexrt.server import Server
from faulty_peer import FaultyPeer, Rejected, masked_frame_header

FRAME = 1920
SLOTS = 4
#: Short limits so that a peer misbehaving is noticed in well under a second.
QUICK = ("server.close_timeout_s=0.3", "server.ping_interval_s=0.2", "server.ping_timeout_s=0.3",
         "server.first_message_timeout_s=0.5")


def _config(*overrides: str):
    return load_config(None, ["server.port=0", f"runtime.slots={SLOTS}", "backend.options.delay_frames=0",
                              "metrics.log_stats=false", *QUICK, *overrides])


def _noise(samples: int, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(samples) * 0.2).astype(np.float32)


async def _free_slots(server: Server) -> int:
    """What the server tells a balancer: the free slots in its /readyz answer."""
    stream = await trio.open_tcp_stream("127.0.0.1", server.ports[0])
    async with stream:
        await stream.send_all(b"GET /readyz HTTP/1.1\r\nhost: x\r\n\r\n")
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
    return json.loads(data.partition(b"\r\n\r\n")[2])["free_slots"]


async def _settled(server: Server) -> None:
    """Every session gone, every slot free, every admission returned, and still serving."""
    runtime = server.runtime
    with trio.fail_after(PATIENCE):
        while (runtime.sessions or runtime.scheduler.free_slots != SLOTS
               or await _free_slots(server) != SLOTS):
            await trio.sleep(0.01)
    received, end = await _healthy_session(server, _noise(2 * FRAME, seed=99))
    assert end["reason"] == "stop" and len(received) == 2 * FRAME * 4


async def _healthy_session(server: Server, audio: np.ndarray, chunk: int = FRAME) -> tuple[bytes, dict]:
    """A well-behaved /v1/duplex client; returns the audio that came back and ``session.end``."""
    received, events = await duplex_session(f"ws://127.0.0.1:{server.ports[0]}/v1/duplex", audio, chunk)
    assert events[0]["type"] == "session.created"
    ends = [event for event in events if event["type"] == "session.end"]
    assert len(ends) == 1, events
    return received, ends[0]


async def _beside_a_healthy_session(server: Server, fault) -> None:
    """Run ``fault`` while a healthy session streams; the healthy one's audio must be exact."""
    audio = _noise(16 * FRAME, seed=7)
    result = {}

    async def healthy() -> None:
        result["healthy"] = await _healthy_session(server, audio)

    with trio.fail_after(PATIENCE):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(healthy)
            await fault()
    received, end = result["healthy"]
    assert received == audio.tobytes()
    assert end["reason"] == "stop" and end["usage"]["frames_out"] == 16


async def test_peer_that_vanishes_mid_message_frees_its_slot(start_server):
    # Resume off: with it, each vanished session keeps its slot for its resume window (10 s, as
    # long as PATIENCE, so the test raced it under load); that wait is tests/test_resume.py's.
    server = (await start_server(f"runtime.slots={SLOTS}", *QUICK, "runtime.resume_window_s=0")).server

    async def fault() -> None:
        for _ in range(3):
            peer = await FaultyPeer.connect(server.ports[0], "/v1/duplex")
            await peer.receive()  # session.created
            await peer.send_bytes(_noise(FRAME, seed=1).tobytes())
            # Half of a 40,000-byte frame, then gone without a Close.
            await peer.send_raw(masked_frame_header(0x2, 40_000) + b"\0" * 20_000)
            await peer.abort()

    await _beside_a_healthy_session(server, fault)
    await _settled(server)


async def test_peer_that_never_answers_close_frees_its_slot_while_still_connected(start_server):
    server = (await start_server(f"runtime.slots={SLOTS}", *QUICK)).server
    peers = []
    for _ in range(SLOTS):
        peer = await FaultyPeer.connect(server.ports[0], "/v1/duplex")
        await peer.send_bytes(_noise(FRAME, seed=2).tobytes())
        await peer.send_text(json.dumps({"type": "input.end"}))
        peers.append(peer)
    for peer in peers:
        received = await peer.receive_until_close()
        assert json.loads(received[-1])["reason"] == "stop"
    # Every peer is still connected and has not answered the Close; the slots come back anyway.
    await _settled(server)
    for peer in peers:
        with trio.fail_after(PATIENCE):
            await peer.wait_closed_by_server()


async def test_peer_that_stops_reading_is_dropped_and_frees_its_slot(start_server):
    # Resume off: with it, the dropped peer's session waits out its resume window first
    # (tests/test_resume.py).
    server = (await start_server(f"runtime.slots={SLOTS}", *QUICK, "runtime.resume_window_s=0")).server

    async def fault() -> None:
        peer = await FaultyPeer.connect(server.ports[0], "/v1/duplex")
        chunk = _noise(4 * FRAME, seed=3).tobytes()
        # Keep sending and never read: the server's pings go unanswered, its sends back up.
        with trio.move_on_after(PATIENCE / 2):
            try:
                while True:
                    await peer.send_bytes(chunk)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        await peer.abort()

    await _beside_a_healthy_session(server, fault)
    await _settled(server)


async def test_silent_peer_that_completed_the_handshake_is_dropped_by_the_keepalive(caplog, start_server):
    caplog.set_level("INFO", logger="duplexrt.session")
    server = (await start_server(f"runtime.slots={SLOTS}", *QUICK, "server.first_message_timeout_s=30", "runtime.resume_window_s=0")).server
    peer = await FaultyPeer.connect(server.ports[0], "/v1/duplex")
    await peer.receive()  # session.created
    await peer.send_bytes(_noise(FRAME, seed=4).tobytes())
    # From here on it reads nothing and answers nothing, as a phone that lost its network would.
    with trio.fail_after(PATIENCE):
        while server.runtime.sessions:
            await trio.sleep(0.01)
    assert "ended: ping_timeout" in caplog.text
    await peer.abort()
    await _settled(server)


async def test_garbage_after_valid_audio_is_refused_and_harms_nobody(caplog, start_server):
    caplog.set_level("INFO", logger="duplexrt.session")
    server = (await start_server(f"runtime.slots={SLOTS}", *QUICK)).server

    async def fault() -> None:
        # Text that is not UTF-8, then a reserved opcode: each fails the connection (RFC 6455
        # 7.1.7): a Close with 1007 or 1002 when the peer reads it in time, else a dropped socket.
        for frame, code in ((masked_frame_header(0x1, 4) + b"\xff\xfe\xfd\xfc", 1007),
                            (masked_frame_header(0x3, 4) + b"junk", 1002)):
            peer = await FaultyPeer.connect(server.ports[0], "/v1/duplex")
            await peer.send_bytes(_noise(2 * FRAME, seed=5).tobytes())
            await peer.send_raw(frame)
            await peer.receive_until_close()
            assert peer.close_code == code or (peer.close_code is None and peer.dropped)
            await peer.abort()
        # Samples cut mid-way in s16: a protocol error event, and the session goes on.
        peer = await FaultyPeer.connect(server.ports[0], "/v1/duplex?format=pcm_s16le")
        await peer.receive()
        await peer.send_bytes(b"\x01\x02\x03")
        error = json.loads((await peer.receive())[0])
        assert error["type"] == "error" and error["code"] == "invalid_audio"
        await peer.send_bytes(b"\0\0" * FRAME)
        await peer.send_text(json.dumps({"type": "input.end"}))
        end = json.loads((await peer.receive_until_close())[-1])
        assert end["usage"]["frames_out"] == 1
        await peer.abort()

    await _beside_a_healthy_session(server, fault)
    await _settled(server)
    assert caplog.text.count("ended: protocol_error") == 2


async def test_reconnect_storm_leaks_nothing(start_server):
    # A short resume window: the sessions of peers gone without a word wait for a resume that never
    # comes, then free their slots like the rest.
    server = (await start_server(f"runtime.slots={SLOTS}", *QUICK, "runtime.resume_window_s=0.5")).server
    port = server.ports[0]
    outcomes: list[str] = []

    async def vanish_after_connect() -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await trio.aclose_forcefully(stream)
        outcomes.append("vanished")

    async def vanish_mid_head() -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"GET /v1/duplex HTTP/1.1\r\nhost: x\r\nupgr")
        await trio.aclose_forcefully(stream)
        outcomes.append("vanished")

    async def short_session(seed: int) -> None:
        try:
            peer = await FaultyPeer.connect(port, "/v1/duplex")
        except Rejected as refused:
            assert refused.status == 503  # every slot busy for a moment: a clean refusal
            outcomes.append("refused")
            return
        await peer.send_bytes(_noise(FRAME, seed=seed).tobytes())
        if seed % 2:
            await peer.abort()  # gone without a word
            outcomes.append("dropped")
            return
        await peer.send_text(json.dumps({"type": "input.end"}))
        await peer.receive_until_close()
        await peer.abort()
        outcomes.append("finished")

    with trio.fail_after(PATIENCE * 2):
        for round_ in range(4):
            async with trio.open_nursery() as storm:
                for i in range(4):
                    storm.start_soon(vanish_after_connect)
                    storm.start_soon(vanish_mid_head)
                    storm.start_soon(short_session, round_ * 4 + i)
    assert len(outcomes) == 48 and "finished" in outcomes
    await _settled(server)


async def test_model_failing_on_random_steps_ends_only_the_sessions_in_those_steps(start_server):
    backend = ControlledBackend(_config(), fail_on=[3, 9, 10, 17])
    server = (await start_server(f"runtime.slots={SLOTS}", *QUICK, backend=backend)).server
    audio = _noise(12 * FRAME, seed=8)
    ends: list[dict] = []
    audios: list[bytes] = []

    async def one() -> None:
        received, end = await _healthy_session(server, audio)
        audios.append(received)
        ends.append(end)

    with trio.fail_after(PATIENCE):
        async with trio.open_nursery() as nursery_:
            for _ in range(SLOTS):
                nursery_.start_soon(one)
    failed = [end for end in ends if end["reason"] == "error"]
    assert failed, "no session met an injected failure"
    for end in failed:
        assert "injected" not in json.dumps(end)  # the backend's own words stay in the log
    for received, end in zip(audios, ends):
        assert end["usage"]["frames_out"] * FRAME * 4 == len(received)
        if end["reason"] == "stop":
            assert end["usage"]["frames_out"] == 12
    # How many steps the sessions took depends on how their frames batched: an injected failure
    # not reached yet would fail the healthy session below.
    backend.fail_on.clear()
    await _settled(server)


# -- the Live route: the same faults in another protocol's clothes -------------------------------

_LIVE_START = json.dumps({"type": "session.start", "session": {"model": "duplexrt", "audio": {
    "input": {"format": {"type": "audio/pcm", "rate": 24000}}}}})


def _live_append(seed: int) -> str:
    import base64

    pcm = (_noise(2400, seed) * 32767).astype("<i2").tobytes()  # 100 ms, as LiveKit sends it
    return json.dumps({"type": "session.input_audio.append", "audio": base64.b64encode(pcm).decode()})


async def test_live_peers_that_vanish_or_never_answer_close_free_their_slots(start_server):
    # Resume off, as for the vanishing duplex peer above: with it, each vanished session keeps
    # its slot for its 10 s window, as long as PATIENCE, and the test would race that wait.
    server = (await start_server(f"runtime.slots={SLOTS}", *QUICK, "runtime.resume_window_s=0")).server

    async def fault() -> None:
        closers = []
        for seed in range(SLOTS - 1):
            peer = await FaultyPeer.connect(server.ports[0], "/v1/live/sessions")
            await peer.send_text(_LIVE_START)
            assert json.loads((await peer.receive())[0])["type"] == "session.started"
            await peer.send_text(_live_append(seed))
            if seed % 2:
                await peer.send_raw(masked_frame_header(0x1, 50_000) + b"{" * 1000)
                await peer.abort()  # gone mid-message
            else:
                await peer.send_text(json.dumps({"type": "session.close"}))
                closers.append(peer)
        for peer in closers:
            events = [json.loads(m) for m in await peer.receive_until_close()]
            assert events[-1]["type"] == "session.closed" and events[-1]["reason"] == "close_requested"
            # ... and the Close is never answered.

    await _beside_a_healthy_session(server, fault)
    await _settled(server)
