"""Moving a session from one row of the ``moshi`` backend's batch to another (``rows.RowMover``,
``MoshiBackend.move_row``), and the walk that finds every field of the package's streaming state.

The tiny seeded Moshi on one torch thread, where the CPU kernels round a row the same wherever it
sits in the batch (checked first, in each test that relies on it: a move can be no more exact than
that).  Equality is bit for bit, audio and text, against the same session alone on a fresh backend.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("NO_TORCH_COMPILE", "1")

from duplexrt.backends.base import BackendInfo, SlotSession  # noqa: E402

torch = pytest.importorskip("torch")
pytest.importorskip("moshi")

from duplexrt.backends.moshi import MoshiBackend, rows  # noqa: E402
from duplexrt.backends.moshi.internals import streaming_state  # noqa: E402

FRAME = 1920


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _backend(slots: int, **options) -> MoshiBackend:
    # The fixed batch, where row = slot: these tests place and move sessions row by row
    # themselves (the buckets' own moves are tested in test_backend_moshi_buckets.py).
    backend = MoshiBackend(BackendInfo("moshi", 24000, FRAME, slots),
                           {"tiny": True, "warmup_steps": 1, "batch": "fixed", **options})
    backend.load()
    return backend


def _signal(seed: int, frames: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((frames, FRAME)) * 0.3).astype(np.float32)


class Batch:
    """Sessions on one backend, stepped together: ``step({row: frame})`` records each row's audio
    and text under the session that holds the row now; ``move(src, dst)`` moves that session."""

    def __init__(self, backend: MoshiBackend) -> None:
        self.backend = backend
        self.holder: dict[int, int] = {}  # row -> session id
        self.got: dict[int, tuple[list[np.ndarray], list[str]]] = {}

    def open(self, row: int, session_id: int) -> None:
        self.backend.open_slot(row, SlotSession(session_id))
        self.holder[row] = session_id
        self.got[session_id] = ([], [])

    def close(self, row: int) -> None:
        self.backend.close_slot(row)
        del self.holder[row]

    def move(self, src: int, dst: int) -> None:
        self.backend.move_row(src, dst)
        self.holder[dst] = self.holder.pop(src)

    def step(self, feed: dict[int, np.ndarray]) -> None:
        order = np.array(sorted(feed), dtype=np.int64)
        inputs = np.stack([feed[int(r)] for r in order])
        outputs = np.full_like(inputs, np.nan)
        texts = self.backend.step(order, inputs, outputs)
        for i, r in enumerate(order.tolist()):
            audio, said = self.got[self.holder[r]]
            audio.append(outputs[i].copy())
            said.append(texts[i])


def _solo(backend: MoshiBackend, frames: np.ndarray, session_id: int, row: int = 0):
    batch = Batch(backend)
    batch.open(row, session_id)
    for frame in frames:
        batch.step({row: frame})
    batch.close(row)
    return batch.got[session_id]


def _same(got, want, what: str) -> None:
    assert got[1] == want[1], f"{what}: the text differs"
    assert len(got[0]) == len(want[0])
    for k, (x, y) in enumerate(zip(got[0], want[0])):
        assert np.array_equal(x, y), f"{what}: frame {k} differs (max {np.abs(x - y).max():.3g})"


def _rows_place_alike(backend: MoshiBackend, frames: np.ndarray) -> None:
    """What a move relies on: this session alone in each row hears the same."""
    first = _solo(backend, frames, 99, row=0)
    for row in range(1, backend.info.slots):
        _same(_solo(backend, frames, 99, row=row), first, f"the kernels round row {row} unlike row 0; no move "
              "can be exact here")


# -- the walk --------------------------------------------------------------------------------------


def _every_tensor(obj, depth: int = 3, seen=None) -> list[int]:
    """Every tensor reachable from ``obj`` through attributes, lists, tuples and dicts: an
    independent look at what the walk should find."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth < 0:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [id(obj)]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _every_tensor(item, depth - 1, seen)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in _every_tensor(item, depth - 1, seen)]
    if callable(obj) or type(obj).__name__ in ("CUDAGraphed", "ExitStack") or not hasattr(obj, "__dict__"):
        return []
    return [t for item in vars(obj).values() for t in _every_tensor(item, depth - 1, seen)]


