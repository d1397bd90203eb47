"""``simulate --url``: virtual clients over real WebSockets to a running server; server-side
figures are the differences of its ``/metrics`` before and after each round.
"""

from __future__ import annotations

import time
import zlib
from collections import Counter
from collections.abc import Callable

import attrs
import numpy as np
import trio

from duplexrt.audio import AudioFormat, AudioFormatError, AudioSpec, make_decoder, make_encoder
from duplexrt.backends import create_backend
from duplexrt.backends.synthetic import MARKER_COUNT
from duplexrt.client.connection import ConnectError, open_connection
from duplexrt.client.resume import ResumingTransport
from duplexrt.client.conversation import CLOSED, COMPLETE, IDLE, Conversation
from duplexrt.client.metrics import MetricsSnapshot, read_ready, scrape_metrics
from duplexrt.client.pacer import Pacer
from duplexrt.client.protocols import (
    ClientProtocol,
    DuplexClient,
    LiveClient,
    MoshiClient,
    RealtimeClient,
    TwilioClient,
    UnknownRoute,
    client_for_url,
    query_of,
    route_of,
)
from duplexrt.config import Config, ConfigError
from duplexrt.progress import show_progress
from duplexrt.reasons import CloseCode
from duplexrt.simulate.checker import Checker, OutputRecord
from duplexrt.simulate.find_capacity import MIN_SECONDS, CapacitySearch, Verdict, find_capacity, judge
from duplexrt.simulate.options import ROUTE_FORMATS, SimulateOptions, Usage, search_options
from duplexrt.simulate.report import RoundReport, ServerFigures, SimulationReport
from duplexrt.simulate.virtual_client import (
    PACING_TICK,
    LagMeter,
    OpusFrames,
    VirtualClient,
    end_failures,
    pacing,
    stream_real_time_factor,
)
from duplexrt.simulate.workload import Workload
from duplexrt.wire.transport import Message, Transport, poller


def default_format(url: str) -> str:
    """The wire format ``simulate --url`` uses on ``url``'s route when ``--format`` is not given."""
    try:
        return ROUTE_FORMATS[route_of(url)]
    except UnknownRoute as exc:
        raise ConfigError(str(exc)) from None


@attrs.frozen
class UrlTarget:
    """Where the virtual clients connect and how they speak: one fresh protocol per session."""

    url: str  # with the query the protocol needs
    route: str
    input_spec: AudioSpec
    output_spec: AudioSpec
    notes: tuple[str, ...] = ()

    @classmethod
    def create(cls, url: str, options: SimulateOptions, config: Config) -> UrlTarget:
        """Check that ``options`` fit the route; raises ConfigError naming the option."""
        model_rate = config.audio.sample_rate
        notes: list[str] = []
        try:
            route = route_of(url)
            fmt = AudioFormat.parse(options.format)
            if route == "duplex":
                protocol = client_for_url(url, input_format=fmt.value, input_rate=options.sample_rate,
                                          model_rate=model_rate)
            else:
                wanted = fmt.value, options.sample_rate
                if route == "realtime":
                    if wanted[0] != "pcm_s16le" or wanted[1] not in (None, 24000):
                        raise ConfigError("/v1/realtime is simulated in pcm16 at 24 kHz: use --format "
                                          "pcm_s16le (the default there) and no --sample-rate")
                    if query_of(url).get("duplex", "").lower() not in ("1", "true", "yes"):
                        notes.append("/v1/realtime is simulated in duplex mode (?duplex=1 added): one "
                                     "continuous response, so each output frame is heard as it is made "
                                     "(turn mode holds it until the client's response.create)")
                    protocol = RealtimeClient(duplex=True, model_rate=model_rate)
                elif route == "live":
                    if wanted[0] != "pcm_s16le" or wanted[1] not in (None, 24000):
                        raise ConfigError("/v1/live/sessions is simulated in pcm16 at 24 kHz: use --format "
                                          "pcm_s16le (the default there) and no --sample-rate")
                    protocol = LiveClient(model_rate=model_rate)
                elif route == "twilio":
                    if wanted[0] != "g711_ulaw" or wanted[1] not in (None, 8000):
                        raise ConfigError("/twilio/media takes mu-law at 8 kHz: use --format g711_ulaw "
                                          "(the default there) and no --sample-rate")
                    if options.drop_rate:
                        raise ConfigError("/twilio/media has no resume (Twilio does not resume a stream): "
                                          "--drop-rate cannot be simulated there")
                    protocol = TwilioClient(model_rate=model_rate)
                else:
                    if wanted[0] != "opus" or wanted[1] not in (None, 24000):
                        raise ConfigError("/api/chat (Moshi) takes Ogg Opus at 24 kHz: use --format opus "
                                          "(the default there) and no --sample-rate")
                    protocol = MoshiClient()
        except (UnknownRoute, AudioFormatError) as exc:
            raise ConfigError(str(exc)) from None
        return cls(protocol.url(url), route, protocol.input_spec, protocol.output_spec, tuple(notes))

    def new_protocol(self, model_rate: int) -> ClientProtocol:
        if self.route == "duplex":
            return DuplexClient(self.input_spec, self.output_spec)
        if self.route == "realtime":
            return RealtimeClient(duplex=True, model_rate=model_rate)
        if self.route == "live":
            return LiveClient(model_rate=model_rate)
        if self.route == "twilio":
            return TwilioClient(model_rate=model_rate)
        return MoshiClient()


