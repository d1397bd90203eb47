"""The GPU script's ``ring`` phase (``benchmarks/gpu.py``) on this CPU with the tiny model: every
cell stepped, the rings alternated at each size, the state per slot following the ring, and the
backend's own ring put back for the phases after it.  (The whole script in the bare layout is
``tests/test_gpu_script.py``.)"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

os.environ.setdefault("NO_TORCH_COMPILE", "1")

pytest.importorskip("torch")
pytest.importorskip("moshi")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def gpu_script():
    spec = importlib.util.spec_from_file_location("gpu_script", ROOT / "benchmarks" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_ring_phase_steps_every_cell_and_puts_the_ring_back(gpu_script):
    import time

    from duplexrt.backends.base import BackendInfo
    from duplexrt.backends.moshi import MoshiBackend

    backend = MoshiBackend(BackendInfo("moshi", 24000, 1920, 1), {"tiny": True, "warmup_steps": 2})
    backend.load()
    seen: list[int] = []
    try:
        rows, rings = gpu_script.CPU_RING
        result = gpu_script.ring_phase(backend, rows, rings, 2, False, time.monotonic() + 120,
                                       lambda cells: seen.append(len(cells)))
        assert backend.settings.context_seconds is None  # the preset's ring, for masked and serve
        backend.resize(2)
        assert backend.ring.positions == 64
    finally:
        backend.close()
    cells = result["cells"]
    assert seen == [1, 2, 3, 4], "written after every cell"
    assert [(c["rows"], c["ring_positions"]) for c in cells] == [(2, 16), (2, 64), (4, 16), (4, 64)]
    for cell in cells:
        assert cell["step_ms"]["p50"] > 0 and set(cell["stage_ms"]) == {"encode", "lm", "decode"}
        assert cell["ratio_to_full_ring"] > 0 and cell["ring_seconds"] == cell["ring_positions"] / 12.5
    by = {(c["rows"], c["ring_positions"]): c for c in cells}
    # 2 layers x K and V x 64 wide x 4 bytes a position: 48 positions fewer, 48 kB less a slot.
    assert by[2, 64]["bytes_per_slot"] - by[2, 16]["bytes_per_slot"] == 48 * 2 * 2 * 64 * 4
    assert by[2, 64]["ratio_to_full_ring"] == 1.0
    assert by[2, 16]["fit_memory"] > by[2, 64]["fit_memory"]


def test_a_cell_past_the_deadline_is_skipped_not_run(gpu_script):
    from duplexrt.backends.base import BackendInfo
    from duplexrt.backends.moshi import MoshiBackend

    backend = MoshiBackend(BackendInfo("moshi", 24000, 1920, 1), {"tiny": True, "warmup_steps": 1})
    backend.load()
    try:
        seen: list[int] = []
        result = gpu_script.ring_phase(backend, (2,), (16, 64), 2, False, 0.0, lambda cells: seen.append(len(cells)))
        assert backend.info.slots == 1 and backend.ring.positions == 64  # nothing was resized
    finally:
        backend.close()
    assert [c.get("skipped") for c in result["cells"]] == ["the phase's time ran out"] * 2 and seen == [1, 2]
