"""``duplexrt client``: stream an audio file to a running server, write what comes back.

The file is read whole (sphn), mixed to mono, converted once to what the route takes — float32 PCM
at the file's own rate on ``/v1/duplex`` where the server takes that rate, pcm16 at 24 kHz on
``/v1/realtime``, Ogg Opus at 24 kHz on ``/api/chat`` — and cut into 80 ms messages before the
connection opens, so that sending costs nothing while it runs.  Messages go out in real time
(``--realtime``: one every 80 ms on the trio clock) or as fast as the server takes them.
Everything the server sends back is decoded and written as a WAV file at the rate it came in.

Exit status: 0 when the server ended the session normally (or, on routes without an end of input,
once all the output was heard); 1 when the connection failed or the server refused it, sent an
error, or closed abnormally; 2 for bad arguments (an unknown route, an unreadable file).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import TextIO

import attrs
import numpy as np
import sphn
import trio

from duplexrt.audio import (
    SUPPORTED_INPUT_RATES,
    AudioFormat,
    AudioFormatError,
    AudioSpec,
    StreamResampler,
    make_decoder,
    make_encoder,
)
from duplexrt.client.connection import ConnectError, open_connection
from duplexrt.client.conversation import Conversation
from duplexrt.client.protocols import (
    DEFAULT_FRAME_SECONDS,
    Buffer,
    ClientProtocol,
    UnknownRoute,
    client_for_url,
    route_of,
)
from duplexrt.client.resume import ResumingTransport
from duplexrt.wire.transport import TransportClosed
from duplexrt.progress import show_progress

__all__ = ["ClientRequest", "ClientResult", "UsageError", "prepare", "run_client", "stream_file"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

#: The rate the routes' fixed formats run at, and the fallback for /v1/duplex.
_DEFAULT_RATE = 24000


class UsageError(Exception):
    """Bad arguments: exit status 2."""


@attrs.frozen(kw_only=True)
class ClientRequest:
    input_path: Path
    url: str
    output_path: Path
    #: Send in real time (one message per ``chunk_ms``), not as fast as the server takes it.
    realtime: bool = False
    api_key: str | None = None
    #: duplex, realtime or moshi, for a path the route table does not know (behind a proxy).
    protocol: str | None = None
    chunk_ms: float = 80.0
    #: After the input is sent, give up once the server has been silent this long.
    idle_timeout: float = 10.0
    connect_timeout: float = 10.0


@attrs.frozen
class Prepared:
    protocol: ClientProtocol
    url: str
    messages: list[bytes]
    interval: float
    seconds_sent: float
    #: Samples of output (at the output rate) that answer all the input, where that is known.
    expected_samples: int | None
    expected_frames: int

    def seconds_of(self, messages: int) -> float:
        """The audio in the first ``messages`` messages: each holds ``interval`` seconds but the
        last, which holds the rest."""
        return min(messages * self.interval, self.seconds_sent)


@attrs.define
class ClientResult:
    exit_code: int
    seconds_sent: float = 0.0
    seconds_received: float = 0.0
    output_rate: int = 0
    end: str = ""
    errors: list[str] = attrs.Factory(list)
    text: str = ""
    #: Times the connection dropped and the session was resumed on a new one.
    resumes: int = 0
    #: Audio written to the connection; ``seconds_sent`` is what the server said it took where
    #: its end event counts input frames, which may be less (a drop, an early end).
    seconds_written: float = 0.0

    def summary(self, output_path: Path) -> str:
        resumed = f"; resumed after {self.resumes} dropped connection(s)" if self.resumes else ""
        unheard = self.seconds_written - self.seconds_sent
        written = (f"; {self.seconds_written:.3f} s written, {unheard:.3f} s of it never taken by the server"
                   if unheard > 0.0005 else "")
        return (f"sent {self.seconds_sent:.3f} s, received {self.seconds_received:.3f} s "
                f"at {self.output_rate} Hz -> {output_path} ({self.end}{resumed}{written})")


def _read_mono(path: Path) -> tuple[np.ndarray, int]:
    try:
        data, rate = sphn.read(str(path))
    except (ValueError, OSError) as exc:
        raise UsageError(f"cannot read {path}: {exc}") from None
    data = np.asarray(data, dtype=np.float32)
    mono = data.mean(axis=0, dtype=np.float32) if data.ndim == 2 else data.reshape(-1)
    if mono.size == 0:
        raise UsageError(f"{path} holds no audio")
    return np.ascontiguousarray(mono, dtype=np.float32), int(rate)


def _resample(signal: np.ndarray, rate: int, to_rate: int) -> np.ndarray:
    if rate == to_rate:
        return signal
    resampler = StreamResampler(rate, to_rate)
    return np.concatenate([resampler.process(signal), resampler.flush()])


def prepare(request: ClientRequest) -> Prepared:
    """Everything decided and encoded before connecting; raises UsageError for bad arguments."""
    if not 1 <= request.chunk_ms <= 10_000:
        raise UsageError(f"--chunk-ms must be from 1 to 10000, got {request.chunk_ms}")
    try:
        name = request.protocol or route_of(request.url)
    except UnknownRoute as exc:
        raise UsageError(str(exc)) from None
    if request.protocol is not None and not request.url.startswith(("ws://", "wss://")):
        raise UsageError(f"{request.url!r} is not a WebSocket URL (ws://HOST:PORT/ROUTE or wss://...)")
    signal, file_rate = _read_mono(request.input_path)
    duplex_rate = file_rate if file_rate in SUPPORTED_INPUT_RATES else _DEFAULT_RATE
    try:
        protocol = client_for_url(request.url, protocol=name, input_format=AudioFormat.PCM_F32LE.value,
                                  input_rate=duplex_rate)
    except (UnknownRoute, AudioFormatError) as exc:
        raise UsageError(str(exc)) from None
    spec = protocol.input_spec
    rate = spec.sample_rate
    wire = _resample(signal, file_rate, rate)
    frame = round(DEFAULT_FRAME_SECONDS * rate)
    if protocol.pads_input and wire.size % frame:
        # No end of input on this route: a partial last frame would never be answered.
        wire = np.concatenate([wire, np.zeros(frame - wire.size % frame, np.float32)])
    chunk = max(1, round(request.chunk_ms / 1000 * rate))
    encoder = make_encoder(AudioSpec.create(spec.format, rate, model_rate=rate), rate)
    messages = [encoder.encode(wire[i:i + chunk]) for i in range(0, wire.size, chunk)]
    tail = encoder.flush()
    if tail:
        messages[-1] += tail
    seconds = wire.size / rate
    out_rate = protocol.output_spec.sample_rate
    expected = round(wire.size * out_rate / rate) if protocol.pads_input else None
    return Prepared(protocol=protocol, url=protocol.url(request.url), messages=messages,
                    interval=chunk / rate, seconds_sent=seconds, expected_samples=expected,
                    expected_frames=max(1, math.ceil(seconds / DEFAULT_FRAME_SECONDS - 1e-9)))


class _Output:
    """What came back: raw PCM bytes kept whole, or Opus decoded as it arrives (so the client
    knows when it has heard everything)."""

    def __init__(self, spec: AudioSpec) -> None:
        self.spec = spec
        self.opus = sphn.OpusStreamReader(spec.sample_rate) if spec.format is AudioFormat.OPUS else None
        self.pcm: list[np.ndarray] = []
        self.data = bytearray()
        self.samples = 0

    def add(self, data: Buffer, _now: float) -> None:
        if self.opus is not None:
            pcm = self.opus.append_bytes(bytes(data))
            if pcm.size:
                self.pcm.append(pcm)
                self.samples += pcm.size
        else:
            self.data += data
            self.samples = len(self.data) // (self.spec.format.bytes_per_sample or 1)

    def audio(self) -> np.ndarray:
        if self.opus is not None:
            return np.concatenate(self.pcm) if self.pcm else np.zeros(0, np.float32)
        width = self.spec.format.bytes_per_sample or 1
        whole = len(self.data) - len(self.data) % width
        decoder = make_decoder(self.spec, self.spec.sample_rate)
        return np.concatenate([decoder.decode(bytes(self.data[:whole])), decoder.flush()])


async def stream_file(request: ClientRequest, prepared: Prepared, *, progress: bool = False,
                      err: TextIO | None = None) -> tuple[ClientResult, np.ndarray]:
    """Connect, stream, listen.  Returns the result and the audio that came back."""
    protocol = prepared.protocol
    say = err or sys.stderr

    def resuming(closed: TransportClosed, window: float) -> None:
        say.write(f"duplexrt: the connection dropped ({closed.reason or closed.code}); resuming the session "
                  f"(for up to {window:g} s)\n")
        say.flush()

    try:
        # resume: a connection that drops mid-file resumes the same session (docs/resume.md).
        async with open_connection(prepared.url, protocol, api_key=request.api_key,
                                   timeout=request.connect_timeout, resume=True,
                                   on_drop=resuming) as (transport, _opened):
            output = _Output(protocol.output_spec)  # the greeting may have said what it is
            expected = prepared.expected_samples
            texts: list[str] = []
            conversation = Conversation(
                transport, protocol, on_audio=output.add, on_text=texts.append,
                caught_up=(lambda: output.samples >= expected) if expected is not None else None,
                idle_timeout=request.idle_timeout)
            frame_out = DEFAULT_FRAME_SECONDS * output.spec.sample_rate
            async with trio.open_nursery() as nursery:
                if progress:
                    nursery.start_soon(
                        lambda: show_progress(f"{protocol.name}", lambda: int(output.samples // frame_out),
                                              prepared.expected_frames, stream=err))
                messages = prepared.messages
                await conversation.run(len(messages), messages.__getitem__,
                                       interval=prepared.interval if request.realtime else None)
                nursery.cancel_scope.cancel()
            resumes = transport.resumes if isinstance(transport, ResumingTransport) else 0
    except ConnectError as exc:
        return ClientResult(EXIT_FAILED, 0.0, end=exc.message), np.zeros(0, np.float32)
    audio = output.audio()
    rate = output.spec.sample_rate
    # What was really sent: a server that ends the session early stops the file there; and of
    # that, what the server says its model took (its end event's input frames; the last frame
    # is padded, so never more than was written).
    written = prepared.seconds_of(conversation.messages_sent)
    # (Realtime's response usage counts the response's input, not the session's: not read.)
    taken = (conversation.end.frames_in if conversation.end is not None and protocol.name != "realtime"
             else None)
    result = ClientResult(
        EXIT_OK if conversation.ok else EXIT_FAILED,
        seconds_sent=written if taken is None else min(written, taken * DEFAULT_FRAME_SECONDS),
        seconds_written=written,
        seconds_received=audio.size / rate,
        output_rate=rate,
        end=conversation.describe(),
        errors=[str(e) for e in conversation.errors],
        text="".join(texts),
        resumes=resumes,
    )
    return result, audio


async def run_client(request: ClientRequest, *, progress: bool = False, out: TextIO | None = None,
                     err: TextIO | None = None) -> int:
    """The whole command: returns its exit status, having said what happened."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        prepared = prepare(request)
    except UsageError as exc:
        err.write(f"duplexrt: error: {exc}\n")
        return EXIT_USAGE
    result, audio = await stream_file(request, prepared, progress=progress, err=err)
    for error in result.errors[:20]:
        err.write(f"server error: {error}\n")
    if result.exit_code != EXIT_OK and not result.output_rate:
        err.write(f"duplexrt: error: {result.end}\n")
        return result.exit_code
    try:
        sphn.write_wav(str(request.output_path), audio, result.output_rate)
    except (ValueError, OSError) as exc:
        err.write(f"duplexrt: error: cannot write {request.output_path}: {exc}\n")
        return EXIT_FAILED
    out.write(result.summary(request.output_path) + "\n")
    if result.text:
        out.write(f"text: {result.text}\n")
    if result.exit_code != EXIT_OK:
        err.write(f"duplexrt: error: {result.end}\n")
    return result.exit_code
