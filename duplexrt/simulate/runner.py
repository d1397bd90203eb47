"""Drive N virtual sessions through the real session pipeline and measure what the host paid.

Each virtual client gets an in-memory transport (the interface a network connection has) to a
real ``Session`` on a real ``Runtime``: reader, decoder, framer, inbox, scheduler thread, writer.
Resource usage is read from the kernel for the whole process, scheduler thread and load generator
included, so nothing the runtime costs can hide.
"""

from __future__ import annotations

import json
import math
import resource
import time

import attrs
import trio

from duplexrt.audio import AudioFormat, AudioSpec
from duplexrt.backends import Backend
from duplexrt.config import Config, ConfigError
from duplexrt.histogram import Histogram
from duplexrt.metrics import FrameMetrics
from duplexrt.runtime import Runtime, open_runtime
from duplexrt.simulate.checker import Checker, OutputRecord
from duplexrt.simulate.progress import show_progress
from duplexrt.simulate.report import RoundReport, SimulationReport
from duplexrt.simulate.workload import Workload
from duplexrt.transport import MemoryTransport, TransportClosed, memory_transport_pair

MODES = ("burst", "paced")


@attrs.frozen(kw_only=True)
class SimulateOptions:
    concurrency: int = 96
    frames: int = 512
    message_ms: float = 160.0
    mode: str = "burst"
    format: str = "pcm_f32le"
    #: Wire sample rate; None means the format's default (the model rate; 8 kHz for G.711).
    sample_rate: int | None = None
    warmup_frames: int = 0
    repeat: int = 1
    #: A frame whose output arrives later than this after its input was sent is late (paced).
    late_ms: float = 80.0

    def check(self, config: Config) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"--mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        for name, value, low in (("--concurrency", self.concurrency, 1), ("--frames", self.frames, 1),
                                 ("--repeat", self.repeat, 1), ("--warmup-frames", self.warmup_frames, 0)):
            if value < low:
                raise ConfigError(f"{name} must be at least {low}, got {value}")
        if self.concurrency > config.runtime.slots:
            raise ConfigError(
                f"--concurrency {self.concurrency} exceeds runtime.slots = {config.runtime.slots}; "
                f"raise it with --slots {self.concurrency}"
            )
        if not 1 <= self.message_ms <= 60_000:
            raise ConfigError(f"--message-ms must be from 1 to 60000, got {self.message_ms}")


@attrs.define
class _Usage:
    cpu: float
    voluntary: int
    involuntary: int

    @classmethod
    def now(cls) -> _Usage:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return cls(ru.ru_utime + ru.ru_stime, ru.ru_nvcsw, ru.ru_nivcsw)


@attrs.define
class _ClientState:
    record: OutputRecord
    end: dict | None = None
    errors: list[str] = attrs.Factory(list)
    send_times: list[float] = attrs.Factory(list)
    first_send: float | None = None
    last_output: float | None = None


async def run_simulation(config: Config, options: SimulateOptions, *, backend: Backend | None = None,
                         progress: bool = False) -> SimulationReport:
    """Run the warm-up (if any) and ``repeat`` measured rounds on one runtime."""
    options.check(config)
    model_rate = config.audio.sample_rate
    fmt = AudioFormat.parse(options.format)
    spec = AudioSpec.create(fmt, options.sample_rate, model_rate=model_rate)
    rounds: list[RoundReport] = []
    async with open_runtime(config, backend) as runtime:
        if options.warmup_frames:
            warm = attrs.evolve(options, frames=options.warmup_frames)
            report = await _run_round(runtime, warm, spec, "warm-up", progress)
            if not report.ok:
                rounds.append(report)  # a broken warm-up is a failed run, and shows why
        for i in range(options.repeat):
            rounds.append(await _run_round(runtime, options, spec, f"round {i + 1}/{options.repeat}", progress))
    settings = {
        "options": attrs.asdict(options),
        "config": config.to_dict(),
        "wire": {"format": spec.format.value, "sample_rate": spec.sample_rate},
    }
    return SimulationReport(settings=settings, rounds=rounds)


