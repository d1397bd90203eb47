"""The ``moshi`` backend on the tiny seeded random Moshi: rows, masks, resets, loading, errors.

Everything runs the real ``moshi`` package (Mimi, LMGen with per-row resets and execution masks)
on a CPU, with nothing downloaded.  Equality is bit for bit: a session's audio and text depend on
its own frames, its seed and its slot only.  (Across slots they may differ in the last bits: the
CPU attention kernel's rounding depends on the row's position in the batch, so every comparison
keeps the session in the same slot.)
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import sphn
import trio
import trio_websocket

from conftest import INPUT_END, PATIENCE
from duplexrt.backends import create_backend
from duplexrt.backends.base import BackendInfo, SlotSession
from duplexrt.config import ConfigError, load_config
from duplexrt.runtime import open_runtime
from duplexrt.core.scheduler import BackendLoadError
from duplexrt.wire.transport import TransportClosed, memory_transport_pair

pytest.importorskip("moshi")

from duplexrt.backends.moshi import STAGES, MoshiBackend  # noqa: E402
from duplexrt.backends.moshi import loading  # noqa: E402
from duplexrt.backends.moshi.tiny import TINY_TEXT_CARD, save_tiny_checkpoint  # noqa: E402

FRAME = 1920
RATE = 24000
ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "moshi-tiny.toml"
REAL_CONFIGS = {
    "moshiko.toml": "kyutai/moshiko-pytorch-bf16",
    "hibiki.toml": "kyutai/hibiki-2b-pytorch-bf16",
    "hibiki-zero.toml": "kyutai/hibiki-zero-3b-pytorch-bf16",
    "moshiko-stt.toml": "kyutai/moshiko-pytorch-bf16",
    "personaplex-stt.toml": "nvidia/personaplex-7b-v1",
}
#: The real presets with a transcriber beside the dialogue model, and its checkpoint.
REAL_STT_CONFIGS = {
    "moshiko-stt.toml": "kyutai/stt-1b-en_fr",
    "personaplex-stt.toml": "kyutai/stt-1b-en_fr",
}


def info(slots: int, frame_size: int = FRAME) -> BackendInfo:
    return BackendInfo(name="moshi", sample_rate=RATE, frame_size=frame_size, slots=slots)


def backend(slots: int = 3, **options) -> MoshiBackend:
    # The fixed batch unless a test says otherwise: these tests hold a session's output bit for bit
    # its own whoever shares the step, the fixed batch's guarantee (steps sized to the active calls
    # round by batch size: test_backend_moshi_buckets.py).
    options = {"tiny": True, "warmup_steps": 1, "batch": "fixed", **options}
    if "checkpoint" in options:
        options.pop("tiny")
    b = MoshiBackend(info(slots), options)
    b.load()
    return b


def signal(seed: int, frames: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((frames, FRAME)) * 0.3).astype(np.float32)


def drive(b: MoshiBackend, script: list[dict[int, np.ndarray]], opens: dict[int, tuple[int, int]],
          closes: dict[int, list[int]] | None = None) -> dict[int, tuple[list[np.ndarray], list[str]]]:
    """Step ``b`` through ``script`` (step k feeds ``{slot: frame}``), opening ``slot`` for
    ``session_id`` before step ``k`` for each ``opens[slot] = (k, session_id)`` and closing the
    slots in ``closes[k]`` before step k.  Returns per slot the outputs and texts it got."""
    closes = closes or {}
    got: dict[int, tuple[list[np.ndarray], list[str]]] = {}
    for k, feed in enumerate(script):
        for slot, (step, session_id) in opens.items():
            if step == k:
                b.open_slot(slot, SlotSession(session_id))
                got[slot] = ([], [])
        for slot in closes.get(k, []):
            b.close_slot(slot)
        if not feed:
            continue
        rows = np.array(sorted(feed), dtype=np.int64)
        inputs = np.stack([feed[r] for r in rows])
        outputs = np.full_like(inputs, np.nan)
        texts = b.step(rows, inputs, outputs)
        assert len(texts) == len(rows)
        for i, r in enumerate(rows):
            got[int(r)][0].append(outputs[i].copy())
            got[int(r)][1].append(texts[i])
    return got


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny3(one_torch_thread) -> MoshiBackend:
    b = backend(3)
    yield b
    b.close()


# -- options --------------------------------------------------------------------------------------


@pytest.mark.parametrize("options, key", [
    ({"tiny": True, "colour": 1}, "backend.options.colour"),
    ({}, "backend.options.checkpoint"),
    ({"tiny": True, "checkpoint": "x/y"}, "backend.options.checkpoint"),
    ({"tiny": "yes"}, "backend.options.tiny"),
    ({"tiny": True, "device": "tpu"}, "backend.options.device"),
    ({"tiny": True, "dtype": "fp8"}, "backend.options.dtype"),
    ({"tiny": True, "seed": -1}, "backend.options.seed"),
    ({"tiny": True, "temp": -0.5}, "backend.options.temp"),
    ({"tiny": True, "temp_text": "hot"}, "backend.options.temp_text"),
    ({"tiny": True, "top_k": 2.5}, "backend.options.top_k"),
    ({"tiny": True, "top_k_text": True}, "backend.options.top_k_text"),
    ({"tiny": True, "greedy": 1}, "backend.options.greedy"),
    ({"tiny": True, "cfg_coef": 1e6}, "backend.options.cfg_coef"),
    ({"tiny": True, "warmup_steps": 1.5}, "backend.options.warmup_steps"),
    ({"checkpoint": "/no/such/checkpoint/dir"}, "backend.options.checkpoint"),
])
def test_bad_options_name_their_key(options, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        MoshiBackend(info(2), options)


def test_the_audio_clock_must_be_mimis():
    with pytest.raises(ConfigError, match=r"audio\.frame_size"):
        MoshiBackend(info(2, frame_size=960), {"tiny": True})


def test_registered_under_its_name_and_every_config_parses():
    tiny = create_backend(load_config(TINY))
    assert isinstance(tiny, MoshiBackend) and tiny.settings.tiny and tiny.info.slots == 8
    for name, repo in REAL_CONFIGS.items():
        config = load_config(ROOT / "configs" / name, ['backend.options.device="cpu"'])
        created = create_backend(config)
        assert isinstance(created, MoshiBackend) and created.settings.checkpoint == repo
    hibiki = load_config(ROOT / "configs" / "hibiki.toml").backend.options
    assert hibiki["cfg_coef"] == 3.0


# -- rows, masks, resets --------------------------------------------------------------------------


def test_a_session_hears_the_same_whoever_joins_leaves_or_skips_steps(tiny3):
    """A in slot 1 alone; then A beside B (joins late, leaves early, in slot 0) and C (slot 2,
    missing from some steps): A's and C's audio and text are bit for bit their solo runs'."""
    frames = 9
    a, bb, c = signal(1, frames), signal(2, frames), signal(3, frames)
    c_steps = [0, 1, 3, 4, 7]  # C sends nothing on the other steps

    solo_a = drive(tiny3, [{1: a[k]} for k in range(frames)], {1: (0, 101)})[1]
    solo_c = drive(tiny3, [{2: c[i]} for i in range(len(c_steps))], {2: (0, 103)})[2]

    script = []
    for k in range(frames):
        feed = {1: a[k]}
        if 2 <= k < 6:
            feed[0] = bb[k - 2]
        if k in c_steps:
            feed[2] = c[c_steps.index(k)]
        script.append(feed)
    together = drive(tiny3, script, {1: (0, 101), 2: (0, 103), 0: (2, 102)}, closes={6: [0]})

    for solo, slot in ((solo_a, 1), (solo_c, 2)):
        outs, texts = together[slot]
        assert texts == solo[1]
        for k, (x, y) in enumerate(zip(outs, solo[0], strict=True)):
            assert np.array_equal(x, y), f"slot {slot} frame {k} differs"
    # The row warming up (the LM's delay) hears silence and says nothing; then speech and text.
    outs, texts = solo_a
    assert not outs[0].any() and texts[0] == ""
    assert all(np.abs(o).max() > 0 for o in outs[1:])
    assert all(np.isfinite(o).all() for o in outs)
    assert any(texts) and all(isinstance(t, str) for t in texts)
    assert len(tiny3.last_stages) == 3 and [n for n, _ in tiny3.last_stages] == list(STAGES)
    assert all(ns > 0 for _, ns in tiny3.last_stages)
    assert tiny3.stage_steps > 0 and all(v > 0 for v in tiny3.stage_seconds.values())


