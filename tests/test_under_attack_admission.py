"""Under attack, admission and resume: one hostile client beside a paced victim session.

Real sockets on loopback against a real server (echo, no delay).  Each case runs one attack
that used to lock others out (issue 32, defects 3-5) next to a victim that talks at the pace of
speech, then checks that the victim heard every frame exactly, in time, and that no slot,
admission or resume claim is left held, with ``/readyz`` telling the truth.

The victim is the paced ``/v1/duplex`` caller of ``tests/attack.py``, which the wire's
under-attack cases use too.
"""

from __future__ import annotations

import json
import socket

import numpy as np
import pytest
import trio
import trio_websocket

import attack
from duplexrt.reasons import FinishReason
from duplexrt.wire.resume import ResumeError
from conftest import http_get

PATIENCE = 15.0
FRAME = 1920  # the default model frame: 80 ms at 24 kHz
UPGRADE = ("GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: upgrade\r\nupgrade: websocket\r\n"
           "sec-websocket-version: 13\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")


@pytest.fixture
def start_server(start_server):
    """The server pinned as a replica with its own CPUs is (``attack.PINNED``)."""
    return attack.pinned_start(start_server)


def _frames(count: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(FRAME) * 0.1).astype(np.float32).tobytes() for _ in range(count)]


class Victim:
    """A paced caller (``attack.paced_victim``) started beside an attack and checked after it."""

    def __init__(self, port: int, frames: int = 25, seed: int = 7) -> None:
        self.port, self.frames, self.seed = port, frames, seed
        self.heard: attack.Victim | None = None

    async def run(self) -> None:
        self.heard = await attack.paced_victim(self.port, self.frames * attack.FRAME_PERIOD_S, self.seed)

    def check(self) -> None:
        """Every frame back exactly and in order; the 99th percentile within one frame period."""
        heard = self.heard
        assert heard is not None and heard.exact and len(heard.lags) == self.frames
        assert heard.p99_ms < attack.FRAME_PERIOD_S * 1e3, sorted(heard.lags)[-5:]


async def _wait_for(predicate, what: str, patience: float = PATIENCE) -> None:
    with trio.fail_after(patience):
        while not predicate():
            await trio.sleep(0.01)


async def _readyz(port: int) -> tuple[int, dict]:
    status, _, body = await http_get(port, "/readyz")
    return status, json.loads(body)


def _raw_socket(port: int, receive_buffer: int | None = None) -> socket.socket:
    sock = socket.socket()
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.connect(("127.0.0.1", port))
    return sock


def _read_status(sock: socket.socket) -> int:
    """The HTTP status of the answer to a request head sent on ``sock`` (blocking, bounded)."""
    sock.settimeout(PATIENCE)
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return int(data.split(b" ")[1]) if data else 0


