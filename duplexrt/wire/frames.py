"""RFC 6455 framing without I/O: a parser that turns received bytes into whole messages and control
frames, and the few helpers that frame outgoing ones.

Why our own and not wsproto's: at 12.5 messages a second per session, the cost that matters is the
machinery per message, not the protocol.  wsproto unmasks a byte at a time in Python and builds an
event object per frame; here a message's payload is unmasked and copied out in one pass by
websockets' C ``apply_mask`` (one numpy XOR over 32-bit words where that extension is missing),
a frame header is one ``struct`` call, and a buffer that holds several frames is parsed in one go.
The socket reads straight into the parser's own buffer (``room`` and ``received``), which lives as
long as the connection: no bytes object per read, no copy into the buffer, and the unmasking works
on memory the read has just touched.
No extension is ever negotiated (the handshake offers none), so every reserved bit must be 0.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from enum import IntEnum
from typing import Any

import numpy as np

from duplexrt.reasons import CloseCode

#: websockets' C ``apply_mask``: one call that XORs and copies in one pass, where a numpy XOR in
#: place and a copy out cost about twice as much in a loaded server, whose numpy calls run cold
#: between messages (what each costs there: ``benchmarks/profile_server.py``).  None without
#: websockets' C extension: numpy does it then.  It takes any buffer, whatever its stub says.
_apply_mask: Callable[[Any, Any], bytes] | None
try:
    from websockets.speedups import apply_mask
    _apply_mask = apply_mask
except ImportError:  # websockets built without its C extension
    _apply_mask = None
#: What ``apply_mask`` takes as it is; any other buffer (a numpy array) goes in as a memoryview.
_MASKABLE = (bytes, bytearray, memoryview)


class Opcode(IntEnum):
    CONTINUATION = 0x0
    TEXT = 0x1
    BINARY = 0x2
    CLOSE = 0x8
    PING = 0x9
    PONG = 0xA


_DATA = (Opcode.TEXT, Opcode.BINARY)
_KNOWN = frozenset(int(op) for op in Opcode)
#: Close codes a peer may send (RFC 6455 7.4.1 and 7.4.2): the rest are a protocol error.
_SENDABLE_CODES = frozenset({1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011, 1012, 1013, 1014})
#: Below this, XOR with Python integers beats numpy's call overhead.
_NUMPY_FROM = 64
#: The receive buffer between large messages: two 80 ms frames of float32 audio and their
#: headers fit, so a paced client's message arrives in one read; kept for the connection's life.
BUFFER_SIZE = 1 << 14
#: A read is offered at least this much room: below it, the unparsed bytes move to the front.
MIN_ROOM = 1 << 12
#: The most frames one message may come in (its first and its continuations): every fragment is
#: a bytes object kept until the message ends, so a peer sending empty or one-byte continuations
#: would otherwise hold memory out of all proportion to what the size limit counts.  Ample for any
#: real client (browsers and the common libraries send a message in one frame, or in frames of
#: kilobytes); the refusal is a 1009, like a message over the size limit.
MAX_FRAGMENTS = 1024
#: A mask key as the native 32-bit word the payload is XORed with, four bytes at a time.
_MASK = struct.Struct("=I")

_H16 = struct.Struct("!BBH")
_H64 = struct.Struct("!BBQ")


class FrameError(Exception):
    """The peer broke the protocol: the connection must close with ``code``."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason


class Ping(bytes):
    """A ping's payload: answer with a pong carrying it."""


class Pong(bytes):
    """A pong's payload."""


class Close:
    """The peer's Close frame: its code (1005 when it gave none) and reason."""

    __slots__ = ("code", "reason")

    def __init__(self, code: int, reason: str) -> None:
        self.code = code
        self.reason = reason

    def __repr__(self) -> str:
        return f"Close({self.code}, {self.reason!r})"


Event = bytes | str | Ping | Pong | Close


def unmask(data: bytes | bytearray | memoryview, mask: bytes) -> bytes:
    """``data`` XOR the repeated 4-byte ``mask`` (masking and unmasking are the same)."""
    if type(data) not in _MASKABLE:
        data = memoryview(data).cast("B")
    if _apply_mask is not None:
        return _apply_mask(data, mask)
    size = len(data)
    if size < _NUMPY_FROM:
        key = (mask * ((size >> 2) + 1))[:size]
        return (int.from_bytes(data, "little") ^ int.from_bytes(key, "little")).to_bytes(size, "little")
    words = size >> 2
    out = (np.frombuffer(data, np.uint32, words) ^ np.frombuffer(mask, np.uint32)[0]).tobytes()
    if size & 3:
        out += bytes(b ^ m for b, m in zip(bytes(data[words * 4:]), mask))
    return out


