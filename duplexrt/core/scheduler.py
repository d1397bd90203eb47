"""The GPU scheduler thread: the one thread that owns the model and steps every session at once.

Trio tasks never touch the backend.  They lease a slot, put frames into the shared ``Inbox`` and
receive outputs through the ``SlotOwner`` callbacks (``core/slot_owner.py``), which run on the trio thread for a whole step
at a time through a single ``run_sync_soon``: at most one crossing per step, and fewer when trio
is busy, since steps that finish before trio has taken the last delivery ride along with it.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import attrs
import numpy as np
import trio

from duplexrt.backends.base import Backend, Persona, PersonaError, SlotChoice, SlotSession
from duplexrt.config import RuntimeConfig
from duplexrt.core.affinity import pin_this_thread, restore
from duplexrt.core.capacity import CapacityEstimator
from duplexrt.core.handoffs import HandoffKind, Handoffs
from duplexrt.core.histogram import Histogram, Summary
from duplexrt.core.inbox import Batch, Control, ControlOp, Inbox, PutTicket
from duplexrt.core.interrupt import Interrupted, Interrupter
from duplexrt.core.slot_owner import SlotOwner
from duplexrt.transcribe.pieces import TranscriptPiece

if TYPE_CHECKING:
    from duplexrt.transcribe.transcriber import Transcriber

log = logging.getLogger("duplexrt.scheduler")

THREAD_NAME = "duplexrt-scheduler"
#: Steps estimated below this (milliseconds) step what queued behind them in the same cycle: a
#: cycle's wake-up and delivery cost the host more than such a step (the scheduler thread's share
#: of the server's CPU is a column of ``benchmarks/server.py``), so for such a model the cycle, not
#: the step, is the cost (echo, a model at zero cost, a tiny CPU one).
DRAIN_BELOW_MS = 0.1
#: While input keeps coming, cycles of such steps start at most this far apart (milliseconds):
#: a frame waits at most this long, and each cycle's wake-up and delivery serve the frames of
#: every session that came meanwhile.
CHEAP_STEP_CYCLE_MS = 5.0
#: Steps on silence the transcriber takes at load (``Transcriber.load``), after the backend's.
TRANSCRIBER_WARMUP_STEPS = 2
#: A load interrupted by a stop (``Scheduler.run`` cancelled while the model loads) gets this
#: long to unwind before its thread is left behind.
LOAD_STOP_S = 10.0


class NoFreeSlotError(RuntimeError):
    """Every slot is taken: the caller should refuse the session, not queue it."""


class SlotClosedError(RuntimeError):
    """The slot was released (or the scheduler stopped) while a submit was waiting."""


class BackendLoadError(RuntimeError):
    """The backend could not load: the runtime cannot start."""


def _device_key(device: str) -> str:
    """``cuda`` and ``cuda:0`` are one device."""
    return f"{device}:0" if device.startswith("cuda") and ":" not in device else device


class TranscriberLoadError(RuntimeError):
    """The transcriber (``[transcriber]``) could not load: the runtime cannot start either."""


class BackendStepError(RuntimeError):
    """The model failed on a step this session was part of.

    Its message is what a client may be told: generic, with an error id.  The backend's own
    exception (file paths, tensor shapes, device messages) is its ``__cause__`` and goes only to
    the log, under the same id, so an operator can find it from what the client reports.
    """

    def __init__(self, error_id: str, what: str = "the model failed on this step") -> None:
        super().__init__(f"{what} (error id {error_id})")
        self.error_id = error_id


def new_error_id() -> str:
    """An id to tie what a client is told to the log record with the details."""
    return f"err_{secrets.token_hex(6)}"


class StepOutcome(NamedTuple):
    """One step's results, handed to trio as one immutable object (a tuple: made once per step
    on the scheduler thread, it costs a tuple's construction, not a frozen class's)."""

    owners: Sequence[SlotOwner]
    stamps: Sequence[int]
    outputs: np.ndarray | None
    texts: Sequence[str] | None
    stepped_ns: int
    error: BaseException | None = None
    #: The backend's own stage durations for this step, ``(name, ns)``.
    stages: tuple[tuple[str, int], ...] = ()
    #: Not a step: the backend took the persona of ``owners[0]``'s slot (``SlotOwner.persona_set``).
    persona_set: bool = False
    #: With a transcriber: what each row's caller said, as far as this step wrote it (``()``:
    #: nothing this step); None without one.
    transcripts: Sequence[tuple[TranscriptPiece, ...]] | None = None


@attrs.frozen
class SchedulerStatistics:
    steps: int
    frames: int
    mean_batch: float
    max_batch: int
    step_time_us: Summary
    open_slots: int
    free_slots: int
    queued_frames: int
    #: Steps (and slot openings) the backend failed, in all, and in a row up to now.
    failed_steps: int = 0
    consecutive_step_failures: int = 0
    #: CPU time the scheduler thread has used (seconds; 0.0 where the platform cannot tell): its
    #: share of the process's CPU is the host cost of stepping (batching, copies, the crossings)
    #: against everything on the trio thread.
    thread_cpu_seconds: float = 0.0


def _drop_rows(batch: Batch, slots: set[int]) -> None:
    """Take the rows of ``slots`` out of ``batch`` (in place, order kept)."""
    keep = [i for i, slot in enumerate(batch.rows) if slot not in slots]
    if len(keep) == len(batch.rows):
        return
    batch.rows = [batch.rows[i] for i in keep]
    batch.owners = [batch.owners[i] for i in keep]
    batch.frames = [batch.frames[i] for i in keep]
    batch.stamps = [batch.stamps[i] for i in keep]


def _host_buffer(shape: tuple[int, ...], device: str) -> np.ndarray:
    """A float32 host array; page-locked when the model lives on a GPU, so copies can overlap."""
    if device.startswith("cuda"):
        import torch

        return torch.empty(shape, dtype=torch.float32, pin_memory=True).numpy()
    return np.zeros(shape, dtype=np.float32)


class SlotLease:
    """A session's hold on one slot, used from the trio thread."""

    __slots__ = ("slot", "owner", "session_id", "_scheduler", "_inbox", "_give_back", "_released", "_persona")

    def __init__(self, scheduler: Scheduler, slot: int, owner: SlotOwner, session_id: int,
                 give_back: Callable[[int], None]) -> None:
        self.slot = slot
        self.owner = owner
        self.session_id = session_id
        self._scheduler = scheduler
        self._inbox = scheduler.inbox
        #: Hands the slot back to the scheduler's free list: given by the scheduler, so the lease
        #: needs nothing of the scheduler's beyond what it was handed.
        self._give_back = give_back
        self._released = False
        self._persona = False

    @property
    def released(self) -> bool:
        return self._released

    def set_persona(self, persona: Persona) -> None:
        """The session is ``persona`` (checked: ``Backend.check_persona``): the scheduler hands it
        to the backend (``Backend.set_persona``) before it steps any frame submitted after this
        call.  Once per lease, before the first submit (the session's first frame).

        The answer comes back to the owner: ``persona_set()`` once the backend took it, or
        ``step_failed()`` with the refusal, which ends only this session; the slot's frames are
        then never stepped without their persona (the scheduler drops them until the slot closes).
        """
        if self._released:
            raise SlotClosedError("the session's slot was released")
        if self._persona:
            raise RuntimeError("a session's persona is set once, before its first frame")
        self._persona = True
        self._inbox.set_persona(self.slot, self.owner, persona)

    def submit_nowait(self, frame: np.ndarray, stamp: int | None = None) -> bool:
        """Queue ``frame`` (submitted at ``stamp``, now by default) without waiting; False if
        the slot's inbox is full.  A plain call: a session's reader tries it first and awaits
        ``submit`` only when it says no, so a frame that fits costs no coroutine."""
        if self._released:
            raise SlotClosedError("the session's slot was released")
        return self._inbox.put_nowait(self.slot, self.owner, frame,
                                      time.perf_counter_ns() if stamp is None else stamp)

    async def submit(self, frame: np.ndarray, stamp: int | None = None) -> None:
        """Queue ``frame`` (submitted at ``stamp``, perf_counter_ns, now by default), waiting on
        a worker thread only when the inbox is full.

        Returns once the frame is queued, and only then: raising (Cancelled, SlotClosedError)
        means it was not queued and never will be, even if the worker thread is still winding down.

        ``offload = "always"`` sends every submit through a worker thread, as the reference
        orchestrator did, so the two can be compared.
        """
        if self._released:
            raise SlotClosedError("the session's slot was released")
        if stamp is None:
            stamp = time.perf_counter_ns()
        scheduler = self._scheduler
        if scheduler.always_offload:
            kind = HandoffKind.SUBMIT_OFFLOAD
        elif self._inbox.put_nowait(self.slot, self.owner, frame, stamp):
            return
        else:
            kind = HandoffKind.FULL_INBOX_OFFLOAD
        # The wait is abandoned on cancellation, so that a cancelled submit returns at once even
        # while the model is stalled; the ticket then settles what the thread does after.
        ticket = PutTicket()
        try:
            queued = await scheduler.handoffs.offload(
                kind, self._inbox.put_blocking, self.slot, self.owner, frame, stamp, ticket,
                abandon_on_cancel=True,
            )
        except trio.Cancelled:
            if self._inbox.withdraw(ticket):
                # The frame went in before the cancellation: the submit happened, so it returns
                # like one (trio's rule: Cancelled means "not done"), and the caller counts it.
                # The cancellation is still pending: it lands at the caller's next checkpoint.
                return
            raise  # withdrawn: the frame will never be queued
        if not queued:
            raise SlotClosedError("the session's slot was released while its submit waited")

    def end_input(self) -> None:
        """No more frames will come: the scheduler stops waiting for this slot when gathering."""
        self._inbox.end_input(self.slot, self.owner)

    def release(self) -> int:
        """Give the slot back (idempotent).  Returns how many queued frames were dropped."""
        if self._released:
            return 0
        self._released = True
        dropped = self._inbox.close(self.slot, self.owner)
        self._give_back(self.slot)
        return dropped