async def run_url_simulation(config: Config, options: SimulateOptions, url: str, *,
                             api_key: str | None = None, progress: bool = False,
                             adopt_server_backend: bool = False, idle_timeout: float = 10.0,
                             connect_timeout: float = 10.0) -> SimulationReport:
    """The same load, guards and report as ``run_simulation``, over real WebSockets to the server
    at ``url``.  ``config`` describes the server (its audio clock, and the backend whose output the
    guards expect: ``--backend``/``-o``); with ``adopt_server_backend`` the backend's name is taken
    from the server's /readyz instead.  Raises ConnectError if the server cannot be reached at all,
    ConfigError for options that do not fit the route."""
    options.check(config, slots=False)
    target = UrlTarget.create(url, options, config)
    notes = list(target.notes)
    ready = await read_ready(target.url)  # also: is anything there?
    server_backend = ready.get("backend") if ready else None
    if isinstance(server_backend, str) and server_backend != config.backend.name:
        if adopt_server_backend:
            config = attrs.evolve(config, backend=attrs.evolve(config.backend, name=server_backend))
            notes.append(f"the server runs the {server_backend!r} backend (from /readyz): checked as that")
        else:
            notes.append(f"the server says it runs {server_backend!r}; checking output as --backend "
                         f"{config.backend.name!r} says")
    if config.backend.name in ("echo", "synthetic"):
        create_backend(config)  # its options are checked (and their defaults known) as the server's
    if config.backend.name == "echo" and "delay_frames" not in config.backend.options:
        notes.append("checking against echo with delay_frames = 2 (the server's default); say otherwise "
                     "with -o delay_frames=N")
    rounds: list[RoundReport] = []
    if options.warmup_frames:
        warm = attrs.evolve(options, frames=options.warmup_frames)
        report = await _run_url_round(config, warm, target, "warm-up", progress, api_key, idle_timeout,
                                      connect_timeout)
        if not report.ok:
            rounds.append(report)
    for i in range(options.repeat):
        rounds.append(await _run_url_round(config, options, target, f"round {i + 1}/{options.repeat}",
                                           progress, api_key, idle_timeout, connect_timeout))
    settings = {
        "options": attrs.asdict(options),
        "config": config.to_dict(),
        "wire": {"format": target.input_spec.format.value, "sample_rate": target.input_spec.sample_rate},
        "url": target.url,
        "route": target.route,
        "server": {k: v for k, v in (ready or {}).items() if not k.startswith("_")},
        "notes": notes,
    }
    return SimulationReport(settings=settings, rounds=rounds)


async def _scrape(url: str, notes: list[str]) -> MetricsSnapshot | None:
    try:
        return await scrape_metrics(url)
    except ConnectError as exc:
        notes.append(f"/metrics: {exc.message}")
        return None


