"""`duplexrt serve` on real loopback sockets: routes, admission, keys, health, bad input, shutdown."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
import trio
import trio_websocket

from conftest import backend_info
from duplexrt.backends.echo import EchoBackend
from duplexrt.config import load_config
from duplexrt.server import Server

FRAME = 1920


def _config(*overrides: str):
    return load_config(None, ["server.port=0", "runtime.slots=4", "backend.options.delay_frames=0", *overrides])


class Running:
    def __init__(self, server: Server) -> None:
        self.server = server
        self.port = server.ports[0]

    def url(self, path: str) -> str:
        return f"ws://127.0.0.1:{self.port}{path}"


async def _start(nursery: trio.Nursery, *overrides: str) -> Running:
    server = Server(_config(*overrides))
    await nursery.start(server.run)
    return Running(server)


async def http_get(port: int, path: str, method: str = "GET", headers: str = "") -> tuple[int, dict, bytes]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(f"{method} {path} HTTP/1.1\r\nhost: x\r\n{headers}\r\n".encode())
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    fields = dict(line.split(": ", 1) for line in lines[1:])
    return status, {k.lower(): v for k, v in fields.items()}, body


def _noise(samples: int, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(samples) * 0.2).astype(np.float32)


async def _duplex_session(url: str, audio: np.ndarray, chunk: int = 2 * FRAME) -> tuple[bytes, list[dict]]:
    """Stream ``audio`` as f32 over /v1/duplex, end input, collect everything until close."""
    received = bytearray()
    events: list[dict] = []
    async with trio_websocket.open_websocket_url(url) as ws:
        async with trio.open_nursery() as nursery:
            async def send() -> None:
                for start in range(0, len(audio), chunk):
                    await ws.send_message(audio[start:start + chunk].tobytes())
                await ws.send_message(json.dumps({"type": "input.end"}))

            nursery.start_soon(send)
            try:
                while True:
                    message = await ws.get_message()
                    if isinstance(message, bytes):
                        received += message
                    else:
                        events.append(json.loads(message))
            except trio_websocket.ConnectionClosed as closed:
                events.append({"type": "closed", "code": closed.reason.code, "reason": closed.reason.reason})
    return bytes(received), events


async def test_health_ready_and_metrics_are_plain_http(nursery):
    running = await _start(nursery)
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


async def test_readyz_is_503_while_the_model_fails_every_step_and_clients_get_no_details(nursery, caplog):
    config = _config("runtime.max_consecutive_step_failures=2")
    backend = FailingEcho(config)
    server = Server(config, backend)
    await nursery.start(server.run)
    running = Running(server)
    status, _, body = await http_get(running.port, "/readyz")
    assert status == 200 and json.loads(body)["reason"] is None

    ends = []
    for seed in (10, 11):  # one frame each: one failed step each
        _, events = await _duplex_session(running.url("/v1/duplex"), _noise(FRAME, seed))
        [end] = [e for e in events if e["type"] == "session.end"]
        assert events[-1]["code"] == 1011 and events[-1]["reason"] == end["error"]
        ends.append(end)
    for end in ends:
        assert end["reason"] == "error"
        assert re.fullmatch(r"the model failed on this step \(error id err_[0-9a-f]+\)", end["error"]), end
        error_id = end["error"].split()[-1].rstrip(")")
        [logged] = [r for r in caplog.records if error_id in r.getMessage()]
        assert "CUDA error" in str(logged.exc_info[1]) and "/srv/models" in str(logged.exc_info[1])

    status, _, body = await http_get(running.port, "/readyz")
    ready = json.loads(body)
    assert status == 503
    assert (ready["ready"], ready["reason"], ready["consecutive_step_failures"]) == (False, "model_failing", 2)
    assert ready["model_loaded"] and ready["free_slots"] == 4

    # New sessions are still admitted: one step that works is what makes the server ready again.
    backend.failing.clear()
    audio = _noise(2 * FRAME, seed=12)
    received, events = await _duplex_session(running.url("/v1/duplex"), audio)
    assert received == audio.tobytes()
    status, _, body = await http_get(running.port, "/readyz")
    ready = json.loads(body)
    assert status == 200 and (ready["ready"], ready["reason"], ready["consecutive_step_failures"]) == (True, None, 0)


async def test_malformed_http_gets_400_and_the_server_goes_on(nursery):
    running = await _start(nursery)
    stream = await trio.open_tcp_stream("127.0.0.1", running.port)
    async with stream:
        await stream.send_all(b"\x16\x03\x01 this is not http\r\n\r\n")
        reply = await stream.receive_some(4096)
    assert reply.startswith(b"HTTP/1.1 400")
    assert (await http_get(running.port, "/healthz"))[0] == 200


async def test_duplex_route_echoes_pcm_and_reports_usage(nursery):
    running = await _start(nursery)
    audio = _noise(5 * FRAME + 100, seed=1)
    received, events = await _duplex_session(running.url("/v1/duplex"), audio, chunk=3000)
    padded = np.concatenate([audio, np.zeros(6 * FRAME - len(audio), np.float32)])
    assert received == padded.tobytes()
    assert events[0]["type"] == "session.created"
    assert events[0]["input"] == {"format": "pcm_f32le", "sample_rate": 24000}
    end = next(e for e in events if e["type"] == "session.end")
    assert end["reason"] == "stop" and end["usage"]["frames_in"] == end["usage"]["frames_out"] == 6
    assert events[-1] == {"type": "closed", "code": 1000, "reason": "stop"}


async def test_duplex_route_takes_s16_at_16k_and_answers_in_kind(nursery):
    running = await _start(nursery)
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


async def test_bad_route_options_are_refused_at_the_handshake(nursery):
    running = await _start(nursery)
    with pytest.raises(trio_websocket.ConnectionRejected) as refused:
        async with trio_websocket.open_websocket_url(running.url("/v1/duplex?format=mp3")):
            pass
    assert refused.value.status_code == 400 and b"mp3" in refused.value.body
    with pytest.raises(trio_websocket.ConnectionRejected) as refused:
        async with trio_websocket.open_websocket_url(running.url("/v1/nothing")):
            pass
    assert refused.value.status_code == 404


async def test_one_session_more_than_slots_is_refused_with_503_and_nothing_leaks(nursery):
    running = await _start(nursery, "runtime.slots=2")
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
    received, _ = await _duplex_session(running.url("/v1/duplex"), _noise(FRAME, seed=3))
    assert len(received) == FRAME * 4
    assert running.server.refused["no_free_slot"] == 1


async def test_api_key_is_required_as_bearer_or_query(nursery):
    running = await _start(nursery, 'server.api_key="s3cret"')
    with pytest.raises(trio_websocket.ConnectionRejected) as refused:
        async with trio_websocket.open_websocket_url(running.url("/v1/duplex")):
            pass
    assert refused.value.status_code == 401
    with pytest.raises(trio_websocket.ConnectionRejected):
        async with trio_websocket.open_websocket_url(running.url("/v1/duplex?api_key=wrong")):
            pass
    async with trio_websocket.open_websocket_url(running.url("/v1/duplex?api_key=s3cret")) as ws:
        assert json.loads(await ws.get_message())["type"] == "session.created"
    async with trio_websocket.open_websocket_url(running.url("/v1/duplex"),
                                                 extra_headers=[(b"authorization", b"Bearer s3cret")]) as ws:
        assert json.loads(await ws.get_message())["type"] == "session.created"


async def test_oversized_message_closes_with_1009(nursery):
    running = await _start(nursery, "server.max_message_bytes=4096")
    async with trio_websocket.open_websocket_url(running.url("/v1/duplex")) as ws:
        await ws.get_message()
        await ws.send_message(b"\x00" * 8192)
        with pytest.raises(trio_websocket.ConnectionClosed) as closed:
            while True:
                await ws.get_message()
    assert closed.value.reason.code == 1009


async def test_silent_client_is_closed_after_the_first_message_timeout(nursery):
    running = await _start(nursery, "server.first_message_timeout_s=0.2")
    async with trio_websocket.open_websocket_url(running.url("/v1/duplex")) as ws:
        await ws.get_message()  # session.created
        with trio.fail_after(5), pytest.raises(trio_websocket.ConnectionClosed) as closed:
            while True:
                await ws.get_message()
    assert closed.value.reason.code == 1008
    assert "no message" in closed.value.reason.reason


async def test_stalled_request_head_is_answered_408(nursery):
    running = await _start(nursery, "server.handshake_timeout_s=0.2")
    stream = await trio.open_tcp_stream("127.0.0.1", running.port)
    async with stream:
        await stream.send_all(b"GET /healthz HTTP/1.1\r\n")
        with trio.fail_after(5):
            reply = await stream.receive_some(4096)
    assert reply.startswith(b"HTTP/1.1 408")


async def test_misbehaving_connections_leave_a_concurrent_session_intact(nursery):
    running = await _start(nursery, "server.max_message_bytes=65536")
    audio = _noise(12 * FRAME, seed=4)
    result = {}

    async def healthy() -> None:
        result["healthy"] = await _duplex_session(running.url("/v1/duplex"), audio, chunk=FRAME)

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


async def test_websockets_library_client_talks_to_the_duplex_route(nursery):
    """An independent client implementation (the `websockets` library), run in a thread."""
    from websockets.sync.client import connect

    running = await _start(nursery)
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


def test_sigterm_drains_sessions_and_exits_zero(tmp_path):
    """The real command in its own process: SIGTERM mid-session, the client is told, exit 0."""
    from websockets.sync.client import connect

    proc = subprocess.Popen(
        [sys.executable, "-m", "duplexrt_cli.app", "serve", "--port", "0", "--log-level", "info",
         "--set", "server.shutdown_grace_s=5"],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        port = None
        for line in proc.stderr:
            if "port(s)" in line:
                port = int(line.split("port(s) ")[1].split()[0])
                break
        assert port, "the server never said where it listens"
        with connect(f"ws://127.0.0.1:{port}/v1/duplex") as ws:
            ws.recv()  # session.created
            ws.send(_noise(2 * FRAME, seed=6).tobytes())
            assert isinstance(ws.recv(), bytes)
            proc.send_signal(signal.SIGTERM)
            messages = []
            try:
                while True:
                    messages.append(ws.recv(timeout=10))
            except Exception as exc:  # the close
                close = exc
        end = json.loads(messages[-1])
        assert end["type"] == "session.end" and end["reason"] == "shutdown"
        assert close.rcvd.code == 1001
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()


async def test_head_gets_the_headers_without_a_body(nursery):
    running = await _start(nursery)
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