def frame_header(opcode: int, size: int, mask: bytes | None = None) -> bytes:
    """The header of one final frame of ``size`` bytes (with ``mask`` appended when given)."""
    first = 0x80 | opcode
    masked = 0x80 if mask is not None else 0
    if size < 126:
        header = bytes((first, masked | size))
    elif size < 1 << 16:
        header = _H16.pack(first, masked | 126, size)
    else:
        header = _H64.pack(first, masked | 127, size)
    return header + mask if mask is not None else header


def masked_frame_parts(opcode: int, payload: bytes | bytearray | memoryview, mask: bytes) -> tuple[bytes | bytearray, bytes]:
    """A client's frame for one writev: its header, and its payload masked (one copy, in C); or,
    without websockets' C extension, the whole frame in one buffer (``masked_frame``) and b""."""
    if type(payload) not in _MASKABLE:
        payload = memoryview(payload)
    if _apply_mask is None:
        return masked_frame(opcode, payload, mask), b""
    if type(payload) is memoryview and payload.format != "B":
        payload = payload.cast("B")  # counted in bytes below
    return frame_header(opcode, len(payload), mask), _apply_mask(payload, mask)


def masked_frame(opcode: int, payload: bytes | bytearray | memoryview, mask: bytes) -> bytes | bytearray:
    """A client's frame: the header, then the payload masked straight into the same buffer (one
    copy of the payload, where header + ``unmask`` made three)."""
    if type(payload) is memoryview and payload.format != "B":
        payload = payload.cast("B")  # sliced by bytes below
    size = len(payload)
    header = frame_header(opcode, size, mask)
    if size < _NUMPY_FROM:
        return header + unmask(payload, mask)
    start = len(header)
    out = bytearray(start + size)
    out[:start] = header
    words = size >> 2
    # The header is 8 bytes for the usual 126..65535-byte message: the words are aligned then.
    np.bitwise_xor(np.frombuffer(payload, np.uint32, words), np.frombuffer(mask, np.uint32)[0],
                   out=np.frombuffer(out, np.uint32, words, start))
    if size & 3:
        at = words * 4
        out[start + at:] = bytes(b ^ m for b, m in zip(bytes(payload[at:]), mask))
    return out


class MaskKeys:
    """A client connection's masking keys: from the system's random source, as RFC 6455 asks (a
    page script must not predict them), but ``batch`` keys a draw instead of a syscall a frame."""

    __slots__ = ("_batch", "_pool", "_at")

    def __init__(self, batch: int = 256) -> None:
        self._batch = batch
        self._pool = b""
        self._at = 0

    def next(self) -> bytes:
        at = self._at
        if at >= len(self._pool):
            self._pool = os.urandom(4 * self._batch)
            at = 0
        self._at = at + 4
        return self._pool[at:at + 4]


def frame(opcode: int, payload: bytes, *, masked: bool = False) -> bytes:
    """One whole final frame: what a client (``masked``) or a server puts on the wire."""
    if masked:
        mask = os.urandom(4)
        return frame_header(opcode, len(payload), mask) + unmask(payload, mask)
    return frame_header(opcode, len(payload)) + payload


def close_payload(code: int, reason: str = "") -> bytes:
    """A Close frame's payload; the reason is cut to fit a control frame (125 bytes)."""
    if code in (1005, CloseCode.ABNORMAL_CLOSURE):  # reserved: "no code", "dropped"
        return b""
    encoded = reason.encode()[:123].decode("utf-8", "ignore").encode()
    return struct.pack("!H", code) + encoded


