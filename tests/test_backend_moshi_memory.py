"""What a slot holds, by the arithmetic (``backends/moshi/memory.py``) and by the tensors a real
streaming state allocates: they must agree to the byte, for the tiny model on the CPU (plain and
guided), and for the real Moshi 7B architecture built on PyTorch's ``meta`` device (which
allocates nothing).  Then what follows from it at load: a ``runtime.slots`` that cannot fit is
refused naming the largest that fits, and ``"auto"`` chooses within the memory and the budget.

The device's free memory is given to the backend (``memory_source``) so that the refusals run on
this CPU with the real arithmetic and the real model; everything else is the real thing.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import trio

os.environ.setdefault("NO_TORCH_COMPILE", "1")

from duplexrt.backends.base import CHOSEN_AT_LOAD, BackendInfo  # noqa: E402
from duplexrt.backends.moshi import MoshiBackend  # noqa: E402
from duplexrt.backends.moshi import memory  # noqa: E402
from duplexrt.backends.moshi import model as moshi_model  # noqa: E402
from duplexrt.config import ConfigError, load_config  # noqa: E402

torch = pytest.importorskip("torch")
pytest.importorskip("moshi")

FRAME = 1920


def _state_bytes(*roots) -> int:
    """Bytes of every tensor in the streaming states under ``roots`` (each tensor once)."""
    from moshi.modules.streaming import StreamingModule
    from moshi.modules.transformer import RingKVCache

    seen: set[int] = set()
    total = 0

    def add(value) -> None:
        nonlocal total
        if isinstance(value, torch.Tensor) and id(value) not in seen:
            seen.add(id(value))
            total += value.numel() * value.element_size()

    for root in roots:
        for module in root.modules():
            state = getattr(module, "_streaming_state", None)
            if not isinstance(module, StreamingModule) or state is None:
                continue
            add(state.exec_mask)
            for field in dataclasses.fields(state):
                value = getattr(state, field.name)
                if isinstance(value, RingKVCache):
                    add(value.cache)
                    add(value.end_offset)
                else:
                    add(value)
    return total


def _measured_per_row(mimi, lm, make_generator, rows_per_slot: int) -> int:
    """Per-slot bytes of the state the package allocates: the difference between two batch sizes
    (what does not grow with the rows, such as LMGen's initial token, cancels out), depformer
    included (streamed inside each step, as ``LMGen.depformer_step`` does)."""
    sizes = (1, 3)
    totals = []
    for slots in sizes:
        generator = make_generator(slots)
        with mimi.streaming(slots), generator.streaming(slots), lm.depformer.streaming(rows_per_slot * slots):
            totals.append(_state_bytes(mimi, generator, lm))
    return (totals[1] - totals[0]) // (sizes[1] - sizes[0])


def _backend(slots: int, source=None, **options) -> MoshiBackend:
    info = BackendInfo("moshi", 24000, FRAME, slots)
    return MoshiBackend(info, {"tiny": True, "warmup_steps": 2, **options}, memory_source=source)


def test_the_arithmetic_matches_the_tiny_models_allocated_state_to_the_byte():
    from moshi.models import LMGen

    from duplexrt.backends.moshi.tiny import build_tiny

    mimi, lm, _ = build_tiny(0)
    expected = memory.slot_bytes(mimi, lm, guided=False)
    measured = _measured_per_row(mimi, lm, lambda slots: LMGen(lm, support_out_of_sync=True), 1)
    assert expected.total == measured
    # The parts, by their own arithmetic: 2 layers x K and V x 64 wide x 64 positions x 4 bytes.
    assert expected.lm_kv == 2 * 2 * 64 * 64 * 4
    assert expected.mimi_kv == 2 * (1 * 2 * 32 * 16 * 4)  # encoder and decoder transformers


def test_with_guidance_a_slot_holds_two_lm_rows_as_the_guided_backend_allocates():
    backend = _backend(2, cfg_coef=3.0)
    backend.load()
    try:
        guided = backend.slot_bytes
        plain = memory.slot_bytes(backend._mimi, backend._lm, guided=False)
        assert guided.lm_kv == 2 * plain.lm_kv and guided.depformer_kv == 2 * plain.depformer_kv
        assert guided.mimi_kv == plain.mimi_kv
        model = backend._model

        def generator(slots: int):
            return model.models.LMGen(model.lm, cfg_coef=model.cfg_coef, support_out_of_sync=True,
                                      condition_tensors=moshi_model.conditions(model.lm, model.model_type,
                                                                               model.cfg_coef, slots))

        backend._release_rows()  # measure fresh states, not the backend's own
        assert _measured_per_row(model.mimi, model.lm, generator, 2) == guided.total
    finally:
        backend.close()


@pytest.fixture(scope="module")
def moshi_7b_on_meta():
    """The package's own Mimi and 7B LM configuration, on the meta device: real shapes, no memory."""
    from moshi.models import loaders

    mimi = loaders.get_mimi(None, device="meta")
    lm = loaders.get_moshi_lm(None, device="meta", dtype=torch.bfloat16)
    return mimi, lm


def test_the_arithmetic_matches_the_7b_architectures_state_and_the_issues_figure(moshi_7b_on_meta):
    from moshi.models import LMGen

    mimi, lm = moshi_7b_on_meta
    per = memory.slot_bytes(mimi, lm, guided=False)
    # 32 layers x K and V x 4096 wide x 3000 positions x 2 bytes (bf16): 1.573 GB a slot.
    assert per.lm_kv == 32 * 2 * 4096 * 3000 * 2 == 1_572_864_000
    measured = _measured_per_row(mimi, lm, lambda slots: LMGen(lm, support_out_of_sync=True), 1)
    assert per.total == measured
    assert 1.58e9 < per.total < 1.60e9  # Mimi's K/V and convolutions: ~16 MB more
    assert 15.2e9 < memory.weight_bytes(lm) < 15.5e9  # 7.69 B parameters in bf16


def test_a_shorter_attention_context_shrinks_the_figure_before_anything_is_allocated():
    """What issue 31's ring will do: change the context the K/V rings are sized from, before
    allocation; the arithmetic reads the same attribute, so it follows."""
    from moshi.models import LMGen
    from moshi.modules.transformer import set_attention_context

    from duplexrt.backends.moshi.tiny import build_tiny

    mimi, lm, _ = build_tiny(0)
    full = memory.slot_bytes(mimi, lm, guided=False)
    set_attention_context(lm.transformer, 16)  # from 64 positions to 16
    short = memory.slot_bytes(mimi, lm, guided=False)
    assert short.lm_kv == full.lm_kv // 4
    assert short.total == _measured_per_row(mimi, lm, lambda slots: LMGen(lm, support_out_of_sync=True), 1)


def _room_for(slots: float):
    """A memory source with room for ``slots`` tiny slots beyond the reserve (and the real
    reserve rule: at least 1 GiB)."""
    per = _backend(1)
    per.load()
    size = per.slot_bytes.total
    per.close()
    total = 8 << 30

    def source(device: str) -> memory.DeviceMemory:
        assert device == "cpu"
        return memory.DeviceMemory(int(memory.reserve_bytes(total) + slots * size), total, "test")

    return source


def test_slots_that_cannot_fit_are_refused_at_load_naming_the_largest_that_fits():
    backend = _backend(16, _room_for(10.5))
    with pytest.raises(ConfigError) as refused:
        backend.load()
    message = str(refused.value)
    assert "runtime.slots = 16 does not fit" in message and "at most 10 slots fit" in message
    assert "set runtime.slots = 10" in message and "kept for activations" in message
    fits = _backend(10, _room_for(10.5))
    fits.load()  # the largest that fits is taken
    assert fits.info.slots == 10 and fits.slot_choice.details["fit_memory"] == 10
    fits.close()


def test_duplexrt_serve_refuses_such_slots_at_load_and_says_why(monkeypatch):
    from typer.testing import CliRunner

    from cli.app import app

    monkeypatch.setattr(memory, "device_memory", _room_for(3.2))
    result = CliRunner().invoke(app, ["serve", "-b", "moshi", "-o", "tiny=true", "--slots", "6",
                                      "--port", "0", "--no-log-stats"])
    assert result.exit_code == 2
    assert "runtime.slots = 6 does not fit" in result.output and "at most 3 slots fit" in result.output


def test_auto_on_the_cpu_times_sizes_and_stays_within_the_memory():
    backend = _backend(CHOSEN_AT_LOAD, _room_for(3.5))
    backend.load()
    try:
        choice = backend.slot_choice
        assert choice.source == "auto" and 1 <= choice.slots <= 3 == choice.details["fit_memory"]
        assert backend.info.slots == choice.slots and backend.description["slots"] == choice.slots
        timed = {t["rows"]: t["step_ms"] for t in choice.details["timed"]}
        assert max(timed) <= 3 and choice.slots in timed
        budget = choice.details["budget_ms"]
        assert budget == pytest.approx(80 * 0.95)
        # The largest timed within the budget (or 1 when none was), and it seeds the estimate.
        within = [rows for rows, ms in timed.items() if ms <= budget]
        assert choice.slots == (max(within) if within else 1)
        assert backend.warmup_costs and backend.warmup_costs[-1][0] == choice.slots
    finally:
        backend.close()


def test_auto_with_a_tight_budget_keeps_what_the_clock_allows():
    """With 90 % of the frame kept free (an 8 ms budget), the tiny model's 8-row batch is over it
    on this CPU; the search shrinks until a timed size is within it, or settles on one row."""
    info = BackendInfo("moshi", 24000, FRAME, CHOSEN_AT_LOAD, capacity_margin=0.9)
    backend = MoshiBackend(info, {"tiny": True, "warmup_steps": 2})
    backend.load()
    try:
        choice = backend.slot_choice
        timed = [(t["rows"], t["step_ms"]) for t in choice.details["timed"]]
        assert timed[0][0] == 8 and choice.details["budget_ms"] == pytest.approx(8.0)
        within = [rows for rows, ms in timed if ms <= 8.0]
        assert choice.slots == (max(within) if within else 1)
        if not within:
            assert "not even 1 row" in choice.reason
    finally:
        backend.close()


def test_auto_is_refused_by_the_backends_whose_rows_cost_nothing():
    from duplexrt.backends import create_backend

    for name in ("echo", "synthetic"):
        with pytest.raises(ConfigError, match='runtime.slots = "auto" is for a backend that measures'):
            create_backend(load_config(None, [f'backend.name="{name}"', 'runtime.slots="auto"']))


async def test_readyz_stats_and_the_runtime_show_what_auto_chose():
    from duplexrt.server import Server
    from tests.conftest import http_get

    config = load_config(None, ["server.port=0", 'backend.name="moshi"', "backend.options.tiny=true",
                                "backend.options.warmup_steps=2", 'runtime.slots="auto"',
                                "metrics.log_stats=false"])
    backend = MoshiBackend(BackendInfo("moshi", 24000, FRAME, CHOSEN_AT_LOAD), config.backend.options,
                           memory_source=_room_for(2.5))
    server = Server(config, backend)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        status, _, body = await http_get(server.ports[0], "/readyz")
        ready = json.loads(body)
        assert status == 200 and ready["slots"] == ready["slot_choice"]["slots"] <= 2
        assert ready["slot_choice"]["source"] == "auto" and ready["slot_choice"]["fit_memory"] == 2
        _, _, body = await http_get(server.ports[0], "/stats")
        assert json.loads(body)["slot_choice"] == ready["slot_choice"]
        server.shutdown()


def test_the_start_line_of_a_real_server_says_what_auto_chose():
    from tests.conftest import ServeProcess

    with ServeProcess("--config", "moshi-tiny", "--slots", "auto", "--set", "runtime.capacity_margin=0.5") as server:
        line = server.wait_for_line("port(s)", timeout=120)
    chosen = line.split("(backend moshi, ")[1]
    slots = int(chosen.split(" slots: ")[0])
    assert slots >= 1 and " slots: auto: " in chosen
    assert "40.0 ms" in chosen  # the budget it kept to: half of the 80 ms frame
    # and the ring each row holds (the preset's: the model's own, sliding)
    assert "a K/V ring of 64 positions a row (5.12 s, the model's own context): a longer call forgets" in chosen
