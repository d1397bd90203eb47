"""The moshi backend's load says what is wrong before it costs minutes, and loudly:

* a configured slot count that cannot fit is refused from the model's configuration on the
  ``meta`` device, before any weight is built (``backends/moshi/presize.py``);
* a configured slot count whose full batch steps over the frame is an ERROR at load naming the
  largest count that keeps real time, and ``slot_choice.real_time`` in ``/readyz`` says it;
* a join step copies its rows to the device through staged, page-locked buffers, never a
  blocking ``.to()`` (``staging.StagedRows``).

FAKE, where used: the device's free memory is given (``memory_source``), and the step's cost is
set by replacing the warm-up's measurement (``_warm_up``) with one that costs 2 ms a row.
"""

from __future__ import annotations

import json
import logging
import os
import time

import pytest
import trio

os.environ.setdefault("NO_TORCH_COMPILE", "1")

from duplexrt.backends.base import BackendInfo  # noqa: E402
from duplexrt.backends.moshi import MoshiBackend, memory  # noqa: E402
from duplexrt.backends.moshi import model as moshi_model  # noqa: E402
from duplexrt.config import ConfigError, load_config  # noqa: E402

torch = pytest.importorskip("torch")
pytest.importorskip("moshi")

FRAME = 1920
GB = 10**9


def _never_built(settings, models, torch_module):
    raise AssertionError("the weights were built before the slots were checked")


def test_slots_that_cannot_fit_a_7b_are_refused_before_its_weights_are_built(monkeypatch):
    monkeypatch.setattr(moshi_model, "load_weights", _never_built)
    room = memory.DeviceMemory(24 * GB, 32 * GB, "a 24 GB box")
    backend = MoshiBackend(BackendInfo("moshi", 24000, FRAME, 64),
                           {"random": "moshi-7b", "device": "cpu", "dtype": "bfloat16"},
                           memory_source=lambda device: room)
    started = time.monotonic()
    with pytest.raises(ConfigError) as refused:
        backend.load()
    assert time.monotonic() - started < 20
    message = str(refused.value)
    # 24 GB less 15.8 GB of weights less the reserve (6 % of 32 GB): 3 slots of 1.59 GB.
    assert message.startswith("runtime.slots = 64 does not fit: each slot holds 1.59 GB of state")
    assert "at most 3 slots fit; set runtime.slots = 3 (--slots 3)" in message
    assert "of weights, from the model's configuration before they are built" in message
    assert message.endswith("(found from the model's configuration, before building it)")
    backend.close()


def test_slots_that_fit_go_on_to_the_build(monkeypatch):
    monkeypatch.setattr(moshi_model, "load_weights", _never_built)
    room = memory.DeviceMemory(200 * GB, 200 * GB, "a big box")
    backend = MoshiBackend(BackendInfo("moshi", 24000, FRAME, 4),
                           {"random": "moshi-7b", "device": "cpu", "dtype": "bfloat16"},
                           memory_source=lambda device: room)
    with pytest.raises(AssertionError, match="the weights were built"):
        backend.load()  # the early check let it through to the build
    backend.close()


def test_duplexrt_serve_refuses_the_issues_command_in_seconds():
    """``serve --config moshi-7b-random -o device=cpu --slots ...`` kept building for minutes."""
    from typer.testing import CliRunner

    from duplexrt_cli.app import app

    started = time.monotonic()
    result = CliRunner().invoke(app, ["serve", "--config", "moshi-7b-random", "-o", 'device="cpu"',
                                      "--slots", "4096", "--port", "0", "--no-log-stats"])
    assert time.monotonic() - started < 20
    assert result.exit_code == 2, result.output
    assert "runtime.slots = 4096 does not fit" in result.output and "before building it" in result.output


def _fake_clock(monkeypatch, ms_per_row: float) -> None:
    """FAKE: a full batch of n rows "steps" in ``ms_per_row`` x n ms (the real warm-up still runs)."""
    real = MoshiBackend._warm_up

    def warm_up(self, steps, unsettled=None):
        measured = real(self, steps, unsettled)
        return self.info.slots * ms_per_row / 1e3 if measured else measured

    monkeypatch.setattr(MoshiBackend, "_warm_up", warm_up)


