"""Each row's K/V ring (``backends/moshi/ring.py``) on the tiny seeded Moshi, whose own context is
64 positions (5.12 s): a call within a shorter ring is the full-context model's call; a call
past it ends with ``length`` ("end") or goes on forgetting ("slide"); the state a row allocates
follows the ring, measured from the tensors; bad values are refused by name; the ring is shown
where the slots are.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import trio

os.environ.setdefault("NO_TORCH_COMPILE", "1")

from conftest import INPUT_END, run_session, spec  # noqa: E402
from duplexrt.backends.base import BackendInfo, SlotSession  # noqa: E402
from duplexrt.config import ConfigError, load_config  # noqa: E402
from duplexrt.runtime import open_runtime  # noqa: E402

torch = pytest.importorskip("torch")
pytest.importorskip("moshi")

from duplexrt.backends.moshi import MoshiBackend, memory, ring  # noqa: E402
from test_backend_moshi_memory import _state_bytes  # noqa: E402

FRAME = 1920
TINY_POSITIONS = 64
F32 = spec("pcm_f32le")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "moshi-tiny.toml")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _backend(slots: int = 2, **options) -> MoshiBackend:
    backend = MoshiBackend(BackendInfo("moshi", 24000, FRAME, slots),
                           {"tiny": True, "warmup_steps": 1, "greedy": True, **options})
    backend.load()
    return backend


def _signal(seed: int, frames: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((frames, FRAME)) * 0.3).astype(np.float32)


def _call(backend: MoshiBackend, frames: np.ndarray, slot: int = 0, session_id: int = 7):
    """One session in ``slot``, alone, frame by frame: its audio and text."""
    backend.open_slot(slot, SlotSession(session_id))
    rows = np.array([slot], dtype=np.int64)
    audio, texts = [], []
    for frame in frames:
        out = np.full((1, FRAME), np.nan, dtype=np.float32)
        texts += backend.step(rows, frame[None], out)
        audio.append(out[0].copy())
    backend.close_slot(slot)
    return np.stack(audio), texts


# -- the model's answers ----------------------------------------------------------------------------


def test_a_call_within_the_ring_is_the_full_context_models_call_and_past_it_forgets():
    """Greedy, a 20-position ring against the model's own 64: the first 20 frames give the same
    text and audio (float tolerance: the attention sums over rings of different lengths); with
    "slide", the call goes on past 20, and from there the short ring's model has forgotten its
    first frames, so it answers differently: the ring really is 20 positions."""
    frames = _signal(3, 34)
    full = _backend()
    short = _backend(context_seconds=1.6, beyond_context="slide")  # 1.6 s x 12.5 = 20 positions
    try:
        assert (full.ring.positions, short.ring.positions) == (TINY_POSITIONS, 20)
        audio_full, text_full = _call(full, frames)
        audio_short, text_short = _call(short, frames)
    finally:
        full.close()
        short.close()
    assert np.isfinite(audio_short).all() and np.abs(audio_full[4:20]).max() > 0
    assert text_short[:20] == text_full[:20]
    np.testing.assert_allclose(audio_short[:20], audio_full[:20], rtol=1e-4, atol=1e-5)
    assert len(audio_short) == 34  # "slide" goes on past the ring
    later = np.abs(audio_short[22:] - audio_full[22:]).max()
    assert later > 1e-3, "past its ring the short model still answered as if it remembered everything"


@pytest.mark.parametrize("beyond", ["end", "slide"])
def test_a_slot_after_a_call_that_filled_or_wrapped_its_ring_is_a_fresh_slot(beyond):
    """A call of twice the ring (its ring filled, and under "slide" overwritten all around), then
    another session in the same slot: it gets exactly what it gets in a fresh backend."""
    used = _backend(context_seconds=0.8, beyond_context=beyond)  # 10 positions
    fresh = _backend(context_seconds=0.8, beyond_context=beyond)
    try:
        _call(used, _signal(5, 20))
        second = _signal(6, 8)
        audio_used, text_used = _call(used, second, session_id=9)
        audio_fresh, text_fresh = _call(fresh, second, session_id=9)
    finally:
        used.close()
        fresh.close()
    assert text_used == text_fresh and np.array_equal(audio_used, audio_fresh)


# -- through the runtime ------------------------------------------------------------------------------


def _tiny(*overrides: str):
    return load_config(TINY, ["runtime.slots=2", "runtime.gather_window_ms=1", "backend.options.warmup_steps=1",
                              "runtime.late_input=wait", "metrics.log_stats=false", *overrides])


def _frames_bytes(seed: int, frames: int) -> bytes:
    return _signal(seed, frames).tobytes()


@pytest.mark.parametrize("beyond, expected", [("end", ("length", 10)), ("slide", ("stop", 25))])
async def test_a_call_longer_than_the_ring_ends_with_length_or_slides_on(beyond, expected):
    """25 frames at a 10-position ring, flooded: 12 frames in one message (past the ring's end in
    the middle of it), then the rest in pieces that split frames.  "end": the call is answered
    for the 10 frames the ring holds and ends with ``length``, a normal close; "slide": all 25."""
    config = _tiny("backend.options.context_seconds=0.8", f'backend.options.beyond_context="{beyond}"')
    data = _frames_bytes(8, 25)
    messages = [data[:12 * FRAME * 4]] + [data[i:i + 5000] for i in range(12 * FRAME * 4, len(data), 5000)]
    async with open_runtime(config) as runtime:
        run = await run_session(runtime, [*messages, INPUT_END], F32, session_id=3)
        after = await run_session(runtime, [_frames_bytes(9, 3), INPUT_END], F32, session_id=4)
        free = runtime.scheduler.free_slots
    reason, frames = expected
    assert run.end.reason == reason and run.client.end["reason"] == reason
    assert run.end.frames_in == run.end.frames_out == frames
    assert len(run.client.audio) == frames * FRAME * 4 and run.client.close_code == 1000
    assert after.end.reason == "stop" and after.end.frames_out == 3 and free == 2


async def test_a_peer_that_floods_past_the_ring_and_drops_leaves_its_slot_fresh():
    """15 frames at a 10-position ring in one message, then the connection dropped without a
    word or a read: the session ends, its slot comes back, and the next call in it is a fresh
    call (the same audio as in a new runtime)."""
    from duplexrt.wire.transport import memory_transport_pair

    config = _tiny("runtime.slots=1", "backend.options.context_seconds=0.8", 'backend.options.beyond_context="end"')
    follow = [_frames_bytes(13, 4), INPUT_END]
    async with open_runtime(config) as runtime:
        client, server = memory_transport_pair()
        ended = []
        async with trio.open_nursery() as nursery:
            async def serve() -> None:
                ended.append(await runtime.serve(server, input_spec=F32, session_id=8))

            nursery.start_soon(serve)
            await client.send(_frames_bytes(12, 15))
            await client.close(1001, "gone")
        free = runtime.scheduler.free_slots
        after = await run_session(runtime, follow, F32, session_id=9)
    async with open_runtime(config) as runtime:
        fresh = await run_session(runtime, follow, F32, session_id=9)
    assert ended and ended[0].frames_in <= 10 and free == 1
    assert after.end.reason == "stop" and bytes(after.client.audio) == bytes(fresh.client.audio)


@pytest.mark.parametrize("ring_s, cap_s", [(0.8, 0.4), (0.4, 0.8)])
async def test_with_runtime_max_session_seconds_too_the_shorter_cap_ends_the_call(ring_s, cap_s):
    config = _tiny(f"backend.options.context_seconds={ring_s}", 'backend.options.beyond_context="end"',
                   f"runtime.max_session_seconds={cap_s}")  # 5 frames either way
    async with open_runtime(config) as runtime:
        run = await run_session(runtime, [_frames_bytes(10, 12), INPUT_END], F32, session_id=5)
    assert run.end.reason == "length" and run.end.frames_out == 5


async def test_unset_the_ring_is_cut_to_runtime_max_session_seconds_and_holds_every_call_whole(caplog):
    """No call outlasts ``runtime.max_session_seconds``, so no row needs a longer ring: unset,
    ``context_seconds`` follows it (here 0.8 s, 10 positions of the model's 64), and the call,
    ended at 10 frames, was heard whole: the same audio as the full-context model's."""
    frames = _frames_bytes(14, 14)
    ends = {}
    for name, overrides in (("capped", ["runtime.max_session_seconds=0.8"]),
                            ("full", ["runtime.max_session_seconds=0.8", "backend.options.context_seconds=5.12"])):
        with caplog.at_level("INFO", logger="duplexrt.backends.moshi"):
            async with open_runtime(_tiny("backend.options.greedy=true", *overrides)) as runtime:
                choice = runtime.scheduler.slot_choice
                ends[name] = (choice, await run_session(runtime, [frames, INPUT_END], F32, session_id=2))
    capped, full = ends["capped"], ends["full"]
    assert capped[0].details["ring"]["positions"] == 10 and capped[0].details["ring"]["source"] == "max_session_seconds"
    assert "as runtime.max_session_seconds caps calls" in capped[0].reason
    assert full[0].details["ring"]["positions"] == TINY_POSITIONS
    assert capped[0].details["bytes_per_slot"]["lm_kv"] == 2 * 2 * 64 * 10 * 4
    for _, run in (capped, full):
        assert run.end.reason == "length" and run.end.frames_out == 10
    np.testing.assert_allclose(np.frombuffer(bytes(capped[1].client.audio), np.float32),
                               np.frombuffer(bytes(full[1].client.audio), np.float32), rtol=1e-4, atol=1e-5)
    # the explicit ring longer than every call: said at load
    assert "backend.options.context_seconds = 0.8 would hold the same calls in less memory" in caplog.text


async def test_the_model_own_context_ends_a_call_under_end_and_not_under_slide():
    """Unset, the ring is the model's own context: "end" ends a call there (where the model
    would otherwise wrap its ring without a word)."""
    for beyond, frames in (("end", TINY_POSITIONS), ("slide", TINY_POSITIONS + 6)):
        config = _tiny(f'backend.options.beyond_context="{beyond}"')
        async with open_runtime(config) as runtime:
            run = await run_session(runtime, [_frames_bytes(11, TINY_POSITIONS + 6), INPUT_END], F32, session_id=6)
        assert run.end.frames_out == frames, beyond


# -- what a row holds ---------------------------------------------------------------------------------


def _allocated_per_row(backend: MoshiBackend, lm_rows: int) -> int:
    """Per-slot bytes of the streaming state the backend allocated, at two sizes, the difference
    (what does not grow with the rows cancels out); the depformer's, which lives inside a step
    (``LMGen.depformer_step``), streamed for the measure."""
    totals = []
    for slots in (1, 3):
        backend.resize(slots)
        with backend._lm.depformer.streaming(lm_rows * slots):
            totals.append(_state_bytes(backend._mimi, backend._lm_gen))
    return (totals[1] - totals[0]) // 2


@pytest.mark.parametrize("cfg_coef", [1.0, 3.0], ids=["plain", "guided"])
def test_the_state_a_row_allocates_follows_the_ring(cfg_coef):
    """Measured from the tensors the package allocates: a row's state shrinks by exactly the LM
    K/V the ring drops (2 layers x K and V x 64 wide x 4 bytes a position, two LM rows with
    guidance), and the arithmetic ``slots = "auto"`` and the memory check use agrees."""
    rows = 2 if cfg_coef != 1.0 else 1
    measured = {}
    for seconds in (None, 2.56, 0.8):
        options = {"cfg_coef": cfg_coef} if seconds is None else {"cfg_coef": cfg_coef, "context_seconds": seconds}
        backend = _backend(1, **options)
        try:
            positions = backend.ring.positions
            per_row = _allocated_per_row(backend, rows)
            assert per_row == backend.slot_bytes.total
            assert backend.slot_bytes.lm_kv == rows * 2 * 2 * 64 * positions * 4
            assert backend.slot_choice.details["bytes_per_slot"]["total"] == backend.slot_bytes.total
            measured[positions] = per_row
        finally:
            backend.close()
    assert sorted(measured) == [10, 32, TINY_POSITIONS]
    per_position = rows * 2 * 2 * 64 * 4
    assert measured[TINY_POSITIONS] - measured[32] == 32 * per_position
    assert measured[TINY_POSITIONS] - measured[10] == 54 * per_position


def test_moshi_7b_at_a_one_minute_ring_holds_a_quarter_of_the_state_and_four_times_the_slots():
    """The real 7B architecture on the meta device (nothing allocated): the figures the sizing
    docs give (docs/capacity.md, "A call cap buys slots")."""
    from moshi.models import loaders

    mimi = loaders.get_mimi(None, device="meta")
    lm = loaders.get_moshi_lm(None, device="meta", dtype=torch.bfloat16)
    weights = memory.weight_bytes(lm, mimi)
    own = ring.model_context(lm)
    assert own == 3000
    per_slot, fits = {}, {}
    for seconds in (60, 120, 240):
        chosen = ring.choose(seconds, "end", own, 12.5)
        ring.apply(lm, chosen)
        per_slot[chosen.positions] = memory.slot_bytes(mimi, lm, guided=False).total
        fits[seconds] = (memory.fits(80 * 10**9, weights, per_slot[chosen.positions]),
                         memory.fits(141 * 10**9, weights, per_slot[chosen.positions]))
    assert per_slot == {750: 409_894_846, 1500: 803_110_846, 3000: 1_589_542_846}
    assert fits == {60: (143, 283), 120: (73, 144), 240: (37, 73)}


def test_a_shorter_ring_admits_more_slots_where_the_memory_is_the_limit():
    full = _backend(1)
    room = 3 * full.slot_bytes.total  # three full-context slots, with a reserve besides
    full.close()
    total = 8 << 30
    source = lambda device: memory.DeviceMemory(memory.reserve_bytes(total) + room, total, "test")  # noqa: E731
    refused = MoshiBackend(BackendInfo("moshi", 24000, FRAME, 4), {"tiny": True, "warmup_steps": 1},
                           memory_source=source)
    with pytest.raises(ConfigError, match="at most 3 slots fit.*backend.options.context_seconds; now 5.12 s"):
        refused.load()
    refused.close()
    capped = MoshiBackend(BackendInfo("moshi", 24000, FRAME, 4),
                          {"tiny": True, "warmup_steps": 1, "context_seconds": 1.28}, memory_source=source)
    capped.load()
    try:
        assert capped.info.slots == 4 and capped.slot_choice.details["fit_memory"] > 4
    finally:
        capped.close()


# -- settings -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("options, message", [
    ({"context_seconds": "60"}, "backend.options.context_seconds"),
    ({"context_seconds": True}, "backend.options.context_seconds"),
    ({"context_seconds": -1}, "backend.options.context_seconds"),
    ({"beyond_context": "wrap"}, "backend.options.beyond_context for moshi must be one of 'end', 'slide'"),
    ({"beyond_context": 1}, "backend.options.beyond_context"),
])
def test_bad_values_are_refused_before_anything_loads(options, message):
    with pytest.raises(ConfigError, match=message):
        MoshiBackend(BackendInfo("moshi", 24000, FRAME, 1), {"tiny": True, **options})