async def _run_url_round(config: Config, options: SimulateOptions, target: UrlTarget, label: str,
                         progress: bool, api_key: str | None, idle_timeout: float,
                         connect_timeout: float) -> RoundReport:
    model_rate = config.audio.sample_rate
    frame_size = config.audio.frame_size
    frame_seconds = config.audio.frame_seconds
    workload = Workload(target.input_spec, model_rate=model_rate, frame_size=frame_size,
                        frames=options.frames, message_ms=options.message_ms)
    checker = Checker(config, workload, target.input_spec, target.output_spec)
    paced = options.mode == "paced"
    meter = (LagMeter(workload, options.late_ms, keep_samples=options.keep_samples)
             if paced or options.keep_samples else None)
    opus_out = target.output_spec.format is AudioFormat.OPUS
    clients = [
        VirtualClient(i, checker.new_record(), meter,
                       OpusFrames(target.output_spec, model_rate, frame_size) if opus_out else None)
        for i in range(options.concurrency)
    ]
    concurrency = options.concurrency
    settled = 0
    all_settled = trio.Event()
    go = trio.Event()
    connected: set[int] = set()
    notes: list[str] = []

    def settle() -> None:
        nonlocal settled
        settled += 1
        if settled == concurrency:
            all_settled.set()

    drop_at = _drop_points(options.drop_rate, concurrency, workload.message_count)
    resuming: list[ResumingTransport] = []

    async def session(index: int) -> None:
        state = clients[index]
        protocol = target.new_protocol(model_rate)
        try:
            async with open_connection(target.url, protocol, api_key=api_key, timeout=connect_timeout,
                                       resume=True) as (transport, _greeting):
                connected.add(index)
                assert isinstance(transport, ResumingTransport)  # what resume=True connects with
                resuming.append(transport)
                settle()
                await go.wait()
                talk: Transport = _CutOnce(transport, drop_at[index]) if index in drop_at else transport
                await state.converse(talk, protocol, workload, paced=paced,
                                     offset=workload.phase(index, concurrency),
                                     caught_up_at=options.frames if protocol.needs_catch_up else None,
                                     idle_timeout=idle_timeout, pacer=pacer)
        except ConnectError as exc:
            state.error = exc
            if index not in connected:
                settle()

    total_frames = concurrency * options.frames
    pacer = Pacer(tick=PACING_TICK) if paced else None
    async with trio.open_nursery() as outer:
        if pacer is not None:
            await outer.start(pacer.run)
        async with trio.open_nursery() as nursery:
            for index in range(concurrency):
                nursery.start_soon(session, index)
            await all_settled.wait()  # every connection open (or failed): now the clock starts
            before = await _scrape(target.url, notes)
            usage_before = Usage.now()
            started = time.perf_counter()
            if progress:
                outer.start_soon(show_progress, label, lambda: sum(c.frames_heard for c in clients), total_frames)
            go.set()
        elapsed = time.perf_counter() - started
        usage = Usage.now()
        outer.cancel_scope.cancel()
    after = await _scrape(target.url, notes)

    failures: list[str] = []
    errors: Counter[str] = Counter()
    frames_in = 0
    for index, state in enumerate(clients):
        if state.error is not None:
            errors[state.error.kind] += 1
            failures.append(f"session {index + 1}: {state.error.message}")
            continue
        conversation = state.conversation
        if conversation is None:  # pragma: no cover - every connected session converses
            continue
        frames_in += _frames_sent(workload, conversation)
        if conversation.outcome == CLOSED and conversation.end is None:
            errors["closed_early"] += 1
            failures.append(f"session {index + 1}: {conversation.describe()}")
        elif conversation.outcome == IDLE:
            errors["idle_timeout"] += 1
            failures.append(f"session {index + 1}: {conversation.describe()}, "
                            f"having heard {state.frames_heard} of {options.frames} frames")
        failures.extend(end_failures(index, conversation))
        if conversation.end is not None:
            frames_out = conversation.end.frames_out
        elif conversation.outcome == COMPLETE:
            frames_out = state.frames_heard  # the protocol has no goodbye: what the client heard
        else:
            frames_out = None
        failures.extend(_check_url_session(checker, index, state.record, frames_out))
    if errors:
        summary = ", ".join(f"{count} {kind}" for kind, count in sorted(errors.items()))
        failures.insert(0, f"connection errors: {summary}")
    frames_out_heard = sum(c.frames_heard for c in clients)
    lag_summary, late, rtf = pacing(clients, meter if paced else None, options.frames, frame_seconds)
    server = _server_figures(before, after)
    if server["note"]:
        notes.append(server["note"])
    return RoundReport(
        mode=options.mode,
        sessions=concurrency,
        elapsed_s=elapsed,
        frames_in=frames_in,
        frames_out=frames_out_heard,
        handoffs=server["handoffs"],
        steps=server["steps"],
        mean_batch=server["mean_batch"],
        frame_lag_ms=lag_summary,
        late_frames=late,
        real_time_factor=rtf,
        failures=failures,
        lag_samples=meter.samples(started) if meter is not None and started is not None else None,
        stream_rtf=stream_real_time_factor(clients, workload) if paced else None,
        capacity=await _server_capacity(target.url),
        measured=ServerFigures(
            url=target.url,
            sessions_connected=len(connected),
            connection_errors=dict(sorted(errors.items())),
            load_generator_cpu_us_per_frame=(usage.cpu - usage_before.cpu) * 1e6 / max(frames_in, 1),
            drops=len(drop_at) if drop_at else None,
            resumes=sum(t.resumes for t in resuming),  # a real drop resumes too, and is counted
            server_cpu_us_per_frame=server["cpu_us_per_frame"],
            server_scheduler_cpu_share=server["scheduler_cpu_share"],
            server_frames_in=server["frames_in"],
            server_frames_out=server["frames_out"],
            server_step_ms_mean=server["step_ms_mean"],
            server_latency_ms_mean=server["latency_ms_mean"],
            server_replica=server["replica"],
            notes=notes,
        ),
    )