def test_configured_slots_too_slow_for_the_frame_are_an_error_naming_what_keeps_real_time(monkeypatch, caplog):
    _fake_clock(monkeypatch, 10.0)  # 16 rows: 160 ms, over the 76 ms budget; 7 rows: 70 ms
    backend = MoshiBackend(BackendInfo("moshi", 24000, FRAME, 16), {"tiny": True, "warmup_steps": 2})
    with caplog.at_level(logging.ERROR, logger="duplexrt.backends.moshi"):
        backend.load()
    try:
        [error] = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert error.startswith("moshi backend: runtime.slots = 16 is too many for this device's clock: a full "
                                "batch steps in 160.0 ms, over the 76.0 ms budget")
        assert "the largest batch timed within it is 7 rows: set runtime.slots = 7 (--slots 7)" in error
        choice = backend.slot_choice
        assert choice.slots == backend.info.slots == 16  # served as configured, said loudly
        clock = choice.details["real_time"]
        assert (clock["within_budget"], clock["largest_slots"], clock["step_ms"]) == (False, 7, 160.0)
        assert [t["rows"] for t in clock["timed"]] == [8, 7]
        assert "TOO SLOW" in choice.reason
    finally:
        backend.close()


def test_configured_slots_within_the_frame_say_so_quietly(monkeypatch, caplog):
    _fake_clock(monkeypatch, 1.0)
    backend = MoshiBackend(BackendInfo("moshi", 24000, FRAME, 8), {"tiny": True, "warmup_steps": 2})
    with caplog.at_level(logging.ERROR, logger="duplexrt.backends.moshi"):
        backend.load()
    try:
        assert not [r for r in caplog.records if r.levelno == logging.ERROR]
        assert backend.slot_choice.details["real_time"] == {"step_ms": 8.0, "budget_ms": 76.0, "within_budget": True}
    finally:
        backend.close()


async def test_readyz_reports_a_configured_batch_too_slow_for_real_time(monkeypatch):
    from conftest import http_get
    from duplexrt.server import Server

    _fake_clock(monkeypatch, 20.0)  # 4 rows: 80 ms, over 76; 3 rows: 60 ms
    config = load_config(None, ["server.port=0", 'backend.name="moshi"', "backend.options.tiny=true",
                                "backend.options.warmup_steps=2", "runtime.slots=4", "metrics.log_stats=false"])
    server = Server(config, MoshiBackend(BackendInfo("moshi", 24000, FRAME, 4), config.backend.options))
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        _, _, body = await http_get(server.ports[0], "/readyz")
        clock = json.loads(body)["slot_choice"]["real_time"]
        assert (clock["within_budget"], clock["largest_slots"]) == (False, 3)
        server.shutdown()


def test_a_join_step_copies_no_rows_with_a_blocking_to(monkeypatch):
    """Joining rows (their reset, their first frame's encoder reset) go to the device through
    staged page-locked buffers; a ``.to()`` from the backend on a pageable tensor would block the
    host until the GPU's queued work (the encoder, on a first frame) was done."""
    import inspect

    import numpy as np

    from duplexrt.backends.base import SlotSession

    backend = MoshiBackend(BackendInfo("moshi", 24000, FRAME, 4), {"tiny": True, "warmup_steps": 1})
    backend.load()
    calls: list[str] = []
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        caller = inspect.currentframe().f_back
        if caller is not None and caller.f_code.co_filename.endswith(os.path.join("moshi", "backend.py")):
            calls.append(caller.f_code.co_name)
        return real_to(self, *args, **kwargs)

    try:
        monkeypatch.setattr(torch.Tensor, "to", to)
        rows = np.array([1, 3], dtype=np.int64)
        for slot in rows:
            backend.open_slot(int(slot), SlotSession(int(slot) + 10))
        frames = np.random.default_rng(0).standard_normal((2, FRAME)).astype(np.float32) * 0.1
        out = np.empty_like(frames)
        backend.step(rows, frames, out)  # the join: resets, first frames, the encoder's reset
        backend.step(rows, frames, out)
        assert calls == []
        assert np.isfinite(out).all()
    finally:
        backend.close()
