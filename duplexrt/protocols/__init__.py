"""Wire protocols as pure translators between messages and typed events (no I/O here).

What a user of ``Runtime.serve`` needs, by name: the ``Translator`` contract and the
``SessionProgress`` it may read, the events ``parse`` returns, and one translator per route
(``RawTranslator`` for ``/v1/duplex``, ``RealtimeTranslator`` for ``/v1/realtime``,
``LiveTranslator`` for ``/v1/live/sessions``, ``MoshiTranslator`` for ``/api/chat``).  Names
load on first use (PEP 562), so importing one translator's module does not import the others
(the realtime one brings its VAD).
"""

import importlib
import typing

#: Public name -> the module that defines it.
_EXPORTS = {
    "Translator": "duplexrt.protocols.base",
    "SessionProgress": "duplexrt.protocols.base",
    "Event": "duplexrt.protocols.events",
    "AudioIn": "duplexrt.protocols.events",
    "InputEnd": "duplexrt.protocols.events",
    "ProtocolError": "duplexrt.protocols.events",
    "Ignored": "duplexrt.protocols.events",
    "Reply": "duplexrt.protocols.events",
    "EndTurn": "duplexrt.protocols.events",
    "Reconfigure": "duplexrt.protocols.events",
    "ClearInput": "duplexrt.protocols.events",
    "ClearOutput": "duplexrt.protocols.events",
    "SessionEnd": "duplexrt.protocols.events",
    "RawTranslator": "duplexrt.protocols.raw",
    "RealtimeTranslator": "duplexrt.protocols.realtime",
    "LiveTranslator": "duplexrt.protocols.live",
    "MoshiTranslator": "duplexrt.protocols.moshi",
}

__all__ = [*_EXPORTS]

if typing.TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ loads these
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


def __getattr__(name: str) -> typing.Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'duplexrt.protocols' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
