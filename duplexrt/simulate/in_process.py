"""``simulate`` in process: virtual clients on in-memory transports to real sessions of a real
``Runtime``; the round's figures are the difference of two ``Runtime.statistics()`` records.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import attrs
import trio

from duplexrt.audio import AudioFormat, AudioSpec
from duplexrt.backends import Backend
from duplexrt.client.pacer import Pacer
from duplexrt.client.protocols import DuplexClient
from duplexrt.config import Config
from duplexrt.core.histogram import Summary
from duplexrt.runtime import Runtime, open_runtime
from duplexrt.progress import show_progress
from duplexrt.reasons import CloseCode
from duplexrt.simulate.checker import Checker
from duplexrt.simulate.find_capacity import MIN_SECONDS, CapacitySearch, Verdict, find_capacity, judge
from duplexrt.simulate.options import SimulateOptions, Usage, search_options
from duplexrt.simulate.report import InProcessFigures, RoundReport, SimulationReport
from duplexrt.simulate.virtual_client import (
    PACING_TICK,
    LagMeter,
    VirtualClient,
    end_failures,
    pacing,
    stream_real_time_factor,
)
from duplexrt.simulate.workload import Workload
from duplexrt.wire.transport import MemoryTransport, memory_transport_pair


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
    paced = options.mode == "paced"
    meter = (LagMeter(workload, options.late_ms, keep_samples=options.keep_samples)
             if paced or options.keep_samples else None)
    clients = [VirtualClient(i, checker.new_record(), meter) for i in range(options.concurrency)]
    frame_seconds = config.audio.frame_seconds
    failures: list[str] = []

    # One record before and one after: the round's figures are the difference, so rounds on
    # one runtime need no reset of its counters.
    before = runtime.statistics()
    usage_before = Usage.now()
    started = time.perf_counter()

    async def serve(index: int, transport: MemoryTransport) -> None:
        try:
            await runtime.serve(transport, input_spec=spec, output_spec=spec, session_id=index + 1)
        except Exception as exc:  # a guard failure, not a crash of the whole run
            failures.append(f"session {index + 1}: the server raised {exc!r}")
            await transport.close(CloseCode.INTERNAL_ERROR, "server error")

    async def client(index: int, transport: MemoryTransport) -> None:
        # The raw protocol, as runtime.serve speaks it by default: no greeting.
        protocol = DuplexClient(spec, spec, greets=False)
        await clients[index].converse(transport, protocol, workload, paced=paced,
                                      offset=workload.phase(index, options.concurrency), pacer=pacer)

    total_frames = options.concurrency * options.frames
    pacer = Pacer(tick=PACING_TICK) if paced else None
    async with trio.open_nursery() as outer:
        if pacer is not None:
            await outer.start(pacer.run)
        if progress:
            frames_out = lambda: runtime.statistics().frames.frames_out - before.frames.frames_out  # noqa: E731
            outer.start_soon(show_progress, label, frames_out, total_frames)
        async with trio.open_nursery() as nursery:
            for index in range(options.concurrency):
                client_end, server_end = memory_transport_pair()
                nursery.start_soon(serve, index, server_end)
                nursery.start_soon(client, index, client_end)
        outer.cancel_scope.cancel()

    elapsed = time.perf_counter() - started
    usage = Usage.now()
    after = runtime.statistics()

    for index, state in enumerate(clients):
        conversation = state.conversation
        assert conversation is not None  # every client conversed, in the nursery above
        failures.extend(end_failures(index, conversation))
        reported_out = conversation.end.frames_out if conversation.end else None
        failures.extend(checker.check_session(index, index + 1, state.record, reported_out))

    frames_in = after.frames.frames_in - before.frames.frames_in
    per_frame = max(frames_in, 1)
    lag_summary, late, rtf = pacing(clients, meter if paced else None, options.frames, frame_seconds)
    steps = after.scheduler.steps - before.scheduler.steps
    step_frames = after.scheduler.frames - before.scheduler.frames

    def interval(name: str) -> Summary:
        """What one histogram recorded during the round, in nanoseconds."""
        return getattr(after.histograms, name).minus(getattr(before.histograms, name)).summary()

    return RoundReport(
        mode=options.mode,
        sessions=options.concurrency,
        elapsed_s=elapsed,
        frames_in=frames_in,
        frames_out=after.frames.frames_out - before.frames.frames_out,
        handoffs={k: after.handoffs.by_kind[k] - before.handoffs.by_kind[k] for k in after.handoffs.by_kind},
        steps=steps,
        mean_batch=step_frames / steps if steps else 0.0,
        frame_lag_ms=lag_summary,
        late_frames=late,
        real_time_factor=rtf,
        failures=failures,
        measured=InProcessFigures(
            cpu_us_per_frame=(usage.cpu - usage_before.cpu) * 1e6 / per_frame,
            voluntary_switches=usage.voluntary - usage_before.voluntary,
            involuntary_switches=usage.involuntary - usage_before.involuntary,
            voluntary_switches_per_frame=(usage.voluntary - usage_before.voluntary) / per_frame,
            involuntary_switches_per_frame=(usage.involuntary - usage_before.involuntary) / per_frame,
            executor_submissions=after.handoffs.offloads - before.handoffs.offloads,
            preprocess_us=interval("preprocess").scaled(1e3),
            enqueue_us=interval("enqueue").scaled(1e3),
            latency_ms=interval("latency").scaled(1e6),
            delivery_ms=interval("delivery").scaled(1e6),
            step_to_sent_ms=interval("step_to_sent").scaled(1e6),
            step_ms=interval("step_time").scaled(1e6),
        ),
        lag_samples=meter.samples(started) if meter is not None else None,
        stream_rtf=stream_real_time_factor(clients, workload) if paced else None,
        capacity=after.capacity.as_dict(),
    )


async def run_find_capacity(config: Config, options: SimulateOptions, *, backend: Backend | None = None,
                            progress: bool = False, min_seconds: float = MIN_SECONDS,
                            on_probe: Callable[[Verdict], None] | None = None, retries: int = 0) -> CapacitySearch:
    """``--find-capacity`` in process: bisect paced concurrency on one runtime, up to its slots."""
    frame_seconds = config.audio.frame_seconds
    options = search_options(options, frame_seconds, min_seconds)
    spec = AudioSpec.create(AudioFormat.parse(options.format), options.sample_rate,
                            model_rate=config.audio.sample_rate)
    async with open_runtime(config, backend) as runtime:
        if options.warmup_frames:
            await _run_round(runtime, attrs.evolve(options, frames=options.warmup_frames), spec, "warm-up",
                             progress)

        async def probe(sessions: int) -> Verdict:
            report = await _run_round(runtime, attrs.evolve(options, concurrency=sessions), spec,
                                      f"{sessions} sessions", progress)
            return judge(report, frame_seconds * 1e3)

        estimate = runtime.scheduler.capacity.estimate
        start = estimate.limit if estimate.source != "none" else None
        return await find_capacity(probe, runtime.scheduler.slots, start=start, on_probe=on_probe, retries=retries)