class Scheduler:
    """Owns the scheduler thread and the backend; leases slots to sessions.

    Run it with ``await nursery.start(scheduler.run)``: that returns once the backend is loaded,
    and cancelling the nursery stops the thread and waits for it, so no thread outlives it.
    """

    def __init__(self, backend: Backend, config: RuntimeConfig, handoffs: Handoffs,
                 transcriber: Transcriber | None = None) -> None:
        self.backend = backend
        #: The caller's speech-to-text model, stepped right after the backend over the same rows
        #: and frames (``duplexrt.transcribe``); loaded on this thread after the backend.
        self.transcriber = transcriber
        self.handoffs = handoffs
        self.always_offload = config.offload == "always"
        self.slots = backend.info.slots
        self.frame_size = backend.info.frame_size
        #: The frame a session submits as its first after its input ended (``BackendInfo.flush_frames``):
        #: silence, recognised by identity, so the backend hears of it (``end_input``) on the very
        #: step that carries it, behind whatever the session queued before.
        self.end_of_input = np.zeros(self.frame_size, dtype=np.float32)
        self.gather_window = config.gather_window_ms / 1e3
        #: How far apart cycles of steps under ``DRAIN_BELOW_MS`` start while input keeps coming.
        self.cheap_cycle = CHEAP_STEP_CYCLE_MS / 1e3
        self.max_consecutive_failures = config.max_consecutive_step_failures
        self._config = config
        #: How the slot count came about (``runtime.slots``, or the backend's choice at load).
        self.slot_choice = SlotChoice(self.slots, "configured", "runtime.slots")
        # Sized for the slots configured; a count the backend chooses at load (``"auto"``: 0
        # here) is sized again on the thread once it is known, before anyone can open a slot.
        self._size_slots(self.slots)
        self._session_ids = itertools.count(1)
        #: Set when trio stops the scheduler: a load that finishes after it serves nothing.
        self._stop = threading.Event()
        #: Lets trio stop a load under way (``core/interrupt.py``) instead of waiting for it.
        self._load_interrupter = Interrupter()
        #: ``runtime.pin_host_threads``: the CPU this thread shares with the trio thread.
        self.pin_cpu: int | None = None
        self.unpinned_cpus: set[int] | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._thread: threading.Thread | None = None
        self._final_cpu_seconds = 0.0  # the thread's CPU time as it ended
        self._started = trio.Event()
        self._finished = trio.Event()
        self._thread_error: BaseException | None = None
        # Steps finished but not yet taken by trio.  When trio is busy, later steps join the
        # delivery already on its way instead of making crossings of their own.
        self._undelivered_lock = threading.Lock()
        self._undelivered: list[StepOutcome] = []
        # Written only by the scheduler thread; read (approximately, while running) by trio.
        self._steps = 0
        self._frames = 0
        self._max_batch = 0
        self._failed_steps = 0
        # Failed steps since the last one that worked: a model that fails every step is not
        # ready, whatever else is true (``failing``).
        self._consecutive_failures = 0
        self._step_time = Histogram()
        #: Steps the transcriber failed (their calls went on without those words), and whether
        #: the last one failed (scheduler thread only).
        self.transcriber_failures = 0
        self._transcriber_failing = False
        #: Slots whose persona the backend refused: their frames are dropped, never stepped
        #: without it, until the slot closes (scheduler thread only).
        self._refused: set[int] = set()
        #: Rows per step (written by the scheduler thread).
        self.batch_sizes = Histogram()
        #: Step finished → its outputs handed to the sessions (written on the trio thread).
        self.delivery_delay = Histogram()
        #: Per backend stage, its duration per step (written on the trio thread, once per step).
        self.stage_time: dict[str, Histogram] = {}

    def _size_slots(self, slots: int) -> None:
        """The structures sized by the slot count: the inbox's queues, the free list, the
        capacity estimate."""
        config, info, handoffs = self._config, self.backend.info, self.handoffs
        self.slots = slots
        #: Step cost by batch size, learnt on this thread; its ``estimate`` is what admission reads.
        self.capacity = CapacityEstimator(slots, info.frame_size / info.sample_rate,
                                          config.capacity_margin, config.max_sessions,
                                          paid_rows=self.backend.paid_rows)
        self.inbox = Inbox(slots, config.inbox_depth,
                           lambda: handoffs.count_from_any_thread(HandoffKind.SCHEDULER_WAKE))
        self._free_slots = list(range(slots - 1, -1, -1))  # pop() gives the lowest

    # -- trio side -------------------------------------------------------------------------

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def ready(self) -> bool:
        return self._started.is_set() and not self._finished.is_set()

    @property
    def failing(self) -> bool:
        """The model failed the last ``runtime.max_consecutive_step_failures`` steps in a row.
        Cleared by the next step that works."""
        return self._consecutive_failures >= self.max_consecutive_failures

    def open_slot(self, owner: SlotOwner, session_id: int | None = None) -> SlotLease:
        """Lease the lowest free slot to ``owner``; raises NoFreeSlotError when none is left."""
        if not self.ready:
            raise SlotClosedError("the scheduler is not running")
        if not self._free_slots:
            raise NoFreeSlotError(f"all {self.slots} slots are in use")
        slot = self._free_slots.pop()
        if session_id is None:
            session_id = next(self._session_ids)
        lease = SlotLease(self, slot, owner, session_id, self._slot_released)
        self.inbox.open(slot, owner, SlotSession(session_id=session_id))
        return lease

    def _slot_released(self, slot: int) -> None:
        self._free_slots.append(slot)
        if len(self._free_slots) > 1 and self._free_slots[-1] > self._free_slots[-2]:
            self._free_slots.sort(reverse=True)

    async def run(self, *, task_status: trio.TaskStatus[Scheduler] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the thread, wait for the backend to load, then serve until cancelled."""
        if self._thread is not None:
            raise RuntimeError("a Scheduler runs once")
        self._token = trio.lowlevel.current_trio_token()
        self._thread = threading.Thread(target=self._thread_main, name=THREAD_NAME, daemon=True)
        self._thread.start()
        try:
            await self._started.wait()
            if self._finished.is_set():
                error = self._thread_error
                what = (str(error) if isinstance(error, TranscriberLoadError)
                        else f"backend {self.backend.info.name!r} failed to load: {error}")
                raise BackendLoadError(what) from error
            task_status.started(self)
            await self._finished.wait()
            raise RuntimeError("the scheduler thread stopped unexpectedly") from self._thread_error
        finally:
            self._stop.set()
            self.inbox.stop()
            if not self._started.is_set() and self._load_interrupter.interrupt():
                # Stopped while the model loads (SIGTERM to a pod still loading): the load is
                # interrupted rather than waited for, and given a few seconds to unwind.
                log.warning("stopping the model's load")
                with trio.CancelScope(shield=True), trio.move_on_after(LOAD_STOP_S):
                    await self._finished.wait()
                if not self._finished.is_set():
                    log.error("the model's load did not stop within %g s; its thread is left behind", LOAD_STOP_S)
                    return
            with trio.CancelScope(shield=True):
                await self._finished.wait()
            self._thread.join()

    def step_time_snapshot(self) -> Histogram:
        """Step durations so far, in nanoseconds (diff two snapshots for one interval)."""
        return self._step_time.snapshot()

    def statistics(self) -> SchedulerStatistics:
        steps = self._steps
        return SchedulerStatistics(
            steps=steps,
            frames=self._frames,
            mean_batch=self._frames / steps if steps else 0.0,
            max_batch=self._max_batch,
            step_time_us=self._step_time.summary().scaled(1e3),
            open_slots=self.slots - len(self._free_slots),
            free_slots=len(self._free_slots),
            queued_frames=self.inbox.total_queued(),
            failed_steps=self._failed_steps,
            consecutive_step_failures=self._consecutive_failures,
            thread_cpu_seconds=self._thread_cpu_seconds(),
        )

    def _thread_cpu_seconds(self) -> float:
        """The scheduler thread's CPU time, read from any thread through its CPU clock (nothing is
        counted on the thread itself); once it has ended, what it had used by then."""
        thread = self._thread
        if thread is None or thread.ident is None:
            return 0.0
        if not thread.is_alive():
            return self._final_cpu_seconds
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (AttributeError, OSError):  # no per-thread CPU clocks here (not Unix), or it just ended
            return self._final_cpu_seconds

    def _take_deliveries(self) -> None:
        """Runs on the trio thread: every step finished since the last delivery, in order."""
        with self._undelivered_lock:
            outcomes, self._undelivered = self._undelivered, []
        now = time.perf_counter_ns()
        for outcome in outcomes:
            self.delivery_delay.record(now - outcome.stepped_ns)
            for name, duration in outcome.stages:
                stage = self.stage_time.get(name)
                if stage is None:
                    stage = self.stage_time[name] = Histogram()
                stage.record(duration)
            self._deliver(outcome)
        # Then each owner once, with every row it got in hand: a session sends them together.
        if len(outcomes) == 1:
            owners: Sequence[SlotOwner] = outcomes[0].owners
        else:
            owners = list(dict.fromkeys(owner for outcome in outcomes for owner in outcome.owners))
        for owner in owners:
            try:
                owner.delivery_done()
            except Exception:
                log.exception("a session failed to take its delivery")

    def _deliver(self, outcome: StepOutcome) -> None:
        """Hand each row's result to its session."""
        owners = outcome.owners
        if outcome.error is not None:
            for owner in owners:
                try:
                    owner.step_failed(outcome.error)
                except Exception:
                    log.exception("a session failed to take a step error")
            return
        if outcome.persona_set:
            try:
                owners[0].persona_set()
            except Exception:
                log.exception("a session failed to take its persona's acknowledgement")
            return
        outputs = outcome.outputs
        assert outputs is not None  # an outcome carries its outputs unless it carries an error
        texts = outcome.texts
        stamps = outcome.stamps
        stepped = outcome.stepped_ns
        transcripts = outcome.transcripts
        if transcripts is not None:
            # Before the rows' outputs: the step that takes a session's last frame may end it,
            # and its caller's last words go out before its end.
            for owner, pieces in zip(owners, transcripts):
                if pieces:
                    try:
                        owner.transcript(pieces)
                    except Exception:
                        log.exception("a session failed to take its transcript")
        for i, owner in enumerate(owners):
            try:
                owner.step_output(outputs[i], texts[i] if texts is not None else None, stamps[i], stepped)
            except Exception:
                log.exception("a session failed to take its output")

    def _on_started(self) -> None:
        self._started.set()

    def _on_finished(self, error: BaseException | None) -> None:
        self._thread_error = error
        self._finished.set()
        self._started.set()

    # -- scheduler thread ------------------------------------------------------------------

    def _to_trio(self, kind: HandoffKind, fn: Callable[..., object], *args: object) -> bool:
        assert self._token is not None
        return self.handoffs.deliver_from_thread(self._token, kind, fn, *args)

    def _load_transcriber_weights(self) -> None:
        """The transcriber's weights first, on a device it shares with the backend: the backend
        then sizes its slots by the memory left beside them, each slot counting the
        transcriber's row too (``Backend.extra_slot_bytes``)."""
        transcriber = self.transcriber
        if transcriber is None:
            return
        try:
            with self._load_interrupter.interruptible():
                transcriber.load_weights()
            if _device_key(transcriber.device) == _device_key(self.backend.info.device):
                self.backend.extra_slot_bytes = transcriber.state_bytes_per_slot()
        except Exception as exc:
            raise TranscriberLoadError(f"the transcriber failed to load: {exc}") from exc

    def _thread_main(self) -> None:
        error: BaseException | None = None
        try:
            # Born pinned like the trio thread that started it: the model loads with every core
            # (a CPU model's thread pool starts here), and only then does this thread pin itself.
            restore(self.unpinned_cpus)
            self._load_transcriber_weights()
            with self._load_interrupter.interruptible():
                self.backend.load()
            if self.backend.info.slots != self.slots:  # chosen at load (``runtime.slots = "auto"``)
                self._size_slots(self.backend.info.slots)
            if self.transcriber is not None:
                try:
                    with self._load_interrupter.interruptible():
                        self.transcriber.load(self.slots, warmup_steps=TRANSCRIBER_WARMUP_STEPS)
                    self.transcriber.check_audio(self.backend.info.sample_rate, self.frame_size)
                except Exception as exc:
                    raise TranscriberLoadError(f"the transcriber failed to load: {exc}") from exc
            if self._stop.is_set():  # trio stopped while the model loaded: serve nothing
                self.inbox.stop()
            self.slot_choice = self.backend.slot_choice or self.slot_choice
            shape = (self.slots, self.frame_size)
            self._inputs = _host_buffer(shape, self.backend.info.device)
            self._outputs = _host_buffer(shape, self.backend.info.device)
            self._input_bytes = self._inputs.data.cast("B")
            self._frame_bytes = self.frame_size * self._inputs.itemsize
            warmup_costs = self.backend.warmup_costs
            if self.transcriber is not None:
                # A step is the backend's and the transcriber's: admission starts from both.
                extra = self.transcriber.warmup_cost
                warmup_costs = tuple((rows, cost + extra) for rows, cost in warmup_costs)
            self.capacity.seed(warmup_costs)
            # After load: whatever threads the model started keep every core.
            pin_this_thread(self.pin_cpu)
            self._rows = np.zeros(self.slots, dtype=np.int64)
        except BaseException as exc:
            if isinstance(exc, Interrupted):
                log.warning("the model's load was stopped")
            else:
                # Its message reaches the caller once, in the BackendLoadError raised on the trio
                # side (``duplexrt serve`` prints it); the traceback is for whoever asks for debug.
                log.debug("backend %r failed to load", self.backend.info.name, exc_info=True)
            try:
                self.backend.close()  # whatever it did load (device memory, thread pools) goes
            except Exception:
                log.exception("backend %r failed to close", self.backend.info.name)
            self._close_transcriber()
            self._to_trio(HandoffKind.LIFECYCLE, self._on_finished, exc)
            return
        self._to_trio(HandoffKind.LIFECYCLE, self._on_started)
        try:
            self._serve()
        except BaseException as exc:
            log.exception("the scheduler thread failed")
            error = exc
        finally:
            try:
                self.backend.close()
            except Exception:
                log.exception("backend %r failed to close", self.backend.info.name)
            self._close_transcriber()
            self._final_cpu_seconds = time.thread_time()
            self._to_trio(HandoffKind.LIFECYCLE, self._on_finished, error)

    def _close_transcriber(self) -> None:
        if self.transcriber is not None:
            try:
                self.transcriber.close()
            except Exception:
                log.exception("the transcriber failed to close")

    def _serve(self) -> None:
        inbox = self.inbox
        window = self.gather_window
        gather_queued = True
        gather_until: float | None = None
        while True:
            batch = inbox.next_batch(window, gather_queued=gather_queued, gather_until=gather_until)
            if batch is None:
                return
            cycle = time.monotonic()
            outcomes = self._run(batch)
            gather_until = None
            if batch.rows:
                gather_queued = self.gathers_after(len(batch.rows))
                if self.drains_after(len(batch.rows)):
                    # A step this cheap costs the host more than the model: the wake-up that
                    # started it and the crossing that delivers it.  So the frames already queued
                    # behind it (a client's message of several frames) are stepped now, in order,
                    # one frame per slot per step as always, and the whole cycle crosses to trio
                    # in one delivery; the next cycle gathers until ``cheap_cycle`` after this one
                    # began, so frames that keep coming are taken once a cycle without a signal
                    # each: no frame waits longer than that (a 5 ms cycle keeps the lag near what
                    # the 2 ms gather window gave, for less host CPU; today's lag and CPU per
                    # frame: benchmarks/server.py).
                    gather_until = cycle + self.cheap_cycle
                    while (time.monotonic() < gather_until and (batch := inbox.queued_batch()) is not None):
                        outcomes += self._run(batch)
                        if not self.drains_after(len(batch.rows)):
                            gather_queued = self.gathers_after(len(batch.rows))
                            gather_until = None
                            break
            if outcomes:
                self._publish(outcomes)

    def drains_after(self, rows: int) -> bool:
        """Whether the frames already queued behind a step of ``rows`` rows are stepped at once,
        in the same cycle (see ``_serve``): only for steps cheaper than ``DRAIN_BELOW_MS``, less
        than what the cycle's wake-up and crossing cost the host.  A dearer one keeps its batches
        whole: stepping a few queued rows at a time would cost a flat-cost model (a GPU's batch)
        a step each."""
        return self.capacity.estimate.cost_ms(rows) < DRAIN_BELOW_MS

    def _run(self, batch: Batch) -> list[StepOutcome]:
        """Apply ``batch``'s controls, then step its rows: the outcomes for trio."""
        outcomes = [outcome for control in batch.controls if (outcome := self._apply(control)) is not None]
        if self._refused and batch.rows:
            _drop_rows(batch, self._refused)
        if batch.rows:
            outcomes.append(self._step(batch))
        return outcomes

    def gathers_after(self, rows: int) -> bool:
        """Whether the frames that queued during a step of ``rows`` rows wait for the gather window.

        Only after a step cheaper than the window.  After a dearer one they have waited longer
        than the window already, the slots still empty will be in the next step, which starts as
        soon as this one ends, and every window waited is added to the step cycle: near capacity
        the cycle is the frame period, so the window is capacity lost (``simulate --find-capacity``
        on the synthetic GPU-like curve, docs/capacity.md).  Cheap steps (echo, a model
        at zero cost) keep gathering, which is what keeps their batches whole in a burst."""
        return self.capacity.estimate.cost_ms(rows) < self.gather_window * 1e3

    def _apply(self, control: Control) -> StepOutcome | None:
        """Open a slot, set its persona or close it; an outcome for trio when an open failed,
        and for every persona (taken, or refused)."""
        op = control.op
        if op is ControlOp.PERSONA:
            return self._set_persona(control)
        if op is ControlOp.CLOSE:
            self._refused.discard(control.slot)
        transcriber = self.transcriber
        try:
            if op is ControlOp.OPEN:
                assert isinstance(control.payload, SlotSession)  # the session's description travels with its OPEN
                self.backend.open_slot(control.slot, control.payload)
                if transcriber is not None:
                    transcriber.open_slot(control.slot)
            else:
                self.backend.close_slot(control.slot)
                if transcriber is not None:
                    transcriber.close_slot(control.slot)
        except Exception as exc:
            error_id = new_error_id()
            log.error("backend failed to %s slot %d (error id %s)", control.op.value, control.slot, error_id,
                      exc_info=exc)
            if control.op is ControlOp.OPEN:
                self._step_failed()
                error = BackendStepError(error_id, "the model failed to open this session")
                error.__cause__ = exc
                return StepOutcome((control.owner,), (0,), None, None, time.perf_counter_ns(), error)
        return None

    def _set_persona(self, control: Control) -> StepOutcome:
        """``Backend.set_persona`` for one slot.  A refusal fails that session alone: a
        PersonaError goes to it as it is (its message is for the caller, and the model is not
        failing), anything else as a model failure with an error id; either way the slot's frames
        are dropped from then on, so none is stepped without its persona."""
        persona = control.payload
        assert isinstance(persona, Persona)  # the persona travels with its control
        error: BaseException
        try:
            self.backend.set_persona(control.slot, persona)
        except PersonaError as exc:
            log.info("the model refused the persona of slot %d: %s", control.slot, exc)
            error = exc
        except Exception as exc:
            error_id = new_error_id()
            log.error("backend failed to set the persona of slot %d (error id %s)", control.slot, error_id,
                      exc_info=exc)
            self._step_failed()
            error = BackendStepError(error_id, "the model failed to take this session's persona")
            error.__cause__ = exc
        else:
            return StepOutcome((control.owner,), (0,), None, None, time.perf_counter_ns(), persona_set=True)
        self._refused.add(control.slot)
        return StepOutcome((control.owner,), (0,), None, None, time.perf_counter_ns(), error)

    def _step(self, batch: Batch) -> StepOutcome:
        n = len(batch.rows)
        rows = self._rows[:n]
        inputs = self._inputs[:n]
        outputs = self._outputs[:n]
        # A plain memory copy per frame, holding the GIL: numpy would release and retake it for
        # every frame (it does for any array over 500 elements), and each release hands the GIL
        # to the busy trio thread and back: a context switch per frame (benchmarks/core.py counts them).
        flat = self._input_bytes
        size = self._frame_bytes
        offset = 0
        mark = self.end_of_input
        transcriber = self.transcriber
        for frame in batch.frames:
            flat[offset:offset + size] = frame.data.cast("B")
            offset += size
            if frame is mark:
                # The mark comes from a session when the model wants a flush (``flush_frames``),
                # or when a transcriber does (the caller's last words, after its delay).
                if self.backend.info.flush_frames:
                    self.backend.end_input(batch.rows[offset // size - 1])
                if transcriber is not None:
                    transcriber.end_input(batch.rows[offset // size - 1])
        rows[:] = batch.rows
        started = time.perf_counter_ns()
        transcripts = None
        try:
            texts = self.backend.step(rows, inputs, outputs)
            if transcriber is not None:
                # The same rows and frames, in the same thread: no crossing of its own; its
                # pieces ride in this step's outcome.
                transcripts = self._transcribe(transcriber, rows, inputs)
        except Exception as exc:
            stepped = time.perf_counter_ns()
            error_id = new_error_id()
            log.error("backend step failed for %d session(s) (error id %s)", n, error_id, exc_info=exc)
            self._step_failed()
            error = BackendStepError(error_id)
            error.__cause__ = exc
            outcome = StepOutcome(batch.owners, batch.stamps, None, None, stepped, error)
        else:
            stepped = time.perf_counter_ns()
            self._consecutive_failures = 0
            self.capacity.record(self.backend.stepped_rows or n, stepped - started)
            # The only per-step allocation: trio keeps these rows after the buffer is reused.
            stages = self.backend.last_stages
            if transcriber is not None:
                stages = (*stages, transcriber.last_stage)
            outcome = StepOutcome(batch.owners, batch.stamps, outputs.copy(), texts, stepped,
                                  stages=stages, transcripts=transcripts)
        self._steps += 1
        self._frames += n
        if n > self._max_batch:
            self._max_batch = n
        self._step_time.record(stepped - started)
        self.batch_sizes.record(n)
        return outcome

    def _transcribe(self, transcriber: Transcriber, rows: np.ndarray,
                    inputs: np.ndarray) -> Sequence[tuple[TranscriptPiece, ...]] | None:
        """The transcriber's step.  Its failure fails no call: the model's output goes out, that
        step's words are lost (None).  Said in the log with an error id when a run of failures
        starts, and when it ends; counted in ``transcriber_failures``."""
        try:
            transcripts = transcriber.step(rows, inputs)
        except Exception as exc:
            self.transcriber_failures += 1
            try:
                transcriber.missed(rows)
            except Exception:
                log.exception("the transcriber failed to skip a failed step's frames")
            if not self._transcriber_failing:
                self._transcriber_failing = True
                log.error("the transcriber failed a step of %d session(s) (error id %s); their calls go on "
                          "without those words", len(rows), new_error_id(), exc_info=exc)
            return None
        if self._transcriber_failing:
            self._transcriber_failing = False
            log.warning("the transcriber steps again, after %d failed step(s) in all", self.transcriber_failures)
        return transcripts

    def _step_failed(self) -> None:
        self._failed_steps += 1
        self._consecutive_failures += 1
        if self._consecutive_failures == self.max_consecutive_failures:
            log.error("the model failed %d steps in a row: not ready until a step works",
                      self._consecutive_failures)

    def _publish(self, outcomes: list[StepOutcome]) -> None:
        """Queue steps for trio; only the first of a run of undelivered steps crosses over."""
        with self._undelivered_lock:
            first = not self._undelivered
            self._undelivered += outcomes
        if first:
            self._to_trio(HandoffKind.OUTPUT_DELIVERY, self._take_deliveries)
