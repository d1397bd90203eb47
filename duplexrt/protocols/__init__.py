"""Wire protocols as pure translators between messages and typed events (no I/O here).

What a user of ``Runtime.serve`` needs, by name: the ``Translator`` contract and the
``SessionProgress`` it may read, the events ``parse`` returns, and one translator per route
(``RawTranslator`` for ``/v1/duplex``, ``RealtimeTranslator`` for ``/v1/realtime``,
``LiveTranslator`` for ``/v1/live/sessions``, ``MoshiTranslator`` for ``/api/chat``).
"""

from duplexrt.protocols.base import SessionProgress, Translator
from duplexrt.protocols.events import (
    AudioIn,
    ClearInput,
    ClearOutput,
    EndTurn,
    Event,
    Ignored,
    InputEnd,
    ProtocolError,
    Reconfigure,
    Reply,
    SessionEnd,
)
from duplexrt.protocols.live import LiveTranslator
from duplexrt.protocols.moshi import MoshiTranslator
from duplexrt.protocols.raw import RawTranslator
from duplexrt.protocols.realtime import RealtimeTranslator

__all__ = [
    "Translator", "SessionProgress", "Event", "AudioIn", "InputEnd", "ProtocolError", "Ignored", "Reply",
    "EndTurn", "Reconfigure", "ClearInput", "ClearOutput", "SessionEnd",
    "RawTranslator", "RealtimeTranslator", "LiveTranslator", "MoshiTranslator",
]
