"""``ServerStatistics``: the runtime's record plus what only the server knows (connections).

``/readyz``, ``/stats``, ``/metrics`` and the ``log_stats`` line all read this one record, so
they cannot disagree: in particular, slots free for new connections are counted once, here.
"""

from __future__ import annotations

import attrs

from duplexrt.runtime import RuntimeStatistics


@attrs.frozen
class ServerStatistics:
    """What the server's endpoints show, read at one moment on the trio thread."""

    #: This replica's name behind a balancer (``server.replica_id``, else host:port once bound).
    replica_id: str
    #: Shutdown has begun: no new session is admitted.
    draining: bool
    #: WebSocket connections admitted and not yet ended (handshakes under way included): what
    #: admission compares with the slots and the capacity limit.
    admitted: int
    #: Connections still sending their request head.
    pending_handshakes: int
    #: Connections refused before a session started, by reason.
    refused: dict[str, int]
    #: The runtime's own record.
    runtime: RuntimeStatistics
    #: Sessions whose connection dropped, waiting for a resume: a new caller that finds every
    #: slot taken ends the oldest of them and takes its slot, so they do not count as taken.
    detached: int = 0

    @property
    def in_use(self) -> int:
        """Sessions that hold a slot a new caller cannot have: admitted, less the detached ones."""
        return self.admitted - self.detached

    @property
    def free_slots(self) -> int:
        """Slots a new connection could still take: the slots less those in use.  A connection
        admitted but still in its handshake holds no row yet, and counts as taken here."""
        return self.runtime.slots - self.in_use

    @property
    def not_ready_reason(self) -> str | None:
        """Why a balancer should send new clients elsewhere, or None when this replica takes them.

        A model failing every step is not ready; new sessions are still admitted (docs/operator.md, Serving: a
        step that works is what clears it, and only a session can bring one)."""
        return self.not_serving_reason or self.full_reason

    @property
    def not_serving_reason(self) -> str | None:
        """Why this replica takes no new session whatever its load (``/readyz?full=ok``), or None."""
        runtime = self.runtime
        if not runtime.ready:
            return "model_not_loaded"
        if self.draining:
            return "draining"
        if runtime.failing:
            return "model_failing"
        return None

    @property
    def full_reason(self) -> str | None:
        """``no_free_slot`` or ``at_capacity`` while every session it can carry is in use."""
        if self.free_slots <= 0:
            return "no_free_slot"
        if self.in_use >= self.runtime.capacity.limit:
            return "at_capacity"
        return None