def test_a_session_id_is_its_sampling_seed(tiny3):
    """Sampling draws from the session's own stream: the same session id and frames give the
    same output in a later session on the same slot; another id gives another one."""
    frames = signal(4, 5)
    one = drive(tiny3, [{0: f} for f in frames], {0: (0, 7)})[0]
    again = drive(tiny3, [{0: f} for f in frames], {0: (0, 7)})[0]
    other = drive(tiny3, [{0: f} for f in frames], {0: (0, 8)})[0]
    assert one[1] == again[1] and all(np.array_equal(x, y) for x, y in zip(one[0], again[0]))
    assert any(not np.array_equal(x, y) for x, y in zip(one[0], other[0]))


@pytest.mark.parametrize("options", [{}, {"cfg_coef": 3.0}], ids=["moshi", "guided"])
def test_a_slot_reused_after_non_finite_input_is_a_fresh_slot(options, caplog):
    """A session that fed NaN, infinity and 1e30 straight to the backend (no sanitiser) leaves its
    row's KV caches full of them; the next session on that slot must still hear exactly what it
    would on a new backend, and the session beside the poisoned one exactly its solo run."""
    poison = signal(8, 5)
    poison[1, ::5] = np.nan
    poison[2, 100:900] = np.inf
    poison[3, :] = 1e30
    poison[4, ::3] = -np.inf
    neighbour, clean = signal(9, 5), signal(10, 10)

    used = backend(2, **options)
    fresh = backend(2, **options)
    try:
        beside = drive(used, [{0: n, 1: p} for n, p in zip(neighbour, poison)], {0: (0, 31), 1: (0, 32)})
        reused = drive(used, [{1: f} for f in clean], {1: (0, 33)})[1]
        solo = drive(fresh, [{0: n} for n in neighbour], {0: (0, 31)})[0]
        first = drive(fresh, [{1: f} for f in clean], {1: (0, 33)})[1]
    finally:
        used.close()
        fresh.close()
    assert not [r for r in caplog.records if "not restored" in r.getMessage()]  # every buffer known
    assert beside[0][1] == solo[1]
    assert all(np.array_equal(x, y) for x, y in zip(beside[0][0], solo[0], strict=True))
    assert reused[1] == first[1]
    for k, (x, y) in enumerate(zip(reused[0], first[0], strict=True)):
        assert np.isfinite(x).all() and np.array_equal(x, y), f"frame {k} differs from a fresh slot's"