def _abort(sock: socket.socket) -> None:
    """Close with no Close frame and no FIN handshake wait: what a dropped phone looks like."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()


# -- defect 3: abrupt upgrades, detached sessions -------------------------------------------------


async def test_abrupt_upgrades_hold_no_slot_and_readyz_stays_ready_beside_a_paced_victim(start_server):
    """13 upgrades a second, each cut as soon as it is answered, against a 4-slot server: an
    upgrade that sent nothing is not resumable, so each ends at once and frees its slot."""
    running = await start_server()
    port = running.port
    victim = Victim(port)
    answers: list[int] = []
    ready: list[int] = []

    async def attack() -> None:
        for _ in range(26):  # two seconds
            sock = _raw_socket(port)
            sock.sendall(UPGRADE.format(path="/v1/duplex").encode())
            answers.append(await trio.to_thread.run_sync(_read_status, sock))
            _abort(sock)
            ready.append((await _readyz(port))[0])
            await trio.sleep(1 / 13)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(attack)
        await trio.sleep(1.0)  # the victim arrives while the attack is under way
        await victim.run()
    victim.check()
    assert answers == [101] * 26 and ready == [200] * 26
    server = running.server
    await _wait_for(lambda: server.admitted == 0 and not server.runtime.sessions, "every session to end")
    assert server.runtime.scheduler.free_slots == server.runtime.scheduler.slots
    assert server.statistics().detached == 0


async def test_a_new_caller_takes_the_slot_of_the_oldest_detached_session(start_server):
    """Sessions that took a message and dropped wait for their resume, but they do not lock a
    caller out: a full server ends the oldest detached one (``resume_expired``) for a new caller,
    and /readyz says so beforehand."""
    running = await start_server("runtime.slots=2", "server.close_timeout_s=0.5")
    server = running.server
    port = running.port
    held = []
    for seed in range(2):
        ws_stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with trio.open_nursery() as nursery:
            ws = await trio_websocket.wrap_client_stream(nursery, ws_stream, "127.0.0.1", "/v1/duplex")
            json.loads(await ws.get_message())
            await ws.send_message(_frames(1, seed)[0])
            await ws.get_message()  # its echo: the session took the frame
            held.append(list(server.runtime.sessions))
            ws_stream.socket.close()  # no Close frame
            nursery.cancel_scope.cancel()
        await _wait_for(lambda: server.statistics().detached == seed + 1, "the drop to be noticed")
    first = next(session for session in held[0])
    assert server.admitted == 2
    status, body = await _readyz(port)
    assert (status, body["free_slots"], body["detached"]) == (200, 2, 2)
    victim = Victim(port, frames=10)
    with trio.fail_after(PATIENCE):
        await victim.run()
    victim.check()
    assert first.summary().reason == FinishReason.RESUME_EXPIRED
    assert server.refused["evicted_detached"] == 1 and server.statistics().detached == 1


async def test_a_session_that_ends_while_detached_keeps_its_end_for_the_resume_window(start_server):
    """The client sent its last audio and input.end, then lost the connection before the end
    came: reconnecting after the close timeout but within the window, it hears the tail and
    gets the usage."""
    running = await start_server("runtime.resume_window_s=3", "server.close_timeout_s=0.3")
    audio = _frames(5, seed=3)
    stream = await trio.open_tcp_stream("127.0.0.1", running.port)
    async with trio.open_nursery() as nursery:
        ws = await trio_websocket.wrap_client_stream(nursery, stream, "127.0.0.1", "/v1/duplex",
                                                     message_queue_size=0)
        token = json.loads(await ws.get_message())["resume_token"]
        for frame in audio:
            await ws.send_message(frame)
        await ws.send_message(json.dumps({"type": "input.end"}))
        await _wait_for(lambda: running.server.statistics().detached == 0 and running.server.runtime.sessions
                        and next(iter(running.server.runtime.sessions)).reader is not None
                        and next(iter(running.server.runtime.sessions)).credits.submitted == 5, "the audio")
        stream.socket.close()
        nursery.cancel_scope.cancel()
    await _wait_for(lambda: not running.server.runtime.sessions, "the session to end, detached")
    await trio.sleep(1.0)  # past the close timeout, within the window
    heard = bytearray()
    async with trio_websocket.open_websocket_url(running.url(f"/v1/duplex?resume={token}&received=1")) as ws:
        with trio.fail_after(PATIENCE):
            assert json.loads(await ws.get_message())["type"] == "session.resumed"
            while True:
                message = await ws.get_message()
                if isinstance(message, bytes):
                    heard += message
                    continue
                end = json.loads(message)
                if end["type"] == "session.end":
                    break
    assert bytes(heard) == b"".join(audio)
    assert end["usage"]["frames_out"] == 5


# -- defect 4: half-sent heads -------------------------------------------------------------------


def test_the_head_deadline_shortens_as_pending_heads_near_the_cap():
    from duplexrt.server.app import head_deadline_s

    assert head_deadline_s(10.0, 0, 256) == 10.0
    assert head_deadline_s(10.0, 128, 256) == 10.0
    assert head_deadline_s(10.0, 192, 256) == pytest.approx(5.0)
    assert head_deadline_s(10.0, 255, 256) == 0.5
    assert head_deadline_s(0.2, 255, 256) == 0.2  # never longer than the configured timeout


async def test_half_sent_heads_past_the_cap_do_not_keep_a_real_client_out(start_server):
    """cap + 16 connections each send part of a request head and stop.  A client that sends its
    head whole still gets a session (the oldest half-sent head is let go), the paced victim
    hears every frame in time, and /readyz's answer is what a new session gets."""
    cap = 32
    running = await start_server(f"server.max_pending_handshakes={cap}")
    server = running.server
    port = running.port
    trickling = []
    for _ in range(cap + 16):
        sock = _raw_socket(port)
        sock.sendall(b"GET /v1/duplex HTTP/1.1\r\nhost: 127.0.0.1\r\nupgrade: websocket\r\n")
        trickling.append(sock)
    try:
        await _wait_for(lambda: server.pending_handshakes == cap, "the heads to be pending")
        status, body = await _readyz(port)
        assert status == 200 and body["ready"] and body["free_slots"] == 4
        victim = Victim(port)
        with trio.fail_after(PATIENCE):
            await victim.run()
        victim.check()
        assert server.pending_handshakes <= cap
        assert server.refused["too_many_pending"] >= 16
    finally:
        for sock in trickling:
            sock.close()
    await _wait_for(lambda: server.pending_handshakes == 0 and server.admitted == 0, "the heads to go")


