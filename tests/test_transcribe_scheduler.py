"""The transcriber in the scheduler thread: stepped with any backend over the same rows and
frames, its pieces delivered in the step's own outcome (no crossing of its own), each caller's
transcript the package's own inference's, its last words flushed by the end-of-input mark."""

from __future__ import annotations

import numpy as np
import pytest
import trio

pytest.importorskip("torch")
pytest.importorskip("moshi")

from conftest import RecordingOwner, make_config  # noqa: E402
from duplexrt.config import ConfigError  # noqa: E402
from duplexrt.core.handoffs import HandoffKind  # noqa: E402
from duplexrt.runtime import open_runtime  # noqa: E402
from test_transcribe import Reference, voice  # noqa: E402

TINY = ("transcriber.enabled=true", "transcriber.tiny=true")


@pytest.fixture(scope="module")
def reference() -> Reference:
    return Reference()


async def _call(runtime, owner: RecordingOwner, audio: np.ndarray, *, ends: bool = True,
                started: trio.Event | None = None, go: trio.Event | None = None) -> None:
    """One caller: its frames (the first half, then wait for ``go``), the end-of-input mark as
    a session sends it, every output back, then the slot given back."""
    lease = runtime.scheduler.open_slot(owner)
    half = len(audio) // 2
    for i, frame in enumerate(audio):
        if i == half and go is not None:
            if started is not None:
                started.set()
            await go.wait()
        await lease.submit(np.ascontiguousarray(frame))
        await owner.wait_for(outputs=i + 1)
    if ends:
        await lease.submit(runtime.scheduler.end_of_input)
        await owner.wait_for(outputs=len(audio) + 1)
    lease.release()


@pytest.mark.parametrize("backend", ["echo", "synthetic"])
async def test_every_caller_gets_the_packages_transcript_whatever_the_backend(backend, reference):
    config = make_config(f"backend.name={backend}", "runtime.slots=3", *TINY)
    async with open_runtime(config) as runtime:
        first, second, third = RecordingOwner(), RecordingOwner(), RecordingOwner()
        audio = [voice(30, 10), voice(31, 8), voice(32, 6)]
        half_way = trio.Event()
        async with trio.open_nursery() as nursery:
            # The second joins while the first is half-way; the third reuses a slot after.
            go = trio.Event()
            nursery.start_soon(lambda: _call(runtime, first, audio[0], started=half_way, go=go))
            await half_way.wait()
            nursery.start_soon(_call, runtime, second, audio[1])
            go.set()
        await _call(runtime, third, audio[2])
        for owner, call_audio in zip((first, second, third), audio):
            assert owner.failures == []
            assert [p.text for p in owner.transcripts if p.text] == reference.text(call_audio)
            assert [p.frame for p in owner.transcripts] == sorted(p.frame for p in owner.transcripts)
        stages = runtime.statistics().histograms.stages
        assert "transcribe" in stages


async def test_a_caller_that_leaves_without_ending_gets_its_words_so_far(reference):
    config = make_config("runtime.slots=2", *TINY)
    async with open_runtime(config) as runtime:
        owner = RecordingOwner()
        audio = voice(33, 9)
        await _call(runtime, owner, audio, ends=False)
        assert [p.text for p in owner.transcripts if p.text] == reference.text(audio, flush=False)


async def test_transcripts_cross_with_the_steps_outputs_not_on_their_own(reference):
    # The crossings a call with a transcript causes: only the scheduler's own kinds (no worker
    # thread of any sort), and never more output deliveries than steps: the pieces ride in the
    # step's outcome, with its outputs.
    config = make_config("runtime.slots=2", *TINY)
    async with open_runtime(config) as runtime:
        owner = RecordingOwner()
        await _call(runtime, owner, voice(34, 6))
        stats = runtime.statistics()
    assert [p.text for p in owner.transcripts if p.text] == reference.text(voice(34, 6))
    by_kind = stats.handoffs.by_kind
    used = {kind for kind, n in by_kind.items() if n}
    assert used <= {HandoffKind.SCHEDULER_WAKE.value, HandoffKind.OUTPUT_DELIVERY.value, HandoffKind.LIFECYCLE.value}
    assert stats.handoffs.offloads == 0
    assert 0 < by_kind[HandoffKind.OUTPUT_DELIVERY.value] <= stats.scheduler.steps


def test_a_transcriber_needs_mimis_frames():
    with pytest.raises(ConfigError, match="audio.frame_size = 1920"):
        make_config("audio.frame_size=960", *TINY)


async def test_a_transcriber_that_fails_a_step_fails_no_call(reference, caplog):
    config = make_config("runtime.slots=2", *TINY)
    async with open_runtime(config) as runtime:
        transcriber = runtime.transcriber
        assert transcriber is not None
        real = transcriber.step
        calls = {"n": 0}

        def sometimes(rows, inputs):
            calls["n"] += 1
            if calls["n"] in (3, 4):
                raise RuntimeError("injected transcriber failure")
            return real(rows, inputs)

        transcriber.step = sometimes  # the scheduler thread looks it up each step
        owner = RecordingOwner()
        audio = voice(35, 8)
        await _call(runtime, owner, audio)
        assert owner.failures == [] and len(owner.outputs) == len(audio) + 1
        assert runtime.scheduler.transcriber_failures == 2
    # Up to the failure, the words are the reference's; the two failed steps wrote nothing (the
    # row's stream missed those frames, so what follows is its own), and words go on after them.
    table = reference.table
    before = [table[t] for t in reference.tokens(audio)[:2] if table[t]]
    assert [p.text for p in owner.transcripts if p.text and p.frame < 2] == before
    assert not [p for p in owner.transcripts if p.frame in (2, 3)]
    assert [p for p in owner.transcripts if p.frame > 3]
    assert sum("the transcriber failed a step" in r.message for r in caplog.records) == 1
    assert any("the transcriber steps again" in r.message for r in caplog.records)


async def test_a_transcriber_that_cannot_load_stops_the_start_and_says_why(tmp_path):
    from duplexrt.core.scheduler import BackendLoadError

    missing = tmp_path / "no-such-stt"
    config = make_config("transcriber.enabled=true", f'transcriber.checkpoint="{missing}"')
    with pytest.raises(BackendLoadError, match=r"^the transcriber failed to load: transcriber.checkpoint: "
                                                 r"no checkpoint directory at .*no-such-stt"):
        async with open_runtime(config):
            pass


async def test_a_transcriber_refuses_a_dialogue_checkpoint(tmp_path):
    from duplexrt.backends.moshi.tiny import save_tiny_checkpoint
    from duplexrt.core.scheduler import BackendLoadError

    directory = save_tiny_checkpoint(tmp_path / "moshi", 0)
    config = make_config("transcriber.enabled=true", f'transcriber.checkpoint="{directory}"')
    with pytest.raises(BackendLoadError, match="is not a speech-to-text model"):
        async with open_runtime(config):
            pass