@pytest.mark.parametrize("seconds, message", [
    (0, "holds no frame: the ring needs at least one \\(0.08 s\\), at most the model's context \\(5.12 s\\)"),
    (0.05, "holds no frame"),
    (5.2, "is beyond this model's context \\(64 positions, 5.12 s\\)"),
    (240, "is beyond .*: the model never attends further; give at most 5.12, or leave it unset"),
])
def test_a_ring_the_model_cannot_have_is_refused_at_load_naming_its_range(seconds, message):
    backend = MoshiBackend(BackendInfo("moshi", 24000, FRAME, 1),
                           {"tiny": True, "warmup_steps": 1, "context_seconds": seconds})
    with pytest.raises(ConfigError, match=f"backend.options.context_seconds = {seconds:g} {message}"):
        backend.load()
    backend.close()


def test_duplexrt_serve_with_a_ring_past_the_models_context_stops_at_load_and_says_why():
    from typer.testing import CliRunner

    from cli.app import app

    result = CliRunner().invoke(app, ["serve", "-b", "moshi", "-o", "tiny=true", "-o", "context_seconds=300",
                                      "--slots", "1", "--port", "0", "--no-log-stats"])
    assert result.exit_code == 2
    assert "backend.options.context_seconds = 300 is beyond this model's context" in result.output