def test_greedy_and_guided_models_keep_rows_apart():
    """Greedy decoding, and a conditioned tiny model with classifier-free guidance (two LM rows
    per slot): a session alone and beside another hears the same."""
    for options in ({"greedy": True}, {"cfg_coef": 3.0}):
        b = backend(2, **options)
        try:
            frames, other = signal(5, 5), signal(6, 5)
            solo = drive(b, [{1: f} for f in frames], {1: (0, 1)})[1]
            both = drive(b, [{0: o, 1: f} for f, o in zip(frames, other)], {0: (0, 2), 1: (0, 1)})[1]
            assert solo[1] == both[1]
            assert all(np.array_equal(x, y) for x, y in zip(solo[0], both[0], strict=True))
            if "cfg_coef" in options:
                assert b.description["cfg_coef"] == 3.0 and b.description["model_type"] == "hibiki"
        finally:
            b.close()


# -- loading --------------------------------------------------------------------------------------


def test_a_saved_tiny_checkpoint_loads_offline_to_the_same_model(tmp_path, monkeypatch):
    import huggingface_hub
    import moshi.models.loaders as loaders

    def no_network(*args, **kwargs):
        raise AssertionError(f"the hub was asked for {args}")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_network)
    monkeypatch.setattr(loaders, "hf_hub_download", no_network)
    monkeypatch.setattr(loading, "hub_offline_reason", no_network)
    written = save_tiny_checkpoint(tmp_path / "first", seed=3)
    config = json.loads((written / "config.json").read_text())
    assert config["mimi_config_name"].startswith("file://")
    assert {p.name for p in written.iterdir()} == {"config.json", "model.safetensors", "mimi.safetensors",
                                                  "mimi_config.json", "tokenizer.model"}
    moved = written.rename(tmp_path / "moved")  # names resolve inside the directory wherever it is

    frames = signal(7, 4)
    results = []
    for options in ({"seed": 3}, {"checkpoint": str(moved), "seed": 3}):
        b = backend(1, **options)
        try:
            assert b._tokenizer.vocab_size() >= TINY_TEXT_CARD
            results.append(drive(b, [{0: f} for f in frames], {0: (0, 5)})[0])
        finally:
            b.close()
    (mem_out, mem_text), (dir_out, dir_text) = results
    assert mem_text == dir_text
    assert all(np.array_equal(x, y) for x, y in zip(mem_out, dir_out, strict=True))


