"""The conversation items of a Realtime session, as far as the protocol needs them.

A speech-to-speech model keeps its own context in its state: items are only what the client and
server say about the conversation (ids to truncate, retrieve or delete, and a chain of
``previous_item_id``).  An item is kept without its audio, and only the last ``MAX_ITEMS``, so a
long session or a client that creates items in a loop costs bounded memory.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from duplexrt.protocols.events import clip

__all__ = ["Items", "MAX_ITEMS", "TEXT_LIMIT", "client_item", "message_item"]

#: Items remembered for retrieve, delete and truncate.
MAX_ITEMS = 256
#: Text a client put in an item is echoed back cut to this many characters.
TEXT_LIMIT = 1000


class Items:
    """Ids in conversation order, with a rendering of each item for retrieve."""

    def __init__(self) -> None:
        self._items: OrderedDict[str, dict[str, Any]] = OrderedDict()

    @property
    def last_id(self) -> str | None:
        return next(reversed(self._items), None)

    def add(self, item: dict[str, Any]) -> str | None:
        """Remember ``item``; the id of the item before it."""
        previous = self.last_id
        self._items[item["id"]] = item
        while len(self._items) > MAX_ITEMS:
            self._items.popitem(last=False)
        return previous

    def get(self, item_id: str) -> dict[str, Any] | None:
        return self._items.get(item_id)

    def delete(self, item_id: str) -> bool:
        return self._items.pop(item_id, None) is not None


def message_item(item_id: str, role: str, content: list[dict[str, Any]], *, beta: bool,
                 status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "object": "realtime.item", "type": "message", "role": role,
            "status": status, "content": content}


def client_item(item_id: str, item: dict[str, Any], *, beta: bool) -> dict[str, Any]:
    """How a client-created item is echoed: its shape normalised to the SDK's item models, text
    cut short, audio left out (it went to the model)."""
    kind = item.get("type")
    if kind in ("function_call", "function_call_output"):
        body: dict[str, Any] = {"id": item_id, "object": "realtime.item", "type": kind,
                                "status": "completed"}
        for field in ("call_id", "name", "arguments", "output"):
            value = item.get(field)
            if isinstance(value, str):
                body[field] = clip(value, TEXT_LIMIT)
        body.setdefault("call_id", "")
        if kind == "function_call":
            body.setdefault("arguments", "")
            body.setdefault("name", "")
        else:
            body.setdefault("output", "")
        return body
    role = item.get("role")
    if role not in ("user", "assistant", "system"):
        role = "user"
    parts = []
    for part in item.get("content") or ():
        if type(part) is not dict:
            continue
        text = part.get("text") if isinstance(part.get("text"), str) else None
        transcript = part.get("transcript") if isinstance(part.get("transcript"), str) else None
        ptype = part.get("type")
        if role == "assistant":
            if beta:
                ptype = "audio" if ptype in ("audio", "output_audio") else "text"
            else:
                ptype = "output_audio" if ptype in ("audio", "output_audio") else "output_text"
        elif beta:
            ptype = "input_audio" if ptype in ("audio", "input_audio") else "input_text"
        else:
            ptype = "input_audio" if ptype in ("audio", "input_audio") else "input_text"
            if role == "system":
                ptype = "input_text"
        rendered: dict[str, Any] = {"type": ptype}
        if text is not None:
            rendered["text"] = clip(text, TEXT_LIMIT)
        if transcript is not None:
            rendered["transcript"] = clip(transcript, TEXT_LIMIT)
        parts.append(rendered)
    return message_item(item_id, role, parts, beta=beta)
