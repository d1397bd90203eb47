"""Usage and finish reasons stay exact whatever is collected; limits end sessions with `length`;
a thousand sessions leave nothing behind; stats reach the log and /metrics."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
import trio

from conftest import (FRAME, INPUT_END, PATIENCE, backend_info, make_config, noise_frames, run_session,
                      run_socket_session, spec, synthetic_wire)
from test_session import SYNTHETIC, pcm_workload
from duplexrt.backends.echo import EchoBackend
from duplexrt.config import ConfigError
from duplexrt.runtime import open_runtime
from duplexrt.server.stats_log import log_stats
from duplexrt.wire.transport import memory_transport_pair

F32 = spec("pcm_f32le")


def _audio(frames: float, seed: int) -> bytes:
    samples = int(frames * FRAME)
    return (np.random.default_rng(seed).standard_normal(samples) * 0.1).astype(np.float32).tobytes()


def _chunks(data: bytes, size: int = 3 * FRAME * 4) -> list[bytes]:
    return [data[i:i + size] for i in range(0, len(data), size)]


class TalkingEcho(EchoBackend):
    """FAKE: the real echo model, plus a piece of 'model text' every third step of each slot, so
    text usage can be counted without a language model; and stage timings, as a staged model
    reports them."""

    def __init__(self, config, max_session_frames=None):
        info = backend_info(config, "echo")
        if max_session_frames is not None:
            import attrs
            info = attrs.evolve(info, max_session_frames=max_session_frames)
        super().__init__(info, {"delay_frames": 0})
        self.counts = np.zeros(info.slots, dtype=np.int64)

    def open_slot(self, slot, session):
        super().open_slot(slot, session)
        self.counts[slot] = 0

    def step(self, rows, inputs, outputs):
        super().step(rows, inputs, outputs)
        self.counts[rows] += 1
        self.last_stages = (("encode", 1000), ("lm", 2000), ("decode", 3000))
        return ["word" if c % 3 == 0 else "" for c in self.counts[rows]]


@pytest.mark.parametrize("collect", [True, False])
async def test_usage_is_exact_with_stage_metrics_on_or_off(collect):
    config = make_config("runtime.slots=4", f"metrics.collect_stage_metrics={str(collect).lower()}",
                         "metrics.log_stats=false")
    async with open_runtime(config, TalkingEcho(config)) as runtime:
        started = time.perf_counter()
        run = await run_session(runtime, _chunks(_audio(7.5, seed=1)), F32, session_id=1)
        wall = time.perf_counter() - started
        latency_count = runtime.metrics.latency.count
    end = run.end
    assert end.reason == "stop"
    assert (end.frames_in, end.frames_out) == (8, 8)
    assert (end.seconds_in, end.seconds_out) == (0.64, 0.64)
    assert end.text_tokens_out == 2  # steps 3 and 6 of the slot
    assert run.client.texts == ["word", "word"]
    assert 0 < end.generation_seconds <= wall  # first submit to last send, in seconds
    assert run.client.end["usage"]["text_tokens_out"] == 2
    # Collection off skips the per-frame timing and nothing else.
    assert latency_count == (8 if collect else 0)


def test_turning_collection_off_with_log_stats_on_is_refused_naming_both():
    with pytest.raises(ConfigError) as error:
        make_config("metrics.collect_stage_metrics=false")
    assert "metrics.log_stats" in str(error.value) and "metrics.collect_stage_metrics" in str(error.value)
    assert "--no-log-stats" in str(error.value)
    make_config("metrics.collect_stage_metrics=false", "metrics.log_stats=false")


@pytest.mark.parametrize("limit", ["runtime", "model"])
async def test_reaching_the_session_limit_ends_with_length_and_full_usage(limit):
    overrides = ["runtime.slots=4"]
    if limit == "runtime":
        overrides.append("runtime.max_session_seconds=0.4")  # five frames
    config = make_config(*overrides)
    backend = TalkingEcho(config, max_session_frames=5 if limit == "model" else None)
    async with open_runtime(config, backend) as runtime:
        run = await run_session(runtime, _chunks(_audio(20, seed=2), FRAME * 4), F32, session_id=1)
        other = await run_session(runtime, _chunks(_audio(3, seed=3)), F32, session_id=2)
        free = runtime.scheduler.free_slots
    assert run.end.reason == "length"
    assert run.end.frames_in == run.end.frames_out == 5
    assert run.client.end["reason"] == "length" and run.client.end["usage"]["frames_out"] == 5
    assert len(run.client.audio) == 5 * FRAME * 4  # every frame taken was answered
    assert run.client.close_code == 1000
    assert other.end.reason == "stop" and other.end.frames_out == 3  # the scheduler goes on
    assert free == 4


async def test_a_thousand_sessions_leave_every_registry_empty():
    config = make_config("runtime.slots=64", "backend.options.delay_frames=1", "metrics.log_stats=false")
    audio = _audio(3, seed=4)
    ended: dict[str, int] = {}

    async with open_runtime(config) as runtime:
        async def one(i: int) -> None:
            client, server = memory_transport_pair()
            async with trio.open_nursery() as nursery:
                async def serve() -> None:
                    end = await runtime.serve(server, input_spec=F32, session_id=i)
                    ended[end.reason] = ended.get(end.reason, 0) + 1

                nursery.start_soon(serve)
                await client.send(audio[: FRAME * 4])
                if i % 3 == 0:  # a third drop their connection mid-stream
                    await client.receive()
                    await client.close(1001, "gone")
                    return
                await client.send(audio[FRAME * 4:])
                await client.send(INPUT_END)
                while True:
                    try:
                        await client.receive()
                    except Exception:
                        return

        with trio.fail_after(120):
            for batch in range(0, 1000, 50):
                async with trio.open_nursery() as nursery:
                    for i in range(batch, batch + 50):
                        nursery.start_soon(one, i)
        scheduler = runtime.scheduler
        with trio.fail_after(PATIENCE):
            while scheduler.inbox._controls or scheduler._undelivered:
                await trio.sleep(0.01)
        assert ended == {"stop": 666, "client_closed": 334}
        assert runtime.sessions == set()
        assert runtime.metrics.sessions_active == 0 and runtime.metrics.sessions_opened == 1000
        assert scheduler.free_slots == 64 and scheduler.inbox.open_count() == 0
        assert scheduler.inbox.total_queued() == 0
        assert runtime.handoffs._limiter.borrowed_tokens == 0


async def test_log_stats_writes_one_line_per_interval(caplog):
    config = make_config("runtime.slots=4")
    caplog.set_level(logging.INFO, logger="duplexrt.stats")
    async with open_runtime(config) as runtime:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(log_stats, runtime, 0.05)
            await run_session(runtime, _chunks(_audio(4, seed=5)), F32, session_id=1)
            with trio.fail_after(PATIENCE):
                while not [r for r in caplog.records if r.name == "duplexrt.stats"]:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    line = [r for r in caplog.records if r.name == "duplexrt.stats"][0].getMessage()
    for part in ("sessions", "steps/s", "mean batch", "frame latency p50", "p99", "handoffs/s", "offloads/s"):
        assert part in line


async def test_an_idle_server_logs_its_stats_line_once_then_again_when_something_changes(caplog):
    """Issue 40: an empty stats line every 10 s when idle was ~8,600 lines a day."""
    config = make_config("runtime.slots=4")
    caplog.set_level(logging.INFO, logger="duplexrt.stats")

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "duplexrt.stats"]

    async with open_runtime(config) as runtime:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(log_stats, runtime, 0.02)
            await trio.sleep(0.3)  # about fifteen idle intervals
            idle = lines()
            assert len(idle) == 1 and idle[0].startswith("sessions 0 | steps/s 0.0")
            await run_session(runtime, _chunks(_audio(4, seed=5)), F32, session_id=1)
            with trio.fail_after(PATIENCE):
                while len(lines()) < 3:  # the busy interval(s), then idle once more
                    await trio.sleep(0.01)
                while lines()[-1] != idle[0]:
                    await trio.sleep(0.01)
            settled = len(lines())
            await trio.sleep(0.3)
            nursery.cancel_scope.cancel()
    assert len(lines()) == settled  # idle again: silent again
    assert any("steps/s 0.0" not in line for line in lines())


async def test_stage_timings_and_usage_counters_reach_prometheus(nursery):
    from duplexrt.server import Server
    from conftest import http_get

    config = make_config("server.port=0", "runtime.slots=4", "metrics.log_stats=false")
    server = Server(config, TalkingEcho(config))
    await nursery.start(server.run)
    await run_session(server.runtime, _chunks(_audio(6, seed=6)), F32, session_id=1)
    status, _, body = await http_get(server.ports[0], "/metrics")
    text = body.decode()
    assert status == 200
    for stage in ("encode", "lm", "decode"):
        assert f'duplexrt_stage_seconds_count{{stage="{stage}"}} ' in text
    assert "duplexrt_text_pieces_total 2.0" in text
    assert "duplexrt_time_to_first_audio_seconds_count 1.0" in text
    assert "duplexrt_frame_latency_seconds_count 6.0" in text
    assert "process_cpu_seconds_total" in text


async def test_the_length_limit_ends_the_session_with_every_taken_frame_answered():
    async with open_runtime(make_config("runtime.slots=1", "runtime.max_session_seconds=0.4", *SYNTHETIC)) as runtime:
        wire = pcm_workload("pcm_f32le", 1, seed=5)[1]
        frames = noise_frames(8, seed=9)
        messages = [frame.astype("<f4").tobytes() for frame in frames]
        end, log = await run_socket_session(runtime, messages, wire, session_id=3)
    assert end.reason == "length" and end.frames_in == end.frames_out == 5
    assert log.end["reason"] == "length"
    assert bytes(log.audio) == synthetic_wire(frames[:5], 3, wire)
