"""Prompt states kept for the next caller with the same persona.

A call centre serves one persona (or a few) to every caller: the state a prompt leaves depends
only on the model, the voice and the text (``prefill``), so it is computed for the first caller
and copied into every later caller's row, a copy of the prompt's positions of K/V instead of a
prefill.  The states live in device memory, bounded in bytes (``max_bytes``, counted by the
memory check and ``runtime.slots = "auto"``); the least recently used goes first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

import attrs

from duplexrt.backends.moshi.prefill import PromptState


@attrs.frozen
class CacheStatistics:
    hits: int
    misses: int
    entries: int
    bytes: int
    max_bytes: int
    evictions: int

    def as_dict(self) -> dict[str, int]:
        return attrs.asdict(self)


class PromptCache:
    """An LRU of ``PromptState`` by persona key, holding at most ``max_bytes`` (0: keeps none).
    Used on the scheduler thread only; ``statistics`` is read from trio as a frozen record."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Hashable, PromptState] = OrderedDict()
        self._bytes = 0
        self._hits = self._misses = self._evictions = 0
        self.statistics = self._snapshot()

    def _snapshot(self) -> CacheStatistics:
        return CacheStatistics(self._hits, self._misses, len(self._entries), self._bytes, self.max_bytes,
                               self._evictions)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def get(self, key: Hashable) -> PromptState | None:
        state = self._entries.get(key)
        if state is None:
            self._misses += 1
        else:
            self._hits += 1
            self._entries.move_to_end(key)
        self.statistics = self._snapshot()
        return state

    def put(self, key: Hashable, state: PromptState) -> None:
        """Keep ``state`` (one larger than the whole bound is not kept), evicting the least
        recently used until it fits."""
        size = state.nbytes
        if size > self.max_bytes or key in self._entries:
            return
        while self._entries and self._bytes + size > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.nbytes
            self._evictions += 1
        self._entries[key] = state
        self._bytes += size
        self.statistics = self._snapshot()

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0
        self.statistics = self._snapshot()
