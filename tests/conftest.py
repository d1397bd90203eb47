"""Shared helpers for the runtime tests: configs, a controllable backend, a slot owner that
records what the scheduler hands it, and a raw-protocol client over the in-memory transport.

Everything here drives the real parts (scheduler thread, inbox, sessions, codecs); the only fake
is ``ControlledBackend``, the real synthetic model with two test hooks added.

No test using these helpers takes ``autojump_clock``: the scheduler is a real thread, and a clock
that jumps whenever every trio task is blocked would fire timeouts while that thread is working.
"""

from __future__ import annotations

import importlib.util
import os
import json
import math
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import attrs
import numpy as np
import pytest
import trio
import trio_websocket

from duplexrt.audio import AudioSpec, Framer, make_decoder, make_encoder
from duplexrt.backends import Backend, BackendInfo
from duplexrt.backends.synthetic import SyntheticBackend, expected_output, marker_tones
from duplexrt.config import Config, load_config
from duplexrt.runtime import Runtime
from duplexrt.server import Server
from duplexrt.core.scheduler import THREAD_NAME
from duplexrt.protocols.events import SessionEnd
from duplexrt.wire.native import NativeWebSocket
from duplexrt.wire.transport import MemoryTransport, TransportClosed, memory_transport_pair

MODEL_RATE = 24000
FRAME = 1920
TONES = marker_tones(MODEL_RATE, FRAME)
#: The longest any test waits for something that should take milliseconds.
PATIENCE = 10.0
#: A stalled step gives up after this long, so a failing test can never hang the run.
GATE_TIMEOUT = 15.0
INPUT_END = json.dumps({"type": "input.end"})


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """A script of benchmarks/ (not a package) as a module, for testing its pieces."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_config(*overrides: str) -> Config:
    return load_config(None, list(overrides))


def backend_info(config: Config, name: str = "synthetic") -> BackendInfo:
    return BackendInfo(name=name, sample_rate=config.audio.sample_rate,
                       frame_size=config.audio.frame_size, slots=config.runtime.slots)


def scheduler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


def spec(fmt: str, rate: int | None = None) -> AudioSpec:
    return AudioSpec.create(fmt, rate, model_rate=MODEL_RATE)


# -- a backend with test hooks ------------------------------------------------------------------


class ControlledBackend(SyntheticBackend):
    """FAKE (test hooks on the real synthetic model):

    * while ``gate`` (a threading.Event) is clear, ``step`` blocks on it: the scheduler thread is
      stalled exactly as a slow GPU would stall it; ``wait_stalled()`` returns once a step is
      blocked there;
    * ``step`` raises on the step numbers (1-based) in ``fail_on``;
    * ``step_rows`` records the rows of every step, in order.

    Otherwise its output is the synthetic backend's, bit for bit.  Create it inside the trio run
    (it keeps the run's token to report a stall).
    """

    def __init__(self, config: Config, *, stalled: bool = False, fail_on: Sequence[int] = ()) -> None:
        super().__init__(backend_info(config), {})
        self.gate = threading.Event()
        if not stalled:
            self.gate.set()
        self.fail_on = set(fail_on)
        self.step_rows: list[list[int]] = []
        self._token = trio.lowlevel.current_trio_token()
        self._stalled = trio.Event()

    def stall(self) -> None:
        self._stalled = trio.Event()
        self.gate.clear()

    def release(self) -> None:
        self.gate.set()

    async def wait_stalled(self) -> None:
        with trio.fail_after(PATIENCE):
            await self._stalled.wait()

    def step(self, rows: np.ndarray, inputs: np.ndarray, outputs: np.ndarray) -> None:
        number = len(self.step_rows) + 1
        self.step_rows.append(rows.tolist())
        if not self.gate.is_set():
            self._token.run_sync_soon(self._stalled.set)
            if not self.gate.wait(GATE_TIMEOUT):
                raise RuntimeError("test gate never opened")
        if number in self.fail_on:
            raise ValueError(f"injected failure on step {number}")
        return super().step(rows, inputs, outputs)


# -- a minimal slot owner --------------------------------------------------------------------------


class RecordingOwner:
    """A SlotOwner that keeps every output and failure the scheduler delivers to it."""

    def __init__(self) -> None:
        self.outputs: list[np.ndarray] = []
        self.failures: list[BaseException] = []
        #: A transcriber's pieces for this owner's caller, in order.
        self.transcripts: list = []
        self._lot = trio.lowlevel.ParkingLot()

    def step_output(self, output: np.ndarray, text: str | None, submitted_ns: int, stepped_ns: int) -> None:
        self.outputs.append(np.array(output))
        self._lot.unpark_all()

    def transcript(self, pieces) -> None:
        self.transcripts.extend(pieces)

    def delivery_done(self) -> None:
        pass

    def step_failed(self, error: BaseException) -> None:
        self.failures.append(error)
        self._lot.unpark_all()

    async def wait_for(self, outputs: int = 0, failures: int = 0) -> None:
        with trio.fail_after(PATIENCE):
            while len(self.outputs) < outputs or len(self.failures) < failures:
                await self._lot.park()


async def wait_until(predicate: Callable[[], bool], what: str) -> None:
    """Poll a condition only another thread can make true (bounded; used where no trio-side
    effect exists to wait on)."""
    with trio.fail_after(PATIENCE):
        while not predicate():
            await trio.sleep(0.001)
    assert predicate(), what


def frame_of(value: float) -> np.ndarray:
    return np.full(FRAME, value, dtype=np.float32)


def synthetic_out(frame: np.ndarray, session_id: int, index: int) -> np.ndarray:
    return expected_output(frame, session_id, index, TONES)


# -- audio on the wire -----------------------------------------------------------------------------


def noise(samples: int, seed: int, scale: float = 0.3) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.standard_normal(samples) * scale, -0.95, 0.95).astype(np.float32)


def cut_points(total: int, seed: int, low: int = 300, high: int = 5000) -> list[int]:
    """Message lengths (in samples) adding up to ``total``, none a multiple of a frame."""
    rng = np.random.default_rng(seed)
    sizes = []
    left = total
    while left > 0:
        size = int(rng.integers(low, high))
        if size % FRAME == 0:
            size += 1
        size = min(size, left)
        sizes.append(size)
        left -= size
    return sizes


def wire_messages(signal: np.ndarray, wire: AudioSpec, sizes: Sequence[int]) -> list[bytes]:
    """``signal`` (at the wire rate) encoded in ``wire``'s format, one message per size."""
    encoder = make_encoder(AudioSpec.create(wire.format, wire.sample_rate, model_rate=wire.sample_rate),
                           wire.sample_rate)
    messages = []
    start = 0
    for size in sizes:
        messages.append(encoder.encode(signal[start:start + size]))
        start += size
    tail = encoder.flush()
    if tail:
        messages.append(tail)
    return [m for m in messages if m]


def model_frames(messages: Sequence[bytes], wire: AudioSpec) -> list[np.ndarray]:
    """The frames the model sees for these messages: decoded and framed as a session does it,
    the last one zero-padded."""
    decoder = make_decoder(wire, MODEL_RATE)
    framer = Framer(FRAME)
    frames: list[np.ndarray] = []
    for message in messages:
        frames.extend(np.array(f) for f in framer.push(decoder.decode(message)))
    frames.extend(np.array(f) for f in framer.push(decoder.flush()))
    last = framer.flush()
    if last is not None:
        frames.append(last)
    return frames


def synthetic_wire(frames: Sequence[np.ndarray], session_id: int, wire: AudioSpec) -> bytes:
    """What a session on the synthetic backend sends back for these input frames."""
    encoder = make_encoder(wire, MODEL_RATE)
    out = b"".join(encoder.encode(synthetic_out(f, session_id, k)) for k, f in enumerate(frames))
    return out + encoder.flush()


# -- a raw-protocol client ---------------------------------------------------------------------------


@attrs.define
class ClientLog:
    """Everything one client received."""

    audio: bytearray = attrs.Factory(bytearray)
    audio_messages: int = 0
    errors: list[dict] = attrs.Factory(list)
    texts: list[str] = attrs.Factory(list)
    end: dict | None = None
    close_code: int | None = None
    close_reason: str = ""
    messages_sent: int = 0
    audio_sent: int = 0
    got_audio: trio.Event = attrs.Factory(trio.Event)
    pongs: int = 0


async def receive_all(transport: MemoryTransport, log: ClientLog) -> None:
    """Read until the server closes, sorting what arrives into ``log``."""
    while True:
        try:
            message = await transport.receive()
        except TransportClosed as closed:
            log.close_code = closed.code
            log.close_reason = closed.reason
            return
        if isinstance(message, str):
            event = json.loads(message)
            kind = event.get("type")
            if kind == "session.end":
                assert log.end is None, "two session.end events"
                log.end = event
            elif kind == "error":
                log.errors.append(event)
            elif kind == "text":
                log.texts.append(event["text"])
            elif kind == "pong":
                log.pongs += 1
            else:
                raise AssertionError(f"unexpected server event {event!r}")
        else:
            assert log.end is None, "audio after session.end"
            log.audio += message
            log.audio_messages += 1
            log.got_audio.set()


async def send_all(transport: MemoryTransport, messages: Sequence[bytes | str], log: ClientLog,
                   *, end_input: bool = True) -> None:
    try:
        for message in messages:
            await transport.send(message)
            log.messages_sent += 1
            if not isinstance(message, str):
                log.audio_sent += 1
        if end_input:
            await transport.send(INPUT_END)
    except TransportClosed:
        pass


async def run_client(transport: MemoryTransport, messages: Sequence[bytes | str],
                     log: ClientLog | None = None) -> ClientLog:
    """Send ``messages`` then input.end while reading everything back, until the server closes."""
    log = log if log is not None else ClientLog()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_all, transport, messages, log)
        await receive_all(transport, log)
        nursery.cancel_scope.cancel()
    return log


