"""The base64 codec of the JSON routes: pybase64's speed, binascii's answers.

``decode_strict`` must accept exactly what ``binascii``'s strict mode accepts, with the same bytes
and a ValueError for the rest, and ``decode`` (the clients') exactly what its lenient default
accepts; ``encode`` must write what ``binascii`` writes.  Checked on every
short text over an alphabet that reaches each rule (padding, bits left over, characters outside
the alphabet, line breaks, non-ASCII), on random texts, and with pybase64 removed.
"""

from __future__ import annotations

import itertools
from binascii import a2b_base64, b2a_base64

import numpy as np
import pytest

from duplexrt.protocols import b64codec


def reference(text: str, strict: bool = True) -> bytes | str:
    try:
        return a2b_base64(text, strict_mode=strict)
    except ValueError:
        return "error"


def ours(text: str, strict: bool = True) -> bytes | str:
    try:
        return b64codec.decode_strict(text) if strict else b64codec.decode(text)
    except ValueError:
        return "error"


def test_the_fast_codec_is_the_one_in_use():
    """pybase64 is a declared dependency: without it every frame costs ~20 µs more."""
    assert b64codec._fast_decode is not None and b64codec._fast_encode is not None


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "lenient"])
def test_decoding_answers_as_binascii_on_every_short_text(strict):
    # 'A' and 'Q' differ in the low bits a padded group must leave at zero; '/' is the last
    # letter; '_' and '-' are url-safe letters; then padding, a line break, a space, non-ASCII.
    alphabet = "AQ/_-=\n é"
    for size in range(7):
        for letters in itertools.product(alphabet, repeat=size):
            text = "".join(letters)
            assert ours(text, strict) == reference(text, strict), repr(text)


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "lenient"])
def test_decoding_answers_as_binascii_on_random_texts(strict):
    rng = np.random.default_rng(12)
    letters = list("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")
    for _ in range(3000):
        raw = rng.bytes(int(rng.integers(0, 40)))
        text = b2a_base64(raw, newline=False).decode("ascii")
        if rng.random() < 0.6 and text:  # spoil it: a letter changed, dropped, or something added
            at = int(rng.integers(0, len(text)))
            spoil = str(rng.choice(letters + ["=", "\n", " ", "*", "\x00"]))
            text = rng.choice([text[:at] + spoil + text[at + 1:], text[:at] + text[at + 1:],
                               text[:at] + spoil + text[at:]])
        assert ours(text, strict) == reference(text, strict), repr(text)


@pytest.mark.parametrize("size", [0, 1, 2, 3, 4, 5, 3840, 3841])
def test_encoding_writes_what_binascii_writes(size):
    raw = np.random.default_rng(size).bytes(size)
    expected = b2a_base64(raw, newline=False).decode("ascii")
    assert b64codec.encode(raw) == expected
    assert b64codec.encode(memoryview(raw)) == expected
    assert type(b64codec.encode(raw)) is str


def test_without_pybase64_binascii_does_the_same_work(monkeypatch):
    monkeypatch.setattr(b64codec, "_fast_decode", None)
    monkeypatch.setattr(b64codec, "_fast_encode", None)
    assert b64codec.encode(b"\x00\xff\x10") == "AP8Q"
    assert b64codec.decode_strict("AP8Q") == b"\x00\xff\x10"
    with pytest.raises(ValueError):
        b64codec.decode_strict("AP8Q*")
    assert b64codec.decode("AP8Q\n") == b"\x00\xff\x10"  # lenient: a line break is skipped