# -- defect 5: one token, many reconnects; a resumer that reads nothing --------------------------


async def _detached_session(running, frames: int = 1) -> tuple[str, int]:
    """A session that took ``frames`` frames, heard them, then lost its connection: its token
    and how many of its messages the client received."""
    stream = await trio.open_tcp_stream("127.0.0.1", running.port)
    received = 0
    async with trio.open_nursery() as nursery:
        ws = await trio_websocket.wrap_client_stream(nursery, stream, "127.0.0.1", "/v1/duplex")
        token = json.loads(await ws.get_message())["resume_token"]
        received += 1
        for frame in _frames(frames, seed=11):
            await ws.send_message(frame)
        for _ in range(frames):
            await ws.get_message()
            received += 1
        stream.socket.close()
        nursery.cancel_scope.cancel()
    await _wait_for(lambda: running.server.statistics().detached >= 1, "the drop to be noticed")
    return token, received


async def test_concurrent_reconnects_with_one_token_exactly_one_wins(start_server):
    """Rounds of 16 reconnects with one token, every head out before any answer is read: in each
    round one connection is upgraded, every other is refused before the upgrade (409 while the
    winner resumes, 404 once the token is used)."""
    running = await start_server("server.close_timeout_s=0.5")
    victim = Victim(running.port, frames=20)
    rounds: list[list[int]] = []

    async def reconnects() -> None:
        for _ in range(4):
            token, received = await _detached_session(running)
            sockets = [_raw_socket(running.port) for _ in range(16)]
            head = UPGRADE.format(path=f"/v1/duplex?resume={token}&received={received}").encode()
            for sock in sockets:
                sock.sendall(head)
            rounds.append([await trio.to_thread.run_sync(_read_status, sock) for sock in sockets])
            for sock in sockets:
                sock.close()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(victim.run)
        await reconnects()
    victim.check()
    for statuses in rounds:
        assert statuses.count(101) == 1, rounds
        assert set(statuses) - {101} <= {409, 404}, rounds


