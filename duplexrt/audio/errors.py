"""The one exception type the audio layer raises for bad client input.

Subclassing ValueError keeps generic ``except ValueError`` handlers working,
while a dedicated type lets the server tell a misbehaving client (reply with
an error, keep the process alive) apart from a bug in our own code.
"""

from __future__ import annotations

__all__ = ["AudioFormatError", "AudioTooLongError"]


class AudioFormatError(ValueError):
    """Input audio or an audio setting that the runtime cannot accept.

    Raised for unknown format names, unsupported sample rates, payloads that
    are not a whole number of samples, and corrupt Opus streams.  The message
    is meant to be shown to the client as is.
    """


class AudioTooLongError(AudioFormatError):
    """One message carries more audio than ``audio.max_message_seconds`` allows.

    Raised before the message is decoded where its size tells its length (PCM, G.711), or as soon
    as decoding passes the bound (Opus).  ``stream_lost`` is True when the decoder could not leave
    the message out whole: an Ogg stream stopped part way through a message cannot go on, so the
    session must end rather than carry on with a broken stream.
    """

    def __init__(self, message: str, *, stream_lost: bool = False) -> None:
        super().__init__(message)
        self.stream_lost = stream_lost
