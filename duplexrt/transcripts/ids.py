"""The id a client fetches its call's transcript by.

A transcript is the caller's words, so its id must not be guessable by anyone else: with no
``server.api_key`` set, the id is the only thing between a stranger and a call's text.  A route
tells its client this id when the call starts (Realtime's ``session.id``, Live's session id,
``/v1/duplex``'s ``session.created`` ``id``), so it is made random here, 96 bits, rather than
counted.
"""

from __future__ import annotations

import re
import secrets

#: What an id looks like: a short prefix naming the route's kind of session, then 24 hex digits.
ID_PATTERN = re.compile(r"[a-z]{2,8}_[0-9a-f]{24}")


def new_call_id(prefix: str = "call") -> str:
    """A fresh unguessable id, ``prefix_`` and 96 random bits in hex."""
    return f"{prefix}_{secrets.token_hex(12)}"