def test_a_checkpoint_directory_missing_files_says_which(tmp_path):
    written = save_tiny_checkpoint(tmp_path / "ckpt", seed=0)
    (written / "tokenizer.model").unlink()
    b = MoshiBackend(info(1), {"checkpoint": str(written)})
    with pytest.raises(ConfigError) as caught:
        b.load()
    message = str(caught.value)
    assert "backend.options.checkpoint" in message and str(written) in message
    assert "text tokenizer (tokenizer.model)" in message
    shutil.rmtree(written)


@pytest.fixture
def empty_hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache, so that no real checkpoint cached on this machine loads."""
    from huggingface_hub import constants

    cache = tmp_path / "hub-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_a_repo_id_offline_fails_at_once_saying_what_and_where(monkeypatch, empty_hub_cache):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    b = MoshiBackend(info(1), {"checkpoint": "kyutai/moshiko-pytorch-bf16"})
    # "At once": no retry and no back-off, counted as sleeps rather than timed on a shared machine.
    sleeps: list[float] = []
    with monkeypatch.context() as patch, pytest.raises(ConfigError) as caught:
        patch.setattr(time, "sleep", sleeps.append)
        b.load()
    assert sleeps == [], "no retries"
    message = str(caught.value)
    assert "backend.options.checkpoint = 'kyutai/moshiko-pytorch-bf16'" in message
    assert "HF_HUB_OFFLINE" in message and "config.json" in message and str(empty_hub_cache) in message

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(loading, "HUB_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(ConfigError, match=r"http://127\.0\.0\.1:9 cannot be reached"):
        b.load()


@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
async def test_real_model_configs_fail_to_start_offline_with_a_clear_error(name, monkeypatch, empty_hub_cache):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = load_config(ROOT / "configs" / name, ['backend.options.device="cpu"', 'transcriber.device="cpu"',
                                                   "runtime.slots=1"])
    with trio.fail_after(PATIENCE):
        with pytest.raises(BackendLoadError) as caught:
            async with open_runtime(config):
                pass
    message = str(caught.value)
    if name in REAL_STT_CONFIGS:
        # A transcriber's weights load first (the dialogue model's slots are sized beside them):
        # its checkpoint is the one named, under its own keys.
        assert message.startswith("the transcriber failed to load: transcriber.checkpoint")
        assert "backend.options" not in message and "transcriber.tiny" in message
        assert REAL_STT_CONFIGS[name] in message and "offline" in message
    else:
        assert REAL_CONFIGS[name] in message and "offline" in message


# -- through the runtime --------------------------------------------------------------------------


class LockstepClient:
    """A raw-protocol client that sends one frame, waits for its audio, then sends the next.
    ``gates[k]`` holds it before frame k; ``on_frame[k]`` is set once frame k's audio is back."""

    def __init__(self, transport, frames: np.ndarray, gates: dict[int, trio.Event] | None = None,
                 on_frame: dict[int, trio.Event] | None = None) -> None:
        self.transport = transport
        self.frames = frames
        self.gates = gates or {}
        self.on_frame = on_frame or {}
        self.audio = bytearray()
        self.texts: list[str] = []
        self.end: dict | None = None
        self._lot = trio.lowlevel.ParkingLot()

    async def receive(self) -> None:
        while True:
            try:
                message = await self.transport.receive()
            except TransportClosed:
                return
            if isinstance(message, str):
                event = json.loads(message)
                if event["type"] == "text":
                    self.texts.append(event["text"])
                elif event["type"] == "session.end":
                    self.end = event
                else:
                    raise AssertionError(event)
            else:
                self.audio += message
                self._lot.unpark_all()

    async def send(self) -> None:
        for k, frame in enumerate(self.frames):
            if k in self.gates:
                await self.gates[k].wait()
            await self.transport.send(frame.tobytes())
            while len(self.audio) < (k + 1) * FRAME * 4:
                await self._lot.park()
            if k in self.on_frame:
                self.on_frame[k].set()
        await self.transport.send(INPUT_END)

    def pcm(self) -> np.ndarray:
        return np.frombuffer(bytes(self.audio), dtype=np.float32).reshape(-1, FRAME)


