"""The filled-only attention (``duplexrt.backends.moshi.attention``) on the tiny random Moshi.

The tiny LM's own context (64 positions) is one read block, so these tests build it with a
longer one (``TINY_LM["context"]``): 320 positions, 25.6 s, of which a call fills a few blocks.
Equality is bit for bit: against the package's full-ring read, and whoever shares the step.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("moshi")

from duplexrt.backends.base import BackendInfo, SlotSession  # noqa: E402
from duplexrt.backends.moshi import MoshiBackend, attention, tiny  # noqa: E402

FRAME = 1920
CONTEXT = 320

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def long_context():
    saved = tiny.TINY_LM["context"]
    tiny.TINY_LM["context"] = CONTEXT
    yield
    tiny.TINY_LM["context"] = saved


def make(slots: int, **options) -> MoshiBackend:
    # The fixed batch: the attention's exactness is measured apart from the buckets' rounding.
    b = MoshiBackend(BackendInfo("moshi", 24000, FRAME, slots),
                     {"tiny": True, "warmup_steps": 1, "batch": "fixed", **options})
    b.load()
    return b


def lm_of(b: MoshiBackend):
    return b._model.lm


def signal(seed: int, frames: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((frames, FRAME)) * 0.3).astype(np.float32)


def run(b: MoshiBackend, frames: int, plan: dict[int, tuple[int, int]], skips: dict[int, set[int]] | None = None):
    """Slot -> (first step, last step + 1) with session id 100 + slot; each slot's input is its own
    seeded signal, fed on its steps except ``skips[slot]``.  Per slot: outputs and texts."""
    skips = skips or {}
    inputs = {slot: signal(slot + 1, frames) for slot in plan}
    fed = {slot: 0 for slot in plan}
    got: dict[int, tuple[list[np.ndarray], list[str]]] = {slot: ([], []) for slot in plan}
    for k in range(frames):
        for slot, (start, end) in plan.items():
            if k == start:
                b.open_slot(slot, SlotSession(100 + slot))
            if k == end:
                b.close_slot(slot)
        rows = [s for s, (start, end) in plan.items() if start <= k < end and k not in skips.get(s, set())]
        if not rows:
            continue
        rows_a = np.array(sorted(rows), dtype=np.int64)
        x = np.stack([inputs[s][fed[s]] for s in rows_a])
        out = np.full_like(x, np.nan)
        texts = b.step(rows_a, x, out)
        for i, s in enumerate(rows_a):
            fed[int(s)] += 1
            got[int(s)][0].append(out[i].copy())
            got[int(s)][1].append(texts[i])
    for slot, (start, end) in plan.items():
        if end > frames:
            b.close_slot(slot)
    return got


def largest_difference(a, b) -> float:
    worst = 0.0
    for slot in a:
        assert a[slot][1] == b[slot][1], f"slot {slot}: text differs"
        assert len(a[slot][0]) == len(b[slot][0])
        for x, y in zip(a[slot][0], b[slot][0]):
            worst = max(worst, float(np.abs(x - y).max()))
    return worst


def test_read_length_is_whole_blocks_of_the_longest_active_row():
    block = attention.BLOCK
    assert attention.read_length(0, 750) == block
    assert attention.read_length(1, 750) == block
    assert attention.read_length(block, 750) == block
    assert attention.read_length(block + 1, 750) == 2 * block
    assert attention.read_length(740, 750) == 750
    assert attention.read_length(750, 750) == 750
    assert attention.read_length(9000, 750) == 750  # a row has wrapped: the whole ring
    assert attention.read_length(3, 40) == 40


def test_filled_only_is_the_default_on_a_cpu_and_bit_identical_to_the_full_ring(long_context, monkeypatch):
    """Three calls of different ages (one skipping steps, one leaving, one joining late) over 200
    frames: every output and text is the same, bit for bit, with the package's full-ring read; and
    the steps did read less than the ring."""
    b = make(4)
    try:
        assert b.description["attention"] == "filled" and attention.installed(lm_of(b))
        assert b.ring.positions == CONTEXT
        lengths: list[int] = []
        real = attention.read_length
        monkeypatch.setattr(attention, "read_length", lambda f, c: lengths.append(real(f, c)) or lengths[-1])
        plan = {0: (0, 200), 1: (30, 150), 3: (120, 400)}
        skips = {0: {5, 6, 7, 90}}
        filled = run(b, 200, plan, skips)
        assert set(lengths) == {64, 128, 192, 256}  # filled-only: never the whole 320
        attention.uninstall(lm_of(b))
        assert not attention.installed(lm_of(b))
        ring = run(b, 200, plan, skips)
        assert largest_difference(filled, ring) == 0.0
    finally:
        b.close()


def test_a_call_hears_the_same_whoever_joins_or_leaves(long_context):
    """Slot 1 alone, then beside an older call (slot 0, 150 frames in: the step reads its length)
    and a call that joins and leaves: slot 1's audio and text are its solo run's, bit for bit."""
    b = make(3)
    try:
        solo = run(b, 100, {1: (0, 100)})
        # Slot 0 starts 150 frames earlier, so it sets the read length for every shared step.
        together = run(b, 250, {0: (0, 250), 1: (150, 250), 2: (170, 220)})
        assert together[1][1] == solo[1][1]
        for k, (x, y) in enumerate(zip(together[1][0], solo[1][0], strict=True)):
            assert np.array_equal(x, y), f"frame {k} differs"
    finally:
        b.close()


def test_a_ring_that_slides_is_read_whole_once_a_row_wraps(long_context):
    """An 80-position ring (6.4 s) that slides: a call past it reads the whole ring, and the
    output is the full ring's, bit for bit, before and after the wrap."""
    b = make(2, context_seconds=6.4, beyond_context="slide")
    try:
        assert b.ring.positions == 80
        plan = {0: (0, 120), 1: (40, 120)}
        filled = run(b, 120, plan)
        attention.uninstall(lm_of(b))
        ring = run(b, 120, plan)
        assert largest_difference(filled, ring) == 0.0
    finally:
        b.close()


def test_a_multi_position_forward_reads_the_whole_ring(long_context):
    """The prompt lane's prefill (several positions in one forward) keeps the package's read: a
    cut there is not bit-identical (see the module's docstring)."""
    import torch

    lm = tiny.build_tiny(0)[1]
    attention.install(lm)
    calls: list[int] = []
    with torch.no_grad(), lm.transformer.streaming(1):
        x = torch.randn(1, 5, lm.dim)
        module = attention.temporal_attentions(lm)[0]
        original = module._complete_kv

        def spy(k, v):
            result = original(k, v)
            calls.append(result.keys.shape[2])
            return result

        module._complete_kv = spy
        lm.transformer(x)
        lm.transformer(x[:, :1])
    assert calls == [CONTEXT, 64]
