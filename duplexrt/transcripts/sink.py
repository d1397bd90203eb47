"""``[transcripts] sink = "jsonl"``: each ended call's transcript as one JSON line, appended to
``transcripts-YYYY-MM-DD.jsonl`` (the UTC day the call ended) in ``[transcripts] directory``.

The trio thread never touches the disk: an ended call's line goes into a bounded channel (no
wait; a full one drops the line, counted and logged once), and one background task takes what
has gathered and appends it in one worker-thread call (``HandoffKind.TRANSCRIPT_WRITE``): at most
one thread crossing per ended call, fewer when calls end together, none per frame.  A disk that
fails (full, no permission, gone) is logged once, the lines of that batch counted as lost; no
call waits on it or hears of it.  Files are created ``0600`` and the directory ``0700``: they
hold what callers said.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path

import trio

from duplexrt.core.handoffs import HandoffKind, Handoffs

log = logging.getLogger("duplexrt.transcripts")

#: Lines waiting for the writer at most: past it an ended call's line is dropped, not waited for.
MAX_PENDING_LINES = 1024
#: How long the last lines get to reach the disk when the runtime stops.
FINAL_WRITE_TIMEOUT_S = 5.0


def file_name(ended: float) -> str:
    """The day file for a call that ended at wall-clock ``ended`` (UTC)."""
    return f"transcripts-{datetime.fromtimestamp(ended, UTC):%Y-%m-%d}.jsonl"


def append_lines(directory: str, by_file: Mapping[str, list[bytes]]) -> None:
    """On a worker thread: append each file's lines (each ending in a newline), creating the
    directory (0700) and the files (0600) as needed.  Raises OSError as the disk does."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    for name, lines in by_file.items():
        fd = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            data = b"".join(lines)
            while data:
                written = os.write(fd, data)
                data = data[written:]
        finally:
            os.close(fd)


class JsonlSink:
    """The writer of ended calls' lines: ``submit`` on the trio thread, ``run`` as a task."""

    def __init__(self, directory: str | Path, handoffs: Handoffs) -> None:
        self.directory = str(directory)
        self._handoffs = handoffs
        self._send, self._receive = trio.open_memory_channel[tuple[float, bytes]](MAX_PENDING_LINES)
        #: Lines written, and lines lost (the channel full, or the disk failed).
        self.written = 0
        self.lost = 0
        #: Worker-thread calls made (each carries every line gathered by then).
        self.writes = 0
        self._failing = False
        self._dropping = False

    def submit(self, ended: float, line: bytes) -> None:
        """Queue one call's line (ending in a newline); never waits."""
        try:
            self._send.send_nowait((ended, line))
        except trio.WouldBlock:
            self.lost += 1
            if not self._dropping:
                self._dropping = True
                log.warning("transcripts: the writer is %d lines behind; ended calls' transcripts are "
                            "dropped until it catches up", MAX_PENDING_LINES)

    async def run(self) -> None:
        """Write what arrives until cancelled, then what is left (bounded)."""
        try:
            while True:
                first = await self._receive.receive()
                await self._write([first, *self._gathered()])
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(FINAL_WRITE_TIMEOUT_S):
                left = self._gathered()
                if left:
                    await self._write(left)

    def _gathered(self) -> list[tuple[float, bytes]]:
        lines = []
        while True:
            try:
                lines.append(self._receive.receive_nowait())
            except trio.WouldBlock:
                return lines

    async def _write(self, lines: list[tuple[float, bytes]]) -> None:
        by_file: dict[str, list[bytes]] = {}
        for ended, line in lines:
            by_file.setdefault(file_name(ended), []).append(line)
        self.writes += 1
        self._dropping = False
        try:
            await self._handoffs.offload(HandoffKind.TRANSCRIPT_WRITE, append_lines, self.directory, by_file)
        except Exception as exc:  # noqa: BLE001 - whatever the disk does, no call may hear of it
            self.lost += len(lines)
            if not self._failing:
                self._failing = True
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
                log.error("transcripts: cannot write to %s (%s); transcripts are lost until it can be "
                          "written again", self.directory, reason)
            return
        if self._failing:
            self._failing = False
            log.info("transcripts: writing to %s again", self.directory)
        self.written += len(lines)