async def serve_clients(runtime, clients: list[tuple[LockstepClient, object, int]]) -> None:
    async def one(client: LockstepClient, server_end, session_id: int) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.receive)
            nursery.start_soon(client.send)
            end = await runtime.serve(server_end, input_spec=runtime.audio_spec("pcm_f32le"),
                                      session_id=session_id)
            assert end.reason == "stop", end

    with trio.fail_after(PATIENCE * 3):
        async with trio.open_nursery() as nursery:
            for client, server_end, session_id in clients:
                nursery.start_soon(one, client, server_end, session_id)


def tiny_config(*overrides: str):
    # "wait", not the preset's "fill": these tests compare exact frames, and a lockstep client on
    # a loaded CPU would otherwise see silence stepped in for audio it had not sent yet.
    # The fixed batch: these tests compare a session's frames bit for bit with its solo run.
    return load_config(TINY, ["runtime.slots=3", "runtime.gather_window_ms=1", "backend.options.warmup_steps=1",
                              "runtime.late_input=wait", 'backend.options.batch="fixed"', *overrides])


async def test_through_the_runtime_sessions_joining_and_leaving_change_nothing():
    """A alone; B alone in slot 1 (an idle session holds slot 0); then A with B joining after A's
    second frame and C after its fourth, both leaving before A ends.  Each session's audio and
    text are bit for bit its solo run's, whatever the steps grouped."""
    a_frames, b_frames, c_frames = signal(11, 9), signal(12, 3), signal(13, 3)
    async with open_runtime(tiny_config()) as runtime:
        client, server = memory_transport_pair()
        solo_a = LockstepClient(client, a_frames)
        await serve_clients(runtime, [(solo_a, server, 21)])

        # B alone, but in slot 1: an idle session (connected, sending nothing) holds slot 0.
        idle_client, idle_server = memory_transport_pair()
        b_client, b_server = memory_transport_pair()
        solo_b = LockstepClient(b_client, b_frames)
        idle = LockstepClient(idle_client, np.zeros((0, FRAME), np.float32))
        b_go = trio.Event()
        solo_b.gates = {0: b_go}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(idle.receive)
            nursery.start_soon(
                lambda: runtime.serve(idle_server, input_spec=runtime.audio_spec("pcm_f32le"), session_id=99))
            with trio.fail_after(PATIENCE):
                while runtime.scheduler.free_slots != 2:
                    await trio.sleep(0.001)
            b_go.set()
            await serve_clients(runtime, [(solo_b, b_server, 22)])
            await idle_client.send(INPUT_END)
        assert solo_b.end is not None

        # Together: A takes slot 0; B (slot 1) joins after A's 2nd frame, C (slot 2) after its 4th.
        after_2, after_4 = trio.Event(), trio.Event()
        ends = [memory_transport_pair() for _ in range(3)]
        a = LockstepClient(ends[0][0], a_frames, on_frame={1: after_2, 3: after_4})
        b = LockstepClient(ends[1][0], b_frames)
        c = LockstepClient(ends[2][0], c_frames)
        a_slot_taken = trio.Event()

        async def late(client: LockstepClient, server_end, session_id: int, after: trio.Event) -> None:
            await after.wait()
            await serve_clients(runtime, [(client, server_end, session_id)])

        async def first() -> None:
            a_slot_taken.set()
            await serve_clients(runtime, [(a, ends[0][1], 21)])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(first)
            await a_slot_taken.wait()
            nursery.start_soon(late, b, ends[1][1], 22, after_2)
            nursery.start_soon(late, c, ends[2][1], 23, after_4)
        stats = runtime.scheduler.statistics()
        assert set(STAGES) <= set(runtime.scheduler.stage_time), "the scheduler reports each stage"

    assert stats.max_batch >= 2, "the sessions never shared a step"
    for together, solo in ((a, solo_a), (b, solo_b)):
        assert together.end["usage"]["frames_out"] == solo.end["usage"]["frames_out"] == len(solo.frames)
        assert together.texts == solo.texts
        assert np.array_equal(together.pcm(), solo.pcm())
    assert not solo_a.pcm()[0].any() and np.abs(solo_a.pcm()[1:]).max() > 0
    assert len(c.pcm()) == 3 and c.end["reason"] == "stop"


