"""Ended calls' transcripts, kept for a while to be fetched by id (``GET /v1/transcripts/{id}``).

Bounded three ways (``[transcripts]``): by age (``keep_seconds``), by count (``max_calls``) and
by the bytes of their JSON (``max_bytes``); over a bound, the oldest go first.  A record is kept as
the JSON it is served as, so what it costs is exactly its length.  Expiry is lazy (checked when a
record is kept or fetched), so nothing runs on a timer; the clock is injectable (trio's by default,
so a test's ``autojump_clock`` moves it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import trio


class TranscriptStore:
    """Ended calls' JSON by id, oldest first.  Trio thread only."""

    def __init__(self, keep_seconds: float, max_calls: int, max_bytes: int,
                 clock: Callable[[], float] = trio.current_time) -> None:
        self.keep_seconds = keep_seconds
        self.max_calls = max_calls
        self.max_bytes = max_bytes
        self._clock = clock
        self._kept: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        #: Bytes of JSON held now.
        self.bytes = 0
        #: Records let go for a bound (age, count, bytes), and those too big to keep at all.
        self.evicted = 0
        self.too_big = 0

    @property
    def enabled(self) -> bool:
        return self.keep_seconds > 0 and self.max_calls > 0 and self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, call_id: str, body: bytes) -> bool:
        """Keep ``body`` under ``call_id``; False when it alone is over ``max_bytes`` (not kept)."""
        if not self.enabled:
            return False
        if len(body) > self.max_bytes:
            self.too_big += 1
            return False
        self._forget(call_id)
        self._kept[call_id] = (self._clock() + self.keep_seconds, body)
        self.bytes += len(body)
        self._expire()
        while len(self._kept) > self.max_calls or self.bytes > self.max_bytes:
            self._drop_oldest()
        return True

    def get(self, call_id: str) -> bytes | None:
        """The record's JSON, or None: unknown, expired or evicted (the same to a caller)."""
        self._expire()
        kept = self._kept.get(call_id)
        return kept[1] if kept is not None else None

    def _expire(self) -> None:
        now = self._clock()
        while self._kept and next(iter(self._kept.values()))[0] <= now:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        _, (_, body) = self._kept.popitem(last=False)
        self.bytes -= len(body)
        self.evicted += 1

    def _forget(self, call_id: str) -> None:
        kept = self._kept.pop(call_id, None)
        if kept is not None:
            self.bytes -= len(kept[1])