@pytest.mark.parametrize("options", [{}, {"cfg_coef": 3.0}], ids=["moshi", "guided"])
def test_the_walk_finds_every_tensor_of_every_streaming_state_and_each_has_a_place(options, caplog):
    backend = _backend(3, **options)
    try:
        roots = {"mimi": backend._mimi, "lm_gen": backend._lm_gen}
        fields = rows.streaming_fields(roots)
        found = {id(f.value()) for f in fields if f.kind == "tensor"}
        states = [streaming_state(m) for root in roots.values() for m in root.modules()]
        reachable = {t for state in states if state is not None for t in _every_tensor(state)}
        assert reachable and reachable <= found
        assert rows.uncovered(fields, 3) == []
        assert not [r for r in caplog.records if "moshi streaming state" in r.getMessage()]
        caches = [f for f in fields if f.field == "kv_cache.cache"]
        assert len(caches) == sum(1 for f in fields if f.field == "kv_cache.end_offset") >= 4
        assert {f.module.split(".")[0] for f in caches} == {"mimi", "lm_gen"}
        # Every per-row tensor is moved: all but LMGen's shared initial column.
        moved = {id(item.value()) for item, _ in backend._mover._moved}
        assert found - moved == {id(f.value()) for f in fields if f.field == "initial"}
    finally:
        backend.close()


@pytest.mark.parametrize("left_out", ["partial", "kv_cache.end_offset", "cache", "previous", "offsets", "first"])
def test_the_check_names_a_per_row_field_the_table_leaves_out(left_out):
    backend = _backend(2)
    try:
        fields = backend._mover.fields
        table = {k: v for k, v in rows.ROW_FIELDS.items() if k != left_out}
        problems = rows.uncovered(fields, 2, row_fields=table)
        assert problems and all(f":{left_out} (a tensor" in p for p in problems)
        assert len(problems) == sum(1 for f in fields if f.field == left_out and f.kind == "tensor")
    finally:
        backend.close()


def test_the_check_names_a_field_a_later_package_adds_or_reshapes():
    backend = _backend(2)
    try:
        state = streaming_state(backend._lm)
        state.new_row_tensor = torch.zeros(2, 5)
        state.new_object = object()
        state.new_count = 3
        conv = next(m for m in backend._mimi.modules() if type(m).__name__ == "StreamingConv1d")
        previous = streaming_state(conv).previous
        streaming_state(conv).previous = previous[:1].repeat(3, 1, 1)  # a batch of three, for two rows
        problems = rows.uncovered(rows.streaming_fields({"mimi": backend._mimi, "lm_gen": backend._lm_gen}), 2)
        assert any(":new_row_tensor (a tensor shaped (2, 5) in no table)" in p for p in problems)
        assert any(":new_object (an object of a kind no table lists)" in p for p in problems)
        assert any(":new_count (a int in no table)" in p for p in problems)
        assert any(":previous (per row on dimension 0, but shaped (3," in p for p in problems)
        assert len(problems) == 4
    finally:
        backend.close()


# -- moves -----------------------------------------------------------------------------------------


def _scenario(backend: MoshiBackend, a: np.ndarray, mover: rows.RowMover | None = None):
    """A (row 2) beside N0 (row 0, joins a step late) and N1 (row 1); N0 leaves, A moves into its
    row; N2 joins in A's old row.  Returns A's audio and text."""
    if mover is not None:
        backend._mover = mover
    n0, n1, n2 = _signal(20, 3), _signal(21, 9), _signal(22, 3)
    batch = Batch(backend)
    batch.open(2, 10)
    batch.open(1, 12)
    for k in range(9):
        if k == 1:
            batch.open(0, 11)
        if k == 4:
            batch.close(0)
            batch.move(2, 0)
        if k == 6:
            batch.open(2, 13)
        feed = {batch_row: None for batch_row in batch.holder}
        for row, session in batch.holder.items():
            feed[row] = {10: a, 11: n0, 12: n1, 13: n2}[session][k - {10: 0, 11: 1, 12: 0, 13: 6}[session]]
        batch.step(feed)
    return batch.got[10]


@pytest.mark.parametrize("options", [{}, {"greedy": True}, {"cfg_coef": 3.0}], ids=["sampled", "greedy", "guided"])
def test_a_session_moved_to_another_row_hears_what_it_would_have_unmoved(options):
    a = _signal(10, 9)
    backend = _backend(3, **options)
    try:
        _rows_place_alike(backend, a)
        fresh = _backend(3, **options)
        try:
            want = _solo(fresh, a, 10, row=2)
        finally:
            fresh.close()
        _same(_scenario(backend, a), want, "the moved session")
    finally:
        backend.close()


@pytest.mark.parametrize("left_out", ["kv_cache.cache", "kv_cache.end_offset", "offsets", "previous", "cache",
                                      "sampling stream"])
def test_a_move_that_leaves_one_field_behind_is_heard(left_out):
    """Each of these left out of the move changes what the moved session hears: the scenario
    above would catch a field the mover forgot."""
    a = _signal(10, 9)
    fresh = _backend(3)
    try:
        want = _solo(fresh, a, 10, row=2)
    finally:
        fresh.close()
    backend = _backend(3)
    try:
        roots = {"mimi": backend._mimi, "lm_gen": backend._lm_gen}
        table = {k: v for k, v in rows.ROW_FIELDS.items() if k != left_out}
        mover = rows.RowMover(roots, 3, row_fields=table)
        if left_out == "sampling stream":
            sampler = backend._sampler
            original = backend.move_row

            def without_stream(src: int, dst: int) -> None:
                keys, counters = sampler.keys[dst].clone(), sampler.counters[dst].clone()
                original(src, dst)
                sampler.keys[dst], sampler.counters[dst] = keys, counters

            backend.move_row = without_stream
        got = _scenario(backend, a, mover)
        with pytest.raises(AssertionError, match="differs"):
            _same(got, want, "the moved session")
    finally:
        backend.close()


