"""A transcriber on the dialogue model's device is counted when the dialogue model sizes its slots
by memory: its weights are loaded first (so the free memory the backend reads is what is left
beside them), and each slot needs the transcriber's row beside its own state."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("NO_TORCH_COMPILE", "1")

pytest.importorskip("torch")
pytest.importorskip("moshi")

from conftest import make_config  # noqa: E402
from duplexrt.backends.base import BackendInfo  # noqa: E402
from duplexrt.backends.moshi import MoshiBackend, memory  # noqa: E402
from duplexrt.config import ConfigError  # noqa: E402
from duplexrt.runtime import open_runtime  # noqa: E402
from duplexrt.transcribe.transcriber import Transcriber  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = ("transcriber.enabled=true", "transcriber.tiny=true")


def test_a_rows_state_is_known_from_the_model_before_any_row_is_allocated():
    """The estimate read from the modules is what the allocated rows then hold, within a few bytes
    of bookkeeping (80,121 against 80,113 on stt-tiny), and never less."""
    transcriber = Transcriber(config=make_config(*TINY).transcriber)
    transcriber.load_weights()
    estimate = transcriber.state_bytes_per_slot()
    transcriber.load(3)
    try:
        measured = transcriber.slot_bytes
        assert 0 < measured <= estimate <= measured + 64, (estimate, measured)
    finally:
        transcriber.close()


def test_slots_that_fit_alone_do_not_fit_beside_a_transcribers_rows():
    """FAKE memory (a CPU has no device memory to size by): room for 4 of the tiny model's slots;
    with a transcriber row as large as a slot beside each, 4 no longer fit, and the refusal
    names the transcriber's share."""
    probe = MoshiBackend(BackendInfo("moshi", 24000, 1920, 1), {"tiny": True, "warmup_steps": 0})
    probe.load()
    per_slot = probe.slot_bytes.total
    probe.close()
    reserve = memory.reserve_bytes(1 << 30)
    room = memory.DeviceMemory(free=reserve + 4 * per_slot + per_slot // 2, total=1 << 30, source="a fake device")

    def backend(extra: int) -> MoshiBackend:
        made = MoshiBackend(BackendInfo("moshi", 24000, 1920, 4), {"tiny": True, "warmup_steps": 0},
                            memory_source=lambda device: room)
        made.extra_slot_bytes = extra
        return made

    alone = backend(0)
    alone.load()
    assert alone.slot_choice.details["fit_memory"] == 4
    alone.close()
    beside = backend(per_slot)
    with pytest.raises(ConfigError) as refused:
        beside.load()
    beside.close()
    assert "for the transcriber's row beside it" in str(refused.value)
    assert "at most 2 slots fit" in str(refused.value)


async def test_the_runtime_loads_the_transcriber_first_and_counts_its_rows_on_a_shared_device():
    config = make_config("backend.name=moshi", "backend.options.tiny=true", "backend.options.warmup_steps=1",
                         "runtime.slots=2", *TINY)
    async with open_runtime(config) as runtime:
        scheduler = runtime.scheduler
        assert scheduler.backend.extra_slot_bytes == scheduler.transcriber.state_bytes_per_slot() > 0
        details = scheduler.backend.slot_choice.details
        assert details["transcriber_bytes_per_slot"] == scheduler.backend.extra_slot_bytes
    echo = make_config("backend.name=echo", "runtime.slots=2", *TINY)
    async with open_runtime(echo) as runtime:
        # echo sizes nothing by memory; it is told all the same, and ignores it
        assert runtime.scheduler.backend.extra_slot_bytes > 0
        assert np.isfinite(runtime.scheduler.transcriber.warmup_cost)
