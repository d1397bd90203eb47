"""``runtime.late_input``: a session whose audio is overdue is stepped with silence ("fill"), and
the audio that then comes for time already filled is dropped; "wait" keeps the echo exact.

The session's input clock is trio's clock; the test holds it still (a MockClock that only moves
when told) and moves it past the fill deadline between messages, so what is filled is exact.
"""

from __future__ import annotations

import numpy as np
import pytest
import trio
import trio.testing

from conftest import FRAME, INPUT_END, ClientLog, make_config, receive_all
from duplexrt.runtime import open_runtime
from duplexrt.wire.transport import memory_transport_pair

FILL_AFTER = 0.24  # the default


@pytest.fixture
def still_clock() -> trio.testing.MockClock:
    """Time moves only when the test jumps it: the scheduler thread is real, so no autojump."""
    return trio.testing.MockClock()


async def _heard(log: ClientLog, frames: int) -> None:
    """Wait for ``frames`` frames of audio (on the client's own event: the clock is still)."""
    while len(log.audio) < frames * FRAME * 4:
        log.got_audio = trio.Event()
        await log.got_audio.wait()


def _frame(value: float) -> np.ndarray:
    return np.full(FRAME, value, dtype=np.float32)


async def _stalled_caller(still_clock, late_input: str):
    """Frame A; then the caller's network stalls past the fill deadline; then B and C arrive
    together, B late.  Returns the session's end, the client's log and the runtime's metrics."""
    config = make_config("runtime.slots=2", "backend.options.delay_frames=0", f"runtime.late_input={late_input!r}",
                         "metrics.log_stats=false")
    log = ClientLog()
    async with open_runtime(config) as runtime:
        client, server = memory_transport_pair()
        ends = []

        async def serve() -> None:
            ends.append(await runtime.serve(server))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            nursery.start_soon(receive_all, client, log)
            await client.send(_frame(0.1).tobytes())
            await _heard(log, 1)
            # A's audio ended one period after the clock started: B is overdue one period later,
            # and filled once it is FILL_AFTER more overdue.
            still_clock.jump(2 * 0.08 + FILL_AFTER + 0.01)
            # Whatever the session does about it happens before it blocks again (a fill is one
            # submit into the inbox): count now, so a session that never fills fails, not hangs.
            await trio.testing.wait_all_tasks_blocked()
            filled_at_once = runtime.metrics.frames_filled
            if filled_at_once:
                await _heard(log, 2)
            await client.send(np.concatenate([_frame(0.2), _frame(0.3)]).tobytes())
            await client.send(INPUT_END)
        assert filled_at_once == (1 if late_input == "fill" else 0)
        return ends[0], log, runtime.metrics


async def test_fill_steps_silence_for_an_overdue_frame_and_drops_the_late_audio(still_clock):
    end, log, metrics = await _stalled_caller(still_clock, "fill")
    heard = np.frombuffer(bytes(log.audio), dtype=np.float32).reshape(-1, FRAME)
    # A, then silence where B was overdue, then C: B came for time already filled.
    np.testing.assert_array_equal(heard, np.stack([_frame(0.1), _frame(0.0), _frame(0.3)]))
    assert (end.frames_in, end.frames_filled, end.frames_dropped_late) == (3, 1, 1)
    assert log.end["usage"]["frames_filled"] == 1 and log.end["usage"]["frames_dropped_late"] == 1
    assert (metrics.frames_filled, metrics.frames_dropped_late) == (1, 1)


async def test_wait_keeps_the_echo_exact_however_late_the_audio(still_clock):
    end, log, metrics = await _stalled_caller(still_clock, "wait")
    heard = np.frombuffer(bytes(log.audio), dtype=np.float32).reshape(-1, FRAME)
    np.testing.assert_array_equal(heard, np.stack([_frame(0.1), _frame(0.2), _frame(0.3)]))
    assert (end.frames_in, end.frames_filled, end.frames_dropped_late) == (3, 0, 0)
    assert (metrics.frames_filled, metrics.frames_dropped_late) == (0, 0)


def test_late_input_is_checked_at_load():
    from duplexrt.config import ConfigError

    with pytest.raises(ConfigError, match="runtime.late_input"):
        make_config("runtime.late_input='skip'")
    with pytest.raises(ConfigError, match="runtime.fill_after_ms"):
        make_config("runtime.fill_after_ms=-1")