def test_the_ring_at_exactly_the_models_context_or_one_frame_is_taken():
    for seconds, positions in ((5.12, TINY_POSITIONS), (0.08, 1)):
        backend = _backend(1, context_seconds=seconds)
        try:
            assert backend.ring.positions == positions and backend.info.max_session_frames == positions
            out = np.empty((1, FRAME), dtype=np.float32)
            backend.open_slot(0, SlotSession(1))
            for frame in _signal(1, 3):  # one position, overwritten every step under the hood
                backend.step(np.array([0]), frame[None], out)
            assert np.isfinite(out).all()
        finally:
            backend.close()


# -- where it is shown ------------------------------------------------------------------------------------


async def test_readyz_stats_and_the_reason_show_the_ring():
    from duplexrt.server import Server
    from tests.test_server import http_get

    config = _tiny("server.port=0", "backend.options.context_seconds=2", 'backend.options.beyond_context="slide"')
    server = Server(config)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        status, _, body = await http_get(server.ports[0], "/readyz")
        ready = json.loads(body)
        _, _, stats = await http_get(server.ports[0], "/stats")
        server.shutdown()
    assert status == 200
    expected = {"positions": 25, "seconds": 2.0, "model_positions": TINY_POSITIONS, "model_seconds": 5.12,
                "beyond_context": "slide", "source": "context_seconds"}
    assert ready["slot_choice"]["ring"] == expected
    assert json.loads(stats)["slot_choice"]["ring"] == expected
    assert "a K/V ring of 25 positions a row (2 s, of the model's 64 (5.12 s)): a longer call forgets" \
        in ready["slot_choice"]["reason"]
