"""``GET /v1/transcripts/{id}``: an ended call's transcript, by the id its client was told.

A transcript is what a caller said, so it is served only to a request with ``server.api_key``
when one is set (401 otherwise, before anything about the id is looked at), and only by id:
nothing lists the ids, and an id is random (``transcripts/ids.py``), so without the key only a
client that was told one can fetch it.  An unknown id, an expired one and one evicted for the
bounds get the same 404: which of them it was says nothing useful and could say too much.
"""

from __future__ import annotations

import json

from duplexrt.server.http import response_bytes
from duplexrt.transcripts.keeper import Transcripts

TRANSCRIPTS_PATH = "/v1/transcripts"
_JSON = "application/json"
#: Caller data: no cache on the way may keep a copy.
_PRIVATE = [("cache-control", "no-store")]


def is_transcript_path(path: str) -> bool:
    return path == TRANSCRIPTS_PATH or path.startswith(TRANSCRIPTS_PATH + "/")


def _error(status: int, code: str, reason: str, headers: list[tuple[str, str]] | None = None) -> bytes:
    body = json.dumps({"error": code, "reason": reason}).encode() + b"\n"
    return response_bytes(status, body, _JSON, [*_PRIVATE, *(headers or [])])


def transcript_response(transcripts: Transcripts | None, method: str, path: str, authorized: bool) -> bytes:
    """The whole HTTP response to a request for ``path`` under ``/v1/transcripts``."""
    if not authorized:
        return _error(401, "unauthorized", "a valid API key is required (Authorization: Bearer KEY or "
                                           "?api_key=KEY)", [("www-authenticate", "Bearer")])
    if method not in ("GET", "HEAD"):
        return _error(405, "method_not_allowed", "only GET is served here", [("allow", "GET")])
    call_id = path[len(TRANSCRIPTS_PATH) + 1:]
    if not call_id or "/" in call_id:
        return _error(404, "not_found", "ask for one call's transcript, GET /v1/transcripts/{id} with the id "
                                        "the call's session was given; they are not listed")
    if transcripts is None or not transcripts.config.kept:
        return _error(404, "not_kept", "this server keeps no transcripts ([transcripts] keep_seconds, "
                                       "max_calls or max_bytes is 0)")
    body = transcripts.store.get(call_id)
    if body is None:
        settings = transcripts.config
        return _error(404, "not_found", f"no transcript {call_id[:64]!r}: unknown, not ended yet, or no longer "
                                        f"kept (kept {settings.keep_seconds:g} s after a call ends, "
                                        f"{settings.max_calls} calls at most)")
    return response_bytes(200, body, _JSON, _PRIVATE)
