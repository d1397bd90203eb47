"""`duplexrt simulate` end to end, in process: the guards pass on honest runs and catch a lie."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from duplexrt.audio import AudioFormat, AudioSpec
from duplexrt.backends.base import BackendInfo
from duplexrt.backends.synthetic import SyntheticBackend
from duplexrt.config import load_config
from duplexrt.simulate.runner import SimulateOptions, run_simulation
from duplexrt.simulate.workload import Workload


def _config(*overrides: str):
    return load_config(None, ['backend.name="synthetic"', "runtime.slots=16", *overrides])


@pytest.mark.parametrize("fmt", ["pcm_f32le", "pcm_s16le", "g711_ulaw", "g711_alaw", "opus"])
async def test_every_format_passes_the_guards(fmt):
    report = await run_simulation(_config(), SimulateOptions(concurrency=4, frames=12, format=fmt))
    (round_,) = report.rounds
    assert round_.failures == []
    assert round_.frames_in == round_.frames_out == 4 * 12
    offloads = round_.handoffs["decode_offload"] + round_.handoffs["full_inbox_offload"]
    if fmt == "opus":
        assert round_.handoffs["decode_offload"] > 0
    else:
        assert offloads == 0


async def test_echo_backend_passes_the_guards_with_odd_message_sizes():
    config = load_config(None, ["runtime.slots=8", "backend.options.delay_frames=3"])
    report = await run_simulation(config, SimulateOptions(concurrency=6, frames=10, message_ms=37))
    assert report.ok, report.rounds[0].failures


class _CorruptingBackend(SyntheticBackend):
    """A deliberately wrong model (a fake, on purpose): flips one sample of one session's frame."""

    def __init__(self, info: BackendInfo, victim_slot: int, victim_step: int) -> None:
        super().__init__(info, {})
        self.victim_slot = victim_slot
        self.victim_step = victim_step
        self.steps_seen = 0

    def step(self, rows, inputs, outputs):
        super().step(rows, inputs, outputs)
        hits = np.flatnonzero(rows == self.victim_slot)
        if hits.size and self.steps_seen == self.victim_step:
            outputs[hits[0], 100] += 0.25
        if hits.size:
            self.steps_seen += 1


async def test_guards_catch_a_single_corrupted_sample():
    config = _config()
    info = BackendInfo(name="synthetic", sample_rate=24000, frame_size=1920, slots=16)
    backend = _CorruptingBackend(info, victim_slot=2, victim_step=5)
    report = await run_simulation(config, SimulateOptions(concurrency=4, frames=10), backend=backend)
    failures = report.rounds[0].failures
    assert len(failures) == 1
    assert "first at frame 5" in failures[0]


class _SwappingBackend(SyntheticBackend):
    """A deliberately wrong model (a fake): answers slot 0 with slot 1's output once."""

    def step(self, rows, inputs, outputs):
        super().step(rows, inputs, outputs)
        if len(rows) >= 2 and rows[0] == 0 and rows[1] == 1 and not getattr(self, "_done", False):
            outputs[[0, 1]] = outputs[[1, 0]]
            self._done = True


async def test_guards_catch_outputs_sent_to_the_wrong_session():
    info = BackendInfo(name="synthetic", sample_rate=24000, frame_size=1920, slots=16)
    report = await run_simulation(_config(), SimulateOptions(concurrency=3, frames=6),
                                  backend=_SwappingBackend(info, {}))
    failures = report.rounds[0].failures
    assert len(failures) == 2
    assert all("first at frame 0" in f for f in failures)


async def test_paced_mode_reports_lag_and_late_frames_of_a_model_slower_than_real_time():
    """README: paced mode reports the frame lag, late frames and real-time factor.  Lag is
    measured on the real clock, so this runs in real time (about a second): a model whose step
    takes 100 ms cannot keep up with 80 ms frames, and the report must say so.  Only lower
    bounds, which a loaded machine can only exceed: every frame's output comes at least one step
    after it was sent, each session's 8 frames take 8 sequential steps."""
    report = await run_simulation(_config("backend.options.step_ms=100"),
                                  SimulateOptions(concurrency=3, frames=8, mode="paced"))
    (round_,) = report.rounds
    assert round_.ok, round_.failures
    lag = round_.frame_lag_ms
    assert lag.count == 3 * 8
    assert lag.min >= 90  # one 100 ms step, less the histogram's bucket rounding
    assert lag.max >= lag.p50 >= lag.min
    assert round_.late_frames == 3 * 8  # every frame later than the 80 ms threshold
    assert round_.real_time_factor >= 1.2  # 8 steps of 100 ms for 8 frames of 80 ms: 1.25


async def test_warmup_and_repeat_report_each_measured_round():
    report = await run_simulation(_config(), SimulateOptions(concurrency=2, frames=4, warmup_frames=3,
                                                             repeat=2))
    assert len(report.rounds) == 2
    assert all(r.frames_in == 8 for r in report.rounds)
    assert report.ok


async def test_offload_always_counts_a_hop_per_conversion_and_submit():
    report = await run_simulation(_config('runtime.offload="always"'),
                                  SimulateOptions(concurrency=2, frames=6))
    handoffs = report.rounds[0].handoffs
    assert handoffs["submit_offload"] == 12
    assert handoffs["convert_offload"] >= 6 + 2  # every input message and every output write
    assert report.rounds[0].measured.executor_submissions == handoffs["submit_offload"] + handoffs["convert_offload"]
    assert report.ok


async def test_an_in_process_round_carries_its_own_figures_and_none_of_a_server_s():
    """The figures only one path measures live in that path's part: an in-process round has
    every runtime figure, and no server figures to leave empty.  Its JSON row still names every
    figure of both paths, the other path's as null, as it always has."""
    from duplexrt.simulate.report import InProcessFigures

    report = await run_simulation(_config(), SimulateOptions(concurrency=2, frames=4))
    (round_,) = report.rounds
    assert isinstance(round_.measured, InProcessFigures) and round_.in_process
    assert round_.target == "in-process"
    assert all(value is not None for value in attrs.asdict(round_.measured).values())
    row = round_.as_dict()
    assert row["cpu_us_per_frame"] == round_.measured.cpu_us_per_frame
    assert row["server_cpu_us_per_frame"] is None and row["sessions_connected"] is None
    assert row["connection_errors"] == {} and row["notes"] == [] and row["target"] == "in-process"
    assert "measured" not in row and "lag_samples" not in row


@pytest.mark.parametrize("message_ms", [80.0, 160.0, 240.0])
def test_paced_sessions_start_spread_over_one_message_period(message_ms):
    """Live callers arrive at random phases: the first messages of N sessions tile one message
    period evenly, whatever its length, so that a message period has no empty part and no burst."""
    spec = AudioSpec.create(AudioFormat.PCM_F32LE, 24000, model_rate=24000)
    workload = Workload(spec, model_rate=24000, frame_size=1920, frames=8, message_ms=message_ms)
    phases = [workload.phase(i, 4) for i in range(4)]
    assert phases == pytest.approx([i * message_ms / 4000 for i in range(4)])
    assert max(phases) < workload.message_seconds
