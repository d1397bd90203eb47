"""Why a session ended, and the WebSocket close codes it ends with: one vocabulary for the
session, the transports, every protocol translator and the clients.

Both are plain ``str``/``int`` enums on purpose: a member *is* its wire value, so JSON, msgpack,
log lines and comparisons with the strings and numbers a peer sends keep the same text as before,
while the code names each value once instead of re-typing literals in every module.
"""

from __future__ import annotations

import enum


class FinishReason(enum.StrEnum):
    """A session's finish reason: ``SessionEnd.reason``, the usage record, the ``ended:`` log line
    and each protocol's last message (``session.end``, ``session.closed``, a Realtime response's
    status).  The first reason recorded wins."""

    #: The client's input ended (an end-of-input event, or the model stopped on its own) and
    #: every frame was answered: the normal end.
    STOP = "stop"
    #: The client closed the connection or it went away.  When this end closed it instead (a
    #: limit, a dead peer, a broken frame), one of the server-side reasons below names why.
    CLIENT_CLOSED = "client_closed"
    #: Something failed: a fatal client error (a closing protocol error) or a server-side fault
    #: (the backend's step raised, an internal error); ``SessionEnd.error`` says which.
    ERROR = "error"
    #: The server is stopping (drain or shutdown) and ended the session early.
    SHUTDOWN = "shutdown"
    #: The session reached its frame limit (``runtime.max_session_seconds``).
    LENGTH = "length"
    #: Server side: the client sent no first message within ``server.first_message_timeout_s``.
    FIRST_MESSAGE_TIMEOUT = "first_message_timeout"
    #: Server side: the client sent nothing for ``server.idle_timeout_s``.
    IDLE_TIMEOUT = "idle_timeout"
    #: Server side: the client did not answer a ping within ``server.ping_timeout_s``.
    PING_TIMEOUT = "ping_timeout"
    #: Server side: a WebSocket message over the size limit (the connection closes with 1009).
    MESSAGE_TOO_BIG = "message_too_big"
    #: Server side: a WebSocket frame the server could not parse (close 1002, or 1007 for bad UTF-8).
    PROTOCOL_ERROR = "protocol_error"
    #: The connection dropped without a clean end and no client resumed the session within
    #: ``runtime.resume_window_s`` (or its output outgrew the resume journal): its slot is freed.
    RESUME_EXPIRED = "resume_expired"


class CloseCode(enum.IntEnum):
    """WebSocket close codes (RFC 6455, section 7.4.1) that duplexrt sends or tells apart, so that
    in-memory and network sessions end alike."""

    NORMAL_CLOSURE = 1000
    GOING_AWAY = 1001
    PROTOCOL_ERROR = 1002
    UNSUPPORTED_DATA = 1003
    #: Reserved: never sent; a connection dropped without a Close frame reports it.
    ABNORMAL_CLOSURE = 1006
    INVALID_PAYLOAD = 1007
    POLICY_VIOLATION = 1008
    MESSAGE_TOO_BIG = 1009
    INTERNAL_ERROR = 1011
    TRY_AGAIN_LATER = 1013


#: Why a connection was refused before a session started (the ``reason`` label of
#: ``duplexrt_connections_refused_total``, exported at 0 from the start so that an alert on its
#: rate has a series to read): the request, the peer, the server's state, or a resume
#: (``resume_`` and the resume error's code).
REFUSAL_REASONS: tuple[str, ...] = (
    # the request
    "not_found", "bad_handshake", "bad_options", "bad_persona", "foreign_origin", "unauthorized",
    # the peer (a TLS listener's: a failed TLS handshake, plain HTTP sent to it)
    "tls_handshake", "plain_http_on_tls", "handshake_timeout", "too_many_from_peer", "too_many_pending", "drain_refused",
    # the server's state
    "shutting_down", "not_ready", "at_capacity", "no_free_slot", "evicted_detached",
    # a resume (``?resume=TOKEN``)
    "resume_bad_received", "resume_journal_exceeded", "resume_resume_in_progress", "resume_session_ended",
    "resume_unknown_token", "resume_wrong_replica", "resume_wrong_route",
)
