"""The stage meter: one session's per-frame timing, with plain calls and given stamps."""

from __future__ import annotations

from conftest import FRAME, make_config, noise, run_session, spec, wire_messages
from duplexrt.core.metrics import FrameMetrics
from duplexrt.runtime import open_runtime
from duplexrt.core.stage_meter import StageMeter

MS = 1_000_000


def item(submitted_ns: int, stepped_ns: int = 0) -> tuple[None, None, int, int]:
    return (None, None, submitted_ns, stepped_ns)


def test_a_batch_records_each_frames_latency_and_the_late_ones():
    metrics = FrameMetrics()
    meter = StageMeter(metrics, frame_seconds=0.08)
    meter._opened_ns = 0  # opened at time 0 on this test's clock
    meter.batch_sent([item(0, 10 * MS), item(50 * MS), item(90 * MS)], now=100 * MS, last_sent_ns=0)
    assert metrics.latency.count == 3
    assert metrics.latency.total == (100 + 50 + 10) * MS
    assert metrics.latency.max == 100 * MS and metrics.latency.min == 10 * MS
    assert metrics.late_frames == 1  # only the frame 100 ms old is over one period
    assert metrics.step_to_sent.count == 1 and metrics.step_to_sent.total == 90 * MS  # once a batch
    assert metrics.first_audio.count == 1 and metrics.first_audio.total == 100 * MS
    assert metrics.jitter.count == 0  # the first send has nothing to stray from


def test_jitter_is_how_far_a_send_strays_from_one_period_per_frame():
    metrics = FrameMetrics()
    meter = StageMeter(metrics, frame_seconds=0.08)
    meter.batch_sent([item(0)], now=10 * MS, last_sent_ns=0)
    for k in range(1, 4):  # on time, one frame a period; not among the batches sampled
        meter.batch_sent([item(k * 80 * MS)], now=(10 + k * 80) * MS, last_sent_ns=(10 + (k - 1) * 80) * MS)
    meter.batch_sent([item(340 * MS), item(350 * MS)], now=420 * MS, last_sent_ns=250 * MS)  # the fifth
    assert metrics.jitter.count == 1
    assert metrics.jitter.total == 10 * MS  # 170 ms after the previous send, for two frames (160)
    assert metrics.late_frames == 0


def test_step_to_sent_and_jitter_are_sampled_one_batch_in_four_latency_never():
    metrics = FrameMetrics()
    meter = StageMeter(metrics, frame_seconds=0.08)
    meter._opened_ns = 0
    for k in range(12):  # one-frame batches, each frame 90 ms old (late) when it goes
        meter.batch_sent([item(k * 80 * MS, k * 80 * MS)], now=(k * 80 + 90) * MS, last_sent_ns=((k - 1) * 80 + 90) * MS)
    meter.batch_sent([item(960 * MS), item(1000 * MS)], now=1050 * MS, last_sent_ns=970 * MS)  # the 13th
    assert metrics.latency.count == 14 and metrics.latency.total == (12 * 90 + 90 + 50) * MS
    assert metrics.late_frames == 13 and meter.describe(14).endswith("max 90.0 ms, 13 late")
    assert metrics.step_to_sent.count == 4  # batches 1, 5, 9 and 13
    assert metrics.jitter.count == 3  # 5, 9 and 13 (the first send has nothing to stray from)


def test_one_message_in_four_and_one_frame_in_eight_are_timed():
    metrics = FrameMetrics()
    meter = StageMeter(metrics, frame_seconds=0.08)
    stamps = [meter.message_started() for _ in range(8)]
    assert [bool(stamp) for stamp in stamps] == [False, False, False, True] * 2
    for stamp in stamps:
        if stamp:
            meter.message_framed(stamp)
    assert metrics.preprocess.count == 2


async def test_a_session_times_the_submit_of_one_frame_in_eight():
    """The sampling is the session's (no call for the frames not timed): 16 frames, 2 timed."""
    config = make_config("runtime.slots=1", "backend.name=synthetic")
    wire = spec("pcm_f32le")
    messages = wire_messages(noise(16 * FRAME, seed=3), wire, [FRAME * 2] * 8)
    async with open_runtime(config) as runtime:
        run = await run_session(runtime, messages, wire, session_id=1)
        assert run.end.frames_in == 16
        assert runtime.metrics.enqueue.count == 2


def test_the_log_line_summarises_the_session():
    metrics = FrameMetrics()
    meter = StageMeter(metrics, frame_seconds=0.08)
    meter._opened_ns = 0
    assert meter.describe(0) == ""
    meter.batch_sent([item(0), item(50 * MS)], now=100 * MS, last_sent_ns=0)
    assert meter.describe(2) == ("; first audio after 100.0 ms, frame latency mean 75.0 ms "
                                 "max 100.0 ms, 1 late")
