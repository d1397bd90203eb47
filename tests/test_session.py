"""Sessions end to end: raw-protocol clients over in-memory transports, real runtime, real codecs.

Each test builds the exact bytes a session must send back (the client's messages decoded and
framed as the server does it, run through the synthetic model's known function, encoded in the
session's format) and compares; thread crossings are read from the runtime's own counters.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import trio
import trio.testing

from conftest import (
    FRAME,
    INPUT_END,
    MODEL_RATE,
    PATIENCE,
    ClientLog,
    ControlledBackend,
    cut_points,
    frames_for,
    make_config,
    model_frames,
    noise,
    receive_all,
    run_client,
    run_session,
    run_sessions,
    send_all,
    spec,
    synthetic_out,
    synthetic_wire,
    wire_messages,
)
from duplexrt.audio import AudioSpec, make_decoder
from duplexrt.core.handoffs import OFFLOAD_KINDS, HandoffKind
from duplexrt.runtime import Runtime, open_runtime
from duplexrt.protocols.events import AudioIn
from duplexrt.protocols.raw import RawTranslator
from duplexrt.reasons import CloseCode
from duplexrt.wire.transport import TransportClosed, memory_transport_pair

SYNTHETIC = ("backend.name=synthetic",)


def pcm_workload(wire_format: str, frames: float, seed: int) -> tuple[list[bytes], AudioSpec]:
    """About ``frames`` frames of noise at the format's default rate, cut into messages of varied
    lengths that are not multiples of a frame."""
    wire = spec(wire_format)
    samples = int(frames * FRAME * wire.sample_rate / MODEL_RATE)
    return wire_messages(noise(samples, seed), wire, cut_points(samples, seed + 1000)), wire


def assert_slot_freed(runtime: Runtime, slot: int) -> None:
    scheduler = runtime.scheduler
    assert scheduler.free_slots == runtime.config.runtime.slots
    assert scheduler.inbox.queued(slot) == 0
    assert scheduler.inbox.open_count() == 0
    assert runtime.sessions == set()
    assert runtime.metrics.sessions_active == 0


# -- order and content ------------------------------------------------------------------------------


async def test_sixteen_concurrent_sessions_each_get_exactly_their_own_output_in_order():
    config = make_config("runtime.slots=16", "runtime.inbox_depth=3", "runtime.outbox_depth=2", *SYNTHETIC)
    workloads = []
    for i in range(16):
        messages, wire = pcm_workload("pcm_f32le", 9 + (i * 5) % 11 + 0.37, seed=i)
        workloads.append((messages, wire, 1 + 3 * i))  # ids not in slot order
    async with open_runtime(config) as runtime:
        runs = await run_sessions(runtime, workloads)
        stats = runtime.statistics()
    for (messages, wire, session_id), run in zip(workloads, runs, strict=True):
        frames = model_frames(messages, wire)
        assert run.end.reason == "stop", run.end
        assert run.end.frames_in == run.end.frames_out == len(frames)
        assert run.client.end["reason"] == "stop"
        assert run.client.end["usage"]["frames_out"] == len(frames)
        assert run.client.errors == []
        assert run.client.close_code == 1000
        got = np.frombuffer(bytes(run.client.audio), dtype="<f4").reshape(-1, FRAME)
        assert got.shape[0] == len(frames), f"session {session_id}"
        for k, frame in enumerate(frames):
            np.testing.assert_array_equal(got[k], synthetic_out(frame, session_id, k),
                                          err_msg=f"session {session_id} frame {k}")
    assert stats.scheduler.max_batch > 1  # they really were stepped together
    assert stats.handoffs.offloads == 0


# -- thread crossings, counted ------------------------------------------------------------------------


@pytest.mark.parametrize("wire_format", ["pcm_f32le", "pcm_s16le", "g711_ulaw", "g711_alaw"])
async def test_pcm_and_g711_sessions_use_no_worker_threads(wire_format):
    config = make_config("runtime.slots=4", *SYNTHETIC)
    workloads = []
    for i in range(3):
        messages, wire = pcm_workload(wire_format, 6.5 + i, seed=100 + i)
        workloads.append((messages, wire, 7 + i))
    async with open_runtime(config) as runtime:
        runs = await run_sessions(runtime, workloads)
        stats = runtime.handoffs.statistics()
        sched = runtime.scheduler.statistics()
    assert stats.offloads == 0
    for kind in OFFLOAD_KINDS:
        assert stats[kind] == 0, kind
    assert 1 <= stats[HandoffKind.OUTPUT_DELIVERY] <= sched.steps
    assert stats[HandoffKind.LIFECYCLE] == 1  # "started" (read while it still runs)
    total = 0
    for (messages, wire, session_id), run in zip(workloads, runs, strict=True):
        frames = model_frames(messages, wire)
        total += len(frames)
        assert run.end.reason == "stop"
        assert run.end.frames_out == len(frames)
        assert bytes(run.client.audio) == synthetic_wire(frames, session_id, wire)
    assert sched.frames == total


async def test_opus_decodes_once_per_message_on_a_worker_thread():
    config = make_config("runtime.slots=4", *SYNTHETIC)
    wire = spec("opus")
    assert wire.sample_rate == MODEL_RATE
    workloads = []
    for i in range(2):
        samples = 7 * FRAME + 333 * i
        pages = wire_messages(noise(samples, seed=200 + i, scale=0.2), wire, cut_points(samples, 300 + i))
        # An Ogg stream may be split anywhere: re-cut it into messages of a few hundred bytes.
        stream = b"".join(pages)
        cuts = np.cumsum(np.random.default_rng(250 + i).integers(50, 400, size=len(stream) // 50))
        bounds = [0, *[int(c) for c in cuts if c < len(stream)], len(stream)]
        messages = [stream[a:b] for a, b in zip(bounds, bounds[1:])]
        assert len(messages) > 10
        workloads.append((messages, wire, 30 + i))
    async with open_runtime(config) as runtime:
        runs = await run_sessions(runtime, workloads)
        stats = runtime.handoffs.statistics()
    sent = sum(run.client.audio_sent for run in runs)
    assert sent == sum(len(messages) for messages, _, _ in workloads)
    assert stats[HandoffKind.DECODE_OFFLOAD] == sent
    assert stats[HandoffKind.FULL_INBOX_OFFLOAD] == 0
    assert stats[HandoffKind.CONVERT_OFFLOAD] == 0
    assert stats[HandoffKind.SUBMIT_OFFLOAD] == 0
    assert stats.offloads == sent
    for (messages, _, session_id), run in zip(workloads, runs, strict=True):
        frames = model_frames(messages, wire)
        assert run.end.reason == "stop"
        assert run.end.frames_in == run.end.frames_out == len(frames)
        # The reply is an Ogg Opus stream carrying one model frame per input frame.
        decoder = make_decoder(wire, MODEL_RATE)
        decoded = np.concatenate([decoder.decode(bytes(run.client.audio)), decoder.flush()])
        assert len(frames) * FRAME <= decoded.size < (len(frames) + 1) * FRAME
        # ... and it is that output: the synthetic model's known answer through a lossy codec
        # (compared by correlation at the codec's delay, not bit for bit).
        want = np.concatenate([synthetic_out(frame, session_id, k) for k, frame in enumerate(frames)])
        best = max((float(np.dot(want[:want.size - lag], decoded[lag:want.size])
                          / (np.linalg.norm(want[:want.size - lag]) * np.linalg.norm(decoded[lag:want.size]))),
                    lag) for lag in range(0, 400, 4))
        assert best[0] > 0.75, best  # 0.84 at 156 samples, measured; another signal gives ~0


async def test_offload_always_sends_every_conversion_and_submit_through_a_worker_thread():
    config = make_config("runtime.slots=4", "runtime.offload=always", *SYNTHETIC)
    workloads = []
    for i in range(2):
        messages, wire = pcm_workload("pcm_f32le", 8.6 + i, seed=400 + i)
        workloads.append((messages, wire, 50 + i))
    async with open_runtime(config) as runtime:
        runs = await run_sessions(runtime, workloads)
        stats = runtime.handoffs.statistics()
        frames_in = runtime.metrics.frames_in
    messages_sent = sum(run.client.audio_sent for run in runs)
    frames_out = sum(run.end.frames_out for run in runs)
    assert frames_in == frames_out == sum(len(model_frames(m, w)) for m, w, _ in workloads)
    assert stats[HandoffKind.SUBMIT_OFFLOAD] == frames_in
    # One decode per message, plus one encode per batch the writers sent (at least one each,
    # at most one per frame).
    assert messages_sent + len(runs) <= stats[HandoffKind.CONVERT_OFFLOAD] <= messages_sent + frames_out
    assert stats[HandoffKind.DECODE_OFFLOAD] == 0
    assert stats[HandoffKind.FULL_INBOX_OFFLOAD] == 0
    assert stats.offloads == stats[HandoffKind.SUBMIT_OFFLOAD] + stats[HandoffKind.CONVERT_OFFLOAD]
    for (messages, wire, session_id), run in zip(workloads, runs, strict=True):
        assert bytes(run.client.audio) == synthetic_wire(model_frames(messages, wire), session_id, wire)


# -- sessions that end early ----------------------------------------------------------------------------


async def test_cancelled_session_frees_its_slot_and_queued_frames():
    depth = 3
    config = make_config("runtime.slots=2", f"runtime.inbox_depth={depth}")
    backend = ControlledBackend(config, stalled=True)
    messages, wire = pcm_workload("pcm_f32le", 12.5, seed=500)
    async with open_runtime(config, backend=backend) as runtime:
        client, server = memory_transport_pair()
        log = ClientLog()
        served = trio.Event()
        try:
            async with trio.open_nursery() as nursery:
                async def serve(task_status=trio.TASK_STATUS_IGNORED) -> None:
                    with trio.CancelScope() as scope:
                        task_status.started(scope)
                        await runtime.serve(server, input_spec=wire, session_id=1)
                    served.set()

                scope = await nursery.start(serve)
                nursery.start_soon(run_client, client, messages, log)
                await backend.wait_stalled()
                await trio.testing.wait_all_tasks_blocked()
                (session,) = runtime.sessions
                slot = session.lease.slot
                assert runtime.scheduler.inbox.queued(slot) == depth - 1  # mid-stream, frames queued
                assert runtime.metrics.sessions_active == 1
                scope.cancel()
                with trio.fail_after(PATIENCE):
                    await served.wait()
                # Freed at once, while the model is still stalled.
                assert_slot_freed(runtime, slot)
        finally:
            backend.release()
        assert log.close_code is not None  # the client was told and let go
        assert log.audio_messages == 0

        # The slot serves a new session; the stalled step's output went to nobody.
        messages2, _ = pcm_workload("pcm_f32le", 3.2, seed=501)
        run = await run_session(runtime, messages2, wire, session_id=2)
        assert bytes(run.client.audio) == synthetic_wire(model_frames(messages2, wire), 2, wire)
        assert_slot_freed(runtime, slot)


async def test_cancelled_session_tells_the_client_it_was_shut_down():
    config = make_config("runtime.slots=2", *SYNTHETIC)
    messages, wire = pcm_workload("pcm_f32le", 30.5, seed=510)
    async with open_runtime(config) as runtime:
        client, server = memory_transport_pair()
        log = ClientLog()
        async with trio.open_nursery() as nursery:
            async def serve(task_status=trio.TASK_STATUS_IGNORED) -> None:
                with trio.CancelScope() as scope:
                    task_status.started(scope)
                    await runtime.serve(server, input_spec=wire, session_id=1)

            scope = await nursery.start(serve)
            nursery.start_soon(run_client, client, messages, log)
            with trio.fail_after(PATIENCE):
                await log.got_audio.wait()
            scope.cancel()  # the runtime's owner stops serving mid-stream
        assert log.end is not None
        assert log.end["reason"] == "shutdown", log.end
        assert log.close_code == 1001
        assert runtime.scheduler.free_slots == 2 and runtime.metrics.sessions_active == 0


async def test_client_closing_mid_stream_ends_the_session_and_frees_its_slot():
    config = make_config("runtime.slots=2", "runtime.inbox_depth=2", *SYNTHETIC)
    messages, wire = pcm_workload("pcm_f32le", 40.5, seed=520)
    async with open_runtime(config) as runtime:
        client, server = memory_transport_pair()
        log = ClientLog()
        result = {}
        slot_seen = []

        async def serve() -> None:
            result["end"] = await runtime.serve(server, input_spec=wire, session_id=1)

        async def client_side() -> None:
            async with trio.open_nursery() as inner:
                inner.start_soon(send_all, client, messages, log)
                inner.start_soon(receive_all, client, log)
                await log.got_audio.wait()
                (session,) = runtime.sessions
                slot_seen.append(session.lease.slot)
                await client.close()  # hang up, mid-stream, without input.end
                inner.cancel_scope.cancel()

        with trio.fail_after(PATIENCE):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve)
                nursery.start_soon(client_side)
        end = result["end"]
        assert end.reason == "client_closed"
        assert 0 < end.frames_out <= end.frames_in < len(model_frames(messages, wire))
        assert log.end is None  # nobody left to tell
        assert_slot_freed(runtime, slot_seen[0])

        # and the runtime goes on serving
        messages2, _ = pcm_workload("pcm_f32le", 2.5, seed=521)
        run = await run_session(runtime, messages2, wire, session_id=2)
        assert bytes(run.client.audio) == synthetic_wire(model_frames(messages2, wire), 2, wire)


# -- bad input -----------------------------------------------------------------------------------------


async def test_bad_input_gets_error_events_and_the_session_goes_on():
    config = make_config("runtime.slots=4", *SYNTHETIC)
    s16 = spec("pcm_s16le")
    good = [wire_messages(noise(n, seed=600 + n), s16, [n])[0] for n in (2500, 3001, 1777, 4000)]
    odd = good[0][:1001]  # 1001 bytes: half a sample too many
    assert len(odd) % 2 == 1
    bad_session = [
        good[0], odd, good[1], "{not json", good[2],
        json.dumps({"type": "speak.now"}), json.dumps([1, 2]), json.dumps({"type": 5}),
        json.dumps({"type": "ping"}), good[3],
    ]
    healthy, f32 = pcm_workload("pcm_f32le", 10.3, seed=610)
    async with open_runtime(config) as runtime:
        bad_run, healthy_run = await run_sessions(runtime, [(bad_session, s16, 1), (healthy, f32, 2)])

    codes = [error["code"] for error in bad_run.client.errors]
    assert codes == ["invalid_audio", "invalid_json", "unknown_event", "invalid_event", "invalid_event"]
    assert "1001 bytes" in bad_run.client.errors[0]["message"]
    assert all(error["message"] for error in bad_run.client.errors)
    # The rejected message is skipped whole; everything around it goes through.
    frames = model_frames(good, s16)
    assert bad_run.end.reason == "stop"
    assert bad_run.end.frames_out == len(frames) == frames_for(2500 + 3001 + 1777 + 4000)
    assert bytes(bad_run.client.audio) == synthetic_wire(frames, 1, s16)
    assert bad_run.client.close_code == 1000
    assert bad_run.client.pongs == 1

    assert healthy_run.client.errors == []
    assert healthy_run.end.reason == "stop"
    assert bytes(healthy_run.client.audio) == synthetic_wire(model_frames(healthy, f32), 2, f32)


async def test_non_finite_f32_messages_are_refused_and_loud_ones_clipped():
    config = make_config("runtime.slots=4", *SYNTHETIC)
    f32 = spec("pcm_f32le")
    good = [wire_messages(noise(n, seed=650 + n), f32, [n])[0] for n in (2500, 3001, 1777)]
    nan, inf = noise(960, seed=660), noise(960, seed=661)
    nan[10] = np.nan
    inf[900:] = -np.inf
    loud = noise(2000, seed=662, scale=3.0)
    session = [good[0], nan.tobytes(), good[1], inf.tobytes(), loud.tobytes(), good[2]]
    healthy, _ = pcm_workload("pcm_f32le", 6.3, seed=663)
    async with open_runtime(config) as runtime:
        run, healthy_run = await run_sessions(runtime, [(session, f32, 1), (healthy, f32, 2)])

    assert [error["code"] for error in run.client.errors] == ["invalid_audio", "invalid_audio"]
    assert "1 NaN or infinite sample (the first at sample 10)" in run.client.errors[0]["message"]
    assert "60 NaN or infinite samples (the first at sample 900)" in run.client.errors[1]["message"]
    # The refused messages are skipped whole; the loud one goes through clipped to [-1, 1].
    frames = model_frames([good[0], good[1], np.clip(loud, -1, 1).tobytes(), good[2]], f32)
    assert run.end.reason == "stop" and run.end.frames_out == len(frames)
    assert bytes(run.client.audio) == synthetic_wire(frames, 1, f32)
    assert healthy_run.client.errors == []
    assert bytes(healthy_run.client.audio) == synthetic_wire(model_frames(healthy, f32), 2, f32)


# -- model failure -------------------------------------------------------------------------------------


async def test_backend_step_failure_ends_the_session_with_1011_and_later_sessions_work(caplog):
    config = make_config("runtime.slots=2")
    backend = ControlledBackend(config, fail_on=[3])
    messages, wire = pcm_workload("pcm_f32le", 12.5, seed=700)
    async with open_runtime(config, backend=backend) as runtime:
        failed = await run_session(runtime, messages, wire, session_id=1)
        assert failed.end.reason == "error"
        # The client hears a generic message with an id, never the backend's exception text...
        assert re.fullmatch(r"the model failed on this step \(error id (err_[0-9a-f]+)\)", failed.end.error)
        error_id = failed.end.error.split()[-1].rstrip(")")
        client_end = failed.client.end
        assert client_end is not None and client_end["reason"] == "error"
        assert client_end["error"] == failed.end.error
        assert failed.client.close_reason == failed.end.error
        # ... which the log has in full, under the same id.
        # (At info the session's end line names the id too; the traceback is in the error record.)
        [logged] = [r for r in caplog.records if error_id in r.getMessage() and r.exc_info]
        assert logged.levelname == "ERROR" and "injected failure on step 3" in str(logged.exc_info[1])
        assert client_end["usage"]["frames_out"] == failed.end.frames_out <= 2
        assert failed.client.close_code == CloseCode.INTERNAL_ERROR == 1011
        # What did arrive before the failure is right.
        frames = model_frames(messages, wire)
        got = bytes(failed.client.audio)
        assert got == synthetic_wire(frames, 1, wire)[:len(got)]
        assert runtime.scheduler.free_slots == 2 and runtime.sessions == set()

        later, _ = pcm_workload("pcm_f32le", 5.1, seed=701)
        run = await run_session(runtime, later, wire, session_id=2)
        assert run.end.reason == "stop" and run.client.errors == []
        assert bytes(run.client.audio) == synthetic_wire(model_frames(later, wire), 2, wire)
        assert runtime.scheduler.ready


# -- the end of input ------------------------------------------------------------------------------------


@pytest.mark.parametrize("sizes", [[1000, 3000, 2460], [1919], [1921], [3840, 1]])
async def test_input_end_pads_and_returns_the_last_partial_frame(sizes):
    config = make_config("runtime.slots=2", *SYNTHETIC)
    wire = spec("pcm_f32le")
    total = sum(sizes)
    signal = noise(total, seed=800)
    messages = wire_messages(signal, wire, sizes)
    async with open_runtime(config) as runtime:
        run = await run_session(runtime, messages, wire, session_id=9)
    frames = frames_for(total)
    assert total % FRAME != 0
    assert run.end.frames_in == run.end.frames_out == frames
    assert run.client.end["usage"]["frames_out"] == frames
    got = np.frombuffer(bytes(run.client.audio), dtype="<f4").reshape(-1, FRAME)
    assert got.shape == (frames, FRAME)
    last = np.zeros(FRAME, dtype=np.float32)
    tail = total - (frames - 1) * FRAME
    last[:tail] = signal[(frames - 1) * FRAME:]
    np.testing.assert_array_equal(got[-1], synthetic_out(last, 9, frames - 1))
    np.testing.assert_array_equal(got[0], synthetic_out(signal[:FRAME] if total >= FRAME else last, 9, 0))


async def test_input_end_with_nothing_sent_ends_cleanly():
    config = make_config("runtime.slots=2", *SYNTHETIC)
    async with open_runtime(config) as runtime:
        client, server = memory_transport_pair()
        log = ClientLog()
        async with trio.open_nursery() as nursery:
            ends = []

            async def serve() -> None:
                ends.append(await runtime.serve(server, session_id=3))

            nursery.start_soon(serve)
            await run_client(client, [], log)
        assert ends[0].reason == "stop" and ends[0].frames_out == 0
        assert ends[0].generation_seconds == 0.0  # nothing was generated
        assert log.messages_sent == 0  # nothing but input.end
        assert log.end["usage"]["frames_in"] == 0 and log.audio_messages == 0
        assert runtime.scheduler.free_slots == 2


async def test_a_reconfigure_event_carries_the_new_formats_to_the_session():
    """The session takes the new wire formats from the event, not by reading the translator
    back: a translator that announces PCM s16 output while its own fields still say f32 gets
    s16 audio from then on."""
    from duplexrt.protocols.events import Reconfigure
    from duplexrt.protocols.raw import RawTranslator

    f32, s16 = spec("pcm_f32le"), spec("pcm_s16le")

    class Switching(RawTranslator):
        def parse(self, message):
            if message == "switch":
                return Reconfigure(input_spec=f32, output_spec=s16, messages=("switched",))
            return super().parse(message)

    config = make_config("runtime.slots=1", "backend.name=echo", "backend.options.delay_frames=0")
    frame = noise(FRAME, seed=3)
    async with open_runtime(config) as runtime:
        client, server = memory_transport_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(runtime.serve, server, Switching(f32, f32))
            await client.send("switch")
            assert await client.receive() == "switched"
            await client.send(frame.astype("<f4").tobytes())
            out = await client.receive()
            await client.close()
    assert len(out) == FRAME * 2  # two bytes a sample: encoded as the event said
    assert np.abs(np.frombuffer(out, "<i2") / 32768 - frame).max() < 1e-3


# -- what the translator says, in the order it says it ----------------------------------------------


class FlipOnSecondAudio(RawTranslator):
    """A translator whose reading of an audio message changes what ``audio_out`` says, as the
    Realtime server VAD does when a pause ends a turn and opens a response: the second audio
    message comes with "flipped", and every batch of output after it is announced by "after"."""

    def __init__(self, spec) -> None:
        super().__init__(spec)
        self.audio_read = 0

    def parse(self, message):
        event = super().parse(message)
        if isinstance(event, AudioIn):
            self.audio_read += 1
            if self.audio_read == 2:
                return AudioIn(event.payload, (json.dumps({"type": "flipped"}),))
        return event

    def audio_out(self, payload: bytes, frames: int):
        said = super().audio_out(payload, frames)
        return [json.dumps({"type": "after"}), *said] if self.audio_read >= 2 else said


async def test_what_reading_an_audio_message_said_goes_out_before_output_delivered_while_it_waits_for_credit():
    """The second message waits for credit (inbox depth 1) while the first frame's step is
    delivered: that output, already announced as "after" by the translator, must follow the
    "flipped" the translator said while reading the message."""
    config = make_config("runtime.slots=1", "runtime.inbox_depth=1", "runtime.outbox_depth=1")
    backend = ControlledBackend(config, stalled=True)
    wire = spec("pcm_f32le")
    frame = noise(FRAME, seed=12)
    async with open_runtime(config, backend=backend) as runtime:
        client, server = memory_transport_pair()
        texts: list[str] = []

        async def serve() -> None:
            await runtime.serve(server, FlipOnSecondAudio(wire), session_id=1)

        with trio.fail_after(PATIENCE):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve)
                await client.send(frame.tobytes())
                await backend.wait_stalled()  # frame 1 is in its step
                await client.send(frame.tobytes())  # read: "flipped"; then it waits for credit
                await trio.testing.wait_all_tasks_blocked()
                backend.release()
                await client.send(INPUT_END)
                while True:
                    try:
                        message = await client.receive()
                    except TransportClosed:
                        break
                    if isinstance(message, str):
                        texts.append(json.loads(message)["type"])
    assert texts.index("flipped") < texts.index("after")