@attrs.define
class SessionRun:
    end: SessionEnd | None = None
    client: ClientLog = attrs.Factory(ClientLog)


async def run_session(runtime: Runtime, messages: Sequence[bytes | str], wire: AudioSpec,
                      session_id: int | None = None) -> SessionRun:
    """One whole session: the server side and a client, until both are done."""
    result = SessionRun()
    client, server = memory_transport_pair()

    async def serve() -> None:
        result.end = await runtime.serve(server, input_spec=wire, output_spec=wire, session_id=session_id)

    with trio.fail_after(PATIENCE):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            await run_client(client, messages, result.client)
    return result


async def run_sessions(runtime: Runtime, workloads: Sequence[tuple[Sequence[bytes | str], AudioSpec, int]]
                       ) -> list[SessionRun]:
    """Several sessions at once: ``(messages, spec, session_id)`` each."""
    results: list[SessionRun | None] = [None] * len(workloads)

    async def one(i: int) -> None:
        messages, wire, session_id = workloads[i]
        results[i] = await run_session(runtime, messages, wire, session_id)

    async with trio.open_nursery() as nursery:
        for i in range(len(workloads)):
            nursery.start_soon(one, i)
    return results  # type: ignore[return-value]


def frames_for(samples: int) -> int:
    return math.ceil(samples / FRAME)