def _drop_points(rate: float, sessions: int, messages: int) -> dict[int, int]:
    """``--drop-rate``: which sessions are cut, each before which of its messages (somewhere in the
    middle fifth to four fifths of its input, spread evenly; the same every run)."""
    if rate <= 0 or messages < 2:
        return {}
    count = round(rate * sessions)
    chosen = [round(i * sessions / count) for i in range(count)] if count else []
    low, high = max(1, messages // 5), max(1, messages * 4 // 5)
    return {index: low + (index * 7919) % max(1, high - low) for index in chosen}


class _CutOnce:
    """Cuts the session's connection once, without a Close frame, as its ``at``-th message is
    about to go; the ``ResumingTransport`` under it resumes the session."""

    def __init__(self, transport: ResumingTransport, at: int) -> None:
        self._transport = transport
        self._poll = poller(transport)
        self._at = at
        self._sent = 0

    async def send(self, message: Message) -> None:
        if self._sent == self._at:
            self._transport.drop()
        self._sent += 1
        await self._transport.send(message)

    async def receive(self) -> Message:
        return await self._transport.receive()

    def receive_nowait(self) -> Message:
        return self._transport.receive_nowait()

    def poll(self) -> Message | None:
        return self._poll()

    async def close(self, code: int = CloseCode.NORMAL_CLOSURE, reason: str = "") -> None:
        await self._transport.close(code, reason)


async def _server_capacity(url: str) -> dict | None:
    """The server's own admission estimate, from its /readyz (None if it gives none)."""
    try:
        ready = await read_ready(url)
    except ConnectError:
        return None
    capacity = (ready or {}).get("capacity")
    return capacity if isinstance(capacity, dict) else None


def _check_url_session(checker: Checker, index: int, record: OutputRecord, frames_out: int | None) -> list[str]:
    """The guards for one session of a server.  The synthetic backend tags its output with the
    server's own session id, which no protocol reports: it is found from the first frame."""
    if checker.config.backend.name != "synthetic" or not checker.checks_content:
        return checker.check_session(index, index + 1, record, frames_out)
    session_id = _synthetic_session_id(checker, index, record)
    if session_id is None:
        return [f"session {index + 1}: its first output frame is no synthetic frame of its input for any "
                "session id", *checker.check_session(index, index + 1, record, frames_out)]
    label = f"session {session_id}:"
    return [f"session {index + 1}:{problem[len(label):]}" if problem.startswith(label) else problem
            for problem in checker.check_session(index, session_id, record, frames_out)]


def _synthetic_session_id(checker: Checker, index: int, record: OutputRecord) -> int | None:
    """Which session id (modulo the marker count: all that the output depends on) made the first
    output frames this session received, or None."""
    inputs = checker.model_inputs(index)[:3]  # enough for any resampler's look-ahead
    if not inputs:
        return None
    size = checker.frame_bytes
    if size is not None:
        if not record.count:
            return None
        wanted = int(record.crcs[0])
    else:
        try:
            received = make_decoder(checker.output_spec, checker.model_rate).decode(b"".join(record.chunks))
        except AudioFormatError:
            return None
    for candidate in range(MARKER_COUNT):
        encoder = make_encoder(checker.output_spec, checker.model_rate)
        wire = b"".join(encoder.encode(frame) for frame in checker.model_outputs(candidate, inputs))
        if size is not None:
            if len(wire) >= size and zlib.crc32(wire[:size]) == wanted:
                return candidate
            continue
        made = make_decoder(checker.output_spec, checker.model_rate).decode(wire)
        common = min(len(made), len(received), checker.frame_size)
        if common and np.array_equal(made[:common], received[:common]):
            return candidate
    return None


def _frames_sent(workload: Workload, conversation: Conversation) -> int:
    """Model frames whose input the client sent in full."""
    if conversation.input_done:
        return workload.frames
    sent = conversation.messages_sent
    return sum(1 for frame in range(workload.frames) if workload.message_completing_frame(frame) < sent)


def _server_figures(before: MetricsSnapshot | None, after: MetricsSnapshot | None) -> dict:
    """What the server's /metrics say it did between two scrapes."""
    figures: dict = {"handoffs": {}, "steps": None, "mean_batch": None, "cpu_us_per_frame": None,
                     "scheduler_cpu_share": None, "replica": None, "note": None,
                     "frames_in": None, "frames_out": None, "step_ms_mean": None, "latency_ms_mean": None}
    if before is None or after is None:
        return figures
    # Behind a balancer each scrape is answered by one replica, whichever it picked: the figures
    # are that replica's, and two scrapes from two replicas have no difference worth showing.
    replicas = [sorted(snapshot.by_label("duplexrt_replica_info", "replica_id")) for snapshot in (before, after)]
    if replicas[0] != replicas[1]:
        figures["note"] = (f"the two /metrics scrapes were answered by different replicas ({', '.join(replicas[0])} "
                           f"then {', '.join(replicas[1])}), behind a balancer: no server figures")
        return figures
    figures["replica"] = ", ".join(replicas[1]) or None

    def delta(name: str) -> float | None:
        return after.delta(before, name)

    def as_int(value: float | None) -> int | None:
        return None if value is None else int(round(value))

    frames_in = as_int(delta("duplexrt_frames_in_total"))
    steps = as_int(delta("duplexrt_steps_total"))
    cpu = delta("process_cpu_seconds_total")
    then = before.by_label("duplexrt_handoffs_total", "kind")
    figures["handoffs"] = {kind: int(round(value - then.get(kind, 0.0)))
                           for kind, value in sorted(after.by_label("duplexrt_handoffs_total", "kind").items())}
    figures["frames_in"] = frames_in
    figures["frames_out"] = as_int(delta("duplexrt_frames_out_total"))
    figures["steps"] = steps
    if steps and frames_in is not None:
        figures["mean_batch"] = frames_in / steps
    if cpu is not None and frames_in:
        figures["cpu_us_per_frame"] = cpu * 1e6 / frames_in
    scheduler_cpu = delta("duplexrt_scheduler_thread_cpu_seconds_total")
    if cpu and scheduler_cpu is not None:  # a server without the series (older) leaves it None
        figures["scheduler_cpu_share"] = scheduler_cpu / cpu
    for key, name, scale in (("step_ms_mean", "duplexrt_step_seconds", 1e3),
                             ("latency_ms_mean", "duplexrt_frame_latency_seconds", 1e3)):
        total, count = delta(f"{name}_sum"), delta(f"{name}_count")
        if total is not None and count:
            figures[key] = total / count * scale
    return figures


async def run_url_find_capacity(config: Config, options: SimulateOptions, url: str, *,
                                api_key: str | None = None, progress: bool = False,
                                adopt_server_backend: bool = False, min_seconds: float = MIN_SECONDS,
                                on_probe: Callable[[Verdict], None] | None = None, retries: int = 0) -> CapacitySearch:
    """``--find-capacity --url``: the same bisection over real WebSockets, up to the server's slots.
    Sessions the server refuses (``at_capacity``) fail a probe like late frames do."""
    frame_seconds = config.audio.frame_seconds
    options = search_options(options, frame_seconds, min_seconds)
    target = UrlTarget.create(url, options, config)
    ready = await read_ready(target.url)
    if ready is None:
        raise ConfigError(f"{url}: the server has no /readyz answer to size the search by")
    server_backend = ready.get("backend")
    if adopt_server_backend and isinstance(server_backend, str) and server_backend != config.backend.name:
        config = attrs.evolve(config, backend=attrs.evolve(config.backend, name=server_backend))
    slots = ready.get("slots")
    ceiling = slots if isinstance(slots, int) and slots > 0 else options.concurrency
    capacity = ready.get("capacity")
    if not isinstance(capacity, dict):
        capacity = {}
    start = capacity.get("limit") if capacity.get("source") not in (None, "none") else None

    async def probe(sessions: int) -> Verdict:
        report = await _run_url_round(config, attrs.evolve(options, concurrency=sessions), target,
                                      f"{sessions} sessions", progress, api_key, 10.0, 10.0)
        return judge(report, frame_seconds * 1e3)

    return await find_capacity(probe, ceiling, start=start if isinstance(start, int) else None,
                               on_probe=on_probe, retries=retries)