def test_a_row_left_by_a_session_that_sent_non_finite_samples_takes_a_move_cleanly():
    """P (row 0) feeds NaN, infinity and 1e30 straight to the backend, then leaves abruptly; A
    moves from row 2 into P's row and hears exactly its solo run; so does the neighbour in row 1."""
    poison = _signal(8, 4)
    poison[0, ::5] = np.nan
    poison[1, 100:900] = np.inf
    poison[2, :] = 1e30
    poison[3, ::3] = -np.inf
    a, n = _signal(10, 9), _signal(11, 9)
    fresh = _backend(3)
    try:
        want_a = _solo(fresh, a, 10, row=0)
        want_n = _solo(fresh, n, 11, row=1)
    finally:
        fresh.close()
    backend = _backend(3)
    try:
        _rows_place_alike(backend, a)
        batch = Batch(backend)
        batch.open(0, 9)
        batch.open(1, 11)
        batch.open(2, 10)
        for k in range(9):
            if k == 4:
                batch.close(0)
                batch.move(2, 0)
            feed = {1: n[k]}
            feed[0 if k >= 4 else 2] = a[k]
            if k < 4:
                feed[0] = poison[k]
            batch.step(feed)
        _same(batch.got[10], want_a, "the session moved into the poisoned row")
        _same(batch.got[11], want_n, "the neighbour")
        assert all(np.isfinite(x).all() for x in batch.got[10][0])
    finally:
        backend.close()


@pytest.mark.parametrize("beyond", ["end", "slide"])
def test_a_move_after_a_ring_filled_or_wrapped_is_exact(beyond):
    """An 8-position ring (0.64 s).  ``end``: the row's last session filled the ring to its end
    and left; A moves in.  ``slide``: A itself runs past its ring (it wraps), then moves.  A hears
    its solo run, frame for frame."""
    ring = {"context_seconds": 0.64, "beyond_context": beyond}
    frames = 14
    a, filler = _signal(10, frames), _signal(12, 8)
    fresh = _backend(3, **ring)
    try:
        want = _solo(fresh, a, 10, row=0)
    finally:
        fresh.close()
    backend = _backend(3, **ring)
    try:
        assert backend.ring.positions == 8
        batch = Batch(backend)
        batch.open(0, 12)
        batch.open(2, 10)
        move_at = 8 if beyond == "end" else 11  # after the filler's last frame; past A's ring
        for k in range(frames):
            if k == 8:
                batch.close(0)
            if k == move_at:
                batch.move(2, 0)
            feed = {0 if k >= move_at else 2: a[k]}
            if k < 8:
                feed[0] = filler[k]
            batch.step(feed)
        _same(batch.got[10], want, f"A after a move ({beyond})")
    finally:
        backend.close()


def test_a_flood_of_joins_and_abrupt_leaves_keeps_rows_dense_and_every_session_exact():
    """Seeded churn on four rows: sessions join in the lowest free row, leave without a word at
    random, and each departure below the highest row moves the highest into the hole (once).
    Rows stay dense, and every session hears its solo run, however often it moved."""
    slots, steps = 4, 16
    rng = np.random.default_rng(5)
    backend = _backend(slots)
    try:
        _rows_place_alike(backend, _signal(3, 4))
        batch = Batch(backend)
        signals: dict[int, np.ndarray] = {}
        sent: dict[int, int] = {}
        next_id, moves = 100, 0
        for _ in range(steps):
            for row in sorted(batch.holder, reverse=True):
                if rng.random() < 0.3:  # an abrupt close
                    batch.close(row)
                    top = max(batch.holder, default=-1)
                    if row < top:
                        batch.move(top, row)
                        moves += 1
            while len(batch.holder) < slots and rng.random() < 0.6:
                row = len(batch.holder)  # the lowest free row, rows being dense
                assert row not in batch.holder
                batch.open(row, next_id)
                signals[next_id], sent[next_id] = _signal(next_id, steps), 0
                next_id += 1
            assert sorted(batch.holder) == list(range(len(batch.holder)))  # dense
            if not batch.holder:
                continue
            feed = {}
            for row, session in batch.holder.items():
                feed[row] = signals[session][sent[session]]
                sent[session] += 1
            batch.step(feed)
        assert moves >= 3 and next_id - 100 >= 8
        for session, frames in signals.items():
            _same(batch.got[session], _solo(backend, frames[:sent[session]], session), f"session {session}")
    finally:
        backend.close()
