"""The rows of the ``moshi`` package's streaming state: what a reset leaves behind (wiped row by
row), every field the state holds (walked, so a field a later package adds is named, not silently
left behind), and moving one row's whole state into another.

``reset_streaming(mask)`` rewinds offsets and zeroes the convolution buffers of the masked rows,
but two per-row buffers keep what the previous session left in them:

* every ``RingKVCache``'s keys and values (Mimi's encoder and decoder transformers, the LM's
  temporal transformer).  The attention masks the stale entries out, but a masked entry still
  enters ``softmax(...) @ V`` with weight zero, and zero times NaN or infinity is NaN: one session
  that sent non-finite (or huge) samples would make every later session on its row hear
  something else than a fresh row would give it.
* ``LMGen``'s token cache.  The step reads only entries it has written since the reset, so stale
  tokens are harmless today, but a fresh row holds "not generated yet" there, and restoring that
  keeps a reused row bit for bit a fresh one whatever the package does next.

A fresh streaming state holds zeros (KV caches) and ``ungenerated_token_id`` (the token cache), so
writing exactly those values back makes a reset row what a new backend's row is.  Only the given
rows are written (``index_fill_``), never the whole batch: a 7B model's KV caches are gigabytes.

``streaming_fields`` walks every attribute of every streaming state (and of the K/V rings they
hold), and ``uncovered`` names each one the tables below do not place: per row (on which
dimension), shared, a plain value of the batch's, or the package's machinery.  The backend logs
what it names at load.  ``RowMover`` copies every per-row field of one row into another: what a
step sized to the active rows (``buckets``) uses to keep the calls in the lowest rows when one
below the top hangs up.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import attrs

from duplexrt.backends.moshi.internals import attributes, streaming_state

log = logging.getLogger("duplexrt.backends.moshi")

#: State fields the package restores itself on reset, or that hold no per-session data.
_RESTORED_BY_PACKAGE = frozenset({
    "batch_size", "device", "exec_mask", "previous", "first", "partial", "offset", "offsets",
    "offset_cpu", "initial", "condition_sum", "condition_cross", "cfg_is_masked_until",
    "k_cross", "v_cross", "graphed_main", "graphed_depth", "graphed_tr_enc", "graphed_tr_dec",
    "graphed_encoder", "graphed_decoder", "exit_stack", "reset_callback", "set_exec_mask_callback",
})


class RowWiper:
    """The buffers of ``roots`` (streaming modules, already streaming) that a row reset must
    restore, found once; ``wipe(rows)`` restores them for those rows."""

    def __init__(self, roots: list[Any], slots: int) -> None:
        from moshi.modules.streaming import StreamingModule
        from moshi.modules.transformer import RingKVCache

        self.slots = slots
        #: (tensor, batch dimension, fill value)
        self._buffers: list[tuple[Any, int, int | float]] = []
        seen: set[int] = set()
        for root in roots:
            for name, module in root.named_modules():
                state = streaming_state(module)
                if not isinstance(module, StreamingModule) or state is None or id(state) in seen:
                    continue
                seen.add(id(state))
                for field in dataclasses.fields(state):
                    value = getattr(state, field.name)
                    if isinstance(value, RingKVCache):
                        # (keys/values, batch, heads, capacity, dim); a fresh cache is zeros.
                        self._buffers.append((value.cache, 1, 0.0))
                    elif field.name == "cache" and hasattr(module, "lm_model"):
                        # LMGen's (batch, codebooks, delay) token cache, fresh: "not generated".
                        lm_model: Any = module.lm_model  # an LMModel; torch types a submodule as Tensor | Module
                        self._buffers.append((value, 0, int(lm_model.ungenerated_token_id)))
                    elif field.name not in _RESTORED_BY_PACKAGE and value is not None:
                        log.warning("moshi streaming state %s.%s is not restored on a row reset: a "
                                    "reused slot may differ from a fresh one", name or "<root>", field.name)

    @property
    def buffers(self) -> list[tuple[Any, int, int | float]]:
        """``(tensor, batch dimension, fresh value)`` of each buffer a wipe restores."""
        return list(self._buffers)

    def wipe(self, rows: Any) -> None:
        """Restore the buffers of ``rows`` (a 1-D int64 tensor on the model's device).  A guided
        model (CFG) runs two batch rows per slot, ``r`` and ``r + slots``: both are restored."""
        doubled = None
        for tensor, dim, fill in self._buffers:
            index = rows
            if tensor.shape[dim] == 2 * self.slots:
                if doubled is None:
                    doubled = rows.repeat(2)
                    doubled[len(rows):] += self.slots
                index = doubled
            tensor.index_fill_(dim, index, fill)


# -- every tensor of the streaming state, and moving a row -----------------------------------------

#: Per-row fields of moshi 0.2.13's streaming states, by name (a nested object's field as
#: ``object.field``), with the dimension that indexes the batch row.  A field whose size there is
#: 1 is broadcast over the rows (a ``RingKVCache`` that ignores the execution mask).
ROW_FIELDS: dict[str, int] = {
    "exec_mask": 0,               # every state: does this row advance on this step
    "offset": 0,                  # attention: the row's position
    "offsets": 0,                 # transformer, LMGen: the row's step count
    "kv_cache.cache": 1,          # (keys/values, batch, heads, capacity, dim)
    "kv_cache.end_offset": 0,     # where the row's ring is written next
    "k_cross": 0, "v_cross": 0,   # cross-attention keys and values (from the conditions)
    "previous": 0,                # a convolution's left context
    "first": 0,                   # a convolution's "no frame seen yet"
    "partial": 0,                 # a transposed convolution's overlap
    "cache": 0,                   # LMGen's delayed-token cache
    "condition_sum": 0, "condition_cross": 0, "cfg_is_masked_until": 0,  # LMGen's conditions
}
#: Tensors every row shares (LMGen's initial token column).
SHARED_TENSORS = frozenset({"initial"})
#: Plain values: the batch's own (its size, its device, a step count every row advances alike,
#: a ring's capacity) or none of a session's data.
SCALAR_FIELDS = frozenset({"batch_size", "device", "offset_cpu", "kv_cache.capacity",
                           "kv_cache.respect_exec_mask"})
#: The package's machinery kept in a state: CUDA graphs (scratch a step overwrites whole), the
#: exit stack and LMGen's callbacks.
MACHINERY_FIELDS = frozenset({"_set_exec_mask_graphed", "graphed_main", "graphed_depth", "graphed_tr_enc",
                              "graphed_tr_dec", "graphed_encoder", "graphed_decoder", "exit_stack",
                              "reset_callback", "set_exec_mask_callback"})
#: Nested objects whose own fields are walked (a state's K/V ring).
NESTED_FIELDS = frozenset({"kv_cache"})


@attrs.frozen
class StateField:
    """One field of one streaming module's state, as the walk found it."""

    #: The module's name under its root (``"lm_gen"``, ``"mimi"``) and the field's (``kv_cache.cache``).
    module: str
    field: str
    #: The state object (the field is read from it when it is used: the package reassigns some).
    state: Any
    #: ``tensor``, ``scalar``, ``none``, ``machinery`` or ``unknown`` (what the walk saw).
    kind: str

    def value(self) -> Any:
        value = self.state
        for part in self.field.split("."):
            value = getattr(value, part)
        return value

    @property
    def name(self) -> str:
        return f"{self.module}:{self.field}"


def streaming_fields(roots: dict[str, Any]) -> list[StateField]:
    """Every field of every streaming state under ``roots`` (``{name: streaming module}``, already
    streaming), nested objects' fields included: what the walk sees, classified by what it holds,
    not by what the tables above expect (``uncovered`` compares the two)."""
    import torch
    from moshi.modules.streaming import StreamingModule

    found: list[StateField] = []
    seen: set[int] = set()

    def kind_of(value: Any) -> str:
        if value is None:
            return "none"
        if isinstance(value, torch.Tensor):
            return "tensor"
        if isinstance(value, (bool, int, float, str, torch.device)):
            return "scalar"
        if callable(value) or type(value).__name__ in ("CUDAGraphed", "ExitStack"):
            return "machinery"
        return "unknown"

    for root_name, root in roots.items():
        for name, module in root.named_modules():
            state = streaming_state(module)
            if not isinstance(module, StreamingModule) or state is None or id(state) in seen:
                continue
            seen.add(id(state))
            where = f"{root_name}.{name}" if name else root_name
            for field, value in attributes(state).items():
                if field in NESTED_FIELDS and value is not None:
                    for inner, inner_value in attributes(value).items():
                        found.append(StateField(where, f"{field}.{inner}", state, kind_of(inner_value)))
                    continue
                found.append(StateField(where, field, state, kind_of(value)))
    return found


def uncovered(fields: list[StateField], rows: int, *, row_fields: dict[str, int] | None = None) -> list[str]:
    """The fields a row move (or a reset) would not know what to do with, each with why: a tensor
    in no table, a per-row field whose batch dimension is not ``rows`` (or twice that, for a guided
    model), a shared tensor sized like the batch, anything else of a kind the tables do not list."""
    row_fields = ROW_FIELDS if row_fields is None else row_fields
    problems = []
    for item in fields:
        value: Any = item.value() if item.kind in ("tensor", "scalar") else None
        if item.kind == "none":
            if item.field not in row_fields and item.field not in MACHINERY_FIELDS \
                    and item.field not in SCALAR_FIELDS and item.field not in NESTED_FIELDS:
                problems.append(f"{item.name} (unknown, None now)")
        elif item.kind == "tensor":
            if item.field in row_fields:
                dim = row_fields[item.field]
                if value.dim() <= dim or value.shape[dim] not in (1, rows, 2 * rows):
                    problems.append(f"{item.name} (per row on dimension {dim}, but shaped {tuple(value.shape)} "
                                    f"for {rows} rows)")
            elif item.field in SHARED_TENSORS:
                if value.dim() and value.shape[0] in (rows, 2 * rows) and rows > 1:
                    problems.append(f"{item.name} (listed as shared, but shaped {tuple(value.shape)} like the batch)")
            else:
                problems.append(f"{item.name} (a tensor shaped {tuple(value.shape)} in no table)")
        elif item.kind == "scalar":
            if item.field not in SCALAR_FIELDS:
                problems.append(f"{item.name} (a {type(value).__name__} in no table)")
        elif item.kind == "machinery":
            if item.field not in MACHINERY_FIELDS:
                problems.append(f"{item.name} (machinery in no table)")
        else:
            problems.append(f"{item.name} (an object of a kind no table lists)")
    return problems


class RowMover:
    """Copies the whole streaming state of one row into another, every per-row field the walk
    found (``ROW_FIELDS``), read from its state at the time of the move (the package reassigns
    some fields every step).  What it leaves alone holds no row's data (``uncovered`` says so).

    Exact only where the kernels round a row the same wherever it sits in the batch: see
    ``benchmarks/moshi_tiny.py --exactness``."""

    def __init__(self, roots: dict[str, Any], rows: int, *, row_fields: dict[str, int] | None = None) -> None:
        table = ROW_FIELDS if row_fields is None else row_fields
        self.rows = rows
        self.fields = streaming_fields(roots)
        #: (field, batch dimension) of every per-row tensor.
        self._moved = [(item, table[item.field]) for item in self.fields
                       if item.kind == "tensor" and item.field in table]

    def move(self, src: int, dst: int) -> None:
        """Row ``src``'s state into row ``dst`` (``src`` is left as it was: a row nobody uses)."""
        rows = self.rows
        for item, dim in self._moved:
            tensor = item.value()
            size = tensor.shape[dim]
            if size == 1:
                continue  # broadcast over the rows: nothing of one row's
            tensor.select(dim, dst).copy_(tensor.select(dim, src))
            if size == 2 * rows:  # a guided model's second (unconditioned) row of the slot
                tensor.select(dim, dst + rows).copy_(tensor.select(dim, src + rows))
