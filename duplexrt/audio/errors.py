"""The one exception type the audio layer raises for bad client input.

Subclassing ValueError keeps generic ``except ValueError`` handlers working,
while a dedicated type lets the server tell a misbehaving client (reply with
an error, keep the process alive) apart from a bug in our own code.
"""

from __future__ import annotations

__all__ = ["AudioFormatError"]


class AudioFormatError(ValueError):
    """Input audio or an audio setting that the runtime cannot accept.

    Raised for unknown format names, unsupported sample rates, payloads that
    are not a whole number of samples, and corrupt Opus streams.  The message
    is meant to be shown to the client as is.
    """
