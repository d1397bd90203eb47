"""What the two Realtime test modules share: the protocol's figures, its event names in either
naming, and how usage is counted (test_protocol_realtime.py: plain calls;
test_realtime_sessions.py: whole sessions on a runtime)."""

from __future__ import annotations

import base64

import pytest

MODEL_RATE = 24000
FRAME = 1920
ULAW_FRAME_BYTES = 640  # 80 ms of 8 kHz G.711
PCM_FRAME_BYTES = FRAME * 2


#: The item and part events around a response's deltas (and a commit's item): most tests look at
#: the deltas and the response's own events, ``lifecycle`` tests look at these.
SCAFFOLD = frozenset({
    "response.output_item.added", "response.output_item.done", "response.content_part.added",
    "response.content_part.done", "conversation.item.added", "conversation.item.created",
    "conversation.item.done",
})


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def names(beta: bool) -> dict[str, str]:
    if beta:
        return {"delta": "response.audio.delta", "done": "response.audio.done",
                "text": "response.audio_transcript.delta", "text_done": "response.audio_transcript.done"}
    return {"delta": "response.output_audio.delta", "done": "response.output_audio.done",
            "text": "response.output_audio_transcript.delta",
            "text_done": "response.output_audio_transcript.done"}


def usage(frames_in: int, frames_out: int, text_out: int = 0) -> dict:
    return {
        "total_tokens": frames_in + frames_out + text_out,
        "input_tokens": frames_in,
        "output_tokens": frames_out + text_out,
        "input_token_details": {"audio_tokens": frames_in, "text_tokens": 0},
        "output_token_details": {"audio_tokens": frames_out, "text_tokens": text_out},
    }


both_namings = pytest.mark.parametrize("beta", [False, True], ids=["ga", "beta"])
