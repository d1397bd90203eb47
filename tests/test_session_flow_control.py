"""Flow control: a session holds a bounded amount for its client, whatever the client does.

Its input waits for credit (``inbox_depth`` frames not yet stepped, ``inbox_depth +
outbox_depth`` not yet sent) and a message with more frames than that is still answered whole;
its queue of replies is bounded by count and bytes, so a client that sends and never reads
stops its own input, and holds no more memory than that (tests/test_promises.py holds the same
for a client that never reads its audio)."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import trio
import trio.testing

from conftest import make_config, noise_frames, run_socket_session, synthetic_wire
from test_session import SYNTHETIC, pcm_workload
from duplexrt.runtime import open_runtime
from duplexrt.wire.transport import TransportClosed, memory_transport_pair


async def test_a_message_with_more_frames_than_the_credits_waits_for_them_and_is_answered_whole():
    async with open_runtime(make_config("runtime.slots=2", "runtime.inbox_depth=2", "runtime.outbox_depth=2",
                              *SYNTHETIC)) as runtime:
        wire = pcm_workload("pcm_f32le", 1, seed=5)[1]
        frames = noise_frames(11, seed=6)
        big = np.concatenate(frames).astype("<f4").tobytes()  # eleven frames, credit for two
        messages = [frames[0].astype("<f4").tobytes(), big, frames[1].astype("<f4").tobytes()]
        end, log = await run_socket_session(runtime, messages, wire, session_id=9)
    sent_frames = [frames[0], *frames, frames[1]]
    assert end.reason == "stop" and end.frames_out == len(sent_frames)
    assert bytes(log.audio) == synthetic_wire(sent_frames, 9, wire)


async def test_a_client_that_never_reads_its_audio_errors_holds_bounded_memory():
    """Every bad audio message gets an error; a client that never reads them must not grow the
    queue of replies without bound (the audio path once never waited for room)."""
    from duplexrt.session import outgoing as session_module

    limit = getattr(session_module, "MAX_PENDING_BYTES", 1 << 20)
    config = make_config("runtime.slots=2")
    async with open_runtime(config) as runtime:
        client, server = memory_transport_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(runtime.serve, server)  # raw, pcm_f32le

            async def flood() -> None:
                with contextlib.suppress(TransportClosed):
                    for _ in range(20_000):
                        await client.send(b"\0\0\0")  # three bytes: not a whole f32 sample

            nursery.start_soon(flood)
            await trio.testing.wait_all_tasks_blocked()
            (session,) = runtime.sessions
            queued = list(session.outgoing.pending)
            await client.close(1000, "bye")
    assert len(queued) > 1000  # every message was answered ...
    assert all(json.loads(m)["code"] == "invalid_audio" for m in queued)
    assert sum(len(m) for m in queued) <= limit + 4096  # ... up to a bounded backlog


async def test_a_client_that_sends_but_never_reads_cannot_grow_the_reply_queue():
    from duplexrt.session.outgoing import MAX_PENDING_MESSAGES

    config = make_config("runtime.slots=2")
    async with open_runtime(config) as runtime:
        client, server = memory_transport_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(runtime.serve, server)

            async def flood() -> None:
                with contextlib.suppress(TransportClosed):
                    for _ in range(1000):
                        await client.send(json.dumps({"type": "ping"}))

            nursery.start_soon(flood)
            await trio.testing.wait_all_tasks_blocked()
            (session,) = runtime.sessions
            assert len(session.outgoing.pending) <= MAX_PENDING_MESSAGES + 1
            await client.close(1000, "bye")