async def test_a_resumer_that_reads_nothing_is_given_up_and_the_real_client_resumes(start_server):
    """A resume whose replay the client does not read: after the handshake timeout the server
    gives that connection up; meanwhile other resumes are refused 409, then the real client
    resumes with the same token and hears the whole journal."""
    running = await start_server("server.handshake_timeout_s=1")
    token, received = await _detached_session(running, frames=1)
    (session,) = running.server.runtime.sessions
    # Output made while away (a model that talks on): a journal far larger than the socket
    # buffers between the server and a client that reads nothing, within the journal's cap.
    (entry,) = running.server._resumable.values()
    transport = entry[0] if isinstance(entry, tuple) else entry.transport
    for _ in range(80):
        await transport.send(b"\x00" * 16384)
    victim = Victim(running.port, frames=25)
    stalled = _raw_socket(running.port, receive_buffer=4096)
    stalled.sendall(UPGRADE.format(path=f"/v1/duplex?resume={token}&received={received}").encode())
    refusals: list[int] = []
    resumed_after = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(victim.run)
        started = trio.current_time()
        await trio.sleep(0.2)
        while resumed_after is None:
            try:
                async with trio_websocket.open_websocket_url(
                        running.url(f"/v1/duplex?resume={token}&received={received}")) as ws:
                    assert json.loads(await ws.get_message())["type"] == "session.resumed"
                    for _ in range(80):
                        assert len(await ws.get_message()) == 16384
                    resumed_after = trio.current_time() - started
                    await ws.send_message(json.dumps({"type": "input.end"}))
                    while json.loads(await ws.get_message())["type"] != "session.end":
                        pass
            except trio_websocket.ConnectionRejected as refused:
                refusals.append(refused.status_code)
                assert trio.current_time() - started < PATIENCE, refusals
                await trio.sleep(0.2)
    stalled.close()
    victim.check()
    assert refusals and set(refusals) == {409}
    assert resumed_after < 1 + 1.0
    assert session.summary().reason == FinishReason.STOP


# -- issue 38: upgrades that evict, resumes mid-way, slow heads under a flood ---------------------


async def _resume_and_end(running, token: str, received: int) -> dict:
    """Resume the session of ``token``, send one frame, hear it, end it: its session.end."""
    frame = _frames(1, seed=12)[0]
    with trio.fail_after(PATIENCE):
        async with trio_websocket.open_websocket_url(
                running.url(f"/v1/duplex?resume={token}&received={received}")) as ws:
            assert json.loads(await ws.get_message())["type"] == "session.resumed"
            await ws.send_message(frame)
            assert await ws.get_message() == frame
            await ws.send_message(json.dumps({"type": "input.end"}))
            return json.loads(await ws.get_message())


async def test_a_malformed_upgrade_on_a_full_server_evicts_no_detached_session(start_server):
    """Issue 38, item 4: on a full server, an upgrade refused for what it is (426: a version
    this server does not speak; 400: no key) takes nobody's slot: the detached session stays
    resumable and ends normally."""
    running = await start_server("runtime.slots=1", "server.close_timeout_s=0.5")
    token, received = await _detached_session(running)
    for head, status in ((UPGRADE.replace("version: 13", "version: 8"), 426),
                         (UPGRADE.replace("sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n", ""), 400)):
        sock = _raw_socket(running.port)
        sock.sendall(head.format(path="/v1/duplex").encode())
        assert await trio.to_thread.run_sync(_read_status, sock) == status
        sock.close()
    assert running.server.refused["evicted_detached"] == 0
    assert running.server.statistics().detached == 1
    end = await _resume_and_end(running, token, received)
    assert (end["type"], end["reason"]) == ("session.end", "stop")


async def test_a_session_being_resumed_is_not_evicted_for_a_new_caller(start_server):
    """Issue 38, item 8: a detached session whose client is resuming it (token claimed, replay
    going out to a client slow to read it) is not given up for a new caller on a full server:
    the caller is refused, and the resume goes through."""
    running = await start_server("runtime.slots=1", "server.handshake_timeout_s=3")
    server = running.server
    token, received = await _detached_session(running)
    (entry,) = server._resumable.values()
    for _ in range(80):  # output made while away: more than the socket buffers of a slow reader
        await entry.transport.send(b"\x00" * 16384)
    slow = _raw_socket(running.port, receive_buffer=4096)
    slow.sendall(UPGRADE.format(path=f"/v1/duplex?resume={token}&received={received}").encode())

    def claimed() -> bool:
        try:
            entry.transport.check(received)
        except ResumeError as exc:
            return exc.status == 409
        return False

    await _wait_for(claimed, "the resume to claim the session")
    caller = _raw_socket(running.port)
    caller.sendall(UPGRADE.format(path="/v1/duplex").encode())
    assert await trio.to_thread.run_sync(_read_status, caller) == 503
    caller.close()
    assert server.refused["evicted_detached"] == 0

    def read_all() -> bytes:  # the slow client reads its replay after all
        slow.settimeout(PATIENCE)
        data = b""
        while len(data) < 80 * 16384:
            chunk = slow.recv(1 << 20)
            if not chunk:
                break
            data += chunk
        return data

    replay = await trio.to_thread.run_sync(read_all)
    assert replay.startswith(b"HTTP/1.1 101") and len(replay) > 80 * 16384
    await _wait_for(lambda: entry.transport.resumes == 1, "the resume to finish")
    slow.close()


