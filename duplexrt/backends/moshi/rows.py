"""Per-row buffers that the ``moshi`` package's own reset leaves behind, wiped row by row.

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
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from duplexrt.backends.moshi.internals import streaming_state

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
                        self._buffers.append((value, 0, int(module.lm_model.ungenerated_token_id)))
                    elif field.name not in _RESTORED_BY_PACKAGE and value is not None:
                        log.warning("moshi streaming state %s.%s is not restored on a row reset: a "
                                    "reused slot may differ from a fresh one", name or "<root>", field.name)

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