class FrameParser:
    """Bytes in (``feed``), events out (``next``): whole messages (``bytes`` for binary, ``str``
    for text), ``Ping``, ``Pong`` and ``Close``.  Raises ``FrameError`` on anything a peer must
    not send; after that the parser is spent.

    ``masked``: what the peer must do (a server's peers mask, a client's do not).
    ``max_message``: the largest message, summed over its fragments; one announced larger is
    refused (1009) from its header, before its payload is buffered.  ``max_fragments``: the most
    frames a message may come in, checked with the size, from the header of the one too many."""

    def __init__(self, *, masked: bool, max_message: int, max_fragments: int = MAX_FRAGMENTS) -> None:
        self._masked = masked
        self._max = max_message
        self._max_fragments = max_fragments
        self._allocate(BUFFER_SIZE, b"")
        #: Received bytes not yet parsed: ``_buffer[_pos:_end]``.
        self._pos = 0
        self._end = 0
        #: Bytes from ``_pos`` that the frame under way needs in all (0: not known yet).
        self._need = 0
        #: A fragmented message under way: its opcode and the fragments so far.
        self._opcode: int | None = None
        self._fragments: list[bytes] = []
        self._size = 0

    def _allocate(self, size: int, unparsed: bytes | bytearray | memoryview) -> None:
        # The buffer is replaced, never resized: the views below stay valid for its whole life,
        # and slicing one costs less than making a view per frame in a loaded server, where each
        # numpy call costs several times what a tight loop says (``benchmarks/profile_server.py``).
        buffer = bytearray((size + 63) & ~63)  # whole 32-bit words, for the word view
        buffer[:len(unparsed)] = unparsed
        self._buffer = buffer
        self._view = memoryview(buffer)
        self._words = np.frombuffer(buffer, np.uint32)

    @property
    def buffered(self) -> int:
        """Bytes received and not yet parsed into an event."""
        return self._end - self._pos

    @property
    def held(self) -> int:
        """Bytes of the peer's this parser keeps: those not yet parsed, and the fragments of a
        message under way."""
        return self._end - self._pos + self._size

    def room(self, at_least: int = MIN_ROOM) -> memoryview:
        """Where the next read goes: at least ``at_least`` bytes at the end of the buffer (more
        when the frame under way needs it).  Tell ``received`` how many were written there.

        The buffer grows for a large frame at most twice over per read, as its bytes arrive, so
        a header that announces a large frame reserves no more than has been sent; once the
        frame is parsed and no more than ``BUFFER_SIZE`` is asked for, it returns to that size."""
        pos = self._pos
        unparsed = self._end - pos
        capacity = len(self._buffer)
        if not unparsed:
            if capacity > BUFFER_SIZE and not self._need and at_least <= BUFFER_SIZE:
                self._allocate(BUFFER_SIZE, b"")
                capacity = BUFFER_SIZE
            pos = self._pos = self._end = 0
        space = unparsed + max(at_least, min(self._need - unparsed, unparsed))
        if pos + space > capacity:
            if space <= capacity:
                view = self._view
                view[:unparsed] = view[pos:pos + unparsed].tobytes()
            else:
                self._allocate(max(space, 2 * capacity), self._view[pos:pos + unparsed])
            self._pos = 0
            self._end = unparsed
        return self._view[self._end:]

    def received(self, count: int) -> None:
        """``count`` bytes were written at the start of the last ``room``."""
        self._end += count

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Bytes received some other way (those that came with the handshake)."""
        size = len(data)
        self.room(size)[:size] = data
        self._end += size

    def next(self) -> Event | None:
        """The next whole event, or None until more bytes arrive."""
        while True:
            buffer = self._buffer
            pos = self._pos
            available = self._end - pos
            if available < 2:
                self._wait(0)
                return None
            first = buffer[pos]
            second = buffer[pos + 1]
            if first & 0x70:
                raise FrameError(CloseCode.PROTOCOL_ERROR, "reserved bits set (no extension was negotiated)")
            opcode = first & 0x0F
            if opcode not in _KNOWN:
                raise FrameError(CloseCode.PROTOCOL_ERROR, f"unknown opcode {opcode:#x}")
            if bool(second & 0x80) != self._masked:
                raise FrameError(CloseCode.PROTOCOL_ERROR,
                                 "client frames must be masked" if self._masked else "server frames must not be masked")
            size = second & 0x7F
            start = pos + 2
            if size == 126:
                if available < 4:
                    self._wait(0)
                    return None
                size = (buffer[pos + 2] << 8) | buffer[pos + 3]
                start = pos + 4
            elif size == 127:
                if available < 10:
                    self._wait(0)
                    return None
                size = int.from_bytes(buffer[pos + 2:pos + 10], "big")
                if size >> 63:
                    raise FrameError(CloseCode.PROTOCOL_ERROR, "frame length has its top bit set")
                start = pos + 10
            fin = first & 0x80
            if opcode >= 0x8:
                if not fin or size > 125:
                    raise FrameError(CloseCode.PROTOCOL_ERROR, "control frames must be final and at most 125 bytes")
            elif opcode == Opcode.CONTINUATION:
                if self._opcode is None:
                    raise FrameError(CloseCode.PROTOCOL_ERROR, "continuation frame with no message under way")
                if self._size + size > self._max or len(self._fragments) >= self._max_fragments:
                    raise self._too_big(size)
            else:
                if self._opcode is not None:
                    raise FrameError(CloseCode.PROTOCOL_ERROR, "new message before the last one's final frame")
                if size > self._max:
                    raise FrameError(CloseCode.MESSAGE_TOO_BIG, f"message larger than {self._max} bytes")
            if self._masked:
                start += 4
                end = start + size
                if self._end < end:
                    self._wait(end - pos)
                    return None
                payload = self._unmask(start, size)
            else:
                end = start + size
                if self._end < end:
                    self._wait(end - pos)
                    return None
                payload = bytes(self._view[start:end])
            self._need = 0
            # All parsed: the next read starts at the front again (and 4-byte aligned).
            if end == self._end:
                self._pos = self._end = 0
            else:
                self._pos = end
            if opcode >= 0x8:
                return self._control(opcode, payload)
            if opcode == Opcode.CONTINUATION:
                self._fragments.append(payload)
                self._size += size
                if not fin:
                    continue
                opcode = self._opcode  # type: ignore[assignment]  # set: a continuation needs one (checked above)
                payload = b"".join(self._fragments)
                self._opcode = None
                self._fragments = []
                self._size = 0
            elif not fin:
                self._opcode = opcode
                self._fragments = [payload]
                self._size = size
                continue
            if opcode == Opcode.BINARY:
                return payload
            try:
                return payload.decode()
            except UnicodeDecodeError:
                raise FrameError(CloseCode.INVALID_PAYLOAD, "text message is not valid UTF-8") from None

    def _too_big(self, size: int) -> FrameError:
        """A continuation of ``size`` bytes that takes its message past a limit: which one."""
        if self._size + size > self._max:
            return FrameError(CloseCode.MESSAGE_TOO_BIG, f"message larger than {self._max} bytes")
        return FrameError(CloseCode.MESSAGE_TOO_BIG, f"message in more than {self._max_fragments} fragments")

    def _unmask(self, start: int, size: int) -> bytes:
        """The payload of ``size`` bytes at ``start`` (its mask just before it), unmasked, as
        bytes: websockets' ``apply_mask``, or else one XOR over 32-bit words of the buffer where
        it lies and one copy out (the buffer is parsed once, so changing it loses nothing)."""
        if _apply_mask is not None:
            view = self._view
            return _apply_mask(view[start:start + size], view[start - 4:start])
        buffer = self._buffer
        if size < _NUMPY_FROM:
            return unmask(self._view[start:start + size], bytes(self._view[start - 4:start]))
        whole = size & ~3
        if start & 3:  # a payload not on a word boundary (a header of 2 or 10 bytes before it)
            words = np.frombuffer(buffer, np.uint32, whole >> 2, start)
        else:  # the usual case: a slice of the long-lived word view, the cheapest way in
            words = self._words[start >> 2:(start + whole) >> 2]
        words ^= _MASK.unpack_from(buffer, start - 4)[0]
        if whole != size:
            for i in range(start + whole, start + size):
                buffer[i] ^= buffer[start - 4 + ((i - start) & 3)]
        return bytes(self._view[start:start + size])

    def _wait(self, need: int) -> None:
        """No whole event yet: remember how many bytes from ``_pos`` the frame under way needs
        (0: its header is not complete), so that ``room`` can make space for all of it."""
        self._need = need
        return None

    def _control(self, opcode: int, payload: bytes) -> Event:
        if opcode == Opcode.PING:
            return Ping(payload)
        if opcode == Opcode.PONG:
            return Pong(payload)
        if not payload:
            return Close(1005, "")
        if len(payload) == 1:
            raise FrameError(CloseCode.PROTOCOL_ERROR, "a Close payload of one byte")
        code = (payload[0] << 8) | payload[1]
        if code not in _SENDABLE_CODES and not 3000 <= code <= 4999:
            raise FrameError(CloseCode.PROTOCOL_ERROR, f"close code {code} may not be sent")
        try:
            reason = payload[2:].decode()
        except UnicodeDecodeError:
            raise FrameError(CloseCode.INVALID_PAYLOAD, "close reason is not valid UTF-8") from None
        return Close(code, reason)
