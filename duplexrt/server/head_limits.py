"""The limits on a request head, checked on the bytes as they arrive, before h11 parses them.

h11 parses a head only once the whole of it is there, and its cost grows with the number of
header lines: a 60 KiB head of thousands of tiny headers holds the trio thread (every session's)
for milliseconds, before the API key is even looked at.  So the lines are counted first, which
costs next to nothing (one ``bytes.count``), and a head with more than ``MAX_HEADER_FIELDS`` is
refused unparsed.  The size limit is checked here too, on the head itself (up to its blank line,
not the WebSocket frames a client may send right behind it), so it holds exactly, whatever the
size of the reads that brought it.  ``HeadScan`` does both on the bytes as they arrive, each
looked at once (a head sent a few bytes at a time costs its length, not its length squared).
``benchmarks/big_heads.py`` measures what a flood of big
heads does to a paced session beside it.
"""

from __future__ import annotations

import re

__all__ = ["MAX_HEAD_BYTES", "MAX_HEADER_FIELDS", "HeadScan", "head_limit_error"]

#: A request head larger than this is refused (431): nothing legitimate needs more.
MAX_HEAD_BYTES = 64 * 1024
#: Header fields a request may have (Apache's default too); a browser sends about 20.
MAX_HEADER_FIELDS = 100

#: Where a head ends, as h11 finds it: a blank line, with or without its CR.
_BLANK_LINE = re.compile(rb"\n\r?\n")


def head_limit_error(received: bytes | bytearray) -> str | None:
    """Why the request head read so far (``received``: every byte of the connection so far) is
    refused with 431, or None while it is within the limits."""
    end = _BLANK_LINE.search(received, 0, MAX_HEAD_BYTES + 2)
    size = end.start() + 1 if end is not None else len(received)
    if size > MAX_HEAD_BYTES:
        return f"request head too large (more than {MAX_HEAD_BYTES} bytes)"
    # Lines up to the end: the request line, then one per field (a folded field counts twice,
    # which only makes the limit stricter for a form no client sends any more).
    if received.count(b"\n", 0, size) - 1 > MAX_HEADER_FIELDS:
        return f"request head has too many header fields (more than {MAX_HEADER_FIELDS})"
    return None


class HeadScan:
    """``head_limit_error`` for a head that arrives in pieces: ``check(received)`` after each
    piece (``received``: every byte so far, the last piece at its end) says the same as
    ``head_limit_error(received)``, but looks only at the new bytes (and the two before them, where
    a blank line may begin).  ``examined``: the bytes looked at so far."""

    def __init__(self) -> None:
        self._scanned = 0  # bytes whose newlines are counted
        self._newlines = 0
        self._size: int | None = None  # the head's size, once its blank line is found
        self.examined = 0

    def check(self, received: bytes | bytearray) -> str | None:
        if self._size is None:
            start = max(0, self._scanned - 2)
            stop = min(len(received), MAX_HEAD_BYTES + 2)
            end = _BLANK_LINE.search(received, start, stop) if stop > start else None
            self.examined += max(0, stop - start)
            if end is not None:
                self._size = end.start() + 1
                if self._size < self._scanned:  # counted a newline of the blank line past the head
                    self._newlines -= received.count(b"\n", self._size, self._scanned)
                    self._scanned = self._size
            size = self._size if self._size is not None else len(received)
            if size > self._scanned:
                self._newlines += received.count(b"\n", self._scanned, size)
                self.examined += size - self._scanned
                self._scanned = size
        size = self._size if self._size is not None else len(received)
        if size > MAX_HEAD_BYTES:
            return f"request head too large (more than {MAX_HEAD_BYTES} bytes)"
        if self._newlines - 1 > MAX_HEADER_FIELDS:
            return f"request head has too many header fields (more than {MAX_HEADER_FIELDS})"
        return None