# -- `duplexrt serve` as a real process ---------------------------------------------------------------


class ServeProcess:
    """``duplexrt serve`` in a process of its own, its log read by a thread as it comes: a log
    pipe nobody drains fills at ``--log-level info`` and stalls the server mid-write."""

    def __init__(self, *args: str) -> None:
        import os
        import subprocess
        import sys

        self.lines: list[str] = []
        self._changed = threading.Condition()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "duplexrt_cli.app", "serve", "--port", "0", "--log-level", "info", *args],
            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        try:
            line = self.wait_for_line("port(s)")
        except BaseException:
            self.close()
            raise
        self.port = int(line.split("port(s) ")[1].split()[0])

    def _read(self) -> None:
        for line in self.proc.stderr:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self.lines.append("")  # end of the log
            self._changed.notify_all()

    def wait_for_line(self, text: str, timeout: float = 60.0) -> str:
        """The first log line holding ``text`` (the log is read to its end, then this fails)."""
        with self._changed:
            found: list[str] = []

            def seen() -> bool:
                found[:] = [line for line in self.lines if text in line]
                return bool(found) or (bool(self.lines) and self.lines[-1] == "")

            self._changed.wait_for(seen, timeout)
            assert found, f"the server never logged {text!r}: {''.join(self.lines)[-2000:]}"
            return found[0]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=PATIENCE)
        self._reader.join(PATIENCE)
        self.proc.stderr.close()

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- a /v1/duplex client over a real WebSocket --------------------------------------------------------


async def duplex_session(url: str, audio: np.ndarray, chunk: int = 2 * FRAME) -> tuple[bytes, list[dict]]:
    """Stream ``audio`` as f32 over /v1/duplex in messages of ``chunk`` samples, end input, and
    collect everything until the server closes.  The events end with ``{"type": "closed", "code",
    "reason"}``.  A server that ends the session first (a failed step) stops the sending quietly:
    it says why in its events."""
    received = bytearray()
    events: list[dict] = []
    async with trio_websocket.open_websocket_url(url) as ws:
        async with trio.open_nursery() as nursery:
            async def send() -> None:
                try:
                    for start in range(0, len(audio), chunk):
                        await ws.send_message(audio[start:start + chunk].tobytes())
                    await ws.send_message(INPUT_END)
                except trio_websocket.ConnectionClosed:
                    pass

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


# -- one server in the test's own trio run -----------------------------------------------------