async def _run_round(runtime: Runtime, options: SimulateOptions, spec: AudioSpec, label: str,
                     progress: bool) -> RoundReport:
    config = runtime.config
    workload = Workload(spec, model_rate=config.audio.sample_rate, frame_size=config.audio.frame_size,
                        frames=options.frames, message_ms=options.message_ms)
    checker = Checker(config, workload, spec, spec)
    clients = [_ClientState(checker.new_record()) for _ in range(options.concurrency)]
    paced = options.mode == "paced"
    frame_seconds = config.audio.frame_seconds
    lag = Histogram()
    late_ns = int(options.late_ms * 1e6)
    late = 0
    failures: list[str] = []

    runtime.metrics = FrameMetrics()
    handoffs_before = runtime.handoffs.statistics()
    scheduler_before = runtime.scheduler.statistics()
    step_time_before = runtime.scheduler.step_time_snapshot()
    delivery_before = runtime.scheduler.delivery_delay.snapshot()
    usage_before = _Usage.now()
    started = time.perf_counter()

    async def serve(index: int, transport: MemoryTransport) -> None:
        try:
            await runtime.serve(transport, input_spec=spec, output_spec=spec, session_id=index + 1)
        except Exception as exc:  # a guard failure, not a crash of the whole run
            failures.append(f"session {index + 1}: the server raised {exc!r}")
            await transport.close(1011, "server error")

    async def send(index: int, transport: MemoryTransport, state: _ClientState) -> None:
        start = trio.current_time() + (index / options.concurrency) * frame_seconds
        try:
            for i in range(workload.message_count):
                if paced:
                    await trio.sleep_until(start + (i + 1) * workload.message_seconds)
                now = time.perf_counter()
                if state.first_send is None:
                    state.first_send = now
                state.send_times.append(now)
                message = workload.message(index, i)
                try:
                    transport.send_nowait(message)  # the load generator yields only when it must
                except trio.WouldBlock:
                    await transport.send(message)
            await transport.send(json.dumps({"type": "input.end"}))
        except TransportClosed:
            pass

    async def receive(transport: MemoryTransport, state: _ClientState) -> None:
        nonlocal late
        record = state.record
        while True:
            try:
                try:
                    message = transport.receive_nowait()
                except trio.WouldBlock:
                    message = await transport.receive()
            except TransportClosed:
                return
            now = time.perf_counter()
            if isinstance(message, str):
                event = json.loads(message)
                if event.get("type") == "session.end":
                    state.end = event
                elif event.get("type") == "error":
                    state.errors.append(f"{event.get('code')}: {event.get('message')}")
                continue
            before = record.count
            completed = record.add(message)
            state.last_output = now
            if paced and completed:
                for frame in range(before, before + completed):
                    sent = state.send_times[min(workload.message_completing_frame(frame), len(state.send_times) - 1)]
                    value = int((now - sent) * 1e9)
                    lag.record(value)
                    if value > late_ns:
                        late += 1

    async def client(index: int, transport: MemoryTransport) -> None:
        state = clients[index]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send, index, transport, state)
            await receive(transport, state)
            nursery.cancel_scope.cancel()

    total_frames = options.concurrency * options.frames
    async with trio.open_nursery() as outer:
        if progress:
            outer.start_soon(show_progress, label, lambda: runtime.metrics.frames_out, total_frames)
        async with trio.open_nursery() as nursery:
            for index in range(options.concurrency):
                client_end, server_end = memory_transport_pair()
                nursery.start_soon(serve, index, server_end)
                nursery.start_soon(client, index, client_end)
        outer.cancel_scope.cancel()

    elapsed = time.perf_counter() - started
    usage = _Usage.now()
    handoffs = runtime.handoffs.statistics()
    scheduler = runtime.scheduler.statistics()
    frames = runtime.metrics.statistics()

    for index, state in enumerate(clients):
        for error in state.errors:
            failures.append(f"session {index + 1}: server sent error {error}")
        if state.end is not None and state.end.get("reason") != "stop":
            failures.append(f"session {index + 1}: ended with {state.end.get('reason')!r}: {state.end.get('error')}")
        frames_out = state.end["usage"]["frames_out"] if state.end else None
        failures.extend(checker.check_session(index, index + 1, state.record, frames_out))

    frames_in = frames.frames_in
    per_frame = max(frames_in, 1)
    rtf = None
    lag_summary = None
    if paced:
        lag_summary = lag.summary().scaled(1e6)
        ratios = [
            (s.last_output - s.first_send) / (options.frames * frame_seconds)
            for s in clients if s.first_send is not None and s.last_output is not None
        ]
        rtf = max(ratios) if ratios else math.nan
    steps = scheduler.steps - scheduler_before.steps
    step_frames = scheduler.frames - scheduler_before.frames
    step_time = runtime.scheduler.step_time_snapshot().minus(step_time_before)
    return RoundReport(
        mode=options.mode,
        sessions=options.concurrency,
        elapsed_s=elapsed,
        frames_in=frames_in,
        frames_out=frames.frames_out,
        cpu_us_per_frame=(usage.cpu - usage_before.cpu) * 1e6 / per_frame,
        voluntary_switches=usage.voluntary - usage_before.voluntary,
        involuntary_switches=usage.involuntary - usage_before.involuntary,
        voluntary_switches_per_frame=(usage.voluntary - usage_before.voluntary) / per_frame,
        involuntary_switches_per_frame=(usage.involuntary - usage_before.involuntary) / per_frame,
        handoffs={k: handoffs.by_kind[k] - handoffs_before.by_kind[k] for k in handoffs.by_kind},
        executor_submissions=handoffs.executor_submissions - handoffs_before.executor_submissions,
        preprocess_us=frames.preprocess_us,
        enqueue_us=frames.enqueue_us,
        latency_ms=frames.latency_us.scaled(1e3),
        delivery_ms=runtime.scheduler.delivery_delay.snapshot().minus(delivery_before).summary().scaled(1e6),
        step_to_sent_ms=frames.step_to_sent_us.scaled(1e3),
        steps=steps,
        mean_batch=step_frames / steps if steps else 0.0,
        step_ms=step_time.summary().scaled(1e6),
        frame_lag_ms=lag_summary,
        late_frames=late if paced else None,
        real_time_factor=rtf,
        failures=failures,
    )

