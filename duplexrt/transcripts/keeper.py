"""Where an ended call's transcript goes: the store (to be fetched) and the sink (a file).

One object per runtime, built from ``[transcripts]``; a session hands it its record once, when it
ends, on the trio thread.  The record is turned into JSON once, there, and shared by both.
"""

from __future__ import annotations

import json

import trio

from duplexrt.config import TranscriptsConfig
from duplexrt.core.handoffs import Handoffs
from duplexrt.transcripts.ids import new_call_id
from duplexrt.transcripts.record import CallTranscript
from duplexrt.transcripts.sink import JsonlSink
from duplexrt.transcripts.store import TranscriptStore


class Transcripts:
    """The runtime's transcripts: ``keep`` an ended call's; ``store`` and ``sink`` to read."""

    def __init__(self, config: TranscriptsConfig, handoffs: Handoffs) -> None:
        self.config = config
        self.store = TranscriptStore(config.keep_seconds, config.max_calls, config.max_bytes)
        self.sink = JsonlSink(config.directory, handoffs) if config.sink == "jsonl" else None

    def record(self, call_id: str | None, route: str, frame_ms: float) -> CallTranscript:
        """A new call's record, bounded by ``max_chars_per_call``; ``call_id`` the id its client
        was told, None on a route that tells none (a fresh id then, for the sink's line only)."""
        return CallTranscript(call_id or new_call_id(), route, frame_ms, self.config.max_chars_per_call,
                              fetchable=call_id is not None)

    def keep(self, record: CallTranscript) -> None:
        """An ended call's record: kept to be fetched, and queued for the file."""
        body = json.dumps(record.as_dict(), separators=(",", ":")).encode()  # ASCII: any text survives
        if self.config.kept and record.fetchable:
            self.store.keep(record.call_id, body)
        if self.sink is not None:
            self.sink.submit(record.ended or 0.0, body + b"\n")

    async def run(self) -> None:
        """The sink's writer, if there is one; else nothing to do."""
        if self.sink is not None:
            await self.sink.run()
        else:
            await trio.sleep_forever()