async def test_opus_in_opus_out_through_a_real_server_on_api_chat(nursery):
    from duplexrt.server import Server

    server = Server(tiny_config("server.port=0", "runtime.slots=1"))
    await nursery.start(server.run)
    url = f"ws://127.0.0.1:{server.ports[0]}/api/chat"
    t = np.arange(int(1.2 * RATE)) / RATE
    voice = (0.3 * np.sin(2 * np.pi * (220 * t + 150 * t * t))).astype(np.float32)
    writer = sphn.OpusStreamWriter(RATE)
    messages = [b"\x01" + data for start in range(0, len(voice), 960)
                if (data := writer.append_pcm(voice[start:start + 960]))]
    reader = sphn.OpusStreamReader(RATE)
    received: list[bytes] = []
    samples = 0
    with trio.fail_after(PATIENCE * 2):
        async with trio_websocket.open_websocket_url(url) as ws:
            async def send() -> None:
                for message in messages:
                    await ws.send_message(message)

            nursery.start_soon(send)
            while samples < 10 * FRAME:
                message = await ws.get_message()
                assert isinstance(message, bytes)
                received.append(message)
                if message[0] == 1:
                    samples += len(reader.append_bytes(message[1:]))
    assert received[0][0] == 0, "the handshake comes first"
    kinds = {m[0] for m in received}
    assert kinds <= {0, 1, 2, 4}
    assert samples >= 10 * FRAME
    texts = [m[1:].decode("utf-8") for m in received if m[0] == 2]
    assert texts and all(texts), "the tiny model speaks text pieces"
