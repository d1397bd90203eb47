"""Every server event checked against the `openai` SDK's own typed models (GA and beta).

The SDK builds its event objects without validating them, so a field of the wrong shape would only
surface in a framework that does validate (pipecat does, with its own models).  Here each event is
validated strictly by the SDK model its ``type`` names; an event type the SDK does not know fails.
"""

from __future__ import annotations

import json
import typing
from typing import Any

import pytest

from openai.types.beta.realtime import RealtimeServerEvent as BetaServerEvent
from openai.types.realtime import RealtimeServerEvent as GaServerEvent

__all__ = ["check_server_event", "every_server_event_is_checked"]


def _by_type(union: Any) -> dict[str, Any]:
    while typing.get_origin(union) is typing.Annotated:
        union = typing.get_args(union)[0]
    models = {}
    for model in typing.get_args(union):
        (name,) = typing.get_args(model.model_fields["type"].annotation)
        models[name] = model
    return models


_GA = _by_type(GaServerEvent)
_BETA = _by_type(BetaServerEvent)
#: The beta session model names OpenAI's own models as a closed list; any model name is fine on
#: the wire (the SDK does not check it), so a stand-in from that list is validated in its place.
_BETA_MODEL = "gpt-4o-realtime-preview"


def check_server_event(event: dict[str, Any], *, beta: bool) -> None:
    """Raise unless ``event`` is valid for the SDK model its type names (GA or beta naming)."""
    models = _BETA if beta else _GA
    model = models.get(event.get("type"))
    assert model is not None, f"{event.get('type')!r} is not a {'beta' if beta else 'GA'} server event"
    if beta and event["type"] in ("session.created", "session.updated"):
        event = {**event, "session": {**event["session"], "model": _BETA_MODEL}}
    if not beta and event["type"] in ("session.created", "session.updated"):
        # The GA format object allows only 24 kHz pcm; duplexrt also speaks other rates (its
        # documented extension), so the rate alone is validated as the SDK's 24000.
        audio = {direction: {**part, "format": {**part["format"], "rate": 24000}}
                 if part["format"].get("type") == "audio/pcm" else part
                 for direction, part in event["session"]["audio"].items()}
        event = {**event, "session": {**event["session"], "audio": audio}}
    model.model_validate(event, strict=False)


def _checked(method):
    def wrapper(self, *args, **kwargs):
        result = method(self, *args, **kwargs)
        messages = result if isinstance(result, list) else getattr(result, "messages", ())
        for message in messages:
            check_server_event(json.loads(message), beta=self.beta)
        return result

    return wrapper


@pytest.fixture(autouse=True)
def every_server_event_is_checked(monkeypatch):
    """Autouse in the realtime test modules: whatever a RealtimeTranslator says in them, through
    any path (unit calls, or a whole server on loopback), is checked against the SDK's models."""
    from duplexrt.protocols.realtime import RealtimeTranslator

    for name in ("start", "audio_out", "text_out", "input_text", "error", "end", "parse"):
        monkeypatch.setattr(RealtimeTranslator, name, _checked(getattr(RealtimeTranslator, name)))
