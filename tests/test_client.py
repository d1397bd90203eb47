"""`duplexrt client`: a WAV file streamed to a real server on a loopback port, on every route,
and what comes back written as a WAV; then the ways it can fail, each with its exit status.

The server runs in process (echo backend, delay 0: every session hears its own input back), so
what comes back is known: exactly the input on the lossless routes, close to it through Opus.
"""

from __future__ import annotations

import io
import json
import socket
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import sphn
import trio
import trio_websocket
from typer.testing import CliRunner

from conftest import ServeProcess
from duplexrt.audio import AudioSpec, StreamResampler, make_decoder, make_encoder
from duplexrt.client.protocols import (
    DuplexClient,
    Ended,
    LiveClient,
    MoshiClient,
    Opened,
    RealtimeClient,
    ServerError,
    Text,
    UnknownRoute,
    client_for_url,
    route_of,
)
from duplexrt.client.stream import ClientRequest, run_client
from duplexrt.config import load_config
from duplexrt.server import Server
from duplexrt_cli.app import app

RATE = 24000
FRAME = 1920
PATIENCE = 15.0


def _config(*overrides: str):
    return load_config(None, ["server.port=0", "runtime.slots=4", "backend.options.delay_frames=0", *overrides])


def _noise(samples: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (0.25 * rng.standard_normal(samples)).clip(-0.9, 0.9).astype(np.float32)


def _chirp(samples: int, rate: int) -> np.ndarray:
    """Not periodic, so the alignment of a lossy copy is unique."""
    t = np.arange(samples) / rate
    return (0.4 * np.sin(2 * np.pi * (200 * t + 300 * t * t))).astype(np.float32)


def _wav(path: Path, signal: np.ndarray, rate: int) -> np.ndarray:
    """Write ``signal`` as the test's input file; returns what a reader gets back from it."""
    sphn.write_wav(str(path), signal, rate)
    data, read_rate = sphn.read(str(path))
    assert read_rate == rate
    return data[0]


def _read(path: Path) -> tuple[np.ndarray, int]:
    data, rate = sphn.read(str(path))
    return data[0], rate


def _padded(signal: np.ndarray, frame: int) -> np.ndarray:
    return np.concatenate([signal, np.zeros(-len(signal) % frame, np.float32)])


def _as_wav_bytes(path: Path, signal: np.ndarray, rate: int) -> bytes:
    sphn.write_wav(str(path), signal, rate)
    return path.read_bytes()


def _pcm16(signal: np.ndarray) -> np.ndarray:
    """``signal`` after a pcm16 round trip, as the realtime route carries it."""
    spec = AudioSpec.create("pcm_s16le", RATE, model_rate=RATE)
    return make_decoder(spec, RATE).decode(make_encoder(spec, RATE).encode(signal))


def _best_correlation(sent: np.ndarray, heard: np.ndarray, max_lag: int = 2000) -> tuple[float, int]:
    """The lag (0..max_lag samples) at which ``heard`` best matches ``sent`` (cross-correlation by
    FFT), and the normalised correlation there, the first 0.1 s (where codecs settle) left out."""
    skip = RATE // 10
    a = sent[skip:len(sent) - max_lag].astype(np.float64)
    b = heard[skip:skip + len(a) + max_lag].astype(np.float64)
    size = 1 << (len(b) + len(a)).bit_length()
    spectrum = np.fft.rfft(b, size) * np.conj(np.fft.rfft(a, size))
    lag = int(np.argmax(np.fft.irfft(spectrum, size)[:max_lag]))
    part = b[lag:lag + len(a)]
    a = a[:len(part)]
    return float(np.dot(a, part) / np.sqrt(np.dot(a, a) * np.dot(part, part) or 1.0)), lag


async def _client(tmp_path: Path, url: str, source: Path, **fields) -> tuple[int, str, str, Path]:
    out = tmp_path / "out.wav"
    stdout, stderr = io.StringIO(), io.StringIO()
    request = ClientRequest(input_path=source, url=url, output_path=out, **fields)
    with trio.fail_after(PATIENCE):
        code = await run_client(request, out=stdout, err=stderr)
    return code, stdout.getvalue(), stderr.getvalue(), out


# -- the routes, end to end -------------------------------------------------------------------------------


async def test_duplex_route_f32_at_24k_comes_back_exactly(tmp_path, start_server):
    port = (await start_server()).port
    sent = _wav(tmp_path / "in.wav", _noise(5 * FRAME + 100, seed=1), RATE)
    code, stdout, stderr, out = await _client(tmp_path, f"ws://127.0.0.1:{port}/v1/duplex", tmp_path / "in.wav")
    assert code == 0, stderr
    heard, rate = _read(out)
    assert rate == RATE and len(heard) == 6 * FRAME  # the last frame is padded by the server
    expected = _padded(sent, FRAME)
    # f32 both ways: the bytes of OUT.wav are those of the padded input written the same way.
    assert out.read_bytes() == _as_wav_bytes(tmp_path / "expected.wav", expected, RATE)
    assert stdout.startswith(f"sent {len(sent) / RATE:.3f} s, received 0.480 s at 24000 Hz")
    assert "server ended the session: stop" in stdout


async def test_duplex_route_at_16k_is_sent_at_the_files_rate(tmp_path, start_server):
    port = (await start_server()).port
    signal = _chirp(16000, 16000)
    sent = _wav(tmp_path / "in16.wav", signal, 16000)
    code, stdout, stderr, out = await _client(tmp_path, f"ws://127.0.0.1:{port}/v1/duplex", tmp_path / "in16.wav")
    assert code == 0, stderr
    heard, rate = _read(out)
    # Sent as f32 at 16 kHz (?rate=16000), answered at 16 kHz: 13 frames of 80 ms, the last padded.
    assert rate == 16000 and len(heard) == 13 * 1280
    # Resampled to the model's 24 kHz and back by the server: close, delayed by the filters.
    value, lag = _best_correlation(sent, heard, max_lag=200)
    assert value > 0.99 and lag < 200, (value, lag)


async def test_realtime_duplex_mode_pcm16_comes_back_exactly(tmp_path, start_server):
    port = (await start_server()).port
    sent = _wav(tmp_path / "in.wav", _noise(4 * FRAME + 700, seed=2), RATE)
    code, stdout, stderr, out = await _client(tmp_path, f"ws://127.0.0.1:{port}/v1/realtime?duplex=1",
                                              tmp_path / "in.wav")
    assert code == 0, stderr
    heard, rate = _read(out)
    assert rate == RATE and len(heard) == 5 * FRAME  # padded by the client: no end of input here
    expected = _pcm16(_padded(sent, FRAME))
    assert out.read_bytes() == _as_wav_bytes(tmp_path / "expected.wav", expected, RATE)
    assert "server ended the session: stop" in stdout  # response.done, after the client's cancel


async def test_realtime_from_a_16k_file_is_resampled_to_24k_by_the_client(tmp_path, start_server):
    port = (await start_server()).port
    sent = _wav(tmp_path / "in16.wav", _chirp(8000, 16000), 16000)
    code, stdout, stderr, out = await _client(tmp_path, f"ws://127.0.0.1:{port}/v1/realtime?duplex=1",
                                              tmp_path / "in16.wav")
    assert code == 0, stderr
    heard, rate = _read(out)
    resampler = StreamResampler(16000, RATE)
    at_24k = np.concatenate([resampler.process(sent), resampler.flush()])
    expected = _pcm16(_padded(at_24k, FRAME))
    assert rate == RATE and len(heard) == len(expected) == 7 * FRAME
    np.testing.assert_allclose(heard, expected, atol=2 / 32768)


async def test_realtime_turn_mode_hears_the_whole_reply_to_its_turn(tmp_path, start_server):
    port = (await start_server()).port
    sent = _wav(tmp_path / "in.wav", _noise(40 * FRAME, seed=3), RATE)
    # Whichever comes first, the model's answer or response.create, the whole reply is heard;
    # each order is forced in tests/test_promises.py and tests/test_realtime_sessions.py.
    code, stdout, stderr, out = await _client(tmp_path, f"ws://127.0.0.1:{port}/v1/realtime",
                                              tmp_path / "in.wav")
    assert code == 0, stderr
    assert "server ended the session: stop" in stdout  # response.done, status completed
    assert out.read_bytes() == _as_wav_bytes(tmp_path / "expected.wav", _pcm16(sent), RATE)


async def test_live_route_pcm16_comes_back_exactly_and_closes_cleanly(tmp_path, start_server):
    port = (await start_server()).port
    sent = _wav(tmp_path / "in.wav", _noise(4 * FRAME + 700, seed=5), RATE)
    code, stdout, stderr, out = await _client(tmp_path, f"ws://127.0.0.1:{port}/v1/live/sessions",
                                              tmp_path / "in.wav")
    assert code == 0, stderr
    heard, rate = _read(out)
    # session.close ends the input: the server pads the last partial frame and answers it.
    assert rate == RATE and len(heard) == 5 * FRAME
    expected = _pcm16(_padded(sent, FRAME))
    assert out.read_bytes() == _as_wav_bytes(tmp_path / "expected.wav", expected, RATE)
    assert "server ended the session: stop" in stdout  # session.closed, close_requested


@pytest.mark.parametrize("rate", [24000, 16000])
async def test_moshi_route_opus_comes_back_close(tmp_path, rate, start_server):
    port = (await start_server()).port
    seconds = 1.5
    sent = _wav(tmp_path / "in.wav", _chirp(int(seconds * rate), rate), rate)
    code, stdout, stderr, out = await _client(tmp_path, f"ws://127.0.0.1:{port}/api/chat", tmp_path / "in.wav")
    assert code == 0, stderr
    assert "complete: all output heard" in stdout
    heard, out_rate = _read(out)
    assert out_rate == RATE and len(heard) == round(seconds / 0.08) * FRAME  # 1.5 s padded to 19 frames
    resampler = StreamResampler(rate, RATE)
    reference = np.concatenate([resampler.process(sent), resampler.flush()])
    value, lag = _best_correlation(reference, heard)
    assert value > 0.9 and 0 < lag < 2000, (value, lag)


async def test_realtime_pacing_takes_as_long_as_the_audio(tmp_path, start_server):
    port = (await start_server()).port
    sent = _wav(tmp_path / "in.wav", _noise(4 * FRAME, seed=4), RATE)
    started = time.perf_counter()
    code, stdout, stderr, out = await _client(tmp_path, f"ws://127.0.0.1:{port}/v1/duplex", tmp_path / "in.wav",
                                              realtime=True)
    elapsed = time.perf_counter() - started
    assert code == 0, stderr
    assert elapsed >= 4 * 0.08 - 0.01  # one 80 ms message every 80 ms
    assert out.read_bytes() == _as_wav_bytes(tmp_path / "expected.wav", sent, RATE)


async def test_a_session_the_server_ends_early_reports_what_was_really_sent(tmp_path, start_server):
    """A 4 s file, paced, to a server that ends every session at 1.2 s (``length``): the line says
    1.2 s sent, not the file's 4 s: what the server's session.end says its model took
    (``frames_in``), not what was written; a message or two written after the end are named as
    such."""
    port = (await start_server("runtime.max_session_seconds=1.2")).port
    _wav(tmp_path / "in.wav", _noise(50 * FRAME, seed=9), RATE)
    code, stdout, stderr, _ = await _client(tmp_path, f"ws://127.0.0.1:{port}/v1/duplex", tmp_path / "in.wav",
                                            realtime=True)
    sent = float(stdout.split("sent ", 1)[1].split(" s,")[0])
    assert "length" in stdout, stdout
    assert sent == 1.2, stdout  # 15 frames taken
    if "written" in stdout:  # up to a few messages in flight when the end came
        written = float(stdout.split("; ", 1)[1].split(" s written")[0])
        assert 1.2 < written <= 1.2 + 0.5, stdout


async def test_api_key_is_sent_as_a_bearer_token(tmp_path, start_server):
    port = (await start_server('server.api_key="s3cret"')).port
    _wav(tmp_path / "in.wav", _noise(FRAME, seed=5), RATE)
    url = f"ws://127.0.0.1:{port}/v1/duplex"
    code, _, stderr, _ = await _client(tmp_path, url, tmp_path / "in.wav", api_key="s3cret")
    assert code == 0, stderr
    code, _, stderr, _ = await _client(tmp_path, url, tmp_path / "in.wav")
    assert code == 1 and "HTTP 401" in stderr


# -- failures ------------------------------------------------------------------------------------------


async def test_no_free_slot_is_a_clear_503_and_exit_1(tmp_path, start_server):
    port = (await start_server("runtime.slots=1")).port
    _wav(tmp_path / "in.wav", _noise(FRAME, seed=6), RATE)
    async with trio_websocket.open_websocket_url(f"ws://127.0.0.1:{port}/v1/duplex") as holder:
        await holder.get_message()  # session.created: the only slot is taken
        code, stdout, stderr, out = await _client(tmp_path, f"ws://127.0.0.1:{port}/v1/duplex", tmp_path / "in.wav")
    assert code == 1 and stdout == ""
    assert "HTTP 503" in stderr and "all 1 session slots are in use" in stderr
    assert not out.exists()


async def test_a_path_the_server_does_not_serve_is_its_404(tmp_path, start_server):
    port = (await start_server()).port
    _wav(tmp_path / "in.wav", _noise(FRAME, seed=7), RATE)
    code, _, stderr, _ = await _client(tmp_path, f"ws://127.0.0.1:{port}/v2/duplex", tmp_path / "in.wav",
                                       protocol="duplex")
    assert code == 1 and "HTTP 404" in stderr and "no WebSocket route /v2/duplex" in stderr


async def test_an_unknown_route_is_a_usage_error(tmp_path):
    _wav(tmp_path / "in.wav", _noise(FRAME, seed=8), RATE)
    code, _, stderr, _ = await _client(tmp_path, "ws://127.0.0.1:9/v1/nope", tmp_path / "in.wav")
    assert code == 2 and "unknown route '/v1/nope'" in stderr
    code, _, stderr, _ = await _client(tmp_path, "http://127.0.0.1:9/v1/duplex", tmp_path / "in.wav")
    assert code == 2 and "not a WebSocket URL" in stderr


async def test_an_unreadable_input_is_a_usage_error(tmp_path):
    (tmp_path / "junk.wav").write_bytes(b"not audio at all" * 8)
    code, _, stderr, _ = await _client(tmp_path, "ws://127.0.0.1:9/v1/duplex", tmp_path / "junk.wav")
    assert code == 2 and "cannot read" in stderr
    code, _, stderr, _ = await _client(tmp_path, "ws://127.0.0.1:9/v1/duplex", tmp_path / "missing.wav")
    assert code == 2 and "cannot read" in stderr


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_connection_refused_is_a_clear_error_and_exit_1(tmp_path):
    _wav(tmp_path / "in.wav", _noise(FRAME, seed=9), RATE)
    code, _, stderr, _ = await _client(tmp_path, f"ws://127.0.0.1:{_closed_port()}/v1/duplex", tmp_path / "in.wav")
    assert code == 1 and "connection refused" in stderr


def test_the_command_line_exit_statuses(tmp_path):
    runner = CliRunner()
    _wav(tmp_path / "in.wav", _noise(FRAME, seed=10), RATE)
    args = ["client", str(tmp_path / "in.wav"), "--out", str(tmp_path / "out.wav"), "--no-progress"]
    result = runner.invoke(app, [*args, "--url", f"ws://127.0.0.1:{_closed_port()}/v1/duplex"])
    assert result.exit_code == 1 and "connection refused" in result.output
    result = runner.invoke(app, [*args, "--url", "ws://127.0.0.1:9/elsewhere"])
    assert result.exit_code == 2 and "unknown route" in result.output
    result = runner.invoke(app, args)  # no --url
    assert result.exit_code == 2
    help_text = runner.invoke(app, ["client", "--help"], terminal_width=200).output
    for option in ("--url", "--out", "--realtime", "--api-key", "--protocol"):
        assert option in help_text


def test_client_and_simulate_url_as_real_processes_against_duplexrt_serve(tmp_path):
    """The commands as a user runs them: `duplexrt serve` in one process, the clients in others."""
    with ServeProcess("--slots", "4", "-o", "delay_frames=0") as server:
        port = server.port
        sent = _wav(tmp_path / "in.wav", _noise(3 * FRAME, seed=11), RATE)
        client = subprocess.run(
            [sys.executable, "-m", "duplexrt_cli.app", "client", str(tmp_path / "in.wav"), "--url",
             f"ws://127.0.0.1:{port}/v1/duplex", "--out", str(tmp_path / "out.wav")],
            capture_output=True, text=True, timeout=60)
        assert client.returncode == 0, client.stderr
        assert "received 0.240 s" in client.stdout
        assert (tmp_path / "out.wav").read_bytes() == _as_wav_bytes(tmp_path / "expected.wav", sent, RATE)
        report = tmp_path / "report.json"
        simulate = subprocess.run(
            [sys.executable, "-m", "duplexrt_cli.app", "simulate", "--url", f"ws://127.0.0.1:{port}/v1/duplex",
             "--concurrency", "3", "--frames", "5", "-o", "delay_frames=0", "--json", str(report),
             "--no-progress"],
            capture_output=True, text=True, timeout=60)
        assert simulate.returncode == 0, simulate.stderr
        assert "server CPU per frame" in simulate.stdout and "load-generator CPU per frame" in simulate.stdout
        data = json.loads(report.read_text())
        assert data["ok"] is True
        (round_,) = data["rounds"]
        assert round_["frames_in"] == round_["frames_out"] == round_["server_frames_in"] == 15


# -- the protocol classes on their own ---------------------------------------------------------------------


def test_routes_name_their_protocols_behind_a_prefix_too():
    assert route_of("ws://h:1/v1/duplex") == "duplex"
    assert route_of("wss://h/proxy/v1/realtime?duplex=1") == "realtime"
    assert route_of("ws://h:1/api/chat/") == "moshi"
    assert route_of("ws://h:1/v1/live/sessions") == "live"
    with pytest.raises(UnknownRoute):
        route_of("ws://h:1/v1/other")


def test_duplex_client_asks_for_its_format_and_reads_the_servers_end():
    client = client_for_url("ws://h:1/v1/duplex", input_format="pcm_f32le", input_rate=16000)
    assert client.url("ws://h:1/v1/duplex") == "ws://h:1/v1/duplex?format=pcm_f32le&rate=16000"
    chosen = client_for_url("ws://h:1/v1/duplex?format=pcm_s16le&output_format=g711_ulaw")
    assert (chosen.input_spec.format.value, chosen.input_spec.sample_rate) == ("pcm_s16le", 24000)
    assert (chosen.output_spec.format.value, chosen.output_spec.sample_rate) == ("g711_ulaw", 8000)
    with pytest.raises(ValueError, match="Opus clients use /api/chat"):
        client_for_url("ws://h:1/v1/duplex?format=opus")
    assert client.end_input() == ['{"type": "input.end"}']
    assert client.parse(b"\x00\x01") == b"\x00\x01"
    created = client.parse(json.dumps({"type": "session.created", "output": {"format": "pcm_s16le",
                                                                            "sample_rate": 8000}}))
    client.opened(created)
    assert client.output_spec == AudioSpec("pcm_s16le", 8000)
    end = client.parse(json.dumps({"type": "session.end", "reason": "stop", "usage": {"frames_in": 3,
                                                                                      "frames_out": 3}}))
    assert end == Ended("stop", 3, 3, None, end.info)
    assert client.parse('{"type": "error", "code": "x", "message": "y"}') == ServerError("x", "y")
    assert client.parse('{"type": "text", "text": "hi"}') == Text("hi")


def test_realtime_client_appends_base64_and_maps_response_done():
    turn = RealtimeClient()
    assert turn.end_input() == []  # nothing appended: nothing to commit
    assert json.loads(turn.audio(b"\x01\x00\x02\x00")) == {"type": "input_audio_buffer.append", "audio": "AQACAA=="}
    assert [json.loads(m)["type"] for m in turn.end_input()] == ["input_audio_buffer.commit", "response.create"]
    assert turn.parse(json.dumps({"type": "response.output_audio.delta", "delta": "AQACAA=="})) == b"\x01\x00\x02\x00"
    done = {"type": "response.done", "response": {"status": "completed", "usage": {
        "input_tokens": 4, "output_tokens": 5, "output_token_details": {"audio_tokens": 4, "text_tokens": 1}}}}
    assert turn.parse(json.dumps(done)) == Ended("stop", 4, 4, None, done)
    duplex = RealtimeClient(duplex=True)
    assert duplex.needs_catch_up and duplex.url("ws://h/v1/realtime") == "ws://h/v1/realtime?duplex=1&continuous=1"
    assert [json.loads(m)["type"] for m in duplex.finish()] == ["response.cancel"]
    cancelled = {"type": "response.done", "response": {"status": "cancelled",
                                                       "status_details": {"reason": "client_cancelled"}}}
    assert duplex.parse(json.dumps(cancelled)).reason == "stop"  # it asked: it had heard everything
    shutdown = {"type": "response.done", "response": {"status": "incomplete",
                                                      "status_details": {"reason": "server_shutdown"}}}
    assert duplex.parse(json.dumps(shutdown)).reason == "shutdown"


def test_client_protocols_read_a_misshapen_end_event_without_failing():
    """A server's end event whose status, reason or details are not what the protocol says (a
    list, an object, a string where an object goes) is still an end: its reason is the value as
    text, never a crash of the client."""
    realtime = RealtimeClient()
    for response in ({"status": ["completed"]}, {"status": "incomplete", "status_details": {"reason": {}}},
                     {"status": "incomplete", "status_details": "server_shutdown", "usage": []}):
        done = {"type": "response.done", "response": response}
        end = realtime.parse(json.dumps(done))
        assert end == Ended(str(response["status"]), None, None, None, done)
    live = LiveClient()
    closed = {"type": "session.closed", "reason": ["expired"], "usage": "none"}
    assert live.parse(json.dumps(closed)) == Ended("['expired']", None, None, None, closed)
    assert live.parse(json.dumps({"type": "error", "error": ["no"]})) == ServerError(None, "None")
    raw = DuplexClient(AudioSpec.create("pcm_s16le", 24000, model_rate=24000))
    assert raw.parse('{"type": "session.end", "reason": "stop", "usage": [1, 2]}').frames_in is None


def test_moshi_client_kinds():
    client = MoshiClient()
    assert client.audio(b"ogg") == b"\x01ogg"
    assert isinstance(client.parse(bytes(9)), Opened)
    assert client.parse(b"\x01OggS") == b"OggS"
    assert client.parse(b"\x02hello") == Text("hello")
    assert client.parse(b"\x05bad") == ServerError("error", "bad")
    end = client.parse(b'\x04{"type":"session.end","reason":"shutdown","usage":{"frames_in":2,"frames_out":2}}')
    assert isinstance(end, Ended) and end.reason == "shutdown" and end.frames_out == 2
    assert client.end_input() == [] and client.finish() == []


def test_live_client_starts_appends_closes_and_maps_session_closed():
    client = client_for_url("ws://h:1/v1/live/sessions")
    assert isinstance(client, LiveClient) and client.greets and client.server_closes
    [start] = client.hello()
    assert json.loads(start) == {"type": "session.start", "session": {
        "model": "duplexrt", "audio": {"format": {"type": "audio/pcm", "rate": 24000}}}}
    assert json.loads(client.audio(b"\x01\x00")) == {"type": "session.input_audio.append", "audio": "AQA="}
    assert [json.loads(m) for m in client.end_input()] == [{"type": "session.close"}]
    assert isinstance(client.parse('{"type": "session.started", "session": {"id": "s"}}'), Opened)
    assert client.parse('{"type": "session.output_audio.delta", "delta": "AQA="}') == b"\x01\x00"
    assert client.parse('{"type": "session.output_transcript.delta", "delta": "hi", "start_ms": 0, '
                        '"end_ms": 80}') == Text("hi")
    closed = {"type": "session.closed", "reason": "expired", "usage": {"seconds": 0.4}}
    assert client.parse(json.dumps(closed)) == Ended("length", None, None, None, closed)
    ours = {"type": "session.closed", "reason": "connection_lost", "finish_reason": "idle_timeout",
            "usage": {"seconds": 0.16, "frames_in": 2, "frames_out": 2}}
    assert client.parse(json.dumps(ours)) == Ended("idle_timeout", 2, 2, None, ours)
    error = {"type": "error", "error": {"code": "unsupported_event", "message": "no"}}
    assert client.parse(json.dumps(error)) == ServerError("unsupported_event", "no")
    ulaw = client_for_url("ws://h:1/v1/live/sessions", input_format="g711_ulaw")
    assert json.loads(ulaw.hello()[0])["session"]["audio"]["format"] == {"type": "audio/pcmu", "rate": 8000}


# -- resume ---------------------------------------------------------------------------------------------


class _CuttingProxy:
    """A loopback TCP relay in front of the server that cuts its first connection, both ways and
    without a Close frame, once ``after`` bytes have come back from the server: a dropped call."""

    def __init__(self, target: int, after: int) -> None:
        self.target = target
        self.after = after
        self.connections = 0
        self.cut = trio.Event()

    async def serve(self, nursery: trio.Nursery) -> int:
        listeners = await nursery.start(partial(trio.serve_tcp, self._relay, 0, host="127.0.0.1"))
        return listeners[0].socket.getsockname()[1]

    async def _relay(self, client: trio.SocketStream) -> None:
        self.connections += 1
        cutting = self.connections == 1
        server = await trio.open_tcp_stream("127.0.0.1", self.target)
        moved = 0

        async def pump(source: trio.SocketStream, sink: trio.SocketStream, counted: bool) -> None:
            nonlocal moved
            try:
                while data := await source.receive_some(65536):
                    await sink.send_all(data)
                    if counted and cutting:
                        moved += len(data)
                        if moved >= self.after and not self.cut.is_set():
                            self.cut.set()
                            client.socket.close()
                            server.socket.close()
                            return
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

        async with trio.open_nursery() as pumps:
            pumps.start_soon(pump, client, server, False)
            pumps.start_soon(pump, server, client, True)


async def test_the_client_resumes_a_dropped_connection_and_hears_every_frame_once(nursery, tmp_path, start_server):
    port = (await start_server()).port
    proxy = _CuttingProxy(port, after=20 * FRAME * 4)
    proxy_port = await proxy.serve(nursery)
    sent = _wav(tmp_path / "in.wav", _noise(60 * FRAME, seed=4), RATE)
    code, stdout, stderr, out = await _client(tmp_path, f"ws://127.0.0.1:{proxy_port}/v1/duplex",
                                              tmp_path / "in.wav")
    assert proxy.cut.is_set() and proxy.connections == 2  # cut once, resumed once
    assert code == 0, stderr
    assert "server ended the session: stop; resumed after 1 dropped connection(s)" in stdout
    resuming = [line for line in stderr.splitlines() if "resuming the session" in line]
    assert len(resuming) == 1 and resuming[0].startswith("duplexrt: the connection dropped ("), stderr
    assert out.read_bytes() == _as_wav_bytes(tmp_path / "expected.wav", sent, RATE)


#: A model that steps in real time (80 ms a frame) and pings every half second: a burst client is
#: seconds ahead of the model, its sender blocked on a full socket, when the pings come.  The pong
#: waits in the socket behind the audio sent before it, at most the file's length: the ping
#: timeout is above that, so only a client that stops answering (or reading) is dropped.
REAL_TIME = ("backend.name=synthetic", "backend.options.step_ms=80", "server.ping_interval_s=0.5",
             "server.ping_timeout_s=5", "runtime.slots=2", "metrics.log_stats=false", "server.port=0")


async def test_a_burst_client_answers_pings_while_the_model_steps_in_real_time(nursery, tmp_path):
    """Before, the client's reader parsed the ping and waited for the write turn its blocked
    sender held: it stopped reading, the server's writer and then its reader stopped, no pong
    came, and the server dropped the call at its ping timeout (resumed here, a drop each time)."""
    server = Server(load_config(None, list(REAL_TIME)))
    await nursery.start(server.run)
    _wav(tmp_path / "in.wav", _noise(50 * FRAME, seed=12), RATE)  # 4 s
    code, stdout, stderr, out = await _client(tmp_path, f"ws://127.0.0.1:{server.ports[0]}/v1/duplex",
                                              tmp_path / "in.wav")
    assert code == 0, stderr
    assert stdout.startswith("sent 4.000 s, received 4.000 s at 24000 Hz")  # every frame
    assert "server ended the session: stop)" in stdout  # and no dropped connection on the way
    assert len(_read(out)[0]) == 50 * FRAME
    assert server.runtime is not None and server.runtime.metrics.sessions_resumed == 0


# -- the connection itself, on both WebSocket paths --------------------------------------------------


@pytest.mark.parametrize("impl", ["native", "trio-websocket"])
async def test_open_connection_greets_echoes_and_names_a_refusal_on_either_path(impl, start_server):
    from duplexrt.client.connection import ConnectError, open_connection
    from duplexrt.client.protocols import client_for_url

    port = (await start_server("runtime.slots=1", "backend.options.delay_frames=0")).port
    url = f"ws://127.0.0.1:{port}/v1/duplex"
    frame = _noise(FRAME, seed=11).tobytes()
    with trio.fail_after(PATIENCE):
        async with open_connection(url, client_for_url(url), impl=impl) as (transport, opened):
            assert opened is not None  # session.created, parsed by the protocol
            await transport.send(frame)
            assert await transport.receive() == frame
            with pytest.raises(ConnectError) as refused:  # the only slot is this connection's
                async with open_connection(url, client_for_url(url), impl=impl):
                    pass
    assert refused.value.kind == "http_503" and "all 1 session slots are in use" in refused.value.message


async def test_a_conversation_whose_server_goes_quiet_after_the_input_ends_idles_out(autojump_clock):
    from duplexrt.client.conversation import IDLE, Conversation
    from duplexrt.client.protocols import DuplexClient
    from duplexrt.wire.transport import TransportClosed, memory_transport_pair

    client_end, server_end = memory_transport_pair(capacity=16)
    spec = AudioSpec("pcm_f32le", RATE)
    heard: list = []
    conversation = Conversation(client_end, DuplexClient(spec, greets=False), on_audio=lambda item, now: heard.append(item),
                                idle_timeout=2.0)
    frame = _noise(FRAME, seed=12).tobytes()

    async def server() -> None:  # answers the first message, then says nothing more
        await server_end.send(await server_end.receive())
        with pytest.raises(TransportClosed):  # until the client, tired of waiting, closes
            while True:
                await server_end.receive()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(server)
        started = trio.current_time()
        await conversation.run(3, lambda i: frame, interval=0.08)
        nursery.cancel_scope.cancel()
    assert conversation.outcome == IDLE and len(heard) == 1
    assert trio.current_time() - started >= 2.0 + 3 * 0.08  # the idle time counts from the input's end
