"""``runtime.coalesce_output``: a client message of several frames is answered as one message.

A client that sends 160 ms (two frames) per message costs the server one read per message but,
without coalescing, one write per frame.  With it the output of the message's first frame waits
for its last one (already queued, a step behind), and they go out together: as many messages
back as came in.  Real runtime, scheduler thread and a native WebSocket on a socket pair.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import trio

from conftest import FRAME, INPUT_END, PATIENCE, make_config
from duplexrt.runtime import open_runtime
from duplexrt.protocols.raw import RawTranslator
from duplexrt.wire.transport import TransportClosed
from test_session_direct import _socket_pair

ECHO = ("backend.name=echo", "backend.options.delay_frames=0", "runtime.slots=2")
#: Steps 20 ms apart: the first frame's output reaches trio well before the second is stepped, so
#: without coalescing they cannot share a delivery by chance.
SLOW = ("backend.name=synthetic", "backend.options.step_ms=20", "runtime.slots=2")


def _message(i: int, frames: int) -> bytes:
    """``frames`` frames, each saying which one it is (echo sends them back unchanged)."""
    return b"".join(np.full(FRAME, ((i * frames + k) % 200) / 256, dtype=np.float32).tobytes()
                    for k in range(frames))


async def _exchange(coalesce: bool, frames_per_message: int, messages: int,
                    backend: tuple[str, ...] = ECHO) -> tuple[list[bytes], dict]:
    """Send ``messages`` messages one at a time, waiting for all of each one's audio; return the
    audio messages the client got and the session's usage."""
    config = make_config(*backend, f"runtime.coalesce_output={str(coalesce).lower()}")
    got: list[bytes] = []
    async with open_runtime(config) as runtime:
        server, client = _socket_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(runtime.serve, server, RawTranslator(runtime.audio_spec(), announce=True))
            with trio.fail_after(PATIENCE):
                assert json.loads(await client.receive())["type"] == "session.created"
                for i in range(messages):
                    message = _message(i, frames_per_message)
                    await client.send(message)
                    audio = b""
                    while len(audio) < len(message):
                        part = await client.receive()
                        assert isinstance(part, bytes)
                        got.append(part)
                        audio += part
                    if backend is ECHO:
                        assert audio == message  # nothing lost, nothing reordered
                    assert len(audio) == len(message)
                await client.send(INPUT_END)
                end = None
                try:
                    while True:
                        message = await client.receive()
                        assert isinstance(message, str), "audio after the input ended"
                        end = json.loads(message)
                except TransportClosed:
                    pass
    assert end is not None and end["type"] == "session.end"
    return got, end["usage"]


@pytest.mark.parametrize("frames_per_message", [2, 3])
async def test_a_message_of_several_frames_is_answered_as_one_message(frames_per_message):
    got, usage = await _exchange(True, frames_per_message, messages=6)
    assert [len(m) for m in got] == [frames_per_message * FRAME * 4] * 6
    assert usage["frames_out"] == 6 * frames_per_message


@pytest.mark.parametrize("coalesce", [True, False])
async def test_steps_apart_are_one_message_with_coalescing_and_two_without(coalesce):
    got, usage = await _exchange(coalesce, 2, messages=4, backend=SLOW)
    per_message = [2 * FRAME * 4] if coalesce else [FRAME * 4, FRAME * 4]
    assert [len(m) for m in got] == per_message * 4
    assert usage["frames_out"] == 8


async def test_one_frame_messages_are_not_held():
    got, usage = await _exchange(True, 1, messages=5)
    assert [len(m) for m in got] == [FRAME * 4] * 5
    assert usage["frames_out"] == 5
