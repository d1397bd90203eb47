"""duplexrt: a trio runtime that serves full-duplex speech models to many real-time sessions.

The public API is ``__all__`` below; everything else is internal and may change.  Names load on
first use (PEP 562), so ``import duplexrt`` stays cheap for ``duplexrt --version``:

* run a model for many sessions: ``open_runtime(config)`` gives a ``Runtime``; ``runtime.serve``
  serves one session over a ``Transport`` with a protocol ``Translator`` and returns its
  ``SessionEnd``; ``runtime.statistics()`` reads every figure;
* write a protocol: subclass ``Translator``, whose ``parse`` returns the events beside it
  (``AudioIn``, ``InputEnd``, ``Reply``, ``EndTurn``, ``Reconfigure``, ``ClearInput``,
  ``ClearOutput``, ``Ignored``, ``ProtocolError``) and which may read ``SessionProgress``; each
  route's own translator is in ``duplexrt.protocols`` (``RawTranslator``, ...);
* serve it over WebSocket: ``Server`` / ``serve``;
* configure: ``load_config`` gives a ``Config``;
* bring a model: subclass ``Backend``.
"""

import importlib
import typing

#: The one place the version is written: pyproject.toml reads it from here (setuptools parses
#: this file without importing the package), and ``duplexrt --version`` prints it.
__version__ = "0.1.0.dev0"

#: Public name -> the module that defines it.
_EXPORTS = {
    "Runtime": "duplexrt.runtime",
    "RuntimeStatistics": "duplexrt.runtime",
    "open_runtime": "duplexrt.runtime",
    "Config": "duplexrt.config",
    "ConfigError": "duplexrt.config",
    "load_config": "duplexrt.config",
    "Server": "duplexrt.server.app",
    "ServerStatistics": "duplexrt.server.statistics",
    "serve": "duplexrt.server.app",
    "Backend": "duplexrt.backends.base",
    "BackendInfo": "duplexrt.backends.base",
    "SlotSession": "duplexrt.backends.base",
    "BackendLoadError": "duplexrt.core.scheduler",
    "NoFreeSlotError": "duplexrt.core.scheduler",
    "Transport": "duplexrt.wire.transport",
    "TransportClosed": "duplexrt.wire.transport",
    "MemoryTransport": "duplexrt.wire.transport",
    "memory_transport_pair": "duplexrt.wire.transport",
    "Translator": "duplexrt.protocols.base",
    "SessionProgress": "duplexrt.protocols.base",
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
    "FinishReason": "duplexrt.reasons",
    "CloseCode": "duplexrt.reasons",
    "AudioFormat": "duplexrt.audio",
    "AudioFormatError": "duplexrt.audio",
    "AudioSpec": "duplexrt.audio",
}

__all__ = ["__version__", *_EXPORTS]

if typing.TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ loads these
    from duplexrt.audio import AudioFormat, AudioFormatError, AudioSpec
    from duplexrt.backends.base import Backend, BackendInfo, SlotSession
    from duplexrt.config import Config, ConfigError, load_config
    from duplexrt.runtime import Runtime, RuntimeStatistics, open_runtime
    from duplexrt.core.scheduler import BackendLoadError, NoFreeSlotError
    from duplexrt.protocols.base import SessionProgress, Translator
    from duplexrt.protocols.events import (
        AudioIn,
        ClearInput,
        ClearOutput,
        EndTurn,
        Ignored,
        InputEnd,
        ProtocolError,
        Reconfigure,
        Reply,
        SessionEnd,
    )
    from duplexrt.reasons import CloseCode, FinishReason
    from duplexrt.server.app import Server, serve
    from duplexrt.server.statistics import ServerStatistics
    from duplexrt.wire.transport import MemoryTransport, Transport, TransportClosed, memory_transport_pair


def __getattr__(name: str) -> typing.Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'duplexrt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
