"""Every crossing between the trio thread and any other thread, counted by kind.

The runtime's promise is that only two things ever move work off the trio thread per frame:
decoding an encoded format and submitting into a full inbox (and, once per ended call at most,
appending its transcript to a file).  That promise is only worth something if it can be
checked, so nothing in duplexrt calls ``trio.to_thread`` or ``TrioToken.run_sync_soon`` or signals
the scheduler thread except through this module, which counts each crossing by kind
(tests/test_thread_crossings.py reads the source for any other crossing: only the scheduler's
own module starts its thread, and interrupts its load).

Offloads and deliveries are counted on the trio thread (a delivery when it *arrives* in trio), so
those counters have a single writer and need no lock.  A scheduler wake can also come from a worker
thread (a blocked put that finally lands), so wakes are counted under a lock of their own.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import trio

T = TypeVar("T")


class HandoffKind(enum.Enum):
    """Why a piece of work crossed a thread boundary."""

    #: Decoding an encoded format (Opus) on a worker thread: expected, once per message.
    DECODE_OFFLOAD = "decode_offload"
    #: Decoding a PCM or G.711 message of more than a second of audio (base64 JSON, a big
    #: binary message) on a worker thread: rare, real-time clients send 20-100 ms per message.
    LARGE_DECODE_OFFLOAD = "large_decode_offload"
    #: A submit found its slot's inbox full and waited on a worker thread: backpressure.
    FULL_INBOX_OFFLOAD = "full_inbox_offload"
    #: ``offload = "always"`` only: a PCM conversion that could have run inline.
    CONVERT_OFFLOAD = "convert_offload"
    #: ``offload = "always"`` only: a submit that could have been a non-blocking append.
    SUBMIT_OFFLOAD = "submit_offload"
    #: Appending ended calls' transcripts to the day's file (``[transcripts] sink``): at most one
    #: per ended call, fewer when calls end together (``transcripts/sink.py``).
    TRANSCRIPT_WRITE = "transcript_write"
    #: The trio thread woke the sleeping scheduler thread.
    SCHEDULER_WAKE = "scheduler_wake"
    #: The scheduler thread handed one whole step's outputs to trio.
    OUTPUT_DELIVERY = "output_delivery"
    #: The scheduler thread told trio about its own life (started, stopped, failed).
    LIFECYCLE = "lifecycle"


#: Kinds that run a function on a worker thread (``trio.to_thread``): "executor submissions".
OFFLOAD_KINDS = frozenset(
    {
        HandoffKind.DECODE_OFFLOAD,
        HandoffKind.LARGE_DECODE_OFFLOAD,
        HandoffKind.FULL_INBOX_OFFLOAD,
        HandoffKind.CONVERT_OFFLOAD,
        HandoffKind.SUBMIT_OFFLOAD,
        HandoffKind.TRANSCRIPT_WRITE,
    }
)


@attrs.frozen
class HandoffStatistics:
    """A snapshot of the counters: ``by_kind`` maps each kind's value to its count."""

    by_kind: dict[str, int]
    #: Functions run on a worker thread (the OFFLOAD_KINDS together): "executor submissions".
    offloads: int

    def __getitem__(self, kind: HandoffKind) -> int:
        return self.by_kind[kind.value]


class Handoffs:
    """The one gateway for thread crossings, with its counters.

    One instance belongs to one runtime (one trio run), so that tests running several runtimes see
    only their own counts.
    """

    def __init__(self) -> None:
        self._counts: dict[HandoffKind, int] = dict.fromkeys(HandoffKind, 0)
        # Crossings counted off the trio thread (a wake from a blocked put) get their own lock.
        self._foreign_lock = threading.Lock()
        self._foreign_counts: dict[HandoffKind, int] = dict.fromkeys(HandoffKind, 0)
        self._limiter = trio.CapacityLimiter(64)

    def count_from_any_thread(self, kind: HandoffKind) -> None:
        """Record a crossing from a thread that may not be trio's."""
        with self._foreign_lock:
            self._foreign_counts[kind] += 1

    async def offload(self, kind: HandoffKind, fn: Callable[..., T], *args: Any,
                      abandon_on_cancel: bool = False) -> T:
        """Run ``fn(*args)`` on a worker thread.  ``fn`` must only touch what it is given.

        By default a cancellation waits for ``fn`` to return, so nothing it does can happen after
        the caller has moved on.  ``abandon_on_cancel`` returns at once instead, leaving the thread
        running: only for a call that may wait unboundedly, and whose caller can settle, once it
        is abandoned, whether its effect happened (a full-inbox put, withdrawn by its ticket).
        """
        if kind not in OFFLOAD_KINDS:
            raise ValueError(f"{kind} is not an offload kind")
        self._counts[kind] += 1
        return await trio.to_thread.run_sync(
            fn, *args, limiter=self._limiter, abandon_on_cancel=abandon_on_cancel
        )

    def deliver_from_thread(self, token: trio.lowlevel.TrioToken, kind: HandoffKind,
                            fn: Callable[..., object], *args: Any) -> bool:
        """Called on a foreign thread: run ``fn(*args)`` soon on the trio thread.

        ``fn`` must never raise (a raise inside ``run_sync_soon`` takes trio down), so it is
        wrapped; a crash in it is reported to the log instead.  Returns False when trio has
        already finished, so the caller can stop producing.
        """
        try:
            token.run_sync_soon(self._arrive, kind, fn, args)
        except trio.RunFinishedError:
            return False
        return True

    def _arrive(self, kind: HandoffKind, fn: Callable[..., object], args: tuple[Any, ...]) -> None:
        self._counts[kind] += 1
        try:
            fn(*args)
        except BaseException:  # noqa: BLE001 - a raise here would crash the whole trio run
            logging.getLogger("duplexrt.handoffs").exception("delivery callback failed")

    def statistics(self) -> HandoffStatistics:
        with self._foreign_lock:
            by_kind = {kind.value: n + self._foreign_counts[kind] for kind, n in self._counts.items()}
        offloads = sum(by_kind[k.value] for k in OFFLOAD_KINDS)
        return HandoffStatistics(by_kind=by_kind, offloads=offloads)
