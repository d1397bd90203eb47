"""The runtime: configuration, the scheduler thread, the handoff counters and the sessions.

One ``Runtime`` is one model serving many sessions.  ``open_runtime`` runs it for the length of an
``async with`` block, so everything it started — thread included — is gone when the block ends.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import attrs
import trio

from duplexrt.audio import AudioFormat, AudioSpec
from duplexrt.backends import Backend, SlotChoice, create_backend
from duplexrt.config import Config
from duplexrt.core.affinity import confine, pin_this_thread, plan_for, restore
from duplexrt.core.capacity import CapacityEstimate
from duplexrt.core.handoffs import HandoffStatistics, Handoffs
from duplexrt.core.histogram import Histogram
from duplexrt.core.metrics import FrameMetrics, FrameStatistics
from duplexrt.core.scheduler import BackendLoadError, Scheduler, SchedulerStatistics
from duplexrt.session.session import Session, SessionServices
from duplexrt.protocols.base import Translator
from duplexrt.protocols.events import SessionEnd
from duplexrt.protocols.raw import RawTranslator
from duplexrt.transcripts.keeper import Transcripts
from duplexrt.wire.transport import Transport

if TYPE_CHECKING:
    from duplexrt.transcribe.transcriber import Transcriber

log = logging.getLogger("duplexrt.runtime")


@attrs.frozen
class RuntimeHistograms:
    """Copies of the runtime's histograms at one moment, in nanoseconds (batch sizes in rows).

    Copies, so a reader can keep one and subtract it from a later reading (``Histogram.minus``)
    to get what happened in between, or export its buckets, while the runtime records on."""

    #: Submitted to the inbox → handed to the transport, per frame.
    latency: Histogram
    #: Decode and framing of one message (one message in four is timed).
    preprocess: Histogram
    #: One frame's submit into the inbox (one frame in eight is timed).
    enqueue: Histogram
    #: A step finished → its batch of output handed to the transport (once per batch).
    step_to_sent: Histogram
    #: Session opened → its first audio sent.
    first_audio: Histogram
    #: How far each send strays from one frame period after the previous one.
    jitter: Histogram
    #: Time the model took per step.
    step_time: Histogram
    #: Rows per step.
    batch_sizes: Histogram
    #: A step finished → its outputs handed to the sessions.
    delivery: Histogram
    #: Per backend stage (by name), its duration per step.
    stages: dict[str, Histogram]


@attrs.frozen
class RuntimeStatistics:
    """Everything the runtime counts, read at one moment: what the Prometheus exporter, the
    ``log_stats`` line, ``/readyz``, ``/stats`` and ``simulate`` show.  Nothing here costs
    anything per frame: it is read from counters and histograms the runtime keeps anyway."""

    #: The backend's name (``backend.info.name``).
    backend: str
    #: The model is loaded and its thread running.
    ready: bool
    #: The model failed the last ``runtime.max_consecutive_step_failures`` steps in a row.
    failing: bool
    #: Batch rows of the model.
    slots: int
    #: How that count came about: ``runtime.slots`` as configured, or what ``"auto"`` chose at
    #: load and why.
    slot_choice: SlotChoice
    #: Rows held by no session.  A connection being admitted has no row yet: for slots free for
    #: new connections, see ``ServerStatistics.free_slots``.
    free_rows: int
    #: Sessions being served now, and opened since start (``frames.sessions_active`` and
    #: ``frames.sessions_opened``).
    sessions_active: int
    #: What admission reads: the fitted step cost and the sessions it allows.
    capacity: CapacityEstimate
    #: Thread crossings by kind, and offloads to worker threads.
    handoffs: HandoffStatistics
    #: Steps, frames stepped, batch sizes and failures of the scheduler thread.
    scheduler: SchedulerStatistics
    #: Per-frame counters and timing summaries (microseconds) of the sessions.
    frames: FrameStatistics
    #: The histograms behind the summaries, for interval figures and exporters.
    histograms: RuntimeHistograms
    #: The persona a caller may set (``Backend.persona_info``: voices, defaults, prompt cache);
    #: None for a model that takes none.
    persona: dict[str, Any] | None = None


class Runtime:
    def __init__(self, config: Config, backend: Backend | None = None) -> None:
        self.config = config
        self.handoffs = Handoffs()
        self.backend = backend if backend is not None else create_backend(config)
        #: The CPUs this replica runs on (``runtime.cpus``, else from its GPU; ``core/affinity.py``).
        self.cpu_plan = plan_for(config.runtime.cpus, self.backend.info.device, config.runtime.pin_host_threads)
        #: What the caller says (``[transcriber]``): loaded with the model, stepped with it.
        self.transcriber: Transcriber | None = None
        if config.transcriber.enabled:
            from duplexrt.transcribe.transcriber import Transcriber

            self.transcriber = Transcriber(config=config.transcriber)
        self.scheduler = Scheduler(self.backend, config.runtime, self.handoffs, self.transcriber)
        self.metrics = FrameMetrics()
        self.sessions: set[Session] = set()
        #: Ended calls' transcripts (``[transcripts]``): kept to be fetched, written to a file;
        #: None when neither is on (sessions then record nothing).
        self.transcripts: Transcripts | None = (Transcripts(config.transcripts, self.handoffs)
                                                if config.transcripts.recorded else None)

    async def run(self, *, task_status: trio.TaskStatus[Runtime] = trio.TASK_STATUS_IGNORED) -> None:
        """Load the model on the scheduler thread, then serve until cancelled."""
        plan = self.cpu_plan
        cpu = plan.host if self.config.runtime.pin_host_threads else None
        if plan.process is not None or cpu is not None:
            log.info("CPUs: %s%s", plan.reason, "" if cpu is not None else " (host threads not pinned)")
        elif self.config.runtime.pin_host_threads == "auto":
            log.info("CPUs: %s", plan.reason)
        original = confine(plan.process)  # the threads started from here on inherit it
        previous = pin_this_thread(cpu)
        self.scheduler.pin_cpu = cpu
        self.scheduler.unpinned_cpus = previous
        try:
            await self.scheduler.run(task_status=_Started(task_status, self))
        finally:
            restore(previous)
            restore(original)
            plan.release()

    def audio_spec(self, format: str | AudioFormat = AudioFormat.PCM_F32LE,
                   sample_rate: int | None = None) -> AudioSpec:
        """A wire format checked against what this runtime can convert to its model's rate."""
        return AudioSpec.create(AudioFormat.parse(format) if isinstance(format, str) else format,
                                sample_rate, model_rate=self.config.audio.sample_rate)

    async def serve(self, transport: Transport, protocol: Translator | None = None, *,
                    input_spec: AudioSpec | None = None, output_spec: AudioSpec | None = None,
                    session_id: int | None = None, route: str = "", peer: str = "") -> SessionEnd:
        """Serve one session over ``transport`` until it ends.

        ``protocol`` defaults to the raw protocol in ``input_spec`` (PCM f32 at the model rate)
        and ``output_spec`` (the same as the input).  Raises NoFreeSlotError at once when every
        slot is taken: admission is the caller's call.  ``route`` (the path it was opened on) and
        ``peer`` (the client's address) go into its log lines, and ``route`` labels its counts.
        """
        if protocol is None:
            input_spec = input_spec or self.audio_spec()
            protocol = RawTranslator(input_spec, output_spec or input_spec)
        services = SessionServices(config=self.config, scheduler=self.scheduler, handoffs=self.handoffs,
                                   metrics=self.metrics, registry=self.sessions,
                                   max_session_frames=self.backend.info.max_session_frames,
                                   flush_frames=self._flush_frames(),
                                   persona_check=self.backend.check_persona if self.backend.takes_persona else None,
                                   transcripts=self.transcripts)
        return await Session(services, transport, protocol, session_id, route=route, peer=peer).run()

    def _flush_frames(self) -> int:
        """Frames a session feeds after its caller's input ends: the model's, and at least the
        end-of-input mark when a transcriber must bring out the caller's last words (one silent
        frame more for the model, which answers it like any other)."""
        frames = self.backend.info.flush_frames
        return max(frames, 1) if self.transcriber is not None else frames

    def statistics(self) -> RuntimeStatistics:
        """One record of every figure the runtime keeps (read on the trio thread)."""
        scheduler = self.scheduler
        metrics = self.metrics
        frames = metrics.statistics()
        return RuntimeStatistics(
            backend=self.backend.info.name,
            ready=scheduler.ready,
            failing=scheduler.failing,
            slots=scheduler.slots,
            slot_choice=scheduler.slot_choice,
            free_rows=scheduler.free_slots,
            sessions_active=frames.sessions_active,
            capacity=scheduler.capacity.estimate,
            handoffs=self.handoffs.statistics(),
            scheduler=scheduler.statistics(),
            frames=frames,
            histograms=RuntimeHistograms(
                latency=metrics.latency.snapshot(),
                preprocess=metrics.preprocess.snapshot(),
                enqueue=metrics.enqueue.snapshot(),
                step_to_sent=metrics.step_to_sent.snapshot(),
                first_audio=metrics.first_audio.snapshot(),
                jitter=metrics.jitter.snapshot(),
                step_time=scheduler.step_time_snapshot(),
                batch_sizes=scheduler.batch_sizes.snapshot(),
                delivery=scheduler.delivery_delay.snapshot(),
                stages={name: histogram.snapshot() for name, histogram in sorted(scheduler.stage_time.items())},
            ),
            persona=self.backend.persona_info(),
        )


class _Started:
    """Reports the runtime, not its scheduler, as what ``nursery.start`` returns."""

    def __init__(self, status: trio.TaskStatus[Runtime], value: Runtime) -> None:
        self._status = status
        self._value = value

    def started(self, _value: object = None) -> None:
        self._status.started(self._value)


@asynccontextmanager
async def open_runtime(config: Config, backend: Backend | None = None) -> AsyncIterator[Runtime]:
    """Run a runtime for the block's duration; on exit, every session and the thread stop."""
    runtime = Runtime(config, backend)  # bad backend options fail here, not inside a nursery
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(runtime.run)
            if runtime.transcripts is not None and runtime.transcripts.sink is not None:
                nursery.start_soon(runtime.transcripts.run)  # the file's writer, off the hot path
            try:
                yield runtime
            finally:
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # A model that cannot load is one plain error for the caller, not a group of one.
        if len(group.exceptions) == 1 and isinstance(group.exceptions[0], BackendLoadError):
            error = group.exceptions[0]
            raise error from error.__cause__
        raise