@attrs.define
class Served:
    """A ``duplexrt serve`` running in the test's nursery, and what a client or a balancer reads
    of it: its port, URLs on it, plain HTTP answers, ``/readyz`` and ``/metrics``."""

    server: Server

    @property
    def port(self) -> int:
        return self.server.ports[0]

    def url(self, path: str = "/v1/duplex", scheme: str = "ws") -> str:
        return f"{scheme}://127.0.0.1:{self.port}{path}"

    async def get(self, path: str, method: str = "GET", headers: str = "") -> tuple[int, dict[str, str], bytes]:
        """One plain HTTP request: status, headers (lower-case names) and body."""
        return await http_get(self.port, path, method, headers)

    async def readyz(self, query: str = "") -> tuple[int, dict]:
        status, _, body = await self.get(f"/readyz{query}")
        return status, json.loads(body)

    async def metrics(self) -> str:
        status, _, body = await self.get("/metrics")
        assert status == 200
        return body.decode()

    async def metric(self, name: str) -> float:
        """One unlabelled sample of ``/metrics`` (a counter named with its ``_total``)."""
        return exported(await self.metrics(), name)


def exported(metrics: str, name: str) -> float:
    """The value of the unlabelled sample ``name`` in a Prometheus text page."""
    (line,) = [line for line in metrics.splitlines() if line.split(" ")[0] == name]
    return float(line.split(" ")[1])


async def http_get(port: int, path: str, method: str = "GET", headers: str = "") -> tuple[int, dict[str, str], bytes]:
    """One plain HTTP/1.1 request to 127.0.0.1:``port``, read to the server's close."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(f"{method} {path} HTTP/1.1\r\nhost: x\r\n{headers}\r\n".encode())
        data = b""
        with trio.fail_after(PATIENCE):
            while chunk := await stream.receive_some(65536):
                data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    fields = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split(" ")[1]), fields, body


@pytest.fixture
async def start_server(nursery):
    """Start ``duplexrt serve`` in the test's nursery: on a free port, 4 slots, the echo model
    with no delay unless told, no periodic stats line.  ``await start_server(*overrides,
    backend=..., config_path=...)`` returns a ``Served``; ``backend`` is a backend, or a callable
    that makes one from the config."""

    async def start(*overrides: str, backend=None, config_path=None) -> Served:
        config = load_config(config_path, ["server.port=0", "runtime.slots=4", "backend.options.delay_frames=0",
                                           "metrics.log_stats=false", *overrides])
        if backend is not None and not isinstance(backend, Backend):
            backend = backend(config)
        server = Server(config, backend)
        await nursery.start(server.run)
        return Served(server)

    return start


# -- a session over a real socket pair ------------------------------------------------------


def noise_frames(count: int, seed: int) -> list[np.ndarray]:
    return list(noise(count * FRAME, seed).astype(np.float32).reshape(count, FRAME))


def socket_pair() -> tuple[NativeWebSocket, NativeWebSocket]:
    """``(client, server)`` over a socket pair."""
    a, b = trio.socket.socketpair()
    server = NativeWebSocket(trio.SocketStream(a))
    client = NativeWebSocket(trio.SocketStream(b), client=True)
    return client, server


def start_socket_session(nursery: trio.Nursery, runtime, session_id: int, wire=None, protocol=None):
    """Serve one session over a socket pair in ``nursery``: ``(client, outcome)``, where
    ``outcome["end"]`` is the session's end once it is over."""
    client, server = socket_pair()
    outcome: dict = {}

    async def serve() -> None:
        outcome["end"] = await runtime.serve(server, protocol, input_spec=wire, output_spec=wire,
                                             session_id=session_id)

    nursery.start_soon(serve)
    return client, outcome


async def run_socket_session(runtime, messages, wire, session_id=None, *, client_log=None):
    """One session over a socket pair."""
    log = client_log if client_log is not None else ClientLog()
    with trio.fail_after(PATIENCE):
        async with trio.open_nursery() as nursery:
            client, outcome = start_socket_session(nursery, runtime, session_id, wire)
            await run_client(client, messages, log)
    return outcome["end"], log


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one intra-op thread for a module's tests (``pytestmark = pytest.mark.usefixtures
    ("one_torch_thread")``): the tiny model's step is Python-bound, so one thread is as fast, and
    on a shared two-core machine far steadier (spinning pool threads stall when another process
    runs); and on one thread the CPU kernels round a row alike wherever it sits in the batch,
    which the exactness tests rely on."""
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


async def serve_personaplex_tiny(nursery, *overrides: str) -> Served:
    """``personaplex-tiny`` served in ``nursery`` on a free port: 2 slots (``overrides`` win),
    one warm-up step, no periodic stats line."""
    from duplexrt import presets

    os.environ.setdefault("NO_TORCH_COMPILE", "1")
    config = load_config(presets.resolve("personaplex-tiny"),
                         ["server.port=0", "runtime.slots=2", "metrics.log_stats=false",
                          "backend.options.warmup_steps=1", *overrides])
    server = Server(config)
    await nursery.start(server.run)
    return Served(server)
