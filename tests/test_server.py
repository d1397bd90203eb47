"""`duplexrt serve` on real loopback sockets: routes, admission, keys, health, bad input, shutdown."""

from __future__ import annotations

import json
import re
import signal
import socket
import threading

import numpy as np
import pytest
import trio
import trio_websocket

from conftest import PATIENCE, ControlledBackend, Served, ServeProcess, backend_info, duplex_session, http_get
from duplexrt.backends.echo import EchoBackend
from duplexrt.config import load_config
from duplexrt.server import Server

FRAME = 1920


def _config(*overrides: str):
    return load_config(None, ["server.port=0", "runtime.slots=4", "backend.options.delay_frames=0", *overrides])


def _noise(samples: int, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(samples) * 0.2).astype(np.float32)


async def test_health_ready_and_metrics_are_plain_http(start_server):
    running = await start_server()
    status, _, body = await http_get(running.port, "/healthz")
    assert (status, body) == (200, b"ok\n")
    status, headers, body = await http_get(running.port, "/readyz")
    ready = json.loads(body)
    assert status == 200 and headers["content-type"] == "application/json"
    assert ready["ready"] and ready["model_loaded"] and ready["free_slots"] == 4 and ready["backend"] == "echo"
    status, headers, body = await http_get(running.port, "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert b"duplexrt_slots_free 4.0" in body and b'duplexrt_handoffs_total{kind="decode_offload"}' in body
    assert (await http_get(running.port, "/nope"))[0] == 404
    assert (await http_get(running.port, "/healthz", method="POST"))[0] == 405
    assert (await http_get(running.port, "/v1/duplex"))[0] == 426


class FailingEcho(EchoBackend):
    """FAKE (a test hook on the real echo model): while ``failing`` is set every step raises, with
    the kind of detail a real model failure carries; otherwise the echo model, bit for bit."""

    def __init__(self, config) -> None:
        super().__init__(backend_info(config, "echo"), config.backend.options)
        self.failing = threading.Event()
        self.failing.set()

    def step(self, rows, inputs, outputs):
        if self.failing.is_set():
            raise RuntimeError("CUDA error: device-side assert triggered at /srv/models/secret/attn.py:42, "
                               "shape (3, 1920)")
        return super().step(rows, inputs, outputs)


async def test_readyz_is_503_while_the_model_fails_every_step_and_clients_get_no_details(start_server, caplog):
    backend = FailingEcho(_config())
    running = await start_server("runtime.max_consecutive_step_failures=2", backend=backend)
    status, _, body = await http_get(running.port, "/readyz")
    assert status == 200 and json.loads(body)["reason"] is None

    ends = []
    for seed in (10, 11):  # one frame each: one failed step each
        _, events = await duplex_session(running.url("/v1/duplex"), _noise(FRAME, seed))
        [end] = [e for e in events if e["type"] == "session.end"]
        assert events[-1]["code"] == 1011 and events[-1]["reason"] == end["error"]
        ends.append(end)
    for end in ends:
        assert end["reason"] == "error"
        assert re.fullmatch(r"the model failed on this step \(error id err_[0-9a-f]+\)", end["error"]), end
        error_id = end["error"].split()[-1].rstrip(")")
        [logged] = [r for r in caplog.records if error_id in r.getMessage() and r.exc_info]
        assert "CUDA error" in str(logged.exc_info[1]) and "/srv/models" in str(logged.exc_info[1])

    status, _, body = await http_get(running.port, "/readyz")
    ready = json.loads(body)
    assert status == 503
    assert (ready["ready"], ready["reason"], ready["consecutive_step_failures"]) == (False, "model_failing", 2)
    assert ready["model_loaded"] and ready["free_slots"] == 4

    # New sessions are still admitted: one step that works is what makes the server ready again.
    backend.failing.clear()
    audio = _noise(2 * FRAME, seed=12)
    received, events = await duplex_session(running.url("/v1/duplex"), audio)
    assert received == audio.tobytes()
    status, _, body = await http_get(running.port, "/readyz")
    ready = json.loads(body)
    assert status == 200 and (ready["ready"], ready["reason"], ready["consecutive_step_failures"]) == (True, None, 0)


async def test_malformed_http_gets_400_and_the_server_goes_on(start_server):
    running = await start_server()
    stream = await trio.open_tcp_stream("127.0.0.1", running.port)
    async with stream:
        await stream.send_all(b"\x16\x03\x01 this is not http\r\n\r\n")
        reply = await stream.receive_some(4096)
    assert reply.startswith(b"HTTP/1.1 400")
    assert (await http_get(running.port, "/healthz"))[0] == 200


async def test_duplex_route_echoes_pcm_and_reports_usage(start_server):
    running = await start_server()
    audio = _noise(5 * FRAME + 100, seed=1)
    received, events = await duplex_session(running.url("/v1/duplex"), audio, chunk=3000)
    padded = np.concatenate([audio, np.zeros(6 * FRAME - len(audio), np.float32)])
    assert received == padded.tobytes()
    assert events[0]["type"] == "session.created"
    assert events[0]["input"] == {"format": "pcm_f32le", "sample_rate": 24000}
    end = next(e for e in events if e["type"] == "session.end")
    assert end["reason"] == "stop" and end["usage"]["frames_in"] == end["usage"]["frames_out"] == 6
    assert events[-1] == {"type": "closed", "code": 1000, "reason": "stop"}


async def test_duplex_route_takes_s16_at_16k_and_answers_in_kind(start_server):
    running = await start_server()
    pcm = (_noise(16000, seed=2) * 32767).astype("<i2")
    async with trio_websocket.open_websocket_url(running.url("/v1/duplex?format=pcm_s16le&rate=16000")) as ws:
        created = json.loads(await ws.get_message())
        assert created["input"] == created["output"] == {"format": "pcm_s16le", "sample_rate": 16000}
        await ws.send_message(pcm.tobytes())
        await ws.send_message(json.dumps({"type": "input.end"}))
        audio = b""
        while isinstance(message := await ws.get_message(), bytes):
            audio += message
    assert json.loads(message)["reason"] == "stop"
    # 1 s in at 16 kHz comes back as 1 s (13 frames of 80 ms, the last one padded) at 16 kHz.
    assert len(audio) == 13 * 1280 * 2


async def test_bad_route_options_are_refused_at_the_handshake(start_server):
    running = await start_server()
    with pytest.raises(trio_websocket.ConnectionRejected) as refused:
        async with trio_websocket.open_websocket_url(running.url("/v1/duplex?format=mp3")):
            pass
    assert refused.value.status_code == 400 and b"mp3" in refused.value.body
    with pytest.raises(trio_websocket.ConnectionRejected) as refused:
        async with trio_websocket.open_websocket_url(running.url("/v1/nothing")):
            pass
    assert refused.value.status_code == 404


async def test_one_session_more_than_slots_is_refused_with_503_and_nothing_leaks(start_server):
    running = await start_server("runtime.slots=2")
    async with trio_websocket.open_websocket_url(running.url("/v1/duplex")) as first, \
            trio_websocket.open_websocket_url(running.url("/v1/duplex")) as second:
        await first.get_message()
        await second.get_message()
        with pytest.raises(trio_websocket.ConnectionRejected) as refused:
            async with trio_websocket.open_websocket_url(running.url("/v1/duplex")):
                pass
        assert refused.value.status_code == 503 and b"2 session slots" in refused.value.body
        status, _, body = await http_get(running.port, "/readyz")
        assert status == 503 and json.loads(body)["free_slots"] == 0
    # Both gone: every slot is free again and a new session is admitted.
    with trio.fail_after(5):
        while running.server.runtime.scheduler.free_slots != 2:
            await trio.sleep(0.01)
    received, _ = await duplex_session(running.url("/v1/duplex"), _noise(FRAME, seed=3))
    assert len(received) == FRAME * 4
    assert running.server.refused["no_free_slot"] == 1


async def test_api_key_is_required_as_bearer_or_query(start_server):
    running = await start_server('server.api_key="s3cret"')
    with pytest.raises(trio_websocket.ConnectionRejected) as refused:
        async with trio_websocket.open_websocket_url(running.url("/v1/duplex")):
            pass
    assert refused.value.status_code == 401
    with pytest.raises(trio_websocket.ConnectionRejected) as refused:
        async with trio_websocket.open_websocket_url(running.url("/v1/duplex?api_key=wrong")):
            pass
    assert refused.value.status_code == 401
    with pytest.raises(trio_websocket.ConnectionRejected) as refused:
        async with trio_websocket.open_websocket_url(running.url("/v1/duplex"),
                                                     extra_headers=[(b"authorization", b"Bearer wrong")]):
            pass
    assert refused.value.status_code == 401
    assert running.server.refused["unauthorized"] == 3
    async with trio_websocket.open_websocket_url(running.url("/v1/duplex?api_key=s3cret")) as ws:
        assert json.loads(await ws.get_message())["type"] == "session.created"
    async with trio_websocket.open_websocket_url(running.url("/v1/duplex"),
                                                 extra_headers=[(b"authorization", b"Bearer s3cret")]) as ws:
        assert json.loads(await ws.get_message())["type"] == "session.created"


async def test_oversized_message_closes_with_1009(start_server):
    running = await start_server("server.max_message_bytes=4096")
    async with trio_websocket.open_websocket_url(running.url("/v1/duplex")) as ws:
        await ws.get_message()
        await ws.send_message(b"\x00" * 8192)
        with pytest.raises(trio_websocket.ConnectionClosed) as closed:
            while True:
                await ws.get_message()
    assert closed.value.reason.code == 1009


async def test_silent_client_is_closed_after_the_first_message_timeout(start_server):
    running = await start_server("server.first_message_timeout_s=0.2")
    async with trio_websocket.open_websocket_url(running.url("/v1/duplex")) as ws:
        await ws.get_message()  # session.created
        with trio.fail_after(5), pytest.raises(trio_websocket.ConnectionClosed) as closed:
            while True:
                await ws.get_message()
    assert closed.value.reason.code == 1008
    assert "no message" in closed.value.reason.reason


async def test_stalled_request_head_is_answered_408(start_server):
    running = await start_server("server.handshake_timeout_s=0.2")
    stream = await trio.open_tcp_stream("127.0.0.1", running.port)
    async with stream:
        await stream.send_all(b"GET /healthz HTTP/1.1\r\n")
        with trio.fail_after(5):
            reply = await stream.receive_some(4096)
    assert reply.startswith(b"HTTP/1.1 408")


async def test_misbehaving_connections_leave_a_concurrent_session_intact(start_server):
    running = await start_server("server.max_message_bytes=65536")
    audio = _noise(12 * FRAME, seed=4)
    result = {}

    async def healthy() -> None:
        result["healthy"] = await duplex_session(running.url("/v1/duplex"), audio, chunk=FRAME)

    async def vandal() -> None:
        async with trio_websocket.open_websocket_url(running.url("/v1/duplex?format=pcm_s16le")) as ws:
            await ws.get_message()
            await ws.send_message(b"\x01\x02\x03")  # not a whole number of samples
            error = json.loads(await ws.get_message())
            await ws.send_message("{oops")
            bad_json = json.loads(await ws.get_message())
            await ws.send_message(json.dumps({"type": "explode"}))
            unknown = json.loads(await ws.get_message())
            result["vandal"] = [error["code"], bad_json["code"], unknown["code"]]
            await ws.send_message(b"\x00" * 100_000)  # too big: the connection is closed
            with pytest.raises(trio_websocket.ConnectionClosed):
                while True:
                    await ws.get_message()

    async with trio.open_nursery() as clients:
        clients.start_soon(healthy)
        clients.start_soon(vandal)
    received, events = result["healthy"]
    assert received == audio.tobytes()
    assert [e for e in events if e["type"] == "error"] == []
    assert result["vandal"] == ["invalid_audio", "invalid_json", "unknown_event"]
    assert (await http_get(running.port, "/healthz"))[0] == 200


async def test_websockets_library_client_talks_to_the_duplex_route(start_server):
    """An independent client implementation (the `websockets` library), run in a thread."""
    from websockets.sync.client import connect

    running = await start_server()
    audio = _noise(3 * FRAME, seed=5)

    def client() -> tuple[bytes, dict]:
        with connect(running.url("/v1/duplex?format=pcm_f32le")) as ws:
            created = json.loads(ws.recv())
            assert created["type"] == "session.created"
            ws.send(audio.tobytes())
            ws.send(json.dumps({"type": "input.end"}))
            data = b""
            while isinstance(message := ws.recv(), bytes):
                data += message
            return data, json.loads(message)

    data, end = await trio.to_thread.run_sync(client)
    assert data == audio.tobytes()
    assert end["type"] == "session.end" and end["usage"]["frames_out"] == 3


def test_sigterm_with_no_grace_tells_every_session_at_once_and_answers_what_it_took(tmp_path):
    """README: when the drain's grace period is over (here at once: shutdown_grace_s = 0), each
    call left is told it is closing (reason ``shutdown``, close code 1001), the frames it already
    took are answered, and the process exits 0.  The real command in its own process; calls that
    go on through a drain are in tests/test_drain.py."""
    from websockets.sync.client import connect

    with ServeProcess("--set", "server.shutdown_grace_s=0") as server:
        audio = b""
        with connect(f"ws://127.0.0.1:{server.port}/v1/duplex") as ws:
            ws.recv()  # session.created
            ws.send(_noise(3 * FRAME, seed=6).tobytes())
            first = ws.recv()
            assert isinstance(first, bytes)
            audio += first
            server.proc.send_signal(signal.SIGTERM)
            messages = []
            try:
                while True:
                    messages.append(ws.recv(timeout=PATIENCE))
            except Exception as exc:  # the close
                close = exc
        audio += b"".join(m for m in messages if isinstance(m, bytes))
        end = json.loads(messages[-1])
        assert end["type"] == "session.end" and end["reason"] == "shutdown"
        usage = end["usage"]
        assert usage["frames_in"] == usage["frames_out"] == 3  # every frame taken was answered
        assert len(audio) == 3 * FRAME * 4
        assert close.rcvd.code == 1001
        assert server.proc.wait(timeout=PATIENCE) == 0
        server.wait_for_line("draining: 1 call left, 0 s to go")


def test_a_second_signal_stops_at_once_without_waiting_for_the_grace_period():
    """README: "A second signal stops at once."  A connection that never sends its request head
    holds the drain open for the whole (long) grace period; the second SIGTERM ends it."""
    with ServeProcess("--set", "server.shutdown_grace_s=600", "--set", "server.handshake_timeout_s=600") as server:
        with socket.create_connection(("127.0.0.1", server.port)):
            server.wait_for_line("duplexrt is up")
            server.proc.send_signal(signal.SIGTERM)
            server.wait_for_line("draining:")
            assert server.proc.poll() is None  # draining: the silent connection is still open
            server.proc.send_signal(signal.SIGTERM)
            # Far less than the 600 s grace: only process exit is waited for.
            assert server.proc.wait(timeout=60) == 0


async def _start_stalled(nursery: trio.Nursery, *overrides: str) -> tuple[Served, ControlledBackend, trio.Event]:
    """A server on the synthetic model with a test gate (see ControlledBackend); the event is set
    once ``run`` has returned."""
    config = _config("backend.name=synthetic", *overrides)
    backend = ControlledBackend(config)
    server = Server(config, backend)
    returned = trio.Event()

    async def run(task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            await server.run(task_status=task_status)
        finally:
            backend.release()
        returned.set()

    await nursery.start(run)
    return Served(server), backend, returned


class _Collect:
    """Everything a raw client hears on /v1/duplex, until the close."""

    def __init__(self) -> None:
        self.audio = b""
        self.events: list[dict] = []
        self.close: tuple[int, str] | None = None
        self.closed = trio.Event()

    async def run(self, ws) -> None:
        try:
            while True:
                message = await ws.get_message()
                if isinstance(message, bytes):
                    self.audio += message
                else:
                    self.events.append(json.loads(message))
        except trio_websocket.ConnectionClosed as closed:
            self.close = (closed.reason.code, closed.reason.reason)
        self.closed.set()


async def test_shutdown_answers_every_frame_taken_then_closes_with_1001(nursery):
    """README: when the drain's grace is over every session is told it is closing: the frames it
    had taken are answered (frames_out == frames_in), then session.end with reason ``shutdown``."""
    running, backend, returned = await _start_stalled(nursery, "server.shutdown_grace_s=0")
    backend.stall()
    heard = _Collect()
    async with trio_websocket.open_websocket_url(running.url("/v1/duplex")) as ws:
        async with trio.open_nursery() as inner:
            inner.start_soon(heard.run, ws)
            await ws.send_message(_noise(3 * FRAME, seed=20).tobytes())
            await backend.wait_stalled()  # the model holds the first frame; the others wait
            (session,) = running.server.runtime.sessions
            with trio.fail_after(PATIENCE):
                while session.frames_in < 3:
                    await trio.sleep(0.001)
            running.server.shutdown()
            backend.release()
            with trio.fail_after(PATIENCE):
                await heard.closed.wait()
    end = heard.events[-1]
    assert end["type"] == "session.end" and end["reason"] == "shutdown"
    assert end["usage"]["frames_in"] == end["usage"]["frames_out"] == 3
    assert len(heard.audio) == 3 * FRAME * 4
    assert heard.close == (1001, "shutdown")
    with trio.fail_after(PATIENCE):
        await returned.wait()


async def test_a_websocket_handshake_that_arrives_while_draining_gets_503(nursery):
    """README: shutdown stops accepting.  A connection accepted before the shutdown whose
    handshake arrives after it is answered 503, while an open session drains."""
    running, backend, returned = await _start_stalled(nursery, "server.shutdown_grace_s=0")
    backend.stall()
    heard = _Collect()
    async with trio_websocket.open_websocket_url(running.url("/v1/duplex")) as ws:
        async with trio.open_nursery() as inner:
            inner.start_soon(heard.run, ws)
            await ws.send_message(_noise(FRAME, seed=21).tobytes())
            await backend.wait_stalled()  # the session cannot finish: the drain waits for it
            late = await trio.open_tcp_stream("127.0.0.1", running.port)
            with trio.fail_after(PATIENCE):
                while running.server._open_connections < 2:  # accepted, head not yet sent
                    await trio.sleep(0.001)
            running.server.shutdown()
            async with late:
                await late.send_all(
                    b"GET /v1/duplex HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
                    b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n")
                reply = b""
                with trio.fail_after(PATIENCE):
                    while chunk := await late.receive_some(4096):
                        reply += chunk
            assert reply.startswith(b"HTTP/1.1 503")
            assert b"shutting down" in reply
            assert running.server.refused["shutting_down"] == 1
            backend.release()
            with trio.fail_after(PATIENCE):
                await heard.closed.wait()
    assert heard.events[-1]["reason"] == "shutdown" and heard.close[0] == 1001
    with trio.fail_after(PATIENCE):
        await returned.wait()


def test_a_session_that_cannot_drain_is_cut_after_the_grace_period_and_the_server_exits():
    """README: the calls left when ``server.shutdown_grace_s`` is over are told ``shutdown``, and the
    server exits 0.  A model whose step takes far longer than the close timeout: the session is cut
    after it, the client still hears
    why (reason ``shutdown``, 1001, fewer frames out than in), and the process exits.  Real time
    is the point here, so only loose bounds on a real clock."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    with ServeProcess("--backend", "synthetic", "-o", "step_ms=1500",
                      "--set", "server.shutdown_grace_s=0.3", "--set", "server.close_timeout_s=1") as server:
        with connect(f"ws://127.0.0.1:{server.port}/v1/duplex") as ws:
            ws.recv()  # session.created
            ws.send(_noise(3 * FRAME, seed=22).tobytes())
            ws.send(json.dumps({"type": "ping"}))
            assert json.loads(ws.recv(timeout=PATIENCE))["type"] == "pong"  # the audio was taken
            server.proc.send_signal(signal.SIGTERM)
            messages = []
            try:
                while True:
                    messages.append(ws.recv(timeout=PATIENCE))
            except ConnectionClosed as exc:
                close = exc
        end = json.loads(messages[-1])
        assert end["type"] == "session.end" and end["reason"] == "shutdown"
        assert end["usage"]["frames_out"] < end["usage"]["frames_in"] == 3  # cut, not drained
        assert close.rcvd.code == 1001
        assert server.proc.wait(timeout=PATIENCE) == 0


async def test_a_model_that_is_not_ready_gets_503_and_health_stays_up(monkeypatch, start_server):
    """README: readiness is "model loaded, free slots"; a WebSocket handshake while the model is
    not ready is refused with 503 (retry-after), /readyz says why, /healthz stays 200."""
    from duplexrt.core.scheduler import Scheduler

    running = await start_server()
    # FAKE: the scheduler reports its model not loaded (as between a thread failure and exit).
    monkeypatch.setattr(Scheduler, "ready", property(lambda self: False))
    with pytest.raises(trio_websocket.ConnectionRejected) as refused:
        async with trio_websocket.open_websocket_url(running.url("/v1/duplex")):
            pass
    assert refused.value.status_code == 503 and b"not ready" in refused.value.body
    assert dict(refused.value.headers)[b"retry-after"] == b"1"
    status, _, body = await http_get(running.port, "/readyz")
    assert status == 503
    ready = json.loads(body)
    assert ready["ready"] is False and ready["model_loaded"] is False and ready["draining"] is False
    assert (await http_get(running.port, "/healthz"))[0] == 200
    assert running.server.refused["not_ready"] == 1


async def test_health_endpoints_stay_open_when_a_key_is_set(start_server):
    """README: "The health endpoints stay open" with --api-key."""
    running = await start_server('server.api_key="s3cret"')
    status, _, body = await http_get(running.port, "/healthz")
    assert (status, body) == (200, b"ok\n")
    status, _, body = await http_get(running.port, "/readyz")
    assert status == 200 and json.loads(body)["ready"] is True
    status, _, body = await http_get(running.port, "/metrics")
    assert status == 200 and b"duplexrt_slots_free 4.0" in body
    with pytest.raises(trio_websocket.ConnectionRejected) as refused:
        async with trio_websocket.open_websocket_url(running.url("/v1/duplex")):
            pass
    assert refused.value.status_code == 401  # while the routes still need it


async def test_head_gets_the_headers_without_a_body(start_server):
    running = await start_server()
    status, headers, body = await http_get(running.port, "/healthz", method="HEAD")
    assert status == 200 and headers["content-length"] == "3" and body == b""


def test_serving_on_a_port_in_use_is_one_clear_error():
    import socket

    from typer.testing import CliRunner

    from duplexrt_cli.app import app

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(app, ["serve", "--port", str(port), "--no-log-stats"])
    assert result.exit_code == 2
    assert "cannot listen" in result.output