async def test_a_slow_head_that_keeps_coming_outlives_a_flood_of_idle_half_heads(start_server):
    """Issue 38, item 6: with the pending heads at their cap and idle half-heads arriving all the
    time, a client whose head takes 1.6 s (a piece every 0.1 s, a phone on a poor link) is still
    served: the head let go is the one silent for longest, not the oldest, and a head that
    keeps coming is not held to the short deadline a flood brings."""
    cap = 32
    running = await start_server(f"server.max_pending_handshakes={cap}")
    server = running.server
    port = running.port
    idle = b"GET /v1/duplex HTTP/1.1\r\nhost: 127.0.0.1\r\nupgrade: websocket\r\n"
    flood: list[socket.socket] = []

    def half_head() -> None:
        sock = _raw_socket(port)
        sock.sendall(idle)
        flood.append(sock)

    try:
        for _ in range(cap):
            half_head()
        await _wait_for(lambda: server.pending_handshakes == cap, "the heads to be pending")
        slow = _raw_socket(port)
        head = UPGRADE.format(path="/v1/duplex").encode()
        pieces = [head[i:i + len(head) // 16 + 1] for i in range(0, len(head), len(head) // 16 + 1)]
        for piece in pieces:  # 16 or 17 pieces, 0.1 s apart; 4 new idle heads between two pieces
            slow.sendall(piece)
            for _ in range(4):
                half_head()
            await trio.sleep(0.1)
        assert await trio.to_thread.run_sync(_read_status, slow) == 101
        # The flood turned over around it: idle heads let go for new ones, or cut for their silence.
        assert server.refused["too_many_pending"] > 0
        assert server.refused["too_many_pending"] + server.refused["handshake_timeout"] >= 4 * len(pieces) - cap
        slow.close()
    finally:
        for sock in flood:
            sock.close()
    await _wait_for(lambda: server.pending_handshakes == 0 and server.admitted == 0, "the heads to go")


async def test_one_address_opening_32_flooding_connections_gets_its_cap_and_the_victim_is_untouched(start_server):
    """Issue 38, item 7: 32 sessions from one address (127.0.0.2), each sending tiny messages
    back to back, beside a paced victim from another (127.0.0.1).  The address holds at most
    ``server.max_connections_per_peer`` (here 1: the rest are refused 429), and the victim hears
    every frame, most of them on time.  Measured on a shared 2-core machine, the victim's median
    lag and frames later than a frame period: capped at 1, 13 ms and 2 of 25; at 4, 55 ms and 9;
    uncapped (32), 94 ms and 16."""
    cap = 1
    running = await start_server(f"server.max_connections_per_peer={cap}", "server.unlimited_peers=[]",
                                 "runtime.resume_window_s=0")
    server = running.server
    await attack.paced_victim(running.port, 0.4, seed=2)  # warm up
    async with attack.hostile(running.port, "many-connections", 3.0) as flood:
        await trio.sleep(0.2)
        victim = await attack.paced_victim(running.port, 25 * attack.FRAME_PERIOD_S, seed=7)
    assert (flood.report["opened"], flood.report["refused"]) == (cap, 32 - cap), flood.report
    assert flood.report["sent"] > 0
    assert server.refused["too_many_from_peer"] == 32 - cap
    assert victim.exact and len(victim.lags) == 25
    late = sum(lag > attack.FRAME_PERIOD_S for lag in victim.lags)
    assert victim.p50_ms < attack.FRAME_PERIOD_S * 1e3 / 2 and late <= 8, (victim.p50_ms, sorted(victim.lags)[-5:])
    await attack.assert_nothing_held(running)
