"""Base64 for the audio inside JSON events, both ways, at the cost of a memory copy.

Every 80 ms frame on a JSON route is base64: about 5 kB decoded from each append and 5 kB
encoded into each delta.  CPython's ``binascii`` does that a character at a time; ``pybase64`` (a
declared dependency) does it with SIMD, many times faster (the translator's share of a frame:
``benchmarks/profile_server.py`` on ``/v1/realtime``).  ``binascii`` stays the reference: where
``pybase64`` is missing it does the work, and where ``pybase64`` refuses a text it has the last
word, so a client sees exactly what ``binascii``'s strict mode accepts (``pybase64`` accepts less:
never a text that ``binascii`` would refuse or read differently, as tests/test_b64codec.py checks).
"""

from __future__ import annotations

from binascii import a2b_base64, b2a_base64
from collections.abc import Callable

__all__ = ["decode", "decode_strict", "encode"]

_fast_decode: Callable[..., bytes] | None
_fast_encode: Callable[..., str] | None
try:
    from pybase64 import b64decode as _fast_decode
    from pybase64 import b64encode_as_string as _fast_encode
except ImportError:  # pragma: no cover - the dependency is declared; this keeps a bare install working
    _fast_decode = None
    _fast_encode = None


def decode_strict(text: str) -> bytes:
    """``binascii.a2b_base64(text, strict_mode=True)``: the same bytes, the same ValueError."""
    if _fast_decode is not None:
        try:
            return _fast_decode(text, validate=True)
        except ValueError:
            pass  # binascii decides (and words the error): it accepts a few things pybase64 does not
    return a2b_base64(text, strict_mode=True)


def decode(text: str) -> bytes:
    """``binascii.a2b_base64(text)``, lenient as it is (what a client reads from a server): the
    same bytes, the same ValueError."""
    if _fast_decode is not None:
        try:
            return _fast_decode(text, validate=True)
        except ValueError:
            pass  # not strict base64: binascii reads it its own lenient way, or refuses it
    return a2b_base64(text)


def encode(data: bytes | bytearray | memoryview) -> str:
    """Standard base64 with padding and no line breaks, as text."""
    if _fast_encode is not None:
        return _fast_encode(data)
    return b2a_base64(data, newline=False).decode("ascii")
