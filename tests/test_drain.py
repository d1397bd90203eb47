"""The drain (duplexrt/server/drain.py): its parts alone on trio's test clock, then the real
``duplexrt serve`` in a process of its own, with a call that goes on through the drain, a call
cut when the grace period ends, the HTTP request a preStop hook makes, and ``/readyz?full=ok``.
HAProxy taking a draining replica out is in tests/test_deploy_haproxy.py.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from ipaddress import ip_address

import numpy as np
import pytest
import trio
import trio_websocket

from conftest import PATIENCE, ServeProcess
from duplexrt.config import load_config
from duplexrt.server.drain import Signals, drain_answer, drain_refusal, progress_line, wait_for_calls
from duplexrt.server.peers import client_address, parse_address
from conftest import http_get

FRAME = 1920
KEY = "sk-drain"


# -- the parts -------------------------------------------------------------------------------------


def test_progress_lines_say_calls_left_and_seconds_to_go():
    assert progress_line(12, 240.0) == "draining: 12 calls left, 240 s to go"
    assert progress_line(1, 0.2) == "draining: 1 call left, 1 s to go"
    assert progress_line(0, -3) == "draining: 0 calls left, 0 s to go"


async def test_the_wait_ends_when_the_last_call_does_and_reports_every_ten_seconds(autojump_clock, caplog):
    caplog.set_level(logging.INFO, "duplexrt.server")
    calls = {"left": 3}

    async def calls_end() -> None:
        for at in (5.1, 25.1, 31.3):  # seconds into the drain, between two polls
            await trio.sleep_until(started + at)
            calls["left"] -= 1

    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(calls_end)
        left = await wait_for_calls(lambda: calls["left"], 240.0)
    assert left == 0
    assert trio.current_time() - started == pytest.approx(31.5), "ends at the first poll after the last call"
    lines = [record.getMessage() for record in caplog.records]
    assert lines == ["draining: 3 calls left, 240 s to go", "draining: 2 calls left, 230 s to go",
                     "draining: 2 calls left, 220 s to go", "draining: 1 call left, 210 s to go",
                     "drained: every call ended, after 31.5 s"]


async def test_the_wait_gives_up_after_the_grace_period_and_says_so(autojump_clock, caplog):
    caplog.set_level(logging.INFO, "duplexrt.server")
    started = trio.current_time()
    assert await wait_for_calls(lambda: 2, 25.0) == 2
    assert trio.current_time() - started == pytest.approx(25.0)
    lines = [record.getMessage() for record in caplog.records]
    assert lines[0] == "draining: 2 calls left, 25 s to go"
    assert lines[-1].startswith("draining: grace period over (server.shutdown_grace_s = 25) with 2 calls left")


async def test_no_calls_no_wait(autojump_clock):
    started = trio.current_time()
    assert await wait_for_calls(lambda: 0, 300.0) == 0
    assert trio.current_time() == started


def test_the_drain_request_is_a_post_with_the_key():
    assert drain_answer("GET", None, False, 0, 300)[0] == 405
    status, body, headers = drain_answer("POST", (401, "a key"), False, 0, 300)
    assert (status, json.loads(body), headers) == (401, {"error": "a key"}, [("www-authenticate", "Bearer")])
    assert drain_answer("POST", (403, "not here"), False, 0, 300)[::2] == (403, [])
    status, body, _ = drain_answer("POST", None, True, 4, 300)
    assert status == 202
    assert json.loads(body) == {"draining": True, "already_draining": True, "calls": 4, "shutdown_grace_s": 300}


def _settings(*overrides: str):
    return load_config(None, list(overrides)).server


def test_only_the_host_itself_or_the_admin_key_may_drain():
    """Issue 38, item 1: stopping the server is not using the model.  Keyless, a loopback peer
    may drain and a peer on the network may not; with an API key, that key is no drain key off
    the host; the admin key drains from anywhere."""
    public, loopback = ip_address("203.0.113.9"), ip_address("127.0.0.1")
    keyless = _settings()
    assert drain_refusal(loopback, False, "", keyless) is None
    assert drain_refusal(ip_address("::1"), False, "", keyless) is None
    assert drain_refusal(public, False, "", keyless)[0] == 403
    assert drain_refusal(None, False, "", keyless)[0] == 403  # an unknown peer is not the host
    # A balancer on the same host connects from loopback: what it forwards is not the host's.
    assert drain_refusal(loopback, True, "", keyless)[0] == 403
    keyed = _settings(f'server.api_key="{KEY}"', 'server.admin_key="sk-admin"')
    assert drain_refusal(public, False, KEY, keyed)[0] == 403
    assert drain_refusal(loopback, False, "", keyed)[0] == 401
    assert drain_refusal(loopback, False, KEY, keyed) is None
    assert drain_refusal(public, False, "sk-admin", keyed) is None
    assert drain_refusal(public, True, "sk-admin", keyed) is None
    assert drain_refusal(public, False, "sk-admin-", keyed)[0] == 403
    wider = _settings('server.drain_from=["10.0.0.0/8"]')
    assert drain_refusal(ip_address("10.1.2.3"), False, "", wider) is None
    assert drain_refusal(loopback, False, "", wider)[0] == 403


def test_the_client_behind_a_trusted_proxy_is_the_one_its_header_names():
    proxy = ip_address("10.0.0.5")
    trusted = ("10.0.0.0/24",)
    headers = {"x-forwarded-for": "127.0.0.1, 198.51.100.7"}  # the client wrote the first one
    assert client_address(proxy, headers, trusted) == ip_address("198.51.100.7")
    assert client_address(proxy, {"x-forwarded-for": "198.51.100.7, 10.0.0.9"}, trusted) == ip_address("198.51.100.7")
    assert client_address(proxy, {}, trusted) == proxy
    assert client_address(proxy, {"x-forwarded-for": "nonsense"}, trusted) is None
    # Not trusted: the header is anyone's to write.
    assert client_address(ip_address("203.0.113.9"), headers, trusted) == ip_address("203.0.113.9")
    assert client_address(proxy, headers, ()) == proxy
    assert parse_address("::ffff:127.0.0.1") == ip_address("127.0.0.1")
    assert parse_address("[::1]") == ip_address("::1")


def test_the_second_signal_is_the_one_that_cuts(caplog):
    caplog.set_level(logging.INFO, "duplexrt.server")
    counted = Signals()
    assert counted.receive("SIGTERM") is False
    assert counted.receive("SIGINT") is True
    assert [r.levelname for r in caplog.records] == ["INFO", "INFO"]
    assert caplog.records[0].getMessage().startswith("received SIGTERM: draining")


# -- in process: readiness and the HTTP request --------------------------------------------------


async def test_readyz_full_ok_stays_ready_while_full_and_not_while_draining(start_server):
    server = (await start_server("runtime.slots=1", "server.shutdown_grace_s=0")).server
    port = server.ports[0]
    async with trio_websocket.open_websocket_url(f"ws://127.0.0.1:{port}/v1/duplex") as ws:
        await ws.get_message()  # session.created: the one slot is taken
        status, _, body = await http_get(port, "/readyz")
        assert (status, json.loads(body)["reason"], json.loads(body)["full"]) == (503, "no_free_slot", True)
        status, _, body = await http_get(port, "/readyz?full=ok")
        assert (status, json.loads(body)["reason"], json.loads(body)["full"]) == (200, None, True)
        server.shutdown()
        for path in ("/readyz", "/readyz?full=ok"):
            status, _, body = await http_get(port, path)
            assert (status, json.loads(body)["reason"]) == (503, "draining")


async def test_post_drain_needs_the_key_then_begins_the_drain_once(nursery, start_server):
    server = (await start_server(f'server.api_key="{KEY}"', "server.shutdown_grace_s=600")).server
    port = server.ports[0]
    url = f"ws://127.0.0.1:{port}/v1/duplex"
    call = await trio_websocket.connect_websocket_url(nursery, url, extra_headers=[("authorization", f"Bearer {KEY}")])
    await call.get_message()  # a call under way keeps the drain (and the server) going
    assert (await http_get(port, "/drain"))[0] == 405
    assert (await http_get(port, "/drain", "POST"))[0] == 401
    assert (await http_get(port, "/drain", "POST", "authorization: Bearer wrong\r\n"))[0] == 401
    assert not server.draining
    status, _, body = await http_get(port, "/drain", "POST", f"authorization: Bearer {KEY}\r\n")
    assert status == 202 and json.loads(body)["already_draining"] is False and server.draining
    status, _, body = await http_get(port, "/drain", "POST", f"authorization: Bearer {KEY}\r\n")
    assert status == 202 and json.loads(body)["already_draining"] is True
    assert json.loads((await http_get(port, "/readyz"))[2])["reason"] == "draining"
    await call.aclose()


async def test_a_flood_of_drain_requests_and_half_sent_ones_leave_the_server_serving(start_server):
    """Hostile peers on the new path: wrong keys, heads cut short, then one real session works."""
    server = (await start_server(f'server.api_key="{KEY}"', "server.handshake_timeout_s=0.5")).server
    port = server.ports[0]
    with trio.fail_after(PATIENCE):
        for _ in range(50):
            assert (await http_get(port, "/drain", "POST", "authorization: Bearer x\r\n"))[0] == 401
        for cut in (b"POST /dra", b"POST /drain HTTP/1.1\r\nauthorization: Bearer " + KEY.encode()):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(cut)
            await stream.aclose()
    assert not server.draining
    url = f"ws://127.0.0.1:{port}/v1/duplex"
    with trio.fail_after(PATIENCE):
        async with trio_websocket.open_websocket_url(url, extra_headers=[("authorization", f"Bearer {KEY}")]) as ws:
            assert json.loads(await ws.get_message())["type"] == "session.created"


async def _post_drain(port: int, *, source: str = "127.0.0.1", target: str = "127.0.0.1",
                      headers: str = "") -> int:
    """POST /drain from the local address ``source`` to ``target``: the status."""
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
    await sock.bind((source, 0))
    await sock.connect((target, port))
    async with trio.SocketStream(sock) as stream:
        await stream.send_all(f"POST /drain HTTP/1.1\r\nhost: x\r\n{headers}\r\n".encode())
        data = b""
        with trio.fail_after(PATIENCE):
            while chunk := await stream.receive_some(65536):
                data += chunk
    return int(data.split(b" ")[1])


async def test_a_peer_outside_drain_from_cannot_drain_and_one_inside_can(start_server):
    """The peer's real address decides, read from the socket: drain_from narrowed to 127.0.0.1,
    a request from 127.0.0.2 (another address, loopback too) is refused and drains nothing."""
    server = (await start_server('server.drain_from=["127.0.0.1"]')).server
    port = server.ports[0]
    assert await _post_drain(port, source="127.0.0.2") == 403
    assert not server.draining and server.refused["drain_refused"] == 1
    assert await _post_drain(port, headers="x-forwarded-for: 127.0.0.1\r\n") == 403  # came through a proxy
    assert not server.draining
    assert await _post_drain(port) == 202
    assert server.draining


async def test_the_admin_key_drains_from_anywhere_and_the_api_key_does_not(start_server):
    server = (await start_server(f'server.api_key="{KEY}"', 'server.admin_key="sk-admin"',
                                 'server.drain_from=["127.0.0.1"]')).server
    port = server.ports[0]
    assert await _post_drain(port, source="127.0.0.2", headers=f"authorization: Bearer {KEY}\r\n") == 403
    assert not server.draining
    assert await _post_drain(port, source="127.0.0.2", headers="authorization: Bearer sk-admin\r\n") == 202
    assert server.draining


async def test_a_call_dropped_during_the_drain_resumes_and_ends_normally(start_server):
    """Issue 38, item 3: the drain waits for the calls under way, so a call whose connection
    drops during it must be able to come back (a new session is still refused)."""
    running = await start_server("server.shutdown_grace_s=600", "server.close_timeout_s=0.5")
    server = running.server
    stream = await trio.open_tcp_stream("127.0.0.1", running.port)
    first, second = _noise(1, seed=21), _noise(2, seed=22)
    async with trio.open_nursery() as nursery:
        ws = await trio_websocket.wrap_client_stream(nursery, stream, "127.0.0.1", "/v1/duplex")
        token = json.loads(await ws.get_message())["resume_token"]
        await ws.send_message(first.tobytes())
        assert await ws.get_message() == first.tobytes()
        assert await _post_drain(running.port) == 202 and server.draining
        stream.socket.close()  # the phone blinks: no Close frame
        nursery.cancel_scope.cancel()
    with trio.fail_after(PATIENCE):
        while server.statistics().detached != 1:
            await trio.sleep(0.01)
    with pytest.raises(trio_websocket.ConnectionRejected) as refused:
        async with trio_websocket.open_websocket_url(running.url("/v1/duplex")):
            pass
    assert refused.value.status_code == 503  # new sessions are still refused
    heard = b""
    with trio.fail_after(PATIENCE):
        async with trio_websocket.open_websocket_url(running.url(f"/v1/duplex?resume={token}&received=2")) as ws:
            assert json.loads(await ws.get_message())["type"] == "session.resumed"
            await ws.send_message(second.tobytes())
            while len(heard) < second.nbytes:
                heard += await ws.get_message()
            await ws.send_message(json.dumps({"type": "input.end"}))
            end = json.loads(await ws.get_message())
    assert heard == second.tobytes()
    assert (end["type"], end["reason"], end["usage"]["frames_out"]) == ("session.end", "stop", 3)


# -- the real command --------------------------------------------------------------------------------


def _noise(frames: int, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(frames * FRAME) * 0.2).astype("<f4")


def _readyz(port: int) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _refused_status(port: int) -> int:
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    with pytest.raises(InvalidStatus) as refused:
        with connect(f"ws://127.0.0.1:{port}/v1/duplex", open_timeout=PATIENCE):
            pass
    return refused.value.response.status_code


def _echoed(ws, audio: np.ndarray) -> bytes:
    """Send ``audio``, read until as many bytes came back (echo, no delay)."""
    ws.send(audio.tobytes())
    heard = b""
    while len(heard) < audio.nbytes:
        message = ws.recv(timeout=PATIENCE)
        assert isinstance(message, bytes), message
        heard += message
    return heard


def test_a_call_goes_on_through_the_drain_and_the_server_exits_when_it_ends():
    from websockets.sync.client import connect

    with ServeProcess("-o", "delay_frames=0", "--no-log-stats", "--set", "server.shutdown_grace_s=120") as server:
        with connect(f"ws://127.0.0.1:{server.port}/v1/duplex") as ws:
            assert json.loads(ws.recv(timeout=PATIENCE))["type"] == "session.created"
            before = _noise(3, seed=1)
            assert _echoed(ws, before) == before.tobytes()
            signalled = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            # The signal is handled in its own time: asked before that, /readyz rightly says 200.
            server.wait_for_line("received SIGTERM: draining")
            status, ready = _readyz(server.port)
            assert (status, ready["reason"]) == (503, "draining")
            assert time.monotonic() - signalled < PATIENCE
            server.wait_for_line("draining: 1 call left, 120 s to go")
            assert _refused_status(server.port) == 503  # no new sessions
            # The call goes on: more audio, every frame of it answered, as before the signal.
            for seed in range(2, 6):
                after = _noise(2, seed=seed)
                assert _echoed(ws, after) == after.tobytes()
            assert server.proc.poll() is None
            ws.send(json.dumps({"type": "input.end"}))
            end = json.loads(ws.recv(timeout=PATIENCE))
        assert end["type"] == "session.end" and end["reason"] == "stop"
        assert end["usage"]["frames_in"] == end["usage"]["frames_out"] == 11
        assert server.proc.wait(timeout=PATIENCE) == 0
        server.wait_for_line("drained: every call ended")
        server.wait_for_line("stopped")
        assert not any("WARNING" in line or "Traceback" in line for line in server.lines), server.lines


def test_a_call_still_going_when_the_grace_period_ends_is_told_shutdown_and_cut():
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    with ServeProcess("-o", "delay_frames=0", "--no-log-stats", "--set", "server.shutdown_grace_s=1") as server:
        with connect(f"ws://127.0.0.1:{server.port}/v1/duplex") as ws:
            ws.recv(timeout=PATIENCE)
            audio = _noise(2, seed=7)
            assert _echoed(ws, audio) == audio.tobytes()
            server.proc.send_signal(signal.SIGTERM)
            messages = []
            try:
                while True:  # the caller keeps talking; the server cuts it after a second
                    ws.send(_noise(1, seed=8).tobytes())
                    messages.append(ws.recv(timeout=PATIENCE))
            except ConnectionClosed:  # a send can find the close first: what came before it is read
                pass
            with pytest.raises(ConnectionClosed) as closed:
                while True:
                    messages.append(ws.recv(timeout=PATIENCE))
        texts = [json.loads(m) for m in messages if isinstance(m, str)]
        assert closed.value.rcvd.code == 1001, (closed.value, texts, server.lines)
        assert [(e["type"], e["reason"]) for e in texts] == [("session.end", "shutdown")]
        assert server.proc.wait(timeout=PATIENCE) == 0
        server.wait_for_line("grace period over (server.shutdown_grace_s = 1) with 1 call left")


def test_a_drain_begun_over_http_is_not_cut_by_the_sigterm_that_follows_it():
    """What Kubernetes does: the preStop hook's POST /drain, then SIGTERM.  That SIGTERM is the
    first signal: the call goes on; only another one cuts."""
    from websockets.sync.client import connect

    with ServeProcess("-o", "delay_frames=0", "--no-log-stats", "--api-key", KEY,
                      "--set", "server.shutdown_grace_s=120") as server:
        headers = {"Authorization": f"Bearer {KEY}"}
        with connect(f"ws://127.0.0.1:{server.port}/v1/duplex", additional_headers=headers) as ws:
            ws.recv(timeout=PATIENCE)
            import urllib.request

            request = urllib.request.Request(f"http://127.0.0.1:{server.port}/drain", method="POST",
                                             headers=headers)
            with urllib.request.urlopen(request, timeout=PATIENCE) as answer:
                assert answer.status == 202 and json.loads(answer.read())["calls"] == 1
            server.proc.send_signal(signal.SIGTERM)
            server.wait_for_line("received SIGTERM: draining")
            audio = _noise(3, seed=9)
            assert _echoed(ws, audio) == audio.tobytes()
            server.proc.send_signal(signal.SIGTERM)  # the second signal: cut now
            assert server.proc.wait(timeout=PATIENCE) == 0
        server.wait_for_line("received SIGTERM again: stopping now")
